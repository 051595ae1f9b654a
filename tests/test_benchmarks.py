"""The benchmarks' plumbing on the tiny checkpoints (CPU): what they measure is timed on GPUs, not here."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from tests.test_train import ROOT


def run(cmd: list[str], timeout: int = 300) -> str:
    """Run `cmd` from the repository root; its stdout (it must exit 0)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def refused(module: str, args: list[str], monkeypatch, capsys) -> str:
    """The stderr of `python -m module *args` refused by its argument checks (exit status 2), run in this
    process through the module's parse_args: a process of its own would spend seconds importing torch."""
    parse_args = importlib.import_module(module).parse_args
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(SystemExit) as e:
        parse_args()
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.slow
def test_rollout_packing_on_two_ranks_reports_the_slowest_rank(tiny_qwen_image, tmp_path):
    """benchmarks.rollout_packing under torchrun: every rank generates its own --images, rank 0 writes
    each cell's time as the slowest rank's. Rank 0's share is the first --images prompts, seeded by their
    global index: the same trajectories as a single process, hence the same log-prob check."""
    args = [
        *("--path", str(tiny_qwen_image), "--images", "4", "--serial-requests", "1", "--max-num-seqs", "4"),
        *("--compiled-max-num-seqs", "--stock-batch", "2", "--logprob-check", "4", "--size", "64"),
        *("--steps", "2"),
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run([*torchrun, "-m", "benchmarks.rollout_packing", *args, "--out", str(tmp_path / "two.json")])
    one_args = [*args, "--breakdown", "--out", str(tmp_path / "one.json")]
    run([sys.executable, "-m", "benchmarks.rollout_packing", *one_args])
    two, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "one"))

    assert (two["world_size"], one["world_size"]) == (2, 1)
    names = [r["name"] for r in two["rows"]]
    assert names == [r["name"] for r in one["rows"]] and len(names) == 3  # serial, packed, stock
    assert names[0].startswith("serial") and names[2].startswith("stock")
    for r in two["rows"]:
        assert len(r["rank_generation_s"]) == len(r["rank_peak_gib"]) == 2
        assert r["generation_s"] == max(r["rank_generation_s"]) > 0
    assert all("rank_generation_s" not in r for r in one["rows"])  # a single process writes what it did
    # --breakdown: one profiled batch of every cell, ours and the stock pipeline's, in the same phases.
    for r in one["rows"]:
        phases = r["breakdown"]["phases"]
        assert phases["transformer"]["calls"] >= 2 and phases["vae_decode"]["calls"] >= 1, r["name"]
    for key in ("mean_abs", "max_abs"):
        assert two["logprob_check"][key] == pytest.approx(one["logprob_check"][key], rel=1e-6)


ENTRIES = sorted(
    f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text()
) + [
    "scripts.gpu.phase_memory",
    "scripts.gpu.two_gpu_runs",
]

# Runs each module as `python -m NAME --help` does (runpy, as __main__, the working directory first on
# sys.path), all in one interpreter so that torch and diffusers import once; prints "NAME ok" or the error.
HELP_ALL = """
import contextlib, io, runpy, sys, traceback
sys.path.insert(0, "")
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        status = "returned without --help's exit"
    except SystemExit as e:
        status = "ok" if e.code in (0, None) and "usage:" in out.getvalue() else f"exit {e.code}"
    except BaseException:
        status = traceback.format_exc()[-2000:]
    print(name, status, flush=True)
"""


@pytest.mark.slow
def test_entries_run_as_modules_from_the_repo_root():
    """Every benchmark (and GPU script) runs as `python -m NAME --help` from the repository root, with
    nothing on PYTHONPATH: the packages import each other by name, no path is patched in."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *ENTRIES], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ", 1)[0] in ENTRIES)
    assert lines == dict.fromkeys(ENTRIES, "ok"), r.stdout[-5000:]


@pytest.mark.slow
def test_two_gpu_report_of_a_gpu_run(tmp_path):
    """scripts.gpu.two_gpu_runs mmk12 on the keys a 2-GPU run logs (per-rank peaks exist only on an
    accelerator, so the CPU rehearsal never shows them): every rank's peak and generation time, the time
    split, the consistency."""
    row = {
        "step": 1, "time/step_s": 20.0, "time/rollout_s": 12.0, "time/train_s": 6.0,
        "time/generate_s": 11.5, "time/generate_s/rank0": 11.5, "time/generate_s/rank1": 10.25,
        "time/score_wait_s": 0.5, "time/rollout_sleep_s": 0.25, "time/train_wake_s": 0.25,
        "mem/rollout_peak_gib": 30.5, "mem/rollout_peak_gib/rank0": 30.5, "mem/rollout_peak_gib/rank1": 29.75,
        "mem/train_peak_gib": 41.0, "mem/train_peak_gib/rank0": 40.0, "mem/train_peak_gib/rank1": 41.0,
        "consistency/prob_pearson": 0.99951, "consistency/logprob_abs_diff_mean": 0.0233,
        "consistency/logprob_abs_diff_max": 0.255, "consistency/tokens": 32768.0, "adv/kept_frac": 1.0,
        "train/updates": 8.0, "reward/mmk12": 0.0,
    }  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    cmd = [sys.executable, "-m", "scripts.gpu.two_gpu_runs", "mmk12", str(tmp_path / "metrics.jsonl")]
    r = subprocess.run([*cmd, "--json", str(tmp_path / "s.json")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("| 1 |"))
    assert "| 11.5 (11.5 / 10.2) | 0.50 | 6.0 | 0.50 | 1.5 | 30.5 / 29.8 | 40.0 / 41.0 | 0.99951 |" in line
    (step,) = json.loads((tmp_path / "s.json").read_text())["steps"]
    assert step["train_peak_gib_per_rank"] == [40.0, 41.0] and step["other_s"] == 1.5


@pytest.mark.slow
def test_rollout_packing_cells_option(tiny_qwen_image, tmp_path, monkeypatch, capsys):
    """--cells adds packed configurations by name; a malformed one is refused before any model loads.
    --repeats times each cell several times and reports the median. An FP8 cell reports the trainer's
    log-prob gap per timestep, the recompute's seconds and its images' difference from its bf16 twin's."""
    import statistics

    args = [
        *("--path", str(tiny_qwen_image), "--images", "3", "--serial-requests", "0", "--max-num-seqs"),
        *("--compiled-max-num-seqs", "--stock-batch", "--logprob-check", "0", "--size", "64", "--steps", "2"),
        *("--cells", "4:split", "4:split:single", "4:split:fp8", "4:split:fp8:untrained", "--repeats", "3"),
    ]
    script = ["-m", "benchmarks.rollout_packing"]
    run([sys.executable, *script, *args, "--out", str(tmp_path / "cells.json")])
    results = json.loads((tmp_path / "cells.json").read_text())
    rows = results["rows"]
    assert [r["name"] for r in rows] == [
        "packed max_num_seqs 4, CFG 2 forwards, eager",
        "packed max_num_seqs 4, CFG 2 forwards, one bucket, eager",
        "packed max_num_seqs 4, CFG 2 forwards, fp8, eager",
        "packed max_num_seqs 4, CFG 2 forwards, fp8, untrained steps only, eager",
    ]
    fp8 = results["precision"]["4:split:recipe:eager:fp8"]
    assert fp8["recompute_s"] > 0 and fp8["logprob_gap"]["per_step"] and fp8["logprob_gap"]["max_abs"] > 0
    assert 0 < fp8["pixels"]["mean_abs"] <= fp8["pixels"]["max_abs"] and fp8["pixels"]["psnr_db"] > 0
    # FP8 on untrained steps only: at 2 steps every step trains a row, so its samples are the bf16 twin's.
    untrained = results["precision"]["4:split:recipe:eager:fp8:untrained"]
    assert untrained["pixels"]["max_abs"] == 0 and untrained["logprob_gap"]["max_abs"] < 1e-4
    for r in rows:
        assert len(r["generation_s_runs"]) == 3 and all(t > 0 for t in r["generation_s_runs"])
        assert r["generation_s"] == statistics.median(r["generation_s_runs"])
    bad = ["--path", str(tiny_qwen_image), "--cells", "4:twice"]
    assert "unknown option 'twice'" in refused("benchmarks.rollout_packing", bad, monkeypatch, capsys)


def _tiktoken_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's byte-pair encoding of one pre-tokenized piece: merge the adjacent pair whose union has
    the lowest rank until none is a token (the reference the tokenizer built from the ranks must match)."""
    parts = [bytes([b]) for b in piece]
    while True:
        pairs = [(ranks.get(a + b, len(ranks)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs, default=(len(ranks), 0))
        if rank == len(ranks):
            return [ranks[p] for p in parts]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def test_qwen_bpe_tokenizer_from_tiktoken_ranks(tmp_path):
    """omnirl/models/tokenizers.py builds the real Qwen2 tokenizer from Qwen's qwen.tiktoken ranks
    (checked on the real file against tiktoken itself; here on a small ranks file against tiktoken's
    algorithm): same ids, the special tokens at the real checkpoint's ids (vocabulary size + 0..13), a file
    that is not byte-level BPE ranks refused by name."""
    import base64
    import random

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from omnirl.models import write_random_checkpoint
    from omnirl.models.tokenizers import QWEN2_SPECIALS, qwen_bpe_tokenizer

    singles = list(range(256))
    random.Random(0).shuffle(singles)  # ranks need not follow byte order
    tokens = [bytes([b]) for b in singles]
    tokens += [b"th", b"he", b" t", b" th", b"the", b" the", b"re", b"ad", b"read", b"reads", b" reads"]
    tokens += [b"ab", b"abc", b"bc", b"  ", "é".encode(), b"yz", b"xy"]  # "xyz": y+z merges first
    ranks = {t: i for i, t in enumerate(tokens)}
    path = tmp_path / "ranks.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))

    tok = qwen_bpe_tokenizer(path)
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    pre = tok.backend_tokenizer.pre_tokenizer
    texts = ["the sign reads abc", "They read   the abcabc", 'café "OPEN" 42x', "bcab thethe reads", "xyz xy"]
    for text in texts:
        expected = []
        for piece, _ in pre.pre_tokenize_str(text):
            expected += _tiktoken_bpe(bytes(char_byte[c] for c in piece), ranks)
        assert tok(text).input_ids == expected, text
    ids = tok.convert_tokens_to_ids(QWEN2_SPECIALS)
    assert ids == list(range(len(ranks), len(ranks) + 14))
    assert tok("<|im_start|>user").input_ids[0] == len(ranks) + 1

    del ranks[b"\x00"]  # a byte missing: not a byte-level BPE
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(ranks)))
    with pytest.raises(ValueError, match="bad.tiktoken: not byte-level BPE ranks"):
        qwen_bpe_tokenizer(bad)
    with pytest.raises(ValueError, match="for the Qwen-Image families, not 'sd3'"):
        write_random_checkpoint("sd3", tmp_path / "ckpt", qwen_bpe=path)


@pytest.mark.parametrize("checkpoint", ["tiny_sd3", "tiny_qwen_image", "tiny_wan_a14b"])
def test_random_init_builds_in_the_dtype_from_pretrained_leaves(checkpoint, request, monkeypatch):
    """random_init_loader builds every model of a checkpoint in bfloat16 directly: each parameter is made
    in bfloat16 (built in float32 and cast after, the 20 B-parameter Qwen-Image transformer would pass
    through 76 GiB of float32 on the device), and ends with the dtype that
    `from_pretrained(torch_dtype=bfloat16)` leaves on the same checkpoint (SD3's `pos_embed` cast;
    Qwen2.5-VL's rotary `inv_freq` and Wan's time embedder, norms and modulation in float32). With the
    meta device standing for the device, the models are built on it, but with `policy_on_host` the
    transformers (both Wan experts) on the host, where from_pretrained leaves them."""
    import torch
    from diffusers import ModelMixin

    from omnirl.models.random_init import POLICY_SUBFOLDERS, random_init_loader

    def dtypes(m) -> dict[str, torch.dtype]:
        return {n: t.dtype for n, t in [*m.named_parameters(), *m.named_buffers()]}

    made = []  # the dtype of each parameter as its module registers it
    register = torch.nn.Module.register_parameter

    def recording(module, name, param):
        made.append(param.dtype if param is not None else None)
        return register(module, name, param)

    path = request.getfixturevalue(checkpoint)
    index = json.loads((path / "model_index.json").read_text())
    parts = {
        sub: v for sub, v in index.items() if isinstance(v, list) and v[0] in ("diffusers", "transformers")
    }
    for sub, (library, name) in parts.items():
        cls = getattr(importlib.import_module(library), name)
        if not issubclass(cls, torch.nn.Module):
            continue  # the tokenizers and the scheduler
        kwargs = {"torch_dtype" if issubclass(cls, ModelMixin) else "dtype": torch.bfloat16}
        real = cls.from_pretrained(path, subfolder=sub, **kwargs)
        made.clear()
        with monkeypatch.context() as m:
            m.setattr(torch.nn.Module, "register_parameter", recording)
            model = random_init_loader(torch.device("cpu"))(cls, path, sub, **kwargs)
        assert made and set(made) <= {torch.bfloat16, None}, (sub, set(made))
        assert dtypes(model) == dtypes(real), sub
        assert not model.training
        meta = torch.device("meta")
        placed = {p.device.type for p in random_init_loader(meta)(cls, path, sub, **kwargs).parameters()}
        assert placed == {"meta"}, sub
        model = random_init_loader(meta, policy_on_host=True)(cls, path, sub, **kwargs)
        assert {p.device.type for p in model.parameters()} == {"cpu" if sub in POLICY_SUBFOLDERS else "meta"}


def test_host_builds_draw_their_random_weights_on_the_device():
    """A policy built on the host for a sharded or offloaded run draws its random weights on the device
    (`_draws_on`: the host's generator is serial) from the same distributions: with a CPU generator
    standing for the device's, the torch modules and a transformers model (its `_init_weights` over the
    modules' own init) equal a plain build seeded alike, draw for draw; tensors under `min_numel` draw in
    place; the tensor methods are restored after."""
    import torch
    from transformers import Qwen2Config, Qwen2Model

    from omnirl.models.random_init import _draws_on

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip

    def build():
        layers = torch.nn.Sequential(
            torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Embedding(50, 8)
        )
        return [layers, Qwen2Model(config)]

    def weights(models):
        return [t for m in models for t in m.state_dict().values()]

    torch.manual_seed(1)
    plain = weights(build())
    torch.manual_seed(0)
    with _draws_on(torch.device("cpu"), generator=torch.Generator().manual_seed(1), min_numel=1):
        drawn = weights(build())
    assert len(drawn) == len(plain) and all(torch.equal(a, b) for a, b in zip(drawn, plain))
    assert "uniform_" not in torch.Tensor.__dict__ and "normal_" not in torch.Tensor.__dict__
    torch.manual_seed(0)
    seed0 = weights(build())
    torch.manual_seed(0)
    with _draws_on(torch.device("cpu"), generator=torch.Generator().manual_seed(1), min_numel=10**9):
        in_place = weights(build())
    assert all(torch.equal(a, b) for a, b in zip(in_place, seed0))
    assert not all(torch.equal(a, b) for a, b in zip(seed0, plain))


@pytest.mark.slow
def test_config_only_thinker_is_built_by_the_run(tmp_path):
    """`two_gpu_runs checkpoint --config-only` writes no weights; the Qwen3-Omni adapter with model.weights
    random (what `train_entry --random-init` sets) builds the thinker from the config the adapter passes
    (its vision_start_token_id set from the tokenizer), in the recipe's dtype, on the host when the frozen
    base is offloaded, with the lm_head scaled as a written thinker's is."""
    import torch

    from omnirl.models import build_adapter
    from omnirl.recipe import config_for
    from scripts.gpu.two_gpu_runs import TINY_THINKER

    cmd = [sys.executable, "-m", "scripts.gpu.two_gpu_runs", "checkpoint", "--out", str(tmp_path)]
    run([*cmd, "--tiny", "--config-only", "--device", "cpu"])
    path = tmp_path / "random_thinker"
    assert not list(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()
    # a wrong value: the adapter sets it from the tokenizer, and the build must take the adapter's config
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vision_start_token_id": 1}))
    cfg = config_for("qwen3_omni_thinker")
    cfg.model.path, cfg.model.dtype, cfg.model.finetune = str(path), "bfloat16", "lora"
    cfg.model.weights = "random"
    cfg.lora.target_modules = ["q_proj", "v_proj"]
    cfg.distributed.frozen_base, cfg.distributed.rollout_gather = "offload", "unit"
    heads = []
    for scale_file in (True, False):
        if not scale_file:
            (path / "random_init.json").unlink()
        adapter = build_adapter(cfg, torch.device("cpu"))  # the same seed per model: the same weights
        base = [p for n, p in adapter.model.named_parameters() if "lora_" not in n]
        assert {p.device.type for p in base} == {"cpu"} and {p.dtype for p in base} == {torch.bfloat16}
        vision_start = adapter.tokenizer.convert_tokens_to_ids(adapter.tokenizer.vision_bos_token)
        assert vision_start != 1 and adapter.thinker.config.vision_start_token_id == vision_start
        assert adapter.thinker.config.text_config.num_experts == TINY_THINKER["experts"]
        heads.append(adapter.lm_head.weight.detach().float())
    assert torch.equal(heads[0], heads[1] * TINY_THINKER["head_scale"])


@pytest.mark.slow
def test_rollout_packing_interleaved_pair(tiny_qwen_image, tmp_path, monkeypatch, capsys):
    """--interleave times packed cells and the stock pipeline in turn on the same prompts (max_num_seqs 1,
    the serial rollout, and 4): every row holds --repeats runs and their median, nothing was compiled while
    timed; two stock batch sizes, or cells of one mode with different prompt buckets, are refused."""
    import statistics

    args = [
        *("--path", str(tiny_qwen_image), "--images", "3", "--serial-requests", "0", "--max-num-seqs"),
        *("--compiled-max-num-seqs", "--stock-batch", "2", "--logprob-check", "0", "--size", "64"),
        *("--steps", "2", "--cells", "1:split", "4:split", "--repeats", "2", "--interleave"),
    ]
    script = ["-m", "benchmarks.rollout_packing"]
    for extra, message in (
        (["--stock-batch", "2", "4"], "give one --stock-batch and at least one cell"),
        (["--cells", "4:split", "4:split:single"], "share one prompt-bucket layout"),
    ):
        err = refused("benchmarks.rollout_packing", [*args, *extra], monkeypatch, capsys)
        assert message in err, err[-2000:]
    out = run([sys.executable, *script, *args, "--out", str(tmp_path / "pair.json")])
    rows = json.loads((tmp_path / "pair.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [
        "packed max_num_seqs 1, CFG 2 forwards, eager",
        "packed max_num_seqs 4, CFG 2 forwards, eager",
        "stock QwenImagePipeline 2 prompts/call, eager",
    ]
    # taken in turn: the printed rows of the first repeat come in cell order, then the second repeat's
    printed = [json.loads(line)["name"] for line in out.splitlines() if line.startswith('{"name"')]
    assert printed == [r["name"] for r in rows] * 2, printed
    assert [b[0] for b in rows[0]["batches"]] == [1, 1, 1] and [b[0] for b in rows[1]["batches"]] == [3]
    for r in rows:
        assert len(r["generation_s_runs"]) == 2 and r["compiled_while_timed"] == 0
        assert r["generation_s"] == pytest.approx(statistics.median(r["generation_s_runs"]), abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, experts, billions",
    [("wan_ti2v", ["_policy"], (4.9, 5.1)), ("wan_a14b", ["transformer", "transformer_2"], (14.1, 14.5))],
)
def test_rollout_packing_dry_run_counts_the_wan_models(model, experts, billions):
    """--dry-run --random-init builds Wan2.2's full-size models from their public configs on the
    meta device (no memory) and prints their parameter counts: TI2V-5B's transformer ~5.0 B, each A14B
    expert ~14.3 B, UMT5-XXL ~5.7 B; and the transformer's FLOPs per video at the recipe's settings."""
    import re

    cmd = [sys.executable, "-m", "benchmarks.rollout_packing", "--model", model, "--random-init", "--dry-run"]
    r = subprocess.run([*cmd, "--images", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = dict(re.findall(r"^  (\w+) +\w+ +[\d,]+ params \(([\d.]+) B\)", r.stdout, re.M))
    for name in experts:
        assert billions[0] < float(counts[name]) < billions[1], r.stdout
    assert 5.6 < float(counts["text_encoder"]) < 5.8, r.stdout
    assert "TFLOP per image" in r.stdout and "MFU of an H200" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
def test_rollout_packing_interleaved_pairs_on_tiny_wan(layout, tiny_wan_ti2v, tiny_wan_a14b, tmp_path):
    """The Wan GPU commands rehearsed on the tiny checkpoints: --size HxW, --frames, and --interleave pairs
    of a packed cell and the stock WanPipeline in the same mode (TI2V: CFG as two forwards, eager and
    compiled, as the reference recipe runs; A14B: both experts, guidance_scale_2), with --breakdown
    labelling the stock pipeline's calls of both experts."""
    path = tiny_wan_ti2v if layout == "ti2v" else tiny_wan_a14b
    cells = ["2:split", "2:split:compiled"] if layout == "ti2v" else ["2"]
    args = [
        *("--model", f"wan_{layout}", "--path", str(path), "--images", "2", "--serial-requests", "0"),
        *("--max-num-seqs", "--compiled-max-num-seqs", "--stock-batch", "2", "--logprob-check", "0"),
        *("--size", "32x64", "--frames", "5", "--steps", "3", "--repeats", "2", "--interleave"),
        "--breakdown",
        *("--cells", *cells, "--out", str(tmp_path / "pair.json")),
    ]
    run([sys.executable, "-m", "benchmarks.rollout_packing", *args])
    rows = json.loads((tmp_path / "pair.json").read_text())["rows"]
    modes = ["eager", "compiled"] if layout == "ti2v" else ["eager"]
    cfg = "CFG 2 forwards" if layout == "ti2v" else "CFG fused"
    assert [r["name"] for r in rows] == [
        name
        for mode in modes
        for name in (f"packed max_num_seqs 2, {cfg}, {mode}", f"stock WanPipeline 2 prompts/call, {mode}")
    ]
    for r in rows:
        assert len(r["generation_s_runs"]) == 2 and r["compiled_while_timed"] == 0, r
        phases = r["breakdown"]["phases"]
        # 3 steps: one labelled velocity per step packed, two forwards per step in the stock pipeline.
        forwards = 3 if r["name"].startswith("packed") else 6
        assert phases["transformer"]["calls"] == forwards and phases["vae_decode"]["calls"] >= 1, r["name"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, lora", [("bfloat16", "bfloat16"), ("float16", "float32")])
def test_generation_benchmark_ranks_what_its_engine_ran(tiny_qwen3_omni_thinker, tmp_path, dtype, lora):
    """generate_throughput --kernels (on a group of 3 samples of one prompt): one more run of each method
    under the profiler, its costliest operators (device kernels on CUDA) ranked with their calls and shares
    of the busy time, and the busy time per decode step of the native engine. The thinker is placed as a
    recipe of its dtype places it: bf16 under FSDP2 with the LoRA gathered in bf16 (no float32 LoRA
    matmul), float16 unwrapped (FSDP2's mixed precision has no float16), the LoRA then in peft's float32."""
    out = tmp_path / "tput.json"
    run([
        sys.executable, "-m", "benchmarks.generate_throughput", "--model", str(tiny_qwen3_omni_thinker),
        "--methods", "ours,ours_one_window", "--num-requests", "3", "--max-num-seqs", "2",
        "--max-new-tokens", "4", "--warmup", "0", "--kv-cache-gib", "0.25", "--kernels", "4",
        "--kernel-methods", "ours", "--dtype", dtype, "--group-size", "3", "--out", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    # one prompt for the 3 requests (--group-size 3), prefilled once in each of the 2 prefills (2 slots)
    assert (report["results"]["ours"]["prefills"], report["results"]["ours"]["prefill_rows"]) == (2, 2)
    # the engine without KV windows, side by side: the same samples
    assert report["windows_vs_one_window_identical_responses"] == "3/3"
    assert report["lora_compute_dtype"] == [lora]
    ours = report["results"]["ours"]
    table = ours["kernels"]
    assert table["what"].startswith("aten operators") and len(table["top"]) == 4
    top = table["top"]
    assert all(r["name"].startswith("aten::") and r["calls"] > 0 and r["s"] > 0 for r in top)
    assert [r["s"] for r in top] == sorted((r["s"] for r in top), reverse=True)
    assert 0 < sum(r["share"] for r in top) <= 1 + 1e-9
    assert len({r["name"] for r in top}) == 4 and table["busy_s"] <= table["wall_s"]  # one thread
    assert table["busy_ms_per_decode_step"] == pytest.approx(1e3 * table["busy_s"] / ours["decode_steps"])
