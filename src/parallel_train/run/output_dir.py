"""The output folder: a run's own, checked before anything is written, and held by one run at a time.

A run writes only inside its output_dir, and only into a folder that is new, empty, or a run of this template:
`check_output_dir` refuses in one line, before anything is written, a folder that holds anything a run never writes
there (a model folder's config.json, someone's notes, other runs). `check_run_files` (the main process, once the
launch will train) refuses each file the run would replace that it did not write or that changed since (the
listing of checkpoint/writer.py), and hf/ and adapter/ when it writes them, so a refusal never costs a training run.
Every file it writes there goes through checkpoint/writer.py; metrics.jsonl, its log, is appended to (on resume cut
back to the resumed step: observe/tracking.py). A run folder of a version before the listing (config.yaml,
no listing) is taken as it is: its files are listed once.

Two launches into one output_dir (a SLURM requeue while the old job still runs, a command started twice) would
delete each other's temporary checkpoints and interleave metrics.jsonl. So the process that writes the shared
files (the main process) takes an exclusive lock on `output_dir/.lock` with flock(2) before the run reads or
writes anything there, and holds it to the end:

- the OS releases it when the process dies, however it dies: a crash leaves no stale lock (the file may stay;
  a later run takes it over);
- the file records the holder's host, pid and start time, so a second launch stops in one line naming it;
- a clean end, and an error, remove the file (while still holding the lock, so no third run can lose a race).

On a file system without locks (Lustre mounted without `-o flock`, NFS mounted with `nolock`) flock fails: the run
says in one line that nothing stops a second run, and goes on. What flock does on NFS and Lustre:
docs/reliability.md#one-run-per-output_dir.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from parallel_train.checkpoint.writer import LISTING, check_file, check_folder, listed, record, write_file
from parallel_train.config.sections import Config
from parallel_train.core.collectives import from_rank0
from parallel_train.core.json_text import json_text
from parallel_train.data.chat_format import FILES as CHAT_FILES
from parallel_train.data.tokenizers import HF_FILE, VOCAB_FILE
from parallel_train.errors import UserError
from parallel_train.observe.plots import PICTURE
from parallel_train.observe.tracking import MetricsLog, init_trackers
from parallel_train.tasks.label_names import LABELS_FILE

RUN_FILES = ("metrics.jsonl", "summary.json", "model.safetensors")
LOCK = ".lock"
# What a run writes in output_dir: files it replaces (each listed: checkpoint/writer.py), its log, lock and listing,
# and folders: checkpoints/ (their manifests), hf/ and adapter/ (their listings), exports/ (scripts/export.py), the
# trackers'; and the temporary names of a write under way (and NFS's .nfsXXXX for a file removed while open).
REPLACED = ("config.yaml", "summary.json", "model.safetensors", PICTURE, "pipeline_timeline.png", VOCAB_FILE, HF_FILE)
REPLACED += (*CHAT_FILES, LABELS_FILE)  # the tokenizer's companions (Data.files)
KEPT = ("metrics.jsonl", LOCK, LISTING, "checkpoints", "hf", "adapter", "exports", "tensorboard", "wandb")
TEMPORARY = re.compile(r"\..+\.tmp(-\d+)?|model\.safetensors\.tmp|\.write-test-\d+|\.nfs[0-9a-f]+")
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # flock unsupported by this file system


def not_a_runs(out: Path) -> list[str]:
    """What in `out` a run never writes there, and its listing does not name ([] for a new or empty folder)."""
    try:
        names = sorted(os.listdir(out)) if out.is_dir() else []
    except OSError:
        return []  # cannot be read: the write test below says why
    ours = {*REPLACED, *KEPT, *listed(out)}
    return [n + ("/" if (out / n).is_dir() else "") for n in names if n not in ours and not TEMPORARY.fullmatch(n)]


def check_output_dir(cfg: Config) -> Path:
    """Refuse an output_dir that is a file, not writable, holds anything a run never writes, or holds a run we would
    overwrite."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir: {cfg.output_dir!r} is a file; give a folder")
    foreign = not_a_runs(out)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(
            f"output_dir: {cfg.output_dir!r} holds {', '.join(foreign[:3])}{more}, which no run writes (a model folder? "
            "someone's files?): a run writes only into a new or empty folder or a run of its own; choose another output_dir "
            "(nothing was written there)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{time.monotonic_ns()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise UserError(f"output_dir: {cfg.output_dir!r} is not writable ({e.strerror})") from None
    if cfg.resume == "none" and any((out / f).exists() for f in RUN_FILES):
        raise UserError(f"output_dir: {cfg.output_dir!r} already holds a run; continue it with resume=auto or choose a new output_dir")
    return out


class RunLock:
    """The main process's hold on output_dir (see the module docstring). `release` is idempotent."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, out: Path) -> tuple[RunLock, str | None]:
        """(the lock, None) or (an empty lock, why not: 'busy: <holder>' or 'unsupported: <reason>')."""
        path = out / LOCK
        for _ in range(20):  # another run may remove the file between our open and our flock: then try again
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in NO_LOCKS:  # no lock, but the file still says who runs here; removed at the end as usual
                    _record(fd)
                    return cls(path, fd), f"unsupported: {e.strerror}"
                holder = _holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return cls(path, None), f"busy: {holder}"
                raise
            if _same_file(fd, path):
                _record(fd)
                return cls(path, fd), None
            os.close(fd)
        raise UserError(f"output_dir: could not lock {path}: it keeps being replaced; is another run starting and stopping there?")

    def release(self) -> None:
        if self.fd is None:
            return
        if _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)  # before the unlock: a run waiting on this file then sees it replaced
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _record(fd: int) -> None:
    """Who holds the lock, for the message of a second launch. Best effort: the lock itself is what counts."""
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
    text = json_text({"host": socket.gethostname(), "pid": os.getpid(), "started": started}).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)
        os.fsync(fd)
    except OSError:
        pass


def _holder(fd: int) -> str:
    try:
        held = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {held['host']}, pid {held['pid']}, started {held['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its lock file holds no details yet"


def lock_output_dir(out: Path, main: bool, notice) -> RunLock:
    """The main process takes output_dir's lock; every rank learns the outcome and raises the same error when
    another run holds it. A collective. Nothing has been read from or written to output_dir before this."""
    lock, why = RunLock(out / LOCK, None), None
    if main:
        try:
            lock, why = RunLock.take(out)
        except (UserError, OSError) as e:  # every rank must hear of it, or the others would wait for rank 0
            why = f"error: {e}"
    why = from_rank0(why)
    if why and why.startswith("error: "):
        raise UserError(why[7:] if why.startswith("error: output_dir") else f"output_dir: cannot lock {out / LOCK} ({why[7:]})")
    if why and why.startswith("busy: "):
        raise UserError(
            f"output_dir: {out} is in use by another run ({why[6:]}; lock {out / LOCK}): wait for it to end or stop it, "
            "or choose another output_dir"
        )
    if why:
        notice(f"warning: output_dir {out} cannot be locked ({why[13:]}): nothing stops a second run from writing there")
    return lock


def check_run_files(out: Path, folders: tuple[str, ...]) -> None:
    """Main process, before the run writes anything: each file of output_dir it may replace, and each of `folders`
    (hf/, adapter/ when it writes them), holds only what the template wrote there, unchanged; else one line naming it.
    A run of an earlier version (config.yaml, no listing) is taken as it is: its files are listed now."""
    present = [name for name in REPLACED if (out / name).exists() or (out / name).is_symlink()]
    if present and not (out / LISTING).exists() and (out / "config.yaml").is_file():
        record(out, present)
    for name in present:
        check_file(out / name)
    for name in folders:
        check_folder(out / name)


def claim_run_files(out: Path, main: bool, folders: tuple[str, ...]) -> None:
    """`check_run_files`, decided by the main process for every rank (a collective)."""
    why = None
    if main:
        try:
            check_run_files(out, folders)
        except UserError as e:
            why = str(e)
        except OSError as e:
            why = f"output_dir: cannot read {out} ({e.strerror}); check its permissions, or choose another output_dir"
    why = from_rank0(why)
    if why:
        raise UserError(why)


def write_run_files(out: Path, config_yaml: str, vocab, files: dict[str, str]) -> None:
    """What a run keeps beside its checkpoints from the start (main process only): config.yaml (what runs, a learning
    rate changed on resume included), the tokenizer (vocab.json or tokenizer.json) and its companions (Data.files: a
    chat template, class names), each written whole and listed (checkpoint/writer.py)."""
    write_file(out / "config.yaml", config_yaml)
    for name, text in {**(vocab.files() if vocab is not None else {}), **files}.items():
        write_file(out / name, text)


def open_run_files(out: Path, cfg: Config, accelerator: Any, data: Any, start_step: int, run_id: str, say: Callable[[str], None]):
    """The run's files at its start: config.yaml and the tokenizer (vocab.json or tokenizer.json, with what goes with it:
    a chat template) written, metrics.jsonl cut back to `start_step`, the trackers started. Returns config.yaml's text,
    the tokenizer's files (every checkpoint holds them too) and the metrics log."""
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    tokenizer_files = {**(data.vocab.files() if data.vocab else {}), **data.files}
    metrics = MetricsLog(out / "metrics.jsonl", accelerator, cfg.tracker)
    metrics.truncate_after(start_step, say)  # first: a metrics.jsonl it cannot read stops the run before any write
    if accelerator.is_main_process:
        write_run_files(out, config_yaml, data.vocab, data.files)
    init_trackers(accelerator, cfg.tracker, cfg.to_dict(), out, run_id)
    return config_yaml, tokenizer_files, metrics
