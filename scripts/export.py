"""Export what omnirl trained, from a checkpoint or from the LoRA a run wrote at its end.

    python scripts/export.py SOURCE OUT                # LoRA, diffusers format (load_lora_weights)
    python scripts/export.py SOURCE OUT --format peft  # LoRA, peft format (PeftModel.from_pretrained)
    python scripts/export.py SOURCE OUT --merge        # the whole pipeline, the LoRA fused into its weights

SOURCE is a checkpoint directory (output_dir/checkpoints/step_NNNNNN) or a diffusers LoRA directory
(output_dir/lora). A checkpoint names its base model in meta.json and `--model-path` replaces it; a LoRA
directory names none, so --merge needs --model-path there. A fully fine-tuned checkpoint has no LoRA and
exports only with --merge. Every weight file is safetensors.

A checkpoint is verified against its manifest before anything is read, and trained weights that hold NaN
or infinity (of a checkpoint or a LoRA directory) are refused: a damaged source is one line `error: ...`
and exit status 2, and nothing is written.

An omni checkpoint (Qwen3-Omni thinker, Qwen-VL) exports its LoRA in the peft format (`--format peft`, as
the run's own `lora/` directory) or, with --merge, the model as a transformers directory with the LoRA
merged into its weights (loadable as `model.path`, or with the model class's `from_pretrained`).
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from omnirl.checkpoint import LORA_FILE, adapter_from_checkpoint, lora_to_peft, save_merged
from omnirl.checkpoint_checks import check_finite
from omnirl.config import ConfigError
from omnirl.distributed import DTYPES


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("source", type=Path, help="a checkpoint directory or a diffusers LoRA directory")
    parser.add_argument("out", type=Path, help="the output directory")
    parser.add_argument("--format", choices=["diffusers", "peft"], default="diffusers", help="LoRA format")
    parser.add_argument("--merge", action="store_true", help="write the pipeline with the LoRA fused in")
    parser.add_argument("--model-path", default="", help="the base model (default: the checkpoint's)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="dtype of the --merge weights"
    )
    args = parser.parse_args(argv)
    if args.merge and args.format != "diffusers":
        parser.error("--merge writes a pipeline, not a LoRA: drop --format")
    is_checkpoint = (args.source / "meta.json").is_file()
    if not is_checkpoint and not (args.source / LORA_FILE).is_file():
        parser.error(f"{args.source}: neither a checkpoint (meta.json) nor a LoRA directory ({LORA_FILE})")
    try:
        return export(parser, args)
    except ConfigError as e:  # CheckpointError included
        print(f"error: {e}", file=sys.stderr)
        return 2


def export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    is_checkpoint = (args.source / "meta.json").is_file()
    lora_only = not args.merge and args.format == "diffusers"
    if not is_checkpoint:
        check_finite(args.source / LORA_FILE, load_file(args.source / LORA_FILE))

    with tempfile.TemporaryDirectory() as tmp:
        lora_dir, model_path, policy = args.source, args.model_path, None
        if is_checkpoint:
            adapter, cfg = adapter_from_checkpoint(args.source, args.model_path)
            model_path = cfg.model.path
            if adapter.kind == "omni":
                if args.merge:
                    adapter.export_merged(args.out, DTYPES[args.dtype])
                elif args.format == "peft" and cfg.model.finetune == "lora":
                    adapter.export_lora(args.out)
                else:
                    parser.error(
                        f"{args.source}: an omni model exports with --format peft (a LoRA) or --merge"
                    )
                print(f"wrote {args.out}")
                return 0
            if cfg.model.finetune == "full":
                if not args.merge:
                    parser.error(f"{args.source} is a full fine-tune (no LoRA): export it with --merge")
                policy, lora_dir = adapter.policy, None
            else:
                lora_dir = args.out if lora_only else Path(tmp)
                adapter.export_lora(lora_dir)
        elif lora_only:
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.source / LORA_FILE, args.out / LORA_FILE)
        if args.merge:
            if not model_path:
                parser.error("--merge of a LoRA directory needs --model-path (the base model)")
            save_merged(model_path, args.out, DTYPES[args.dtype], lora_dir, policy)
        elif args.format == "peft":
            lora_to_peft(lora_dir, args.out, model_path)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
