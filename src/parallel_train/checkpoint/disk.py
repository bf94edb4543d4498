"""Writing the run's files when disks fill up or fail: whole files or none, and one line that says what it needed.

A full disk (ENOSPC), a quota (EDQUOT) or a failing one (EIO) must not leave a torn file where a good one was, nor
end in a traceback. `write_atomic` writes a sibling temporary file, flushes it and renames it over the old one
(config.yaml, summary.json): a failure leaves the old file as it was and removes the temporary one. Every write
error becomes one line naming the file, the bytes it needed and the space left on its file system
(`write_error`); checkpoint/checkpointer.py says the same for a checkpoint, after removing its temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from parallel_train.errors import UserError


def human(n: float) -> str:
    """`12.3 MB`: bytes for people (powers of 1000, as df -H and file managers show them)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def free_bytes(path: Path) -> int | None:
    """Space left to an unprivileged writer on `path`'s file system (the nearest existing folder), or None."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def space_line(path: Path, needed: int) -> str:
    free = free_bytes(path)
    return f"it needs {human(needed)}, {human(free) if free is not None else 'an unknown amount'} free on its file system"


def write_error(path: Path, error: OSError, needed: int, after: str = "") -> UserError:
    """One line for a failed write: `writing PATH failed (No space left on device): it needs 2.1 kB, 0 B free ...`."""
    what = error.strerror or type(error).__name__
    return UserError(
        f"writing {path} failed ({what}): {space_line(path.parent, needed)}{after}; free space (or fix the disk), then relaunch"
    )


def as_os_error(error: BaseException, path: Path | str | None = None) -> OSError | None:
    """`error` as an OSError naming `path`, when it is one: safetensors (written in Rust) raises its own
    SafetensorError and puts the OS error in the message (`... No space left on device (os error 28)`)."""
    if isinstance(error, OSError):
        return error
    found = re.search(r"\(os error (\d+)\)", str(error)) if type(error).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), None if path is None else str(path))


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` whole, or leave it as it was (a UserError says why)."""
    data = text.encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e, len(data), f"; {path.name} was left as it was") from None
