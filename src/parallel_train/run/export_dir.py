"""The folder an export writes: checked before anything is written, written whole, and never anything else deleted.

scripts/export.py writes a folder OUT (and, for a LoRA run's `--format hf`, OUT-adapter beside it: models/hf_export.py).
Before anything is written, `check_target` refuses in one line (exit 2) an OUT that

- is a run folder (config.yaml with metrics.jsonl, summary.json or checkpoints/), or lies inside one: the only
  folders an export may write in a run are that run's own export folders, when it exports that run's checkpoints:
  RUN/hf and RUN/adapter (`--format hf`: what the run itself writes at its end) and RUN/exports/NAME (where an
  export of a checkpoint goes by default, `default_target`);
- is a checkpoint (manifest.json, or a step_* folder under checkpoints/) or lies inside one: a file added there
  makes its manifest fail, and `resume=auto` would skip it as damaged;
- exists and holds anything that the template did not write there. Every folder an export writes (the trainer's
  RUN/hf and RUN/adapter too) lists the files written, with their sha256 (checkpoint/writer.py). An empty folder,
  or one whose every entry is on its list unchanged, may be replaced; anything else is left alone, named in the
  error: a user's file, a file of the export edited since (of the same size and mtime too), a model folder from
  elsewhere, an export written before the list held hashes (remove it yourself once).

The folders are written whole by checkpoint/writer.py's `write_folders`, the same way the run writes its own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from parallel_train.checkpoint.manifest import MANIFEST
from parallel_train.checkpoint.writer import foreign_entries
from parallel_train.errors import UserError

RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")  # with config.yaml: a run folder
OWN_HF = ("hf", "adapter")  # RUN/hf and RUN/adapter: the run's own Hugging Face export (trainer.py `finish`)
EXPORTS = "exports"  # RUN/exports/NAME: exports of the run's checkpoints


# ---------------------------------------------------------------- what a folder is


def kind_of(folder: Path) -> str | None:
    """'checkpoint', 'run' or None (a folder that cannot be read is None: writing it will say why)."""
    try:
        if (folder / MANIFEST).is_file() or (folder.parent.name == "checkpoints" and re.match(r"\.?(tmp-)?step_", folder.name)):
            return "checkpoint"
        if (folder / "config.yaml").is_file() and any((folder / name).exists() for name in RUN_FILES):
            return "run"
    except OSError:
        pass
    return None


def run_of(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint belongs to (RUN of RUN/checkpoints/step_*), else None."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def default_target(source: Path, checkpoint: Path, fmt: str) -> Path:
    """OUT when none is given: a run's own RUN/hf for `--format hf` of a run folder (what the run writes itself);
    otherwise RUN/exports/step_NNNNNNN-FORMAT beside the run's checkpoints (outside checkpoints/), or, for a
    checkpoint that is not in a run, step_NNNNNNN-FORMAT beside it."""
    checkpoint = Path(os.path.normpath(checkpoint))
    if fmt == "hf" and source.resolve() != checkpoint.resolve():
        return source / "hf"
    run = run_of(checkpoint)
    return (run / EXPORTS if run is not None else checkpoint.parent) / f"{checkpoint.name}-{fmt}"


def own_export(target: Path, run: Path, fmt: str) -> bool:
    """Whether `target` (resolved) is one of `run`'s own export folders."""
    return (target.parent == run and target.name in OWN_HF and fmt == "hf") or target.parent == run / EXPORTS


# ---------------------------------------------------------------- the guard


def check_target(target: Path, checkpoint: Path, fmt: str) -> None:
    """Refuse in one line an export into `target` that would change or delete anything an export did not write (see
    the module docstring). `checkpoint`: the checkpoint exported; `fmt`: 'safetensors' or 'hf'."""
    where = target.resolve()
    if where.exists() and not where.is_dir():
        raise UserError(f"{target}: is a file; give a folder")
    own = run_of(checkpoint.resolve())
    for folder in (where, *where.parents):
        kind = kind_of(folder)
        if kind == "checkpoint":
            place = "is a checkpoint" if folder == where else f"is inside the checkpoint {folder}"
            raise UserError(
                f"{target} {place}: an export never writes into a checkpoint (a file added there fails its manifest and "
                "resume=auto would skip it as damaged); give a folder outside it as OUT, or leave OUT out"
            )
        if kind == "run" and folder == where:
            held = ", ".join(n + ("/" if (where / n).is_dir() else "") for n in ("config.yaml", *RUN_FILES) if (where / n).exists())
            raise UserError(
                f"{target} is a run folder ({held}): an export never writes into a run; give a new folder as OUT, or leave OUT out"
            )
        if kind == "run" and not (folder == own and own_export(where, own, fmt)):
            raise UserError(
                f"{target} is inside the run folder {folder}: an export writes in a run only its own hf/ (--format hf) and "
                f"{EXPORTS}/NAME, from that run's checkpoints; give a folder outside the run as OUT"
            )
    foreign = foreign_entries(where) if where.is_dir() else []
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(
            f"{target} holds files no export wrote ({', '.join(foreign[:3])}{more}): an export never deletes them; "
            "give a new or empty folder as OUT, or move them away first"
        )
