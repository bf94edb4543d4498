"""Run train.py's entry point once per bad input, each case in its own forked process.

    python tests/bad_input_runner.py CASES.json RESULTS.json WATCHED_DIR

Why not one `python train.py` launch per case: a launch spends most of its few seconds importing torch,
accelerate and datasets, and the catalogue has dozens of cases. Here one process imports them once; every case
is a child forked from it that runs exactly what train.py runs (`run_cli(main)`), in its own session, with its
own stdout, stderr and exit code, so a traceback or a wrong exit code shows as it would from a launch.
CASES.json: a list of [id, [argument, ...]] or [id, [argument, ...], {variable: value}] (set in the child's
environment, e.g. a RANK leaked from another launch). RESULTS.json: id -> returncode, stdout, stderr and the snapshot
of WATCHED_DIR (size, mtime, sha256 of every file) after the case, to prove that nothing there changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import transformers  # noqa: E402,F401  (the fine-tuning cases' model.name=hf: seconds per case otherwise)

import parallel_train.trainer  # noqa: E402,F401  (imported once here, shared by every forked case)
from parallel_train.cli import main  # noqa: E402
from parallel_train.errors import run_cli  # noqa: E402

TIMEOUT_S = 120


def snapshot(folder: Path) -> dict[str, list]:
    """Every file of the watched run."""
    return {
        str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()]
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def child(args: list[str], out: Path, err: Path, env: dict[str, str]) -> None:
    """In the forked process: train.py's `run_cli(main)`, then leave with its exit code (never return)."""
    code = 1
    try:
        os.environ.update(env)
        os.setsid()
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv = ["train.py", *args]
        run_cli(main)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()  # what the interpreter prints for an uncaught exception
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start_case(args: list[str], tmp: Path, env: dict[str, str]) -> int:
    """Fork the case's process (its output to files under `tmp`); returns its pid."""
    pid = os.fork()
    if pid == 0:
        child(args, tmp / "stdout", tmp / "stderr", env)
    return pid


def finish_case(pid: int, tmp: Path, deadline: float) -> dict | None:
    """The case's outcome once its process has ended (killed past the deadline), else None."""
    done = os.waitpid(pid, os.WNOHANG)
    if done[0] == 0:
        if time.monotonic() < deadline:
            return None
        os.killpg(pid, signal.SIGKILL)
        done = os.waitpid(pid, 0)
    return {
        "returncode": os.waitstatus_to_exitcode(done[1]),
        "stdout": (tmp / "stdout").read_text(),
        "stderr": (tmp / "stderr").read_text(),
    }


def run_all(cases: list, watched: Path, slots: int = 1) -> dict:
    """Every case, `slots` at a time. One: most cases share the watched run's output_dir, which one run at a time may
    hold (run/output_dir.py), so two at once would refuse each other."""
    results: dict[str, dict] = {}
    running: dict[str, tuple[int, Path, float]] = {}
    queue = list(cases)
    with tempfile.TemporaryDirectory() as tmp:
        while queue or running:
            while queue and len(running) < slots:
                case_id, args, *env = queue.pop(0)
                folder = Path(tmp) / case_id
                folder.mkdir()
                running[case_id] = (start_case(args, folder, env[0] if env else {}), folder, time.monotonic() + TIMEOUT_S)
            for case_id, (pid, folder, deadline) in list(running.items()):
                outcome = finish_case(pid, folder, deadline)
                if outcome is not None:
                    results[case_id] = {**outcome, "snapshot": snapshot(watched)}
                    del running[case_id]
            time.sleep(0.02)
    return results


if __name__ == "__main__":
    cases_file, results_file, watched_dir = sys.argv[1:4]
    results = run_all(json.loads(Path(cases_file).read_text()), Path(watched_dir))
    Path(results_file).write_text(json.dumps(results))
