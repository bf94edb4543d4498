"""Run real launches from tests: own process group, hard timeout that kills every child.

A launch's timeout is capped so that it ends before pytest-timeout stops the test (conftest.py records when that
would be): pytest-timeout interrupts the test, not the launch, and a launch it interrupted would keep running. Any
interruption of the wait (pytest-timeout's signal, Ctrl-C) also kills the launched process groups.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(sys.executable).parent
ACCELERATE = str(BIN / "accelerate")
TORCHRUN = str(BIN / "torchrun")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def launch_env(tmp_path: Path | None = None, **extra: str) -> dict[str, str]:
    """Environment for a launched run: offline, quiet, temp files under tmp_path, one thread per process."""
    env = dict(os.environ)
    env.update(
        {
            "WANDB_MODE": "offline",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("WANDB_API_KEY", None)
    if tmp_path is not None:
        env["TMPDIR"] = str(tmp_path)  # torchelastic and inductor leave files under TMPDIR
    env.update(extra)
    return env


# When pytest-timeout would stop the current test (time.monotonic()), set by conftest.py; None: no limit.
TEST_DEADLINE: float | None = None
MARGIN_S = 30.0  # a launch is killed this long before that, so that the test fails on the harness's terms


def launch_limit(timeout: float) -> tuple[float, str]:
    """(the seconds a launch may run, why it is less than asked): its own timeout, capped to end MARGIN_S before
    pytest-timeout stops the test."""
    if TEST_DEADLINE is None:
        return timeout, ""
    left = TEST_DEADLINE - MARGIN_S - time.monotonic()
    if left >= timeout:
        return timeout, ""
    return max(1.0, left), " (capped to end before pytest-timeout stops the test)"


def kill_groups(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


class WarmCmd(list):
    """A script and its arguments for `nproc` ranks forked from the warm launcher (tests/warm_launcher.py): the same
    entry point and a real process group, without importing torch once per rank or starting torchrun. For tests
    whose point is what a layout computes or what a script prints, not how a launcher starts it."""

    def __init__(self, nproc: int, script: str, args: tuple[str, ...], fresh: bool = False):
        super().__init__(["warm_launcher", f"--nproc={nproc}", script, *args])
        self.nproc, self.script, self.args, self.fresh = nproc, script, list(args), fresh


# Every test this session collected, before deselection: ({name: [slow?, ...]}, {test file paths}); set by conftest.py.
COLLECTED: tuple[dict[str, list[bool]], set[str]] | None = None


def warm_cmd(nproc: int, *overrides: str) -> WarmCmd:
    """train.py on `nproc` ranks."""
    return WarmCmd(nproc, "train.py", overrides)


def warm_script(script: str, *args: str) -> WarmCmd:
    """`python SCRIPT ARGS` (scripts/sample.py, scripts/export.py, ...), forked warm."""
    return WarmCmd(1, script, args)


class WarmLauncher:
    """The warm launchers of this test session (one that imported this checkout's template, one "fresh" whose
    children import it from the checkout they run in), each started at its first use (a few seconds of imports)
    and left to die with the session (its stdin closes)."""

    procs: dict[bool, subprocess.Popen] = {}

    @classmethod
    def launch(cls, cmd: WarmCmd, env: dict[str, str], cwd: Path, limit: float) -> dict:
        proc = cls.procs.get(cmd.fresh)
        if proc is None or proc.poll() is not None:
            argv = [PYTHON, str(REPO / "tests" / "warm_launcher.py"), *(["--fresh"] if cmd.fresh else [])]
            proc = cls.procs[cmd.fresh] = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=launch_env(), start_new_session=True
            )
        request = {"script": cmd.script, "args": cmd.args, "nproc": cmd.nproc, "env": env, "cwd": str(cwd), "timeout": limit}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the warm launcher (tests/warm_launcher.py) died; run a test with train_cmd to see why")
        return json.loads(line)


def run(cmd: list[str], timeout: float = 300, env: dict[str, str] | None = None, cwd: Path = REPO) -> Result:
    """Run cmd in its own session; on timeout kill the whole process group and fail loudly."""
    limit, why = launch_limit(timeout)
    if isinstance(cmd, WarmCmd):
        reply = WarmLauncher.launch(cmd, env or launch_env(), cwd, limit)
        if reply["timed_out"]:
            raise AssertionError(
                f"timed out after {limit:.0f}s{why}: {' '.join(cmd)}\n--- stdout\n{reply['stdout'][-3000:]}\n"
                f"--- stderr\n{reply['stderr'][-3000:]}"
            )
        return Result(reply["returncode"], reply["stdout"], reply["stderr"])
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env or launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_groups([proc])
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {limit:.0f}s{why}: {' '.join(cmd)}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
        ) from None
    except BaseException:  # the wait was interrupted (pytest-timeout, Ctrl-C): the launch must not outlive it
        kill_groups([proc])
        raise
    return Result(proc.returncode, out, err)


def run_together(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float = 300, cwd: Path = REPO) -> list[Result]:
    """Run several launches at once (e.g. one per "node"); on timeout kill every process group and fail loudly."""
    limit, why = launch_limit(timeout)
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for cmd, env in zip(cmds, envs, strict=True)
    ]
    deadline = time.monotonic() + limit

    def wait(proc: subprocess.Popen) -> tuple[str, str, bool]:
        try:  # a thread each: every pipe is drained while the others run
            return *proc.communicate(timeout=max(0.1, deadline - time.monotonic())), False
        except subprocess.TimeoutExpired:
            kill_groups(procs)
            return *proc.communicate(), True

    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            outcomes = list(pool.map(wait, procs))
    except BaseException:  # interrupted (pytest-timeout, Ctrl-C): no launch outlives the wait
        kill_groups(procs)
        raise
    results = [Result(proc.returncode, out, err) for proc, (out, err, _) in zip(procs, outcomes, strict=True)]
    if any(late for _, _, late in outcomes):
        logs = "\n".join(f"--- launch {i}\n{r.output[-3000:]}" for i, r in enumerate(results))
        raise AssertionError(f"timed out after {limit:.0f}s{why}: {len(cmds)} concurrent launches\n{logs}")
    return results


def check(result: Result) -> Result:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(*overrides: str) -> list[str]:
    return [PYTHON, "train.py", *overrides]


def accelerate_cmd(config: str, *overrides: str, launch_args: tuple[str, ...] = ()) -> list[str]:
    return [ACCELERATE, "launch", "--config_file", f"accelerate_configs/{config}.yaml", *launch_args, "train.py", *overrides]


def accelerate_args(config: str, *flags: str):
    """What `accelerate launch --config_file accelerate_configs/<config>.yaml <flags> train.py` resolves to."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(REPO / "accelerate_configs" / f"{config}.yaml"), *flags, "train.py"])
    return _validate_launch_command(args)[0]


def accelerate_warm(config: str, *overrides: str, launch_args: tuple[str, ...] = ()) -> tuple[WarmCmd, dict[str, str]]:
    """accelerate_cmd's ranks forked warm: (the command, the variables accelerate's launcher adds for its workers from
    the config: ACCELERATE_*, FSDP_*, PARALLELISM_CONFIG_*). For tests of what a config makes the template do; the
    launchers themselves (one process, several, several nodes) are launched by tests/test_training.py and
    tests/test_topologies.py."""
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = accelerate_args(config, *launch_args)
    several = args.multi_gpu or args.use_fsdp or args.use_deepspeed
    env = prepare_multi_gpu_env(args) if several else prepare_simple_launcher_cmd_env(args)[1]
    keys = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
    return warm_cmd(int(args.num_processes), *overrides), {k: v for k, v in env.items() if k.startswith(keys)}


def torchrun_cmd(nproc: int, *overrides: str, launch_args: tuple[str, ...] = ()) -> list[str]:
    return [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *launch_args, "train.py", *overrides]


# Tiny, fast settings: a 2-layer 32-wide GPT, a few steps, few eval batches.
TINY = (
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=16",
    "train.batch_size=4",
    "train.max_steps=6",
    "train.warmup_steps=2",
    "train.lr_decay_steps=6",
    "train.log_interval=1",
    "eval.interval=3",
    "eval.iters=4",
    "checkpoint.interval=3",
    "tracker=none",
)


def snapshot(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Size, mtime and sha256 of every file under `folder`: equal before and after means nothing was changed."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as JSON itself does (Python's reader would take them)."""

    def refuse(token: str):
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def read_metrics(out: Path) -> list[dict]:
    return [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out) if r.get("kind") == "train"}


def summary(out: Path) -> dict:
    return strict_json((out / "summary.json").read_text())


def doc_lines(page: str) -> list[str]:
    """The lines of a documentation page: "README" is README.md, any other name docs/<name>.md."""
    path = REPO / "README.md" if page == "README" else REPO / "docs" / f"{page}.md"
    return path.read_text().splitlines(keepends=True)


def heading_level(line: str) -> int:
    """1-6 for a Markdown ATX heading line (`# `, `## `, ...), else 0."""
    hashes = len(line) - len(line.lstrip("#"))
    return hashes if 1 <= hashes <= 6 and line[hashes : hashes + 1] in (" ", "\n", "") else 0


def doc_section(page: str, title_start: str) -> str:
    """The section of a page whose heading starts with `title_start` (any level), up to the next heading of the
    same or a higher level; headings inside ``` fences (a `# comment` in a code block) do not count.
    Docs tests read the pages themselves, so a page cannot drift from the code."""
    lines, fenced, start, level = doc_lines(page), False, None, 0
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            continue
        n = 0 if fenced else heading_level(line)
        if not n:
            continue
        if start is None and line[n:].strip().startswith(title_start):
            start, level = i, n
        elif start is not None and n <= level:
            return "".join(lines[start:i])
    assert start is not None, f"no heading starting with {title_start!r} in {page}"
    return "".join(lines[start:])
