#!/usr/bin/env python3
"""Write a model.name=hf run (or one of its checkpoints) as a Hugging Face model folder.

    python scripts/export_hf.py runs/my_finetune                                   # -> runs/my_finetune/hf
    python scripts/export_hf.py runs/my_finetune/checkpoints/step_0001000 exported/step1000
    python scripts/export_hf.py runs/my_finetune exported/bf16 --dtype bfloat16              # half the size

The folder holds config.json, model.safetensors (the trained weights under the model's own names) and the run's
tokenizer files, so that `AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)`
load it. A training run writes output_dir/hf/ itself at the end; this script does the same for any checkpoint. A
LoRA run's (model.lora_rank) holds the base model with the adapters merged in, and OUT-adapter beside it the
adapters alone, for `peft.PeftModel.from_pretrained` (the run's own: output_dir/adapter).
It reads the model's config.json from model.hf_path (the folder or the Hub cache the run trained from).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone, no install step

from parallel_train.errors import UserError, run_cli  # noqa: E402


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like train.py (argparse prints usage too)
        raise UserError(f"{message} (see --help)")


def parse(argv: list[str]) -> argparse.Namespace:
    p = Parser(description="Export a model.name=hf run or checkpoint as a Hugging Face model folder.")
    p.add_argument("source", type=Path, help="a run's output_dir (its final weights) or a checkpoints/step_* folder")
    p.add_argument("out", type=Path, nargs="?", help="the folder to write (default: SOURCE/hf); replaced if it exists")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="dtype of the exported weights (default: the run's model.dtype)")
    return p.parse_args(argv)


def check_source(source: Path) -> None:
    """A checkpoint, verified against its manifest (each rank's part of the weights, or a whole model.safetensors
    in checkpoints of earlier versions), or a finished run (its model.safetensors)."""
    from parallel_train import checkpoint

    if not source.is_dir():
        raise UserError(f"{source}: no such folder (give a run's output_dir or a checkpoints/step_* folder)")
    if (source / checkpoint.MANIFEST).is_file():
        checkpoint.refuse_code(source)
        problem = checkpoint.verify(source)
        if problem:
            raise UserError(f"{source}: not a valid checkpoint ({problem})")
    elif not (source / "model.safetensors").is_file():
        newest = checkpoint.list_checkpoints(source / "checkpoints")
        hint = f"; export a checkpoint: python scripts/export_hf.py {newest[-1]}" if newest else ""
        raise UserError(f"{source}: no model.safetensors (the run has not finished){hint}")


def main() -> int:
    args = parse(sys.argv[1:])
    import yaml

    from parallel_train.chat_format import FILES as CHAT_FILES
    from parallel_train.config import config_from_dict
    from parallel_train.models.hf import HFCausalLM
    from parallel_train.tokenization import load_saved
    from parallel_train.weights_export import load_weights

    check_source(args.source)
    config_file = args.source / "config.yaml"
    if not config_file.is_file():
        raise UserError(f"{args.source}: no config.yaml; is it the output_dir of a training run?")
    cfg = config_from_dict(yaml.safe_load(config_file.read_text()) or {})
    if cfg.model.name != "hf":
        raise UserError(f"{args.source} trained model.name={cfg.model.name}; this script exports model.name=hf runs")
    tokenizer = load_saved(args.source)  # the run's (or checkpoint's) vocab.json or tokenizer.json, if any
    out = args.out or args.source / "hf"
    # The model's tensors only, by parameter name, assembled whole from the ranks' parts (weights_export.py): no
    # optimizer state is read. save_pretrained needs the whole model in memory, as the run's own export does.
    state = load_weights(args.source)
    # The chat template the run trained with (data.format=chat|instruction), saved beside its tokenizer.
    chat_files = {name: (args.source / name).read_text(encoding="utf-8") for name in CHAT_FILES if (args.source / name).is_file()}
    print(HFCausalLM.export(cfg.model, state, out, tokenizer, source=str(args.source), dtype=args.dtype, chat_files=chat_files))
    return 0


if __name__ == "__main__":
    run_cli(main)
