"""The launch environment: what RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT claim, checked before
anything starts.

torchrun and accelerate launch set all of them (and TORCHELASTIC_RUN_ID) for every process they start. A shell
that kept them from an earlier launch (`export RANK=1`, a job script sourced twice) makes a plain
`python train.py` a process of a distributed launch that does not exist: accelerate then waits for peers that
never come (parallel.timeout_s, 30 minutes by default), fails inside torch with a traceback, or trains with
every message switched off because the process believes it is rank 1. Here such an environment is one line
that says what it claims and what is missing. A launch by hand with all four variables set (two shells, the
env:// method) is a real launch: it is let through with one notice that it waits for its peers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from parallel_train.errors import NoLauncher

CLAIMS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
NEEDED = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")  # what torch's env:// rendezvous reads
# Launchers that set the variables themselves: torch's elastic agent (torchrun, accelerate launch) and MPI.
LAUNCHER_MARKS = ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _int(env: dict[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        raise NoLauncher(f"the environment sets {name}={env[name]!r}, which is not a number; unset it or launch with torchrun") from None


def check_launch_env(env: dict[str, str] | None = None, notice=None) -> None:
    """Refuse an environment that claims a distributed launch no launcher made (see the module docstring)."""
    env = os.environ if env is None else env
    if any(mark in env for mark in LAUNCHER_MARKS):
        return
    claims = ", ".join(f"{k}={env[k]}" for k in CLAIMS if k in env)
    world, rank = _int(env, "WORLD_SIZE", 1), _int(env, "RANK", 0)
    fix = "unset them to train in one process, or launch with `torchrun --nproc-per-node N train.py`"
    if world <= 1 and "LOCAL_RANK" not in env:
        if rank != 0:
            raise NoLauncher(
                f"the environment says {claims}, but WORLD_SIZE is not above 1: a run of one process is rank 0, and no launcher "
                f"(torchrun, accelerate launch) started this one; {fix}"
            )
        return
    missing = [k for k in NEEDED if k not in env]
    if missing:
        raise NoLauncher(
            f"the environment says {claims} (a process of a distributed launch), but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set and no launcher (torchrun, accelerate launch) started this process; {fix}"
        )
    if not 0 <= rank < world:
        raise NoLauncher(f"the environment says {claims}: RANK must be in [0, WORLD_SIZE); {fix}")
    if world > 1 and rank == 0:
        (notice or _print)(
            f"notice: {claims} come from the environment, not from a launcher: this process waits for the other {world - 1} "
            f"at {env['MASTER_ADDR']}:{env['MASTER_PORT']} for up to parallel.timeout_s"
        )


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- what a launched process does for itself

PR_SET_PDEATHSIG = 1  # prctl(2)


def launched_by_a_launcher(env: dict[str, str], parent: int) -> bool:
    """Whether this process's parent is a launcher: torch's elastic agent (torchrun, a multi-process accelerate launch:
    it sets TORCHELASTIC_RUN_ID), or a one-process `accelerate launch`, which starts the script as a plain child and
    marks it with nothing but its own command line."""
    if "TORCHELASTIC_RUN_ID" in env:
        return True
    try:
        argv = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    names = [Path(arg).name for arg in argv[:3]]
    return ("accelerate" in names and "launch" in argv[1:4]) or bool(
        {"accelerate-launch", "accelerate.commands.launch"} & {*names, *argv[:3]}
    )


def end_with_launcher(env: dict[str, str] | None = None) -> bool:
    """Ask Linux to send this process SIGTERM when the launcher that started it dies.

    torch's elastic agent (torchrun, and a multi-process accelerate launch, which runs the same agent) starts every
    worker in a session of its own. A SIGKILL of the agent therefore reaches no worker: they trained on as orphans
    (measured: two workers still stepping 10 s after `kill -9` of torchrun). A one-process accelerate launch dies of
    a SIGTERM without forwarding it, with the same result. With the parent-death signal each worker gets the SIGTERM
    that a preemption gives, so it checkpoints at the next step boundary and exits (guards.py). Only under a
    launcher: a plain `python train.py` belongs to its shell. Returns whether the signal is set."""
    env = os.environ if env is None else env
    parent = os.getppid()
    if sys.platform != "linux" or not launched_by_a_launcher(env, parent):
        return False
    import ctypes
    import signal

    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died before the signal was set: nothing will send it now
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a container limited to 2
    CPUs on a 64-core host sees 64 in its mask, and 64 threads sharing 2 CPUs' time crawl)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def cpu_threads(env: dict[str, str] | None = None, cores: int | None = None) -> int:
    """Threads for this process's intra-op work. A user's OMP_NUM_THREADS stands
    (torchrun sets 1 for several processes when it is unset, and accelerate launch always sets it); otherwise the
    usable cores shared among the processes of this node (LOCAL_WORLD_SIZE), at least one: torch's own default is one
    thread per core for every process, so N processes on one node, or one in a CPU-capped container, oversubscribe
    the cores (issue 27 reported steps 10-30x slower on a busy host until OMP_NUM_THREADS=1). Other users' load on
    an uncapped host is not seen here: OMP_NUM_THREADS stays the lever for that."""
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    local = max(1, _int(env, "LOCAL_WORLD_SIZE", 1))
    return max(1, (usable_cores() if cores is None else cores) // local)


def set_cpu_threads() -> int:
    """cpu_threads() applied: torch's intra-op pool and, for the processes this one starts, OMP_NUM_THREADS."""
    import torch

    threads = cpu_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    return threads
