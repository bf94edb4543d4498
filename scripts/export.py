#!/usr/bin/env python3
"""Export a run's weights: as safetensors under the plain model's parameter names, or as a Hugging Face model folder.

    python scripts/export.py runs/x exported/                                  # the run's newest valid checkpoint
    python scripts/export.py runs/x/checkpoints/step_0001000 exported/ --max-shard-size 5GB
    python scripts/export.py runs/my_finetune --format hf                      # -> runs/my_finetune/hf
    python scripts/export.py runs/my_finetune exported/bf16 --format hf --dtype bfloat16

SOURCE is a checkpoints/step_* folder or a run's output_dir (its newest checkpoint that verifies). A checkpoint holds
each rank's part (DDP, FSDP2, tensor parallel or pipeline; any number of processes); its manifest is verified first,
a folder holding a pickle is refused, and only the model's tensors are read (no optimizer state), one whole tensor
at a time (src/parallel_train/checkpoint/export.py).

--format safetensors (the default): one `model.safetensors`, or past --max-shard-size `model-00001-of-0000N.safetensors`
files and a `model.safetensors.index.json` weight map, as Hugging Face stores large models. A finished run's own
model.safetensors is this export of its last checkpoint.
--format hf (model.name=hf runs): config.json, model.safetensors under the model's own names and the run's tokenizer
files (its chat template too), so that `AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)`
load it (the model's config.json comes from model.hf_path). A LoRA run's (model.lora_rank) holds the base model with
the adapters merged in, and OUT-adapter beside it the adapters alone, for `peft.PeftModel.from_pretrained`. A run
writes output_dir/hf/ (and output_dir/adapter/) itself at the end.
--format hf of the template's GPT: model.flavor=llama as a LlamaForCausalLM folder, MixtralForCausalLM with
model.n_experts; the gpt2 flavor as GPT2LMHeadModel, its experts refused in one line
(src/parallel_train/models/gpt_export.py). Written by this script only: a GPT run writes no hf/ itself.
--max-shard-size applies to --format safetensors only, --dtype to --format hf only: given with the other format,
each is refused in one line (it would change nothing).

OUT is never a run folder, a checkpoint, or a folder holding anything an earlier export did not write: such an OUT
is refused in one line naming it and what is there, before anything is written (src/parallel_train/run/export_dir.py;
every folder written lists its files with their sha256: src/parallel_train/checkpoint/writer.py).
Without OUT: RUN/hf for `--format hf` of a run folder (the run's own export, replaced), else
RUN/exports/step_NNNNNNN-safetensors or -hf beside the run's checkpoints (outside checkpoints/: a checkpoint stays
as its manifest says). Everything is written into `.OUT.tmp-<pid>` beside OUT and renamed in place at the end: a
full or read-only disk, or any failure, is one line, and leaves the old OUT as it was.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone, no install step

from parallel_train.errors import UserError, run_cli  # noqa: E402

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like train.py (argparse prints usage too)
        raise UserError(f"{message} (see --help)")


def size_bytes(text: str) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000000` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size: {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def parse(argv: list[str]) -> argparse.Namespace:
    p = Parser(description="Export a run's weights as safetensors or as a Hugging Face model folder.")
    p.add_argument("source", type=Path, help="a checkpoints/step_* folder, or a run's output_dir (its newest valid checkpoint)")
    p.add_argument(
        "out",
        type=Path,
        nargs="?",
        help="the folder to write, new or empty or an earlier export (default: RUN/hf for --format hf of a run, else RUN/exports/step_NNNNNNN-FORMAT)",
    )
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors", help="what to write (default: safetensors)")
    p.add_argument(
        "--max-shard-size", default=None, help="--format safetensors only: files of at most this size, e.g. 5GB (default: one file)"
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="--format hf only: dtype of the exported weights (default: the run's model.dtype)"
    )
    args = p.parse_args(argv)
    if args.max_shard_size is not None and args.format != "safetensors":
        raise UserError(
            f"--max-shard-size: applies to --format safetensors only (--format {args.format} is written by save_pretrained, in "
            "files of its own size); drop it, or export --format safetensors"
        )
    if args.dtype is not None and args.format != "hf":
        raise UserError(
            f"--dtype: applies to --format hf only (--format {args.format} keeps each tensor's dtype as the checkpoint holds it); "
            "drop it, or export --format hf"
        )
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UserError(f"{args.out}: is a file; give a folder")
    return args


def checkpoint_of(source: Path) -> Path:
    """The checkpoint SOURCE names: itself, or a run's newest that verifies (one line when there is none)."""
    from parallel_train.run.resume import choose_checkpoint

    if not source.is_dir():
        raise UserError(f"{source}: no such folder; give a checkpoints/step_* folder or a run's output_dir")
    folder = choose_checkpoint(str(source), source / "checkpoints", warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    if folder is None:
        raise UserError(f"{source}: no checkpoint to export (the run has written none yet)")
    return folder


def hf_writer(folder: Path, out: Path, dtype: str | None) -> tuple[list[Path], Callable[[Path], str]]:
    """A model.name=hf checkpoint as a Hugging Face model folder: the folders it writes (OUT, and OUT-adapter beside it
    for a LoRA run) and the function that writes them into a given folder."""
    import yaml

    from parallel_train.config.load import config_from_dict
    from parallel_train.models.hf_export import adapter_folder

    cfg = config_from_dict(yaml.safe_load((folder / "config.yaml").read_text()) or {})
    if cfg.model.name == "gpt":
        return [out], gpt_writer(folder, cfg.model, dtype)
    if cfg.model.name != "hf":
        raise UserError(
            f"{folder} trained model.name={cfg.model.name}; --format hf exports model.name=hf and model.name=gpt runs "
            "(use --format safetensors)"
        )

    def write(into: Path) -> str:
        from parallel_train.checkpoint.export import load_weights
        from parallel_train.data.chat_format import FILES as CHAT_FILES
        from parallel_train.data.tokenizers import load_saved
        from parallel_train.models.hf import HFModel
        from parallel_train.tasks.label_names import saved_label_names

        # The chat template the run trained with (data.format=chat|instruction), saved beside its tokenizer.
        chat_files = {name: (folder / name).read_text(encoding="utf-8") for name in CHAT_FILES if (folder / name).is_file()}
        # save_pretrained needs the whole model in memory, as the run's own export does; no optimizer state is read.
        state = load_weights(folder)
        labels = saved_label_names(folder)  # a classifier's class names: the export's id2label
        return HFModel.export(
            cfg.model, state, into, load_saved(folder), source=str(folder), dtype=dtype, chat_files=chat_files, label_names=labels
        )

    return [out, adapter_folder(out)] if cfg.model.lora_rank else [out], write


def gpt_writer(folder: Path, cfg, dtype: str | None) -> Callable[[Path], str]:
    """The GPT as a Llama, Mixtral or GPT-2 model folder; the gpt2 flavor's experts are refused before anything is
    written (models/gpt_export.py)."""
    from parallel_train.models.gpt_export import export_gpt, refuse_gpt2

    refuse_gpt2(cfg, str(folder))

    def write(into: Path) -> str:
        from parallel_train.checkpoint.export import load_weights
        from parallel_train.data.tokenizers import load_saved

        return export_gpt(cfg, load_weights(folder), into, load_saved(folder), source=str(folder), dtype=dtype)

    return write


def safetensors_writer(folder: Path, out: Path, limit: int | None) -> tuple[list[Path], Callable[[Path], str]]:
    from parallel_train.checkpoint.export import export

    return [out], lambda into: "\n".join(str(path) for path in export(folder, into, limit))


def main() -> int:
    from parallel_train.checkpoint.writer import write_folders
    from parallel_train.run.export_dir import check_target, default_target

    args = parse(sys.argv[1:])
    limit = size_bytes(args.max_shard_size) if args.max_shard_size else None
    folder = checkpoint_of(args.source)
    out = args.out or default_target(args.source, folder, args.format)
    out = out.resolve() if out.is_symlink() else out  # a link to a folder: the folder it names is replaced
    if args.format == "hf":
        targets, write = hf_writer(folder, out, args.dtype)
    else:
        targets, write = safetensors_writer(folder, out, limit)
    for target in targets:  # before anything is written: never a run, a checkpoint or a folder with a user's files
        check_target(target, folder, args.format)
    # OUT left out: the default may sit on the run's read-only disk
    hint = "" if args.out else f"give OUT elsewhere: python scripts/export.py {args.source} OUT --format {args.format}"
    print(write_folders(out, write, names={t.name for t in targets}, hint=hint))
    return 0


if __name__ == "__main__":
    run_cli(main)
