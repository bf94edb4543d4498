"""User-facing errors: one line, exit code 2, no traceback.

Anything a user can fix (a config key, a path, a launch flag) raises `UserError`. `train.py` and the
scripts catch it at the top and print `error: <message>` once, from the first process only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

EXIT_USER_ERROR = 2
EXIT_PEER_FAILURE = 1


class UserError(Exception):
    """A problem with the user's input. The message names what is wrong and how to fix it."""


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


def is_first_process() -> bool:
    # Read the launcher's environment, not torch.distributed: errors can happen before the process
    # group exists, and every rank of a multi-process launch hits the same config error.
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def run_cli(main: Callable[[], int | None]) -> None:
    """Run `main`, turning a UserError into one line on stderr and exit code 2."""
    try:
        code = main()
    except UserError as e:
        if is_first_process():
            print(f"error: {e}", file=sys.stderr, flush=True)
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
