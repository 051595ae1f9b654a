"""A tiny Qwen3-Omni whose thinker has been taught the MMK12 answer format, for the tiny MMK12 recipe.

A random-init thinker draws ~266 byte tokens nearly uniformly: it never writes "<answer>\\boxed{...}
</answer>", so every response scores 0, every GRPO group has zero spread and the recipe never updates.
This one is the tiny random Qwen3-Omni (`make_tiny_qwen3_omni`) after a few supervised steps on the
tiny K12 training prompts (data/mmk12_tiny, the real prompt template and images) with targets
"<answer>\\boxed{X}</answer><|im_end|>", X drawn at random each time: an option letter of the row for
multiple-choice rows, a gold answer of a random free-form row otherwise. It learns the format and not the
answers, so its sampled responses (temperature 1) are mostly well formed, sometimes broken, now and then
correct: the real mmk12 reward (math-verify included) then has spread within groups, which is what RL
needs to start (benchmarks/RESULTS.md: how many groups have spread after the steps, and their cost).

The checkpoint keeps the full Qwen3-Omni layout (thinker.* / talker.* / code2wav.*), like the real one.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import torch

from omnirl.config import REPO_ROOT

K12_DATA = REPO_ROOT / "data" / "mmk12_tiny" / "train.jsonl"  # JSONL: building needs no pyarrow
STEPS, BATCH, LR = 100, 8, 3e-3


def make_tiny_qwen3_omni_k12(out_dir: str | Path, data: str | Path = K12_DATA, head_dim: int = 16) -> Path:
    """The checkpoint at `out_dir`; head_dim 32 gives the variant vLLM runs (`make_tiny_qwen3_omni`)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnirl.models.qwen3_omni_thinker.tiny import add_vllm_config_keys, make_tiny_qwen3_omni

    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny_qwen3_omni(Path(tmp) / "base", head_dim)
        thinker = _teach_format(base, data)
        full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(base)
        full.thinker.load_state_dict(thinker.state_dict())
        shutil.copytree(base, out_dir)  # tokenizer, chat template, processor config
        full.save_pretrained(out_dir)
    if head_dim != 16:
        add_vllm_config_keys(Path(out_dir))  # save_pretrained rewrote config.json
    return Path(out_dir)


def _teach_format(path: Path, data: str | Path):
    """The thinker of the checkpoint at `path` after STEPS supervised steps on the answer format."""
    from omnirl.data.mmk12 import load_mmk12
    from omnirl.models.base import GenerationParams, Request
    from omnirl.models.lm import pad_responses
    from omnirl.models.qwen3_omni_thinker.adapter import Qwen3OmniThinkerAdapter
    from omnirl.recipe import config_for

    cfg = config_for("qwen3_omni_thinker")
    cfg.model.path, cfg.model.finetune = str(path), "full"
    adapter = Qwen3OmniThinkerAdapter(cfg, torch.device("cpu"))
    tok = adapter.tokenizer
    rows = load_mmk12(data)
    free_answers = sorted({r.metadata["answer"] for r in rows if "choices" not in r.metadata})
    prompts = [
        adapter.prepare(Request(r.prompt, 0, i, 0, GenerationParams(1), inputs=r.inputs))
        for i, r in enumerate(rows)
    ]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(0)
    torch.manual_seed(0)

    def target(meta: dict) -> list[int]:
        choices = meta.get("choices")
        x = rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(choices)]) if choices else rng.choice(free_answers)
        return tok.encode(f"<answer>\\boxed{{{x}}}</answer>", add_special_tokens=False) + [end]

    optimizer = torch.optim.Adam(adapter.trainable_parameters(), lr=LR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hidden-64 matmuls gain nothing from threads (2 were slower: RESULTS.md)
    for _ in range(STEPS):
        picked = rng.sample(range(len(rows)), min(BATCH, len(rows)))
        targets = [target(rows[i].metadata) for i in picked]
        seqs, mask = pad_responses(targets, adapter.pad_token_id)  # [B, T]
        logprobs = adapter.token_logprobs(adapter.collate([prompts[i] for i in picked]), seqs, mask, 1.0)
        loss = -logprobs.sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    return adapter.thinker
