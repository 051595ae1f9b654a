"""What `scripts/export.py` reads and writes besides a checkpoint: diffusers LoRA directories (a run's
`lora/`), their conversion to the peft format, and the output directory, written whole or not at all.

A diffusion family's LoRA directory holds one file per trained component: `pytorch_lora_weights.safetensors`
for `transformer` and `pytorch_lora_weights_<component>.safetensors` for any other (Wan2.2 T2V-A14B's
`transformer_2`); the adapter's `lora_files` says which files a checkpoint's export holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from omnirl.checkpoint_checks import check_finite
from omnirl.errors import ConfigError
from omnirl.models.diffusers_setup import LORA_FILE
from omnirl.weights import safe_open

STEM = LORA_FILE.removesuffix(".safetensors")


def lora_dir_files(lora_dir: Path) -> dict[str, str]:
    """Component -> LoRA file name, for the LoRA files in `lora_dir` (see the module docstring)."""
    found = {}
    for f in sorted(lora_dir.glob(f"{STEM}*.safetensors")):
        rest = f.name.removeprefix(STEM).removesuffix(".safetensors")
        if not rest:
            found["transformer"] = f.name
        elif rest.startswith("_"):
            found[rest[1:]] = f.name
    return found


def check_lora_dir(lora_dir: Path, files: dict[str, str], model_path: str) -> None:
    """Every file of `files` (component -> name) is in `lora_dir`, and no other LoRA file is: an export
    that cannot write every trained component's weights, or would drop some, refuses."""
    present = lora_dir_files(lora_dir)
    missing = [f"{name} (the LoRA of {c})" for c, name in files.items() if c not in present]
    if missing:
        raise ConfigError(
            f"{lora_dir} lacks {', '.join(missing)}: the model at {model_path!r} has components "
            f"{', '.join(files)}, and an export without every one's LoRA is refused"
        )
    extra = sorted(set(present) - set(files))
    if extra:
        raise ConfigError(
            f"{lora_dir} holds LoRA files of {', '.join(extra)}, which the model at {model_path!r} does not "
            f"have (its components: {', '.join(files)}): a LoRA of another model?"
        )


def read_lora(file: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a diffusers LoRA file and the LoRA config its metadata carries (`{}` without one);
    a ConfigError when it is no readable safetensors file or holds NaN or infinity."""
    try:
        with safe_open(file) as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            raw = (f.metadata() or {}).get("lora_adapter_metadata", "{}")
    except OSError as e:
        raise ConfigError(f"{file}: not readable ({e})") from None
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: its lora_adapter_metadata is not valid JSON ({e})") from None
    check_finite(file, tensors)
    return tensors, metadata if isinstance(metadata, dict) else {}


def lora_to_peft(file: Path, out_dir: Path, model_path: str = "") -> None:
    """A diffusers-format LoRA file of one transformer -> the peft format (`adapter_config.json` +
    `adapter_model.safetensors` in `out_dir`), which `peft.PeftModel.from_pretrained(<the base
    transformer>, out_dir)` loads. The LoRA's config comes from the metadata omnirl writes into the file;
    a file without it is a ConfigError."""
    import peft
    from safetensors.torch import save_file

    from omnirl.models.peft_lora import sorted_sets

    tensors, metadata = read_lora(file)
    others = [k for k in tensors if not k.startswith("transformer.")]
    config = {k.removeprefix("transformer."): v for k, v in metadata.items() if k.startswith("transformer.")}
    if others or not config:
        raise ConfigError(
            f"{file}: --format peft needs a transformer LoRA with its config (rank, alpha, target modules) "
            f"in its metadata, as omnirl writes it (keys outside the transformer: {others[:3]}; config in "
            f"the metadata: {bool(config)})"
        )
    try:
        lora_config = peft.LoraConfig.from_peft_type(**config)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{file}: its metadata is not a LoRA config peft reads ({e})") from None
    lora_config.base_model_name_or_path = model_path or None
    out_dir.mkdir(parents=True, exist_ok=True)
    # PeftModel's own key layout: the wrapped model sits at base_model.model.
    save_file(
        {"base_model.model." + k.removeprefix("transformer."): v for k, v in tensors.items()},
        out_dir / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    sorted_sets(lora_config).save_pretrained(str(out_dir))


def lora_dir_to_peft(lora_dir: Path, files: dict[str, str], out_dir: Path, model_path: str = "") -> None:
    """Every LoRA file of `lora_dir` (component -> name) in the peft format: into `out_dir` itself for one
    transformer, into `out_dir/<component>` each when there are several (Wan2.2 A14B's two experts)."""
    for component, name in files.items():
        target = out_dir if list(files) == ["transformer"] else out_dir / component
        lora_to_peft(lora_dir / name, target, model_path)


def check_out(out: Path, sources: list[Path]) -> None:
    """`out` is a new (or empty) directory that is none of `sources` and holds none of them."""
    real = os.path.realpath(out)
    for source in sources:
        src = os.path.realpath(source)
        if real == src or src.startswith(real + os.sep):
            raise ConfigError(f"{out}: the export would write over its own source {source}: choose another")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory: an export writes a new one")


@contextlib.contextmanager
def staged(out: Path):
    """A new directory beside `out`, renamed to `out` when the block ends and removed (with any parent
    directories made for it) when it raises: an export is written whole or not at all."""
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]  # deepest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        _remove_empty(made)
        raise ConfigError(f"{out}: cannot write there ({e.strerror or e})") from None
    try:
        yield tmp
        if out.is_dir():
            out.rmdir()  # empty (check_out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        raise


def _remove_empty(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return
