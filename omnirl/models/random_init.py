"""Full-size models with random weights, for measurements that must run without downloads.

`write_random_checkpoint` writes a config-only checkpoint of the public configs
(`omnirl.models.public_configs`) with the byte-level tokenizers of `omnirl.models.tokenizers`
(`edit_tokenizer` for Qwen-Image-Edit; the real Qwen2 BPE when its ranks are given: `qwen_bpe_tokenizer`).
With model.weights random, `omnirl.models.build_adapter` builds the adapter under `random_weights`: every
model the adapter loads through `omnirl.fsdp.load_pretrained` is then built by `random_init_loader` from
its config, directly in its dtype on the device (a sharded run's policy on the host), with random weights
seeded per model, so every rank builds the same ones. Any family gets this by loading each of its models
through `load_pretrained`; `BUILD_HOOKS` lets a measuring script see each build.
`write_random_thinker` saves a random-init Qwen3-Omni thinker of a given text-model shape, or only its
config (`weights=False`: then `random_init_loader` builds it in the run itself, with no checkpoint on disk).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omnirl.models.public_configs import (
    BAGEL_7B_MOT_LLM,
    LTX2_SCHEDULER,
    LTX23_AUDIO_VAE,
    LTX23_CONNECTORS,
    LTX23_GEMMA3_TEXT,
    LTX23_GEMMA3_VISION,
    LTX23_TRANSFORMER,
    LTX23_VAE,
    LTX23_VOCODER,
    QWEN_SCHEDULER,
    SD35_CLIP_G,
    SD35_CLIP_L,
    SD35_SCHEDULER,
    SD35_T5,
    SD35_TRANSFORMER,
    SD35_VAE,
    WAN22,
    WAN_SCHEDULER,
    WAN_UMT5,
    checked,
)
from omnirl.models.tokenizers import (
    clip_tokenizer,
    edit_tokenizer,
    gemma_tokenizer,
    qwen_bpe_tokenizer,
    qwen_image_tokenizer,
    t5_tokenizer,
)

if TYPE_CHECKING:
    from omnirl.config import Config

# The Qwen2.5-VL config fields naming the special tokens of a condition image.
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
}  # fmt: skip


def write_random_checkpoint(model: str, out: Path, qwen_bpe: str | Path | None = None) -> None:
    """A config-only checkpoint of the public configs, with the byte-level tokenizers of
    `omnirl.models.tokenizers`
    (`edit_tokenizer` for "qwen_image_edit", whose processor/ also holds the real image processor's
    settings: a 512 px condition image is 324 vision tokens, as with the real checkpoint). `qwen_bpe`: the
    path of Qwen's `qwen.tiktoken`, for the real tokenizer of the Qwen-Image families
    (`qwen_bpe_tokenizer`)."""
    if qwen_bpe and model not in ("qwen_image", "qwen_image_edit"):
        raise ValueError(f"the Qwen BPE tokenizer is for the Qwen-Image families, not {model!r}")

    def dump(sub: str, cfg: dict) -> None:
        (out / sub).mkdir(parents=True, exist_ok=True)
        (out / sub / "config.json").write_text(json.dumps(cfg))

    out.mkdir(parents=True, exist_ok=True)
    if model in ("qwen_image", "qwen_image_edit"):
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        edit = model == "qwen_image_edit"
        pipeline = "QwenImageEditPipeline" if edit else "QwenImagePipeline"
        (out / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        # Qwen-Image-Edit's transformer, VAE and text encoder have Qwen-Image's shapes.
        with torch.device("meta"):  # the defaults are Qwen-Image's; built on meta only to read the config
            dump("transformer", dict(QwenImageTransformer2DModel().config))
            dump("vae", dict(AutoencoderKLQwenImage().config))
        if qwen_bpe:
            tokenizer = qwen_bpe_tokenizer(qwen_bpe)
        else:
            tokenizer = edit_tokenizer() if edit else qwen_image_tokenizer()
        # The edit text encoder finds the condition image's tokens by these ids: the tokenizer's own.
        ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in VISION_TOKENS.items()} if edit else {}
        te = Qwen2_5_VLConfig(  # Qwen2.5-VL-7B-Instruct
            text_config=dict(
                vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
            ),
            vision_config=dict(
                depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31],
            ),
            **{"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, **ids},
        )  # fmt: skip
        te.save_pretrained(out / "text_encoder")
        tokenizer.save_pretrained(out / "tokenizer")
        if edit:  # the pipeline tokenizes with its processor's tokenizer; Qwen-Image-Edit's image processor
            Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16384).save_pretrained(
                out / "processor"
            )
            tokenizer.save_pretrained(out / "processor")
        dump("scheduler", {})
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_SCHEDULER))
    elif model == "sd35":
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextConfig, T5Config

        (out / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
        with torch.device("meta"):
            dump("transformer", dict(SD3Transformer2DModel(**SD35_TRANSFORMER).config))
            dump("vae", dict(AutoencoderKL(**SD35_VAE).config))
        clip = clip_tokenizer()
        # The tiny tokenizer's special ids (CLIP pools at the first EOS token); the embeddings keep the
        # real vocabulary size, so the parameter count is the real one.
        ids = dict(
            bos_token_id=clip.bos_token_id, eos_token_id=clip.eos_token_id, pad_token_id=clip.pad_token_id
        )
        checked(CLIPTextConfig, **SD35_CLIP_L, **ids).save_pretrained(out / "text_encoder")
        checked(CLIPTextConfig, **SD35_CLIP_G, **ids).save_pretrained(out / "text_encoder_2")
        checked(T5Config, **SD35_T5).save_pretrained(out / "text_encoder_3")
        clip.save_pretrained(out / "tokenizer")
        clip_tokenizer().save_pretrained(out / "tokenizer_2")
        t5_tokenizer(model_max_length=512).save_pretrained(out / "tokenizer_3")  # the pipeline uses 256
        dump("scheduler", {})
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SD35_SCHEDULER))
    elif model in WAN22:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5Config

        w = WAN22[model]
        index = {"_class_name": "WanPipeline", "boundary_ratio": w["boundary_ratio"],
                 "expand_timesteps": w["expand_timesteps"], "transformer_2": [None, None]}  # fmt: skip
        with torch.device("meta"):
            for name in w["experts"]:
                dump(name, dict(WanTransformer3DModel(**w["transformer"]).config))
                index[name] = ["diffusers", "WanTransformer3DModel"]
            dump("vae", dict(AutoencoderKLWan(**w["vae"]).config))
        (out / "model_index.json").write_text(json.dumps(index))
        # The tiny character-level tokenizer (UMT5's SentencePiece model is not in any wheel): a prompt is
        # about one token per character instead of ~1 per word, but every prompt is zero-padded to the
        # pipeline's 512 tokens and all 512 enter the cross-attention, so the transformer's cost is the
        # real one; only prompts longer than 512 characters are cut shorter than real.
        tokenizer = t5_tokenizer(model_max_length=512)
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        checked(UMT5Config, **WAN_UMT5, **ids).save_pretrained(out / "text_encoder")
        tokenizer.save_pretrained(out / "tokenizer")
        dump("scheduler", {})
        scheduler = {**WAN_SCHEDULER, "flow_shift": w["flow_shift"]}
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    elif model == "ltx23":
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE
        from transformers import Gemma3Config

        index = {
            "_class_name": "LTX2Pipeline", "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLLTX2Video"],
            "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
            "vocoder": ["ltx2", "LTX2VocoderWithBWE"], "connectors": ["ltx2", "LTX2TextConnectors"],
            "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
            "tokenizer": ["transformers", "GemmaTokenizer"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        }  # fmt: skip
        (out / "model_index.json").write_text(json.dumps(index))
        with torch.device("meta"):
            dump("transformer", dict(LTX2VideoTransformer3DModel(**LTX23_TRANSFORMER).config))
            dump("connectors", dict(LTX2TextConnectors(**LTX23_CONNECTORS).config))
            dump("vae", dict(AutoencoderKLLTX2Video(**LTX23_VAE).config))
            dump("audio_vae", dict(AutoencoderKLLTX2Audio(**LTX23_AUDIO_VAE).config))
            dump("vocoder", dict(LTX2VocoderWithBWE(**LTX23_VOCODER).config))
        # The tiny character-level Gemma tokenizer: every prompt is padded to the pipeline's 1024 tokens and
        # all of them run through Gemma and the connectors, so the cost is the real one.
        tokenizer = gemma_tokenizer()
        tokenizer.model_max_length = 1024
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   bos_token_id=tokenizer.bos_token_id)  # fmt: skip
        te = Gemma3Config(
            text_config={**LTX23_GEMMA3_TEXT, **ids},
            vision_config=LTX23_GEMMA3_VISION,
            mm_tokens_per_image=256,
        )
        te.save_pretrained(out / "text_encoder")
        tokenizer.save_pretrained(out / "tokenizer")
        dump("scheduler", {})
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(LTX2_SCHEDULER))
    elif model == "bagel":
        write_random_bagel(out)
    elif model == "flux1_dev":
        from omnirl.models.flux.config import write_random_flux

        write_random_flux(out)
    else:
        raise ValueError(f"--random-init has no configs for {model!r}")


def write_random_bagel(out: Path) -> None:
    """BAGEL-7B-MoT in the official layout without its weights: llm_config.json, an ema.safetensors holding
    only the latent position table (what its config reads; random_init_loader builds the model from the
    config), a random FLUX autoencoder in BFL layout (ae.safetensors, 84 M parameters, bfloat16) and the
    tiny byte-level Qwen2 tokenizer with the BAGEL special tokens (the embeddings keep the real
    vocabulary)."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from omnirl.models.bagel_port import FLUX_VAE, MAX_LATENT_SIZE, bfl_vae_state, sincos_2d

    llm = checked(Qwen2Config, **BAGEL_7B_MOT_LLM).to_dict()
    (out / "llm_config.json").write_text(json.dumps({**llm, "qk_norm": True}, indent=2))
    table = sincos_2d(BAGEL_7B_MOT_LLM["hidden_size"], MAX_LATENT_SIZE).to(torch.bfloat16)
    save_file({"latent_pos_embed.pos_embed": table}, out / "ema.safetensors")
    # (diffusers' and transformers' `to` is typed as the unbound `Module.to`, taking the dtype for `self`.)
    vae = AutoencoderKL(**FLUX_VAE).to(torch.bfloat16)  # pyright: ignore[reportArgumentType]
    save_file(bfl_vae_state(vae), out / "ae.safetensors")
    qwen_image_tokenizer().save_pretrained(out)


# The checkpoint subfolders that hold the diffusion adapters' policies (Wan2.2 A14B: both experts); a
# model at a checkpoint's root (no subfolder: the omni adapters' one transformers model) is a policy too.
POLICY_SUBFOLDERS = ("transformer", "transformer_2")
# A config-only thinker's build settings (write_random_thinker(weights=False)), read by random_init_loader.
RANDOM_INIT_FILE = "random_init.json"
# The random weights: torch is seeded with this plus a hash of the model's class and subfolder before each
# build, so that every rank builds the same weights, whatever it drew before, and two experts of one class
# (Wan2.2 A14B) differ.
BUILD_SEED = 1234
# Called after each build of `random_weights` as hook(cls, subfolder, model, seconds): what a measuring
# script records of the builds (scripts/gpu/phase_memory.py).
BUILD_HOOKS: list[Callable] = []


@contextlib.contextmanager
def random_weights(cfg: Config, device: torch.device):
    """While in effect, every model loaded through `omnirl.fsdp.load_pretrained` is built by
    `random_init_loader` on `device`, seeded per model (`BUILD_SEED`); a run whose frozen base FSDP2 shards
    or offloads builds its policy on the host (not when `device` is meta: nothing is allocated there)."""
    from omnirl import fsdp
    from omnirl.memory import synchronize

    on_host = cfg.distributed.frozen_base != "replicate" and device.type != "meta"
    load = random_init_loader(device, policy_on_host=on_host)

    def build(cls, path, subfolder=None, **kwargs):
        torch.manual_seed(BUILD_SEED + zlib.crc32(f"{cls.__name__}/{subfolder}".encode()))
        begin = time.perf_counter()
        model = load(cls, path, subfolder=subfolder, **kwargs)
        if BUILD_HOOKS:
            synchronize()
            for hook in BUILD_HOOKS:
                hook(cls, subfolder, model, time.perf_counter() - begin)
        return model

    with fsdp.building_with(build):
        yield


def random_init_loader(device: torch.device, policy_on_host: bool = False):
    """What `load_pretrained` builds with under `random_weights`: each model from its config, random
    weights, on the device, with the dtypes `from_pretrained(torch_dtype=...)` leaves (`_as_loaded`). With
    `policy_on_host` the policies (`POLICY_SUBFOLDERS`, or a model at the checkpoint's root) are built on
    the host, where `from_pretrained` leaves them, for a run whose frozen base FSDP2 shards
    (distributed.frozen_base shard / offload): the adapter leaves its policy there and `fully_shard` moves
    it to the device one unit at a time (docs/memory.md). A `config` the adapter passes is used as given; a
    `RANDOM_INIT_FILE` beside the config scales the output embedding by its `head_scale` (as
    `write_random_thinker` does)."""
    from diffusers import ModelMixin

    def load(cls, path, subfolder=None, torch_dtype=None, dtype=None, config=None, **_):
        dtype = torch_dtype or dtype or torch.float32
        policy = subfolder in POLICY_SUBFOLDERS or subfolder is None
        where = torch.device("cpu") if policy_on_host and policy else device
        # Made in `dtype` (the default dtype while the modules are made, as both libraries' from_pretrained
        # do), not in float32 and cast after: Qwen-Image's 20 B-parameter transformer would pass through
        # 76 GiB of float32 on the device, more than an 80 GB device holds.
        # A host build's random draws on the accelerator (`_draws_on`): the host's generator is serial.
        drawn = _draws_on(device) if where.type == "cpu" and device.type not in ("cpu", "meta") else None
        with torch.device(where), _default_dtype(dtype), drawn or contextlib.nullcontext():
            model_cls: Any = cls  # a diffusers or transformers class: its config API is reached by name
            if issubclass(cls, ModelMixin):
                model = model_cls.from_config(model_cls.load_config(path, subfolder=subfolder))
            else:  # the config the adapter passes (it may have set fields), else the checkpoint's
                config = config or model_cls.config_class.from_pretrained(path, subfolder=subfolder)
                model = model_cls._from_config(config, dtype=dtype)
        _as_loaded(model, dtype)
        settings = Path(path, subfolder or "", RANDOM_INIT_FILE)
        if settings.is_file():
            head_scale = json.loads(settings.read_text()).get("head_scale", 1.0)
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(head_scale)
        return model.eval()

    return load


@contextlib.contextmanager
def _draws_on(device: torch.device, generator: torch.Generator | None = None, min_numel: int = 1 << 16):
    """While models are built in host memory: a large host tensor's `uniform_` / `normal_` (what every
    torch.nn.init function ends in: the modules' own `reset_parameters` and transformers' `_init_weights`)
    is drawn on `device` (from `generator`, else the device's default one) and copied back. The host's
    generator is serial, so a 20 B-parameter transformer takes minutes to build on the host
    (benchmarks/RESULTS.md); a device draws at its memory speed and the copy back is one pass over the
    host memory the build allocates anyway.
    Same distributions, the device's random stream; a call that brings its own generator, and small
    tensors, draw in place."""
    originals = {name: getattr(torch.Tensor, name) for name in ("uniform_", "normal_")}
    defined = {name: torch.Tensor.__dict__[name] for name in originals if name in torch.Tensor.__dict__}

    def drawing(original):
        def draw(self, *args, **kwargs):
            own = kwargs.pop("generator", None)
            if own is not None or self.device.type != "cpu" or self.numel() < min_numel:
                return original(self, *args, generator=own, **kwargs)
            with torch.no_grad():
                values = torch.empty(self.shape, dtype=self.dtype, device=device)
                self.copy_(original(values, *args, generator=generator, **kwargs))
            return self

        return draw

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, drawing(original))
        yield
    finally:
        for name in originals:
            if name in defined:
                setattr(torch.Tensor, name, defined[name])
            else:
                delattr(torch.Tensor, name)  # back to TensorBase's own method


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _as_loaded(model, dtype: torch.dtype) -> None:
    """Give a model built under the default dtype `dtype` the dtypes its library's `from_pretrained` would
    leave. diffusers casts every checkpoint tensor (parameters and persistent buffers, whatever dtype the
    module made them in: SD3's float32 `pos_embed`) to `dtype`, except those under `_keep_in_fp32_modules`
    (a module name among the key's dotted parts: Wan's time embedder, norms and modulation), which stay
    float32; transformers keeps each tensor's dtype as built (the float32 rotary `inv_freq`) except the
    modules of its dtype plan (`_keep_in_fp32_modules` under float16, `_keep_in_fp32_modules_strict` under
    bfloat16 too: float32). Non-persistent buffers stay as built in both."""
    from diffusers import ModelMixin

    if isinstance(model, ModelMixin):
        keep = set(model._keep_in_fp32_modules or ())

        def target(key: str, t: torch.Tensor) -> torch.dtype:
            return torch.float32 if keep & set(key.split(".")) else dtype
    else:
        plan = model._get_dtype_plan(dtype)  # glob -> dtype; transformers searches each key for the globs
        patterns = [(re.compile(glob.replace("*", ".*")), d) for glob, d in plan.items()]

        def target(key: str, t: torch.Tensor) -> torch.dtype:
            return next((d for pattern, d in patterns if pattern.search(key)), t.dtype)

    for key, t in model.state_dict(keep_vars=True).items():
        if t.is_floating_point() and t.dtype != (want := target(key, t)):
            t.data = t.data.to(want)


def write_random_thinker(
    out_dir: Path, device: torch.device, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
    head_dim: int, moe_intermediate: int, experts: int, experts_per_tok: int, dtype: str, head_scale: float,
    weights: bool = True,
) -> Path:  # fmt: skip
    """A random-init Qwen3-Omni thinker of the given text-model shape (vision / audio towers tiny: the
    prompts are text), saved as OUT_DIR/random_thinker with the tiny model's tokenizer and processor files
    in the layout of the released checkpoint (Qwen/Qwen3-Omni-30B-A3B-Instruct): a
    `Qwen3OmniMoeForConditionalGeneration` config (the tiny talker and code2wav beside this thinker) and the
    thinker's weights under `thinker.`, so that the Qwen3-Omni adapter loads it as `model.path` and vLLM
    serves it with its own Qwen3-Omni thinker class, as it serves the real model (a thinker-only config is
    not one of vLLM's architectures: it falls back to its generic transformers backend). With the keys vLLM
    reads that transformers does not save (`tiny_omni.add_vllm_config_keys`). Embedding rows beyond the
    tokenizer's vocabulary are never in a prompt but can be sampled, as with the real model. `head_scale`
    multiplies the random lm_head (a random model's output is near uniform: this sharpens it).

    `weights=False` writes the config and those files only, with `RANDOM_INIT_FILE` holding `head_scale`:
    a run whose adapter loads through `random_init_loader` then builds the thinker itself (in its dtype,
    where the frozen-base placement puts it), so the full-size thinker (61 GB in bf16) is never written,
    read back, nor built in float32."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import (
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    from omnirl.fsdp import DTYPES
    from omnirl.models.tiny_omni import add_vllm_config_keys, make_tiny_qwen3_omni
    from omnirl.weights import load_safetensors

    tiny = make_tiny_qwen3_omni(out_dir / "tiny")
    full = json.loads((tiny / "config.json").read_text())
    tiny_cfg = full["thinker_config"]
    text = dict(
        tiny_cfg["text_config"],
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        moe_intermediate_size=moe_intermediate,
        num_experts=experts,
        num_experts_per_tok=experts_per_tok,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e6, mrope_section=[24, 20, 20], mrope_interleaved=True
        ),
        max_position_embeddings=65536,
    )
    vision = dict(tiny_cfg["vision_config"], out_hidden_size=hidden)
    audio = dict(tiny_cfg["audio_config"], output_dim=hidden)
    ids = {k: v for k, v in tiny_cfg.items() if k.endswith("token_id")}
    config = Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vision, audio_config=audio, **ids)
    config.dtype = DTYPES[dtype]
    path = out_dir / "random_thinker"
    path.mkdir(parents=True, exist_ok=True)
    full["thinker_config"] = config.to_dict()
    full_config = Qwen3OmniMoeConfig.from_dict({k: v for k, v in full.items() if k != "transformers_version"})
    full_config.dtype = DTYPES[dtype]
    full_config.save_pretrained(path)
    add_vllm_config_keys(path)
    _copy_processor_files(tiny, path)
    if not weights:
        (path / RANDOM_INIT_FILE).write_text(json.dumps({"head_scale": head_scale}) + "\n")
        return path
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config)
        model = model.to(DTYPES[dtype])  # pyright: ignore[reportArgumentType] (`to`: see write_random_bagel)
    if head_scale != 1.0:
        model.lm_head.weight.data *= head_scale
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        model.save_pretrained(tmp)  # the thinker's checkpoint names, then under `thinker.`
        del model
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            tensors = {f"thinker.{k}": v for k, v in load_safetensors(shard).items()}
            save_file(tensors, path / shard.name, metadata={"format": "pt"})
        index = Path(tmp, "model.safetensors.index.json")
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"] = {f"thinker.{k}": v for k, v in data["weight_map"].items()}
            (path / index.name).write_text(json.dumps(data, indent=2) + "\n")
    return path


def _copy_processor_files(tiny: Path, path: Path) -> None:
    """The tiny thinker's tokenizer, processor and generation files, into a random thinker's folder. The
    processor's class is named in its config, as the released checkpoint's preprocessor_config.json does: a
    thinker-only config's model_type (qwen3_omni_moe_thinker) maps to no processor in AutoProcessor, which
    then returns the bare tokenizer (vLLM refuses that for a multimodal model)."""
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
    for name in names:
        (path / name).write_bytes((tiny / name).read_bytes())
    processor = json.loads((tiny / "preprocessor_config.json").read_text())
    processor["processor_class"] = "Qwen3OmniMoeProcessor"
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
