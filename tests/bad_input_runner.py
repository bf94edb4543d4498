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

import parallel_train.trainer  # noqa: E402,F401  (imported once here, shared by every forked case)
from parallel_train.cli import main  # noqa: E402
from parallel_train.errors import run_cli  # noqa: E402

TIMEOUT_S = 120


def snapshot(folder: Path) -> dict[str, list]:
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


def run_case(args: list[str], tmp: Path, env: dict[str, str]) -> dict:
    out, err = tmp / "stdout", tmp / "stderr"
    pid = os.fork()
    if pid == 0:
        child(args, out, err, env)
    deadline = time.monotonic() + TIMEOUT_S
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    return {"returncode": os.waitstatus_to_exitcode(done[1]), "stdout": out.read_text(), "stderr": err.read_text()}


def run_all(cases: list, watched: Path) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case_id, args, *env in cases:
            results[case_id] = {**run_case(args, Path(tmp), env[0] if env else {}), "snapshot": snapshot(watched)}
    return results


if __name__ == "__main__":
    cases_file, results_file, watched_dir = sys.argv[1:4]
    results = run_all(json.loads(Path(cases_file).read_text()), Path(watched_dir))
    Path(results_file).write_text(json.dumps(results))
