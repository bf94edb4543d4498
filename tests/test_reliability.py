"""Never lose work: real processes, real signals, real kills (test-only faults via PARALLEL_TRAIN_FAULT).

Every "bit-identical" check compares the final model.safetensors bytes of an interrupted-and-resumed run
with an uninterrupted one, with dropout on (so per-rank RNG state must be restored exactly too).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import PYTHON, REPO, TINY, accelerate_cmd, check, launch_env, read_metrics, run, torchrun_cmd, train_losses, warm_cmd
from parallel_train import faults
from parallel_train.checkpoint import checkpointer
from parallel_train.checkpoint.export import load_weights
from parallel_train.errors import UserError, collective_failure_message
from parallel_train.run.resume import choose_checkpoint

pytestmark = pytest.mark.multiprocess

BASE = (*TINY, "model.dropout=0.1")  # 6 steps, checkpoints at 3 and 6, log every step
SECRET = "fake-secret-0123456789abcdef0123456789abcdef"


def fault_env(tmp_path: Path, spec: str = "", **extra: str) -> dict[str, str]:
    env = launch_env(tmp_path, **extra)
    if spec:
        env[faults.ENV] = spec
    return env


def same_bytes(a: Path, b: Path) -> bool:
    return (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def train_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out) if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def ref1(tmp_path_factory) -> tuple[Path, str]:
    """One process, never interrupted. Also the secrets check: a fake WANDB_API_KEY and wandb (offline) on."""
    tmp = tmp_path_factory.mktemp("ref1")
    env = launch_env(tmp, WANDB_API_KEY=SECRET, HF_TOKEN=SECRET, WANDB_MODE="offline")
    result = check(run(warm_cmd(1, *BASE, "tracker=wandb", f"output_dir={tmp / 'run'}"), env=env))
    return tmp / "run", result.output


@pytest.fixture(scope="module")
def ref2(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ref2")
    check(run(warm_cmd(2, *BASE, f"output_dir={tmp / 'run'}"), env=launch_env(tmp)))
    return tmp / "run"


# ---------------------------------------------------------------- crash and exact resume


def test_sigkill_between_checkpoints_then_resume_is_bit_identical(ref1, tmp_path):
    out = tmp_path / "run"
    killed = run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path, "kill@4"))
    assert killed.returncode == -signal.SIGKILL, killed.output[-2000:]
    assert [p.name for p in checkpointer.list_checkpoints(out / "checkpoints")] == ["step_0000003"]
    resumed = check(run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path)))
    assert "resumed from" in resumed.output and "step_0000003" in resumed.output
    assert same_bytes(out, ref1[0])
    assert train_steps(out) == [1, 2, 3, 4, 5, 6]  # the killed run's step 4 record was dropped, not duplicated


def test_kill_during_save_leaves_previous_checkpoint_valid(ref1, tmp_path):
    out = tmp_path / "run"
    killed = run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path, "kill_in_save@6"))
    assert killed.returncode == -signal.SIGKILL
    root = out / "checkpoints"
    assert list((root / ".tmp-step_0000006" / "shards").glob("rank*.safetensors"))  # written, never sealed nor renamed
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000003"]
    assert checkpointer.verify(root / "step_0000003") is None
    assert not (out / "model.safetensors").exists()
    check(run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path)))
    assert same_bytes(out, ref1[0])
    assert not list(root.glob(".tmp-*"))  # the stale partial save was cleaned up


def test_two_processes_sigkill_then_resume_is_bit_identical(ref2, tmp_path):
    """Rank 1 dies: rank 0 exits with one line (no hang); resume on 2 processes is bit-identical."""
    out = tmp_path / "run"
    killed = run(warm_cmd(2, *BASE, f"output_dir={out}"), env=fault_env(tmp_path, "kill@4:rank=1"))
    assert killed.returncode != 0
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error: rank 0: a collective failed at step 4")]
    assert len(errors) == 1, killed.output[-3000:]
    check(run(warm_cmd(2, *BASE, f"output_dir={out}"), env=fault_env(tmp_path)))
    assert same_bytes(out, ref2)


def same_training(run_dir: Path, ref_dir: Path, steps: range, tol: float = 1e-5) -> None:
    """The losses of `steps` and the final weights of two runs agree to `tol` (dropout off: only float rounding,
    from another reduction order, separates them)."""
    got, want = {k: v for k, v in train_losses(run_dir).items() if k in steps}, train_losses(ref_dir)
    assert sorted(got) == list(steps), got
    for step in steps:
        assert got[step] == pytest.approx(want[step], abs=tol), (step, got[step], want[step])
    a, b = load_file(str(run_dir / "model.safetensors")), load_file(str(ref_dir / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in b:
        torch.testing.assert_close(a[name], b[name], atol=tol, rtol=0, msg=name)


def test_a_two_process_checkpoint_continues_on_one_process(tmp_path):
    """2 processes x batch 4 -> 1 process x batch 8 from the step-3 checkpoint, with a notice: the global batch is
    the same, so steps 4-6 read the same samples and, dropout off, end where the 2-process run ends (1e-5)."""
    ddp, one = tmp_path / "ddp", tmp_path / "one"
    check(run(warm_cmd(2, *TINY, f"output_dir={ddp}"), env=fault_env(tmp_path)))
    step3 = ddp / "checkpoints" / "step_0000003"
    moved = check(run(warm_cmd(1, *TINY, "train.batch_size=8", f"resume={step3}", f"output_dir={one}"), env=fault_env(tmp_path)))
    notice = [line for line in moved.output.splitlines() if line.startswith("notice: the checkpoint was written by 2 processes")]
    assert len(notice) == 1 and "global batch is unchanged" in notice[0], moved.output[-3000:]
    same_training(one, ddp, range(4, 7))


@pytest.mark.slow
def test_elastic_torchrun_restarts_and_matches_uninterrupted(ref2, tmp_path):
    marker = tmp_path / "fired"
    result = check(
        run(
            torchrun_cmd(2, *BASE, f"output_dir={tmp_path / 'run'}", launch_args=("--max-restarts", "1")),
            env=fault_env(tmp_path, f"kill@4:rank=1:once={marker}"),
        )
    )
    assert marker.exists(), "the fault never fired"
    assert "SIGKILL rank 1 after step 4" in result.output and "resumed from" in result.output
    assert same_bytes(tmp_path / "run", ref2)


@pytest.mark.slow
def test_elastic_accelerate_max_restarts(ref2, tmp_path):
    marker = tmp_path / "fired"
    cmd = [
        str(Path(PYTHON).parent / "accelerate"),
        "launch",
        "--config_file",
        "accelerate_configs/multi_cpu.yaml",
        "--max_restarts",
        "1",
        "train.py",
        *BASE,
        f"output_dir={tmp_path / 'run'}",
    ]
    result = check(run(cmd, env=fault_env(tmp_path, f"kill@4:rank=1:once={marker}")))
    assert marker.exists() and "resumed from" in result.output
    assert same_bytes(tmp_path / "run", ref2)


def test_hung_rank_makes_the_others_fail_within_the_timeout(tmp_path):
    result = run(
        torchrun_cmd(2, *BASE, "parallel.timeout_s=10", f"output_dir={tmp_path / 'run'}"),  # torchrun ends the hung rank
        env=fault_env(tmp_path, "hang@2:rank=1"),
        timeout=240,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: rank 0: a collective failed at step 2")]
    assert len(errors) == 1 and "parallel.timeout_s (10 s)" in errors[0], result.output[-3000:]
    assert re.search(r"exitcode\s*: 1 \(pid", result.output)  # a clean exit 1 (elastic launchers restart on it), not an abort


# ---------------------------------------------------------------- preemption


def test_sigusr1_checkpoints_exits_cleanly_and_resume_is_bit_identical(ref1, tmp_path):
    out = tmp_path / "run"
    stopped = check(run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path, "sigusr1@4")))
    assert "SIGUSR1: stopped at step 4 of 6" in stopped.output and "resume=auto" in stopped.output
    assert checkpointer.verify(out / "checkpoints" / "step_0000004") is None
    assert not (out / "model.safetensors").exists()
    check(run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path)))
    assert same_bytes(out, ref1[0])


@pytest.mark.slow  # the same path as SIGUSR1 above; only the first-Ctrl-C bookkeeping differs
def test_sigint_checkpoints_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    stopped = check(run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path, "sigint@2")))
    assert "SIGINT: stopped at step 2 of 6" in stopped.output and "Traceback" not in stopped.output
    assert checkpointer.verify(out / "checkpoints" / "step_0000002") is None


def test_signal_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    result = check(run(warm_cmd(2, *BASE, f"output_dir={out}"), env=fault_env(tmp_path, "sigterm@4:rank=1")))
    assert "stopped at step 4 of 6" in result.output
    saved = out / "checkpoints" / "step_0000004"
    assert checkpointer.verify(saved) is None
    assert (saved / "rng_rank0.safetensors").exists() and (saved / "rng_rank1.safetensors").exists()
    assert json.loads((saved / "trainer_state.json").read_text())["step"] == 4


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_on_all_ranks(tmp_path):
    """A real preemption: SIGTERM to the launcher (as SLURM does) while training; torchrun forwards it to
    the workers, which may be at different steps: they agree on one, save there and exit."""
    out = tmp_path / "run"
    cmd = torchrun_cmd(2, *BASE, "train.max_steps=5000", "eval.interval=0", "checkpoint.interval=0", f"output_dir={out}")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=fault_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    deadline = time.monotonic() + 240
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"step 3/5000 ", line):
                proc.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline, "no step 3 line"
        lines += proc.communicate(timeout=120)[0].splitlines()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "\n".join(lines)
    match = re.search(r"SIGTERM: stopped at step (\d+) of 5000 and saved (\S+)\.", output)
    assert match, output[-3000:]
    saved = Path(match.group(2))
    assert saved.name == checkpointer.checkpoint_name(int(match.group(1))) and checkpointer.verify(saved) is None
    assert (saved / "rng_rank0.safetensors").exists() and (saved / "rng_rank1.safetensors").exists()
    assert "Traceback" not in "".join(line for line in lines if "[rank" in line)  # workers: no tracebacks


@pytest.mark.parametrize(
    "launcher, sent",
    [
        pytest.param("torchrun", signal.SIGKILL, id="torchrun_sigkill"),
        pytest.param("accelerate", signal.SIGTERM, id="accelerate_one_process_sigterm", marks=pytest.mark.slow),
    ],
)
def test_a_killed_launcher_ends_its_workers_with_a_checkpoint(tmp_path, launcher, sent):
    """torchrun starts each worker in a session of its own and a SIGKILL of it forwards nothing; a one-process
    accelerate launch dies of a SIGTERM without forwarding it: either way the workers trained on as orphans. Each
    worker now asks Linux for SIGTERM when its launcher dies (parallel/launch_env.py): they stop at one step,
    checkpoint and exit."""
    import psutil

    out, args = tmp_path / "run", (*TINY, "train.max_steps=100000", "eval.interval=0", "checkpoint.interval=0")
    cmd = torchrun_cmd(2, *args, f"output_dir={out}") if launcher == "torchrun" else accelerate_cmd("cpu", *args, f"output_dir={out}")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=fault_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    workers: list[psutil.Process] = []
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 3/100000 "):
                break
            assert time.monotonic() < deadline, "no step 3 line"
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == (2 if launcher == "torchrun" else 1)
        proc.send_signal(sent)  # to the launcher alone, not its process group
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, f"workers {[w.pid for w in alive]} outlived their launcher by 60 s"
        lines += proc.stdout.read().splitlines()  # every writer of the pipe has exited: this ends
    finally:
        for worker in workers:  # only what this test started, by pid
            if worker.is_running():
                worker.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "\n".join(lines)
    match = re.search(r"SIGTERM: stopped at step (\d+) of 100000 and saved (\S+)\.", output)
    assert match, output[-3000:]
    assert checkpointer.verify(Path(match.group(2))) is None


# ---------------------------------------------------------------- checkpoint hygiene


def test_corrupt_checkpoints_are_skipped_and_the_resumed_one_goes_once_a_newer_one_verified(ref1, tmp_path):
    out = tmp_path / "run"
    args = (*BASE, "checkpoint.interval=2", "eval.interval=2", f"output_dir={out}")
    check(run(warm_cmd(1, *args, "checkpoint.keep=3"), env=fault_env(tmp_path)))
    root = out / "checkpoints"
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000002", "step_0000004", "step_0000006"]
    with open(root / "step_0000006" / "shards" / "rank00000-000.safetensors", "r+b") as f:
        f.truncate(100)  # a truncated file
    (root / "step_0000004" / "rng_rank0.safetensors").unlink()  # a missing file
    (out / "model.safetensors").unlink()

    result = check(run(warm_cmd(1, *args, "checkpoint.keep=1", "checkpoint.keep_best=true"), env=fault_env(tmp_path)))
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: skipping checkpoint")]
    assert len(warnings) == 2 and "step_0000006" in warnings[0] and "shards/rank00000-000.safetensors has 100 bytes" in warnings[0]
    assert "step_0000004" in warnings[1] and "rng_rank0.safetensors is missing" in warnings[1]
    assert "step_0000002 at step 2" in result.output
    # keep=1 keeps the newest: the resumed-from step_2 went once step_4 had verified; the damaged step_6 stayed until
    # this run wrote its own step_6 over it. The best (lowest val loss) is step_6 here.
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000006"]
    assert same_bytes(out, ref1[0])  # checkpoint interval and corruption change nothing in the training


def _fake_checkpoint(root: Path, step: int, val_loss: float | None, evaluated_here: bool = True) -> None:
    folder = root / checkpointer.checkpoint_name(step)
    folder.mkdir(parents=True)
    state = {"step": step, "final_val_loss": val_loss, "final_val_step": step if evaluated_here else step - 1}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def test_prune_keeps_newest_best_and_resumed(tmp_path):
    root = tmp_path / "checkpoints"
    for step, loss, here in [(1, 3.0, True), (2, 1.5, True), (3, 1.0, False), (4, 2.0, True), (5, 2.5, True), (6, 2.2, True)]:
        _fake_checkpoint(root, step, loss, here)
    (root / ".tmp-step_0000007").mkdir()
    checkpointer.prune(root, keep=2, protect=root / "step_0000001", keep_best=True)
    # newest 2 (5, 6) + best evaluated at its own step (2; step 3's 1.0 is an older eval) + resumed-from (1)
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000001", "step_0000002", "step_0000005", "step_0000006"]
    assert not list(root.glob(".tmp-*"))
    checkpointer.prune(root, keep=1)
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000006"]


def test_prune_goes_by_step_number_up_to_the_step_just_written(tmp_path):
    """keep=1 after resume=PATH to an older checkpoint: a newer one left by the earlier run (step 9) is not the
    newest of this run; the one just written (step 5) is kept, and step numbers past 7 digits sort as numbers."""
    root = tmp_path / "checkpoints"
    for step in (3, 5, 9, 9_999_999, 10_000_000):
        _fake_checkpoint(root, step, None)
    assert [checkpointer.checkpoint_step(p) for p in checkpointer.list_checkpoints(root)] == [3, 5, 9, 9_999_999, 10_000_000]
    checkpointer.prune(root, keep=1, upto=5)
    assert [checkpointer.checkpoint_step(p) for p in checkpointer.list_checkpoints(root)] == [5, 9, 9_999_999, 10_000_000]
    checkpointer.prune(root, keep=1, upto=10_000_000)
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_10000000"]


def test_checkpoints_are_ordered_and_pruned_by_their_manifests_step(tmp_path):
    """A folder whose name and manifest disagree (copied or renamed: step 6's checkpoint named step_0000001, step 2's
    named step_0000099) is left out of the listing, so pruning never deletes it; a manifest without a step (an
    earlier version's) leaves the name as the step."""
    root = tmp_path / "checkpoints"
    for name, step in ((1, 6), (2, 2), (4, 4), (5, None), (99, 2)):
        _fake_checkpoint(root, name, None)
        manifest = {"format": 2, "files": {}, **({"step": step} if step is not None else {})}
        (root / checkpointer.checkpoint_name(name) / "manifest.json").write_text(json.dumps(manifest))
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000002", "step_0000004", "step_0000005"]
    checkpointer.prune(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000001", "step_0000005", "step_0000099"]
    shutil.rmtree(root / "step_0000005")  # only misnamed folders left: resume=auto stops rather than start over
    with pytest.raises(UserError, match=r"holds no checkpoint whose name is its step \(step_0000001 holds step 6, step_0000099 holds"):
        choose_checkpoint("auto", root, warn=print)


# ---------------------------------------------------------------- divergence


def test_non_finite_loss_stops_naming_the_step_and_writes_no_checkpoint(tmp_path):
    out = tmp_path / "run"
    result = run(warm_cmd(1, *BASE, f"output_dir={out}"), env=fault_env(tmp_path, "nan@2"))
    assert result.returncode == 2 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite loss or gradients at step 2" in errors[0]
    assert not checkpointer.list_checkpoints(out / "checkpoints") and not (out / "model.safetensors").exists()


def test_a_nan_loss_without_gradient_clipping_stops_at_its_own_step(tmp_path):
    """train.grad_clip=0 and train.max_skipped_steps=0: no gradient norm is computed, so the loss check alone must
    catch the NaN (not only inf). The run stops at step 2 naming step 2, not at the step-3 checkpoint (which would
    refuse the NaN weights naming step 3). With max_skipped_steps=1 step 2 is skipped and the weights stay finite."""
    out = tmp_path / "stop"
    result = run(warm_cmd(1, *BASE, "train.grad_clip=0", f"output_dir={out}"), env=fault_env(tmp_path, "nan@2"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output[-3000:]
    assert "non-finite loss or gradients at step 2 (all ranks stopped at step 2;" in errors[0], errors[0]
    assert train_steps(out) == [1] and not checkpointer.list_checkpoints(out / "checkpoints")
    out = tmp_path / "skip"
    skip = ("train.grad_clip=0", "train.max_skipped_steps=1", f"output_dir={out}")
    result = check(run(warm_cmd(1, *BASE, *skip), env=fault_env(tmp_path, "nan@2")))
    assert "non-finite loss or gradients at step 2: update skipped (1 of at most 1)" in result.output
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "model.safetensors")).values())


def test_between_agreements_a_signal_and_a_non_finite_step_are_still_caught(tmp_path):
    """No log or checkpoint step forces an agreement here, so ranks compare notes every guards.AGREE_EVERY (16)
    steps: a signal on one rank stops both at step 16, and a NaN at step 2 is still named as step 2."""
    quiet = (*BASE, "train.max_steps=40", "train.lr_decay_steps=40", "train.log_interval=100", "eval.interval=0", "checkpoint.interval=0")
    out = tmp_path / "signal"
    result = check(run(warm_cmd(2, *quiet, f"output_dir={out}"), env=fault_env(tmp_path, "sigterm@3:rank=1")))
    assert "SIGTERM: stopped at step 16 of 40" in result.output
    assert json.loads((out / "checkpoints" / "step_0000016" / "trainer_state.json").read_text())["step"] == 16
    out = tmp_path / "nan"
    result = run(warm_cmd(2, *quiet, f"output_dir={out}"), env=fault_env(tmp_path, "nan@2:rank=1"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.output[-3000:]
    assert "non-finite loss or gradients at step 2 (all ranks stopped at step 16" in errors[0]
    assert not checkpointer.list_checkpoints(out / "checkpoints") and not (out / "model.safetensors").exists()


def test_non_finite_steps_are_skipped_up_to_the_limit_on_all_ranks(tmp_path):
    out = tmp_path / "run"
    result = check(run(warm_cmd(2, *BASE, "train.max_skipped_steps=1", f"output_dir={out}"), env=fault_env(tmp_path, "nan@2:rank=1")))
    assert "non-finite loss or gradients at step 2: update skipped (1 of at most 1)" in result.output
    for folder in checkpointer.list_checkpoints(out / "checkpoints"):
        weights = load_weights(folder)
        assert all(torch.isfinite(t).all() for t in weights.values())
        assert json.loads((folder / "trainer_state.json").read_text())["skipped_steps"] == 1


# ---------------------------------------------------------------- secrets


def test_secrets_never_reach_outputs_or_logs(ref1):
    out, output = ref1
    assert SECRET not in output
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


# ---------------------------------------------------------------- units


def test_fault_spec_parsing_and_collective_error_lines():
    parsed = faults.parse("kill@4:rank=1:once=/tmp/x; nan@2")
    assert (parsed[0].kind, parsed[0].step, parsed[0].rank, parsed[0].once) == ("kill", 4, 1, "/tmp/x")
    assert (parsed[1].kind, parsed[1].step) == ("nan", 2)
    with pytest.raises(ValueError):
        faults.parse("explode@3")
    gloo = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. This is typically ...")
    assert "Connection reset by peer" in collective_failure_message(gloo) and "[/x" not in collective_failure_message(gloo)
    assert collective_failure_message(RuntimeError("size mismatch for head.weight")) is None
