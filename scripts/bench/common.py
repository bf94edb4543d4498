"""What every benchmark here shares: the repository's paths, a free port, the environment of a launched run, the
machine's load, and writing a measured table into docs/BENCHMARKS.md between its markers.

The benchmarks run from a clone with no install step: `python scripts/bench/NAME.py` puts this folder first on
sys.path (so `from common import ...` finds this file), and REPO/src is added here for the ones that import the
template itself.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "BENCHMARKS.md"
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
sys.path.insert(0, str(REPO / "src"))

# A launch that only trains: no warm-up, a log line per step, no evaluation or checkpoint before the last step, no
# tracker, never resumed (the memory and start-up benchmarks add their model and step count).
BARE_RUN = (
    "train.warmup_steps=0",
    "train.log_interval=1",
    "eval.interval=0",
    "eval.iters=1",
    "checkpoint.interval=0",
    "tracker=none",
    "resume=none",
)


def free_port() -> int:
    """A port nobody listens on now (torchrun's rendezvous; never a fixed 29500 that another job may hold)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(tmp: Path | str, **extra: str) -> dict[str, str]:
    """A launched run's environment: one thread per process (one process per core), temporary files under `tmp`,
    no tracker traffic, unbuffered output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def load() -> float:
    """The 1-minute load average: recorded next to every figure, it says how far to trust it on a shared machine."""
    return os.getloadavg()[0]


def update_docs(text: str, start: str, end: str, section: str | None = None) -> None:
    """Put `text` between the `start` and `end` markers of docs/BENCHMARKS.md (other sections untouched). Without the
    markers: a new `section` heading and the markers at the end of the page, or an error when no section is given."""
    block = f"{start}\n{text.strip()}\n{end}"
    doc = DOC.read_text()
    if start in doc and end in doc:
        DOC.write_text(doc[: doc.index(start)] + block + doc[doc.index(end) + len(end) :])
    elif section is not None:
        DOC.write_text(doc.rstrip("\n") + f"\n\n{section}\n\n{block}\n")
    else:
        raise SystemExit(f"{DOC} lacks the {start} / {end} markers; add them where the table goes")
