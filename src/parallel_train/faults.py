"""Test-only fault injection: make a real run fail in a chosen way at a chosen step.

Off unless the environment variable PARALLEL_TRAIN_FAULT is set; the reliability tests use it to kill,
hang or signal real processes deterministically. Format: `KIND@STEP[:rank=R][:once=MARKER_FILE]`, several
separated by `;`.

    kill@4               SIGKILL this process right after optimizer step 4 (a crash, an OOM kill)
    kill@4:rank=1        only on global rank 1
    kill@4:rank=1:once=/tmp/m   only if /tmp/m does not exist yet (it is created): fires once across restarts
    kill_in_save@6       SIGKILL in the middle of writing checkpoint 6 (every rank's tensors written, no manifest yet);
                         with checkpoint.async=true this happens in the background thread, while training goes on
    kill_in_seal@6       SIGKILL rank 0 right before it writes checkpoint 6's manifest (every file hashed): the rename
                         to step_* comes after the manifest, so the old set of checkpoints must still stand
    hang@3               stop answering after step 3 (the others must time out, not hang)
    sigterm@3, sigusr1@3, sigint@3   send this process a real signal after step 3
    nan@3                make the loss of step 3 NaN (through the model output)
    overflow@3           make the gradients of step 3's first micro-batch inf, the loss staying finite: what an fp16
                         loss scale too high for one batch does (the scaler must skip that update, not the guard)
    kill_in_prepare@2    SIGKILL scripts/prepare_data.py once its 2nd token shard is in place (no metadata yet)
    user_error@2         raise a UserError after step 2 (@0: at the start, before the process group exists)
    enospc@6             writing this rank's tensors of checkpoint 6 fails with ENOSPC (a full disk)
    stale_listing@6      this rank's listing of checkpoints/ lacks step 6 and newer (a stale NFS directory cache)
    unreadable@6         this rank cannot read the files of checkpoint 6 (its view of the file system is broken)
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "PARALLEL_TRAIN_FAULT"
SIGNALS = {"sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1, "sigint": signal.SIGINT}
KINDS = (
    "kill",
    "kill_in_save",
    "kill_in_seal",
    "kill_in_prepare",
    "hang",
    "nan",
    "overflow",
    "user_error",
    "enospc",
    "stale_listing",
    "unreadable",
    *SIGNALS,
)


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None = None
    once: str | None = None

    def applies(self, kind: str, step: int) -> bool:
        if kind != self.kind or step != self.step:
            return False
        if self.rank is not None and self.rank != int(os.environ.get("RANK", "0")):
            return False
        if self.once:
            marker = Path(self.once)
            if marker.exists():
                return False
            marker.write_text(f"fired {self.kind}@{self.step} in pid {os.getpid()}\n")
        return True


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        head, *options = item.split(":")
        kind, _, step = head.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"{ENV}: cannot parse {item!r}; kinds: {', '.join(KINDS)}")
        fault = Fault(kind, int(step))
        for opt in options:
            key, _, value = opt.partition("=")
            if key == "rank":
                fault.rank = int(value)
            elif key == "once":
                fault.once = value
            else:
                raise ValueError(f"{ENV}: unknown option {opt!r} in {item!r}")
        faults.append(fault)
    return faults


FAULTS: list[Fault] = []


def load() -> None:
    """Read PARALLEL_TRAIN_FAULT (again): at import, and in a process that has set its environment since."""
    FAULTS[:] = parse(os.environ.get(ENV, ""))


load()


def _fire(kind: str, step: int) -> bool:
    return any(f.applies(kind, step) for f in FAULTS)


def after_step(step: int) -> None:
    """After each optimizer step (through step_hook)."""
    if not FAULTS:
        return
    if _fire("kill", step):
        print(f"[fault] SIGKILL rank {os.environ.get('RANK', '0')} after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    user_error(step)
    if _fire("hang", step):
        print(f"[fault] rank {os.environ.get('RANK', '0')} hangs after step {step}", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a stuck process: the launcher's SIGTERM ends it
        while True:
            time.sleep(3600)
    for name, sig in SIGNALS.items():
        if _fire(name, step):
            print(f"[fault] {sig.name} to rank {os.environ.get('RANK', '0')} after step {step}", flush=True)
            os.kill(os.getpid(), sig)


def in_save(step: int) -> None:
    """Called by checkpoint/checkpointer.py once every rank's tensors of checkpoint `step` are written, before the manifest."""
    if FAULTS and _fire("kill_in_save", step):
        where = "in the training thread" if threading.current_thread() is threading.main_thread() else "in the background"
        print(f"[fault] SIGKILL while saving checkpoint {step} ({where})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def in_seal(folder: str) -> None:
    """Called by checkpoint/manifest.py right before the manifest of `folder` (`.../.tmp-step_0000006`) is written."""
    step = _step_in(folder) if FAULTS else None
    if step is not None and _fire("kill_in_seal", step):
        print(f"[fault] SIGKILL before the manifest of checkpoint {step} is written ({folder})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def user_error(step: int) -> None:
    """`user_error@K`: after step K (the trainer), or with K = 0 at the start (cli.py, before the process group)."""
    if FAULTS and _fire("user_error", step):
        from parallel_train.errors import UserError  # errors.py imports nothing of ours; here only when a fault is set

        raise UserError(f"[fault] a user error on rank {os.environ.get('RANK', '0')} only, at step {step}")


def in_shard_write(path: str) -> None:
    """Called by checkpoint/storage.py before this rank writes a tensor file (`.../.tmp-step_0000006/shards/...`)."""
    step = _step_in(path) if FAULTS else None
    if step is not None and _fire("enospc", step):
        print(f"[fault] ENOSPC writing {path} on rank {os.environ.get('RANK', '0')}", flush=True)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _step_in(path: str) -> int | None:
    """The checkpoint step a path inside a checkpoint folder names: the last `step_N` (output_dir may hold one too)."""
    found = re.findall(r"step_(\d+)", path)
    return int(found[-1]) if found else None


def hidden(step: int, listing: bool) -> bool:
    """Whether this rank pretends checkpoint `step` is not there: in its listing (`stale_listing@N`: step N and
    newer are missing, as in a stale directory cache) or when it reads the files (`unreadable@N`)."""
    if not FAULTS:
        return False
    if listing:
        return any(f.kind == "stale_listing" and step >= f.step and f.applies("stale_listing", f.step) for f in FAULTS)
    return _fire("unreadable", step)


def in_prepare(shards: int) -> None:
    """Called by data/prepare.py each time a token shard is renamed into place (`shards` so far)."""
    if FAULTS and _fire("kill_in_prepare", shards):
        print(f"[fault] SIGKILL while preparing data, after shard {shards}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def step_hook(model, current_step) -> Callable[[int], None]:
    """The one fault hook of the training loop: the trainer calls what this returns after every optimizer step. It
    installs the model-output faults (nan, overflow) on `model` and fires the after-step ones (kill, hang,
    signals, user_error); with PARALLEL_TRAIN_FAULT unset it does nothing. `current_step()` -> int."""
    if not FAULTS:
        return lambda step: None
    install(model, current_step)
    return after_step


def install(model, current_step) -> None:
    """For `nan@K` and `overflow@K`: a forward hook on the model's output at step K. `current_step()` -> int."""
    faults = [f for f in FAULTS if f.kind in ("nan", "overflow")]
    if not faults or model is None:
        return
    overflowed: set[int] = set()

    def poison(module, inputs, output):
        step = current_step()
        if not module.training:
            return output
        if any(f.applies("nan", step) for f in faults):
            print(f"[fault] NaN output at step {step}", flush=True)
            return output * float("nan")
        if step not in overflowed and any(f.applies("overflow", step) for f in faults):
            overflowed.add(step)
            print(f"[fault] inf gradients at step {step}", flush=True)
            output.register_hook(lambda grad: grad * float("inf"))
        return output

    model.register_forward_hook(poison)
