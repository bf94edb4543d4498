"""The one way the template writes what a user keeps: never over a file it did not write, or changed since.

Every folder the template writes its files in (a run's output_dir, the run's hf/ and adapter/, a folder of
scripts/export.py) holds LISTING: the files written there, each with its sha256. A write replaces a file only when
the listing names it with the hash the file has now. A file the listing does not name (a user's model card, a model
folder's weights) or one changed since it was written (an edit, of the same size and mtime too) stops the write in
one line naming it, and nothing is written. Checkpoints are listed by their own manifest (checkpoint/manifest.py).

- one file in a folder (config.yaml, the tokenizer, summary.json, model.safetensors, pictures): `check_file` before,
  `record` after; `write_file` writes text whole (disk.write_atomic) between the two;
- a folder written whole (hf/, adapter/, an export): `foreign_entries` says what in it the listing does not vouch
  for; `write_folders` writes the new folders into a temporary `.NAME.tmp-<pid>` beside them, lists their files and
  renames each in place of its namesake (the old ones moved aside and removed last). A failure at any point (a full
  or read-only disk, an exception, Ctrl-C) puts the old folders back, removes the temporary one and says what failed
  in one line. A SIGKILL can leave `.NAME.tmp-<pid>`; the next write to that place removes it once no process of
  that pid is alive.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from parallel_train.checkpoint.disk import as_os_error, free_bytes, human, write_atomic
from parallel_train.checkpoint.manifest import sha256 as sha256_of  # hashlib.file_digest, as a checkpoint's manifest
from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError

T = TypeVar("T")
LISTING = ".parallel-train-files.json"  # the files the template wrote in a folder, with their sha256
WRITER = "parallel_train"
NEW, OLD = "new", "old"  # inside the temporary folder: what is being written, and the folders it replaces
FULL = (errno.ENOSPC, errno.EDQUOT)


# ---------------------------------------------------------------- the listing


def listed(folder: Path) -> dict[str, str]:
    """The files `folder`'s listing names, {relative path: sha256} ({} without a readable listing)."""
    try:
        found = json.loads((folder / LISTING).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = found.get("files") if isinstance(found, dict) and found.get("written_by") == WRITER else None
    return {k: v for k, v in files.items() if isinstance(v, str)} if isinstance(files, dict) else {}


def save_listing(folder: Path, files: dict[str, str]) -> None:
    write_atomic(folder / LISTING, json_text({"written_by": WRITER, "files": dict(sorted(files.items()))}, indent=1))


def record(folder: Path, names: list[str]) -> None:
    """List `names` (files in `folder`, just written) as they are now."""
    files = listed(folder)
    files.update({name: sha256_of(folder / name) for name in names if (folder / name).is_file()})
    save_listing(folder, files)


def mark(folder: Path) -> None:
    """List every file of `folder`, a folder written whole."""
    save_listing(folder, {str(p.relative_to(folder)): sha256_of(p) for p in sorted(folder.rglob("*")) if not p.is_dir()})


def unchanged(path: Path, sha256: str | None) -> bool:
    return sha256 is not None and path.is_file() and not path.is_symlink() and sha256_of(path) == sha256


# ---------------------------------------------------------------- one file


def check_file(path: Path) -> None:
    """Refuse in one line to replace `path` unless its folder's listing names it, unchanged (no file: nothing to refuse)."""
    if not (path.exists() or path.is_symlink()):
        return
    sha256 = listed(path.parent).get(path.name)
    if unchanged(path, sha256):
        return
    why = "changed since the template wrote it" if sha256 is not None else "not written by this template"
    raise UserError(
        f"{path}: {why}, so it is not replaced (the template never overwrites a file it did not write); move it away, "
        "or choose another output folder"
    )


def write_file(path: Path, text: str) -> None:
    """`text` as `path`, whole, and listed; refused in one line when `path` is not the template's (`check_file`)."""
    check_file(path)
    write_atomic(path, text)
    record(path.parent, [path.name])


def write_with(path: Path, write: Callable[[Path], T]) -> T:
    """`write(path)` (a picture, a safetensors file), checked before and listed after."""
    check_file(path)
    result = write(path)
    record(path.parent, [path.name])
    return result


# ---------------------------------------------------------------- a folder written whole


def foreign_entries(folder: Path) -> list[str]:
    """What in `folder` the template did not write, or changed since: its files and folders, by relative path (a
    folder that is not the template's is named once, not its contents)."""
    files = listed(folder)
    folders = {str(parent) for name in files for parent in Path(name).parents if str(parent) != "."}
    found: list[str] = []
    for root, dirs, names in os.walk(folder):
        for name in sorted(names):
            path = Path(root, name)
            rel = str(path.relative_to(folder))
            if rel != LISTING and not unchanged(path, files.get(rel)):
                found.append(rel)
        for name in sorted(dirs):
            rel = str(Path(root, name).relative_to(folder))
            if rel not in folders or Path(root, name).is_symlink():
                found.append(rel + "/")
        dirs[:] = [d for d in dirs if str(Path(root, d).relative_to(folder)) in folders and not Path(root, d).is_symlink()]
    return found


def check_folder(folder: Path) -> None:
    """Refuse in one line to replace `folder` when it holds anything the template did not write, or changed since."""
    foreign = foreign_entries(folder) if folder.is_dir() else []
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        listed_names = ", ".join(foreign[:3]) + more
        raise UserError(
            f"{folder} holds files the template did not write or that changed since ({listed_names}): it never deletes them; move them away, then run again"
        )


def remove_stale(parent: Path, name: str) -> None:
    """The temporary folders that killed writes to `parent/name` left (their process is gone)."""
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
    """One line for folders that could not be written: the folder, the OS's reason, and what to do."""
    what = error.strerror or type(error).__name__
    if error.errno in FULL:
        free = free_bytes(target.parent)
        what += f"; {human(free) if free is not None else 'an unknown amount'} free on its file system"
        hint = hint or "free space, or give OUT on another disk"
    return UserError(f"writing {target} failed ({what}): nothing was changed there; {hint or 'give a writable folder as OUT'}")


def write_folders(target: Path, write: Callable[[Path], T], names: set[str] | None = None, hint: str = "") -> T:
    """`write(folder)` writes `folder` (named as `target`, and any folders beside it, e.g. a LoRA run's adapters)
    into the temporary `.NAME.tmp-<pid>` beside `target`; each is then listed and renamed in place of its namesake
    beside `target`. `names`: the only names it may write. Each folder it replaces is checked (`check_folder`: one
    line, nothing written): those of `names` (else `target`) before anything is written, any other before the swap.
    Returns what `write` returned, a line naming the temporary folders naming their final place. An OSError (a full
    or read-only disk) is one line, ending with `hint` (what to do); any failure leaves the old folders as they were."""
    parent = target.parent
    for name in sorted(names or {target.name}):
        check_folder(parent / name)
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
        for name in written if names is None else []:
            check_folder(parent / name)  # names not given: each checked before it is replaced
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
