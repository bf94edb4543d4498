"""A launcher for tests: train.py's ranks (or one run of a script) forked from one process that imported the
template once.

    python tests/warm_launcher.py           (started by tests/helpers.py; reads requests on stdin, one JSON per line)
    python tests/warm_launcher.py --fresh   the same, but the template itself is imported by each child from the
                                            checkout it runs in (the guide test's copy, changed as the guide goes)

Why: a launch of a few tiny steps spends most of its seconds importing torch, accelerate and datasets, once per
rank, and torchrun adds its own start. The equivalence tests launch dozens of runs whose point is the arithmetic
of a layout, not the launcher. Here every rank of a run is a child forked from this warm process: it sets the
environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), then
runs the script as `python SCRIPT ARGS` would (`runpy` with `__name__ == "__main__"`: train.py's `run_cli(main)`),
with its own stdout, stderr and exit code. The process group is
real (gloo over TCP between the children), as are checkpoints, signals and kills. What it is not: torchrun's
agent (restarts, its store, its handling of a failed worker) and accelerate's launcher; the tests of those keep
launching them (tests/test_topologies.py, test_reliability's elastic and signal tests).

Request: {"script": "train.py", "args": [...], "nproc": N, "env": {...}, "cwd": "...", "timeout": seconds}. Reply: {"returncode",
"stdout", "stderr"}: every rank's output in rank order; the return code of the one process, or for several that of
torchrun (0 when every rank succeeded, else 1). On timeout every rank is killed and "timed_out" is true.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# What a run imports, imported once here and shared by every forked rank (late imports included).
import accelerate  # noqa: E402,F401
import datasets  # noqa: E402,F401
import peft  # noqa: E402,F401  (LoRA runs: 1 s per rank otherwise)
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.pipelining  # noqa: E402,F401
import transformers  # noqa: E402,F401  (model.name=hf and the fine-tuning runs: seconds per launch otherwise)
from matplotlib.figure import Figure  # noqa: E402,F401  (metrics.png at the end of every run: 1 s of a tiny run's 2.4)
from matplotlib.ticker import MaxNLocator  # noqa: E402,F401

FRESH = "--fresh" in sys.argv
if FRESH:  # the children import the template from their own checkout; the heavy libraries it uses are shared
    sys.path.remove(str(REPO / "src"))
    import matplotlib.pyplot  # noqa: E402,F401
else:
    import parallel_train.trainer  # noqa: E402,F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, request: dict, port: int, group: int, out: Path, err: Path) -> None:
    """In a forked child: become rank `rank` of the run, run the script, leave with its exit code."""
    code = 1
    try:
        os.setpgid(0, group)  # every rank in one process group: a timeout kills them all
        n = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        if n > 1:
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
        os.chdir(request["cwd"])
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        tempfile.tempdir = None  # TMPDIR is the request's
        if not FRESH:
            from parallel_train import faults

            faults.load()  # PARALLEL_TRAIN_FAULT is the request's (imported before it was set)
        sys.argv = [request["script"], *request["args"]]
        runpy.run_path(request["script"], run_name="__main__")  # as `python SCRIPT ARGS`: exits through sys.exit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()  # what the interpreter prints for an uncaught exception
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(request: dict) -> dict:
    n, port = request["nproc"], free_port()
    with tempfile.TemporaryDirectory() as tmp:
        files = [(Path(tmp) / f"out{r}", Path(tmp) / f"err{r}") for r in range(n)]
        pids: list[int] = []
        for r in range(n):
            pid = os.fork()
            if pid == 0:
                rank_main(r, request, port, pids[0] if pids else 0, *files[r])
            os.setpgid(pid, pids[0] if pids else pid)  # also here: no race with the child's own call
            pids.append(pid)
        codes, timed_out = wait(pids, time.monotonic() + request["timeout"])
        stdout = "".join(out.read_text(errors="replace") for out, _ in files if out.exists())
        stderr = "".join(err.read_text(errors="replace") for _, err in files if err.exists())
    returncode = codes[0] if n == 1 else (0 if all(c == 0 for c in codes) else 1)
    return {"returncode": returncode, "stdout": stdout, "stderr": stderr, "timed_out": timed_out}


def wait(pids: list[int], deadline: float) -> tuple[list[int], bool]:
    """Every rank's exit code (a signal as -N, like subprocess); on the deadline the whole group is killed."""
    codes: dict[int, int] = {}
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(done[1])
        if len(codes) < len(pids) and time.monotonic() > deadline:
            timed_out = True
            try:
                os.killpg(pids[0], signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in pids:
                if pid not in codes:
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.02)
    return [codes[pid] for pid in pids], timed_out


if __name__ == "__main__":
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(launch(json.loads(line))), flush=True)
