"""Export what omnirl trained, from a checkpoint or from the LoRA a run wrote at its end.

    python scripts/export.py SOURCE OUT                # LoRA, diffusers format (load_lora_weights)
    python scripts/export.py SOURCE OUT --format peft  # LoRA, peft format (PeftModel.from_pretrained)
    python scripts/export.py SOURCE OUT --merge        # the whole pipeline, the LoRA fused into its weights

SOURCE is a checkpoint directory (output_dir/checkpoints/step_NNNNNN) or a run's LoRA directory
(output_dir/lora): diffusers' format, or the peft adapter that BAGEL and the omni models write
(adapter_config.json, adapter_model.safetensors). A checkpoint names its base model in meta.json and
`--model-path` replaces it; a LoRA directory names none, so --merge needs --model-path there. A peft
adapter is copied as it is (its own format: --format peft, the default for it) or, with --merge and a
BAGEL --model-path, fused into BAGEL's weights; an omni model's LoRA merges from its checkpoint. A fully
fine-tuned checkpoint has no LoRA and exports only with --merge. Every weight file is safetensors. OUT is
a new (or empty) directory, written whole or not at all.

The export holds every trained component: a Wan2.2 T2V-A14B run's LoRA directory holds one file per expert
(`pytorch_lora_weights.safetensors`, `pytorch_lora_weights_transformer_2.safetensors`), all copied; its
--merge fuses each into its expert; its peft format is one adapter per expert (OUT/transformer,
OUT/transformer_2). A LoRA directory that lacks a file of a component of --model-path's model is refused.

A checkpoint is verified against its manifest before anything is read, and trained weights that hold NaN
or infinity (of a checkpoint or a LoRA directory) are refused: a damaged source, a missing local model
path or an OUT that cannot be written is one line `error: ...` and exit status 2, and nothing is written.

An omni checkpoint (Qwen3-Omni thinker, Qwen-VL) exports its LoRA in the peft format (`--format peft`, as
the run's own `lora/` directory) or, with --merge, the model as a transformers directory with the LoRA
merged into its weights (loadable as `model.path`, or with the model class's `from_pretrained`).
"""

import argparse
import shutil
import sys
from pathlib import Path

from omnirl.checkpoint import LORA_FILE, adapter_from_checkpoint
from omnirl.config_checks import check_model_path
from omnirl.errors import ConfigError
from omnirl.export import (
    check_lora_dir,
    check_out,
    lora_dir_files,
    lora_dir_to_peft,
    read_lora,
    staged,
)
from omnirl.fsdp import DTYPES
from omnirl.models.bagel.port import LLM_CONFIG, WEIGHTS
from omnirl.weights import check_weight_files

PEFT_CONFIG, PEFT_FILE = "adapter_config.json", "adapter_model.safetensors"  # a peft adapter's files


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("source", type=Path, help="a checkpoint directory or a diffusers LoRA directory")
    parser.add_argument("out", type=Path, help="the output directory (new, or empty)")
    parser.add_argument(
        "--format",
        choices=["diffusers", "peft"],
        help="LoRA format (default: diffusers; a peft adapter's: peft)",
    )
    parser.add_argument("--merge", action="store_true", help="write the pipeline with the LoRA fused in")
    parser.add_argument("--model-path", default="", help="the base model (default: the checkpoint's)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="dtype of the --merge weights"
    )
    args = parser.parse_args(argv)
    if args.merge and args.format == "peft":
        parser.error("--merge writes a pipeline, not a LoRA: drop --format")
    is_checkpoint = (args.source / "meta.json").is_file()
    is_peft = all((args.source / name).is_file() for name in (PEFT_CONFIG, PEFT_FILE))
    if not (is_checkpoint or is_peft or (args.source / LORA_FILE).is_file()):
        parser.error(
            f"{args.source}: neither a checkpoint (meta.json) nor a LoRA directory ({LORA_FILE}, or a peft "
            f"adapter's {PEFT_CONFIG} and {PEFT_FILE})"
        )
    if is_peft and not is_checkpoint and args.format == "diffusers":
        parser.error(
            f"{args.source} is a peft adapter, which has no diffusers format: --format peft or --merge"
        )
    args.format = args.format or ("peft" if is_peft and not is_checkpoint else "diffusers")
    try:
        check_out(args.out, [args.source])
        if args.model_path:
            check_model_path(args.model_path, "--model-path")
            check_weight_files(args.model_path)  # its files' headers, before anything loads
        if is_checkpoint:
            return export_checkpoint(parser, args)
        if is_peft:
            return export_peft_dir(parser, args)
        return export_lora_dir(parser, args)
    except ConfigError as e:  # CheckpointError included
        print(f"error: {e}", file=sys.stderr)
        return 2


def export_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """A checkpoint, through the adapter it was trained on: its export_lora / export_merged."""
    adapter, cfg = adapter_from_checkpoint(args.source, args.model_path)
    lora = cfg.model.finetune == "lora"
    if adapter.kind == "omni" and not args.merge and args.format != "peft":
        parser.error(f"{args.source}: an omni model exports with --format peft (a LoRA) or --merge")
    if not lora and not args.merge:
        parser.error(f"{args.source} is a full fine-tune (no LoRA): export it with --merge")
    with staged(args.out) as out:
        if args.merge:
            adapter.export_merged(out, DTYPES[args.dtype])
        elif adapter.kind == "omni" or args.format == "diffusers":
            adapter.export_lora(out)  # an omni model's LoRA is peft's format
        else:
            lora_dir = out / ".diffusers"
            adapter.export_lora(lora_dir)
            lora_dir_to_peft(lora_dir, lora_dir_files(lora_dir), out, cfg.model.path)
            shutil.rmtree(lora_dir)
    print(f"wrote {args.out}")
    return 0


def export_lora_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """A run's diffusers LoRA directory: every LoRA file in it, checked against --model-path's components
    when it is given."""
    if args.merge and not args.model_path:
        parser.error("--merge of a LoRA directory needs --model-path (the base model)")
    files = lora_dir_files(args.source)
    adapter_cls = None
    if args.model_path:
        from omnirl.models import diffusion_adapter_for

        adapter_cls = diffusion_adapter_for(args.model_path)
        files = adapter_cls.lora_files(args.model_path)
        check_lora_dir(args.source, files, args.model_path)
    for name in files.values():
        read_lora(args.source / name)  # readable and finite, before anything is written
    with staged(args.out) as out:
        if args.merge:
            adapter_cls.merge_lora(args.model_path, args.source, out, DTYPES[args.dtype])
        elif args.format == "peft":
            lora_dir_to_peft(args.source, files, out, args.model_path)
        else:
            for name in files.values():
                shutil.copyfile(args.source / name, out / name)
    print(f"wrote {args.out}")
    return 0


def export_peft_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """A run's peft adapter directory (BAGEL's `lora/`, an omni model's): its tensors readable and finite,
    then copied as they are, or with --merge fused into the BAGEL checkpoint at --model-path
    (`BagelAdapter.merge_lora`, which refuses a LoRA of another model naming its key)."""
    if args.merge and not args.model_path:
        parser.error("--merge of a LoRA directory needs --model-path (the base model)")
    read_lora(args.source / PEFT_FILE)  # readable and finite, before anything is written
    if args.merge and not all((Path(args.model_path) / f).is_file() for f in (LLM_CONFIG, WEIGHTS)):
        raise ConfigError(
            f"--model-path {args.model_path!r} is not a BAGEL checkpoint in the official layout "
            f"({LLM_CONFIG}, {WEIGHTS}): --merge of a peft adapter directory fuses BAGEL's; an omni model's "
            "LoRA merges from its checkpoint (export.py CHECKPOINT OUT --merge)"
        )
    with staged(args.out) as out:
        if args.merge:
            from omnirl.models.bagel.adapter import BagelAdapter

            BagelAdapter.merge_lora(args.model_path, args.source, out, DTYPES[args.dtype])
        else:
            for name in (PEFT_CONFIG, PEFT_FILE):
                shutil.copyfile(args.source / name, out / name)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
