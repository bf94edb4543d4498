"""The folder an export writes: checked before anything is written, written whole, and never anything else deleted.

scripts/export.py writes a folder OUT (and, for a LoRA run's `--format hf`, OUT-adapter beside it: models/hf_export.py).
Before anything is written, `check_target` refuses in one line (exit 2) an OUT that

- is a run folder (config.yaml with metrics.jsonl, summary.json or checkpoints/), or lies inside one: the only
  folders an export may write in a run are that run's own export folders, when it exports that run's checkpoints:
  RUN/hf and RUN/adapter (`--format hf`: what the run itself writes at its end) and RUN/exports/NAME (where an
  export of a checkpoint goes by default, `default_target`);
- is a checkpoint (manifest.json, or a step_* folder under checkpoints/) or lies inside one: a file added there
  makes its manifest fail, and `resume=auto` would skip it as damaged;
- exists and holds anything that an earlier export did not write. Every folder an export writes (the trainer's
  RUN/hf and RUN/adapter too) holds MARK: the list of the files it wrote, with their sizes and mtimes. An empty
  folder, or one whose every entry is on its list unchanged, may be replaced; anything else is left alone, named
  in the error: a user's file, a file of the export edited since, a model folder from elsewhere, an export written
  before the list existed (remove it yourself once).

`write_folders` writes into a new sibling `.NAME.tmp-<pid>` and, at the end, renames each folder written there in
place of the old one (the old ones are moved aside, on the same file system, and removed last): a failure at any
point (a full or read-only disk, an exception, Ctrl-C) puts the old folders back, removes the temporary one and
says what failed in one line. A SIGKILL can leave `.NAME.tmp-<pid>`; the next export to that place removes it once
no process of that pid is alive.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from parallel_train.checkpoint.disk import as_os_error, free_bytes, human
from parallel_train.checkpoint.json_text import json_text
from parallel_train.checkpoint.manifest import MANIFEST
from parallel_train.errors import UserError

T = TypeVar("T")
MARK = ".parallel-train-export.json"  # the files an export wrote: the only ones a later export may replace
WRITER = "parallel_train export"
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")  # with config.yaml: a run folder
OWN_HF = ("hf", "adapter")  # RUN/hf and RUN/adapter: the run's own Hugging Face export (trainer.py `finish`)
EXPORTS = "exports"  # RUN/exports/NAME: exports of the run's checkpoints
NEW, OLD = "new", "old"  # inside the temporary folder: what is being written, and the folders it replaces
FULL = (errno.ENOSPC, errno.EDQUOT)


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


# ---------------------------------------------------------------- what an export wrote


def stat_of(path: Path) -> list[int]:
    st = path.lstat()
    return [st.st_size, st.st_mtime_ns]


def mark(folder: Path) -> None:
    """Record in `folder` every file in it, as this export wrote it."""
    files = {str(p.relative_to(folder)): stat_of(p) for p in sorted(folder.rglob("*")) if not p.is_dir()}
    (folder / MARK).write_text(json_text({"written_by": WRITER, "files": files}, indent=1))


def marked_files(folder: Path) -> dict[str, list[int]]:
    """The files the folder's MARK lists ({} without a readable MARK)."""
    try:
        found = json.loads((folder / MARK).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict) or found.get("written_by") != WRITER or not isinstance(found.get("files"), dict):
        return {}
    return found["files"]


def foreign_entries(folder: Path) -> list[str]:
    """What in `folder` an export did not write, or changed since: its files and folders, by relative path (a folder
    that is not the export's is named once, not its contents)."""
    files = marked_files(folder)
    folders = {str(parent) for name in files for parent in Path(name).parents if str(parent) != "."}
    found: list[str] = []
    for root, dirs, names in os.walk(folder):
        for name in sorted(names):
            path = Path(root, name)
            rel = str(path.relative_to(folder))
            if rel != MARK and (rel not in files or stat_of(path) != files[rel]):
                found.append(rel)
        for name in sorted(dirs):
            rel = str(Path(root, name).relative_to(folder))
            if rel not in folders or Path(root, name).is_symlink():
                found.append(rel + "/")
        dirs[:] = [d for d in dirs if str(Path(root, d).relative_to(folder)) in folders and not Path(root, d).is_symlink()]
    return found


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


# ---------------------------------------------------------------- writing it whole


def remove_stale(parent: Path, name: str) -> None:
    """The temporary folders that killed exports to `parent/name` left (their process is gone)."""
    for stale in parent.glob(f".{glob.escape(name)}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # alive, another user's


def swap_in(stage: Path, parent: Path, names: list[str]) -> None:
    """Each stage/new/NAME in place of parent/NAME (the old one to stage/old/NAME); on a failure, every old one back."""
    done: list[str] = []
    try:
        for name in names:
            dest = parent / name
            if dest.exists() or dest.is_symlink():
                (stage / OLD).mkdir(exist_ok=True)
                os.rename(dest, stage / OLD / name)
            done.append(name)
            os.rename(stage / NEW / name, dest)
    except BaseException:
        for name in reversed(done):
            dest = parent / name
            if not (stage / NEW / name).exists() and (dest.exists() or dest.is_symlink()):
                os.rename(dest, stage / NEW / name)
            if (stage / OLD / name).exists():
                os.rename(stage / OLD / name, dest)
        raise


def write_failed(target: Path, error: OSError, hint: str) -> UserError:
    """One line for an export that could not be written: the folder, the OS's reason, and what to do."""
    what = error.strerror or type(error).__name__
    if error.errno in FULL:
        free = free_bytes(target.parent)
        what += f"; {human(free) if free is not None else 'an unknown amount'} free on its file system"
        hint = hint or "free space, or give OUT on another disk"
    return UserError(f"writing {target} failed ({what}): nothing was changed there; {hint or 'give a writable folder as OUT'}")


def write_folders(target: Path, write: Callable[[Path], T], names: set[str] | None = None, hint: str = "") -> T:
    """`write(folder)` writes `folder` (named as `target`, and any folders beside it, e.g. a LoRA run's adapters)
    into the temporary `.NAME.tmp-<pid>` beside `target`; each is then marked (MARK) and renamed in place of its
    namesake beside `target`. `names`: the only names it may write (those checked by `check_target`). Returns what
    `write` returned, a line naming the temporary folders naming their final place. An OSError (a full or read-only
    disk) is one line, ending with `hint` (what to do); any failure leaves the old folders as they were."""
    parent = target.parent
    stage = parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        if parent.is_dir():
            remove_stale(parent, target.name)
        shutil.rmtree(stage, ignore_errors=True)  # a reused pid's
        (stage / NEW).mkdir(parents=True)
        result = write(stage / NEW / target.name)
        written = sorted(p.name for p in (stage / NEW).iterdir())
        if names is not None and not set(written) <= names:
            raise RuntimeError(f"the export wrote {written}, not only the folders checked ({sorted(names)})")
        for name in written:
            mark(stage / NEW / name)
        swap_in(stage, parent, written)
    except BaseException as e:
        shutil.rmtree(stage / NEW, ignore_errors=True)
        for leftover in (stage / OLD, stage):  # empty once swap_in put the old folders back; never removed otherwise
            with contextlib.suppress(OSError):
                leftover.rmdir()
        os_error = as_os_error(e, target)
        if os_error is None:
            raise
        raise write_failed(target, os_error, hint) from None
    shutil.rmtree(stage, ignore_errors=True)  # the old folders
    return result.replace(str(stage / NEW), str(parent)) if isinstance(result, str) else result
