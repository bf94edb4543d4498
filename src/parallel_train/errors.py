"""User-facing errors: one line, exit code 2, no traceback.

Anything a user can fix (a config key, a path, a launch flag) raises `UserError`. `train.py` and the
scripts catch it at the top and print `error: <message>`, once per run whichever ranks raised it:

- one process: printed, whatever RANK says;
- every rank raised the same message (a config error): one rank prints it, as it is;
- only some ranks raised it (a second node's missing file, a fault on one rank): each of them prints
  `error: rank R (host H): <message>`, so a misconfigured node never exits silently.

The ranks count each message in the launcher's key-value store (torchrun's and accelerate's agent keeps one for
the job; with a process group but no agent, torch.distributed's default store) and wait a few seconds for the
count to reach the world size. Without any store every rank prints with its prefix.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass

EXIT_USER_ERROR = 2
EXIT_PEER_FAILURE = 1
ERROR_WAIT_S = 5.0  # how long a failing rank waits to learn whether every rank failed alike


class UserError(Exception):
    """A problem with the user's input. The message names what is wrong and how to fix it."""

    def __init__(self, message: str = "", *args):
        # torch's DataLoader raises a worker's error again in the training process as its type built from "Caught
        # UserError in DataLoader worker process N.\nOriginal Traceback ...\n...UserError: MESSAGE": keep MESSAGE,
        # the one line (an image that cannot be decoded, read with data.num_workers > 0).
        if isinstance(message, str) and message.startswith("Caught ") and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1]
        super().__init__(message, *args)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser for a script that does not run under `run_cli`: a bad command line is one line, `error: ...`,
    and exit 2, like train.py's (argparse's own prints its usage first, and `PROG: error: ...`)."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


class NoLauncher(UserError):
    """The environment claims a distributed launch that no launcher made (parallel/launch_env.py): this process is alone."""


@dataclass
class Progress:
    """Where this process is, for error messages raised outside the loop (see collective_failure_message)."""

    step: int = 0
    timeout_s: int | None = None
    rank: int = 0


PROGRESS = Progress()


# ---------------------------------------------------------------- failed collectives

COLLECTIVE_MARKERS = (
    "gloo",
    "nccl",
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "timed out waiting",
    "watchdog",
    "processgroup",
    "collective operation timeout",
)


def collective_failure_message(error: BaseException) -> str | None:
    """One line for an error raised by a collective (a peer died or hung), else None."""
    import torch  # only here: errors.py is imported before anything heavy

    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(error).strip()
    if not (isinstance(error, dist_error) or any(m in text.lower() for m in COLLECTIVE_MARKERS)):
        return None
    first = text.splitlines()[0] if text else type(error).__name__
    if first.startswith("[") and "] " in first:  # drop gloo's "[/path/to/pair.cc:537] " source location
        first = first.split("] ", 1)[1]
    first = first.split(". This is typically")[0][:200]
    timeout = f"{PROGRESS.timeout_s} s" if PROGRESS.timeout_s else "the timeout"
    return (
        f"rank {PROGRESS.rank}: a collective failed at step {PROGRESS.step} ({first}): another process died or did not "
        f"answer within parallel.timeout_s ({timeout}); see that process's output, then relaunch with resume=auto"
    )


def world_size() -> int:
    """Processes of this launch, from the launcher's environment (1 without one)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def is_first_process() -> bool:
    # Read the launcher's environment, not torch.distributed: messages are printed before the process group
    # exists too. A run of one process is the first whatever a leaked RANK says (parallel/launch_env.py refuses those).
    if world_size() == 1:
        return True
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


# ---------------------------------------------------------------- one line per error, from any rank


def error_store():
    """A key-value store every rank of this launch reaches, or None. The launcher agent's (torchrun, accelerate
    launch) exists before the process group; otherwise torch.distributed's default store, once the group exists."""
    if world_size() == 1:
        return None
    from datetime import timedelta

    import torch.distributed as dist  # only here: errors.py is imported before anything heavy

    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=ERROR_WAIT_S))
        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except (KeyError, ValueError, RuntimeError, OSError):  # no store to reach: every failing rank prints its own line
        return None
    return None


def failed_alike(store, message: str, world: int, wait_s: float = ERROR_WAIT_S) -> tuple[bool, bool]:
    """Count this rank's `message` in `store` and wait up to `wait_s` for every rank to report the same one.
    Returns (every rank failed with it, this rank arrived first). The first rank to decide writes the verdict,
    so every rank reads the same one: a rank that gave up waiting makes every rank print its own line."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # the agent's store outlives a restart
    key = f"parallel_train/errors/{attempt}/{hashlib.sha256(message.encode()).hexdigest()[:24]}"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + wait_s
    while store.add(key, 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    mine = b"all" if store.add(key, 0) >= world else b"some"
    verdict = store.compare_set(key + "/verdict", "", mine)
    if verdict == b"all":
        # Every rank is here: wait until each has read the verdict before any leaves, since the store may live in
        # one of us (torch.distributed's default store is served by rank 0) and die with it. A rank that sees the
        # store go already has its verdict: its host left only once every rank had read it.
        try:
            store.add(key + "/read", 1)
            deadline = time.monotonic() + wait_s
            while store.add(key + "/read", 0) < world and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 (the store's host has left: nothing more to wait for)
            pass
    return verdict == b"all", arrived == 1


def report_user_error(message: str, alone: bool = False) -> bool:
    """Print `error: <message>` once for the run (see the module docstring). True when the other ranks failed alike
    (or there are none): then they exit too; False when this rank failed alone while the others may be waiting in a
    collective for it."""
    world = 1 if alone else world_size()
    store = error_store() if world > 1 else None
    if world == 1:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return True
    try:
        alike, first = failed_alike(store, message, world) if store is not None else (False, False)
    except Exception:  # the store went away (its launcher is shutting down): say it here rather than not at all
        alike, first = False, False
    if alike:
        if first:
            print(f"error: {message}", file=sys.stderr, flush=True)
        return True
    rank = os.environ.get("RANK", "?")
    print(f"error: rank {rank} (host {socket.gethostname()}): {message}", file=sys.stderr, flush=True)
    return False


def run_cli(main: Callable[[], int | None]) -> None:
    """Run `main`, turning a UserError into one line on stderr and exit code 2."""
    try:
        code = main()
    except UserError as e:
        if not report_user_error(str(e), alone=isinstance(e, NoLauncher)):
            # The other ranks may be waiting for this one in a collective: a normal interpreter exit could wait on
            # the process group's teardown. The launcher sees exit code 2 and stops them.
            sys.stdout.flush()
            os._exit(EXIT_USER_ERROR)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        sys.exit(130)
    except RuntimeError as e:
        message = collective_failure_message(e)
        if message is None:
            raise
        # A peer died or hung: one line from every surviving rank, exit 1 (an elastic launcher restarts the
        # job). os._exit: the process group is broken, and its teardown can abort or hang.
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_PEER_FAILURE)
    sys.exit(code or 0)
