"""The promises at the edges a user reaches after a crash, a requeue or a misconfigured node: resume=auto never starts
a run over, a finished run never trained again, torn files, what may change on resume, one run per output_dir. Full
disks, one resume choice for every rank and a user error from any rank: tests/test_disks_and_ranks.py.

Real processes where processes matter (several ranks, a second launch, a full disk); in this process where they add
nothing: a tiny run trains and resumes in a second or two through cli.main, as `python train.py` would.
(The launch-environment cases are in the bad-input catalogue, tests/test_bad_inputs.py.)
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import REPO, TINY, check, launch_env, read_metrics, run, snapshot, train_cmd, warm_cmd
from parallel_train import faults
from parallel_train.checkpoint import checkpointer
from parallel_train.checkpoint.export import load_weights
from parallel_train.checkpoint.manifest import verify
from parallel_train.config.load import load_config
from parallel_train.errors import UserError
from parallel_train.optim import lr_at
from parallel_train.run.output_dir import LOCK, RunLock

pytestmark = pytest.mark.multiprocess


def train_here(capsys, *args: str) -> tuple[str, str]:
    """`python train.py ARGS` in this process: ("ok" or the one-line UserError, everything it printed)."""
    from parallel_train.cli import main

    try:
        outcome = "ok" if main([*TINY, *args]) == 0 else "failed"
    except UserError as e:
        outcome = str(e)
    printed = capsys.readouterr()
    return outcome, printed.out + printed.err


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished one-process run: checkpoints at steps 3 and 6, model.safetensors, summary.json."""
    tmp = tmp_path_factory.mktemp("finished")
    check(run(warm_cmd(1, *TINY, f"output_dir={tmp / 'run'}"), env=launch_env(tmp)))
    return tmp / "run"


def copy_of(run_dir: Path, tmp_path: Path, name: str = "run") -> Path:
    shutil.copytree(run_dir, tmp_path / name)
    return tmp_path / name


# ---------------------------------------------------------------- resume=auto never starts a run over


@pytest.mark.parametrize("keep", ["checkpoint.keep=1", "checkpoint.interval=0"], ids=["keep_1", "default_keep"])
def test_resume_auto_stops_when_no_checkpoint_verifies_and_changes_nothing(tmp_path, capsys, keep):
    """The only checkpoint (keep=1; or the default keep with a checkpoint at the end only) misses a file: one line
    names it and the two ways on; metrics.jsonl, model.safetensors, summary.json, config.yaml and the damaged
    checkpoint itself are left exactly as they were."""
    out = tmp_path / "run"
    assert train_here(capsys, keep, f"output_dir={out}")[0] == "ok"
    assert [p.name for p in checkpointer.list_checkpoints(out / "checkpoints")] == ["step_0000006"]
    (out / "checkpoints" / "step_0000006" / "rng_rank0.safetensors").unlink()
    before = snapshot(out)
    outcome, printed = train_here(capsys, keep, "train.max_steps=9", f"output_dir={out}")
    assert outcome.startswith(
        f"resume=auto: no checkpoint in {out / 'checkpoints'} verifies (step_0000006: rng_rank0.safetensors is missing)"
    )
    assert "resume=PATH" in outcome and "new output_dir" in outcome and "\n" not in outcome
    assert "warning:" not in printed  # the error line names every checkpoint itself
    assert snapshot(out) == before


def test_resume_from_an_older_checkpoint_with_keep_1_keeps_what_this_run_writes(tmp_path, capsys):
    """resume=step_2 with a newer step_6 left by the earlier run, keep=1, max_steps=4: pruning goes by step number up
    to the step just written, so step_4 stays (and is the final model), step_2 goes once step_4 verified, and the
    earlier run's step_6 is not this run's to delete. (Before: pruning by name kept step_6 and deleted each new one.)"""
    out = tmp_path / "run"
    assert train_here(capsys, "checkpoint.interval=2", "eval.interval=2", "checkpoint.keep=3", f"output_dir={out}")[0] == "ok"
    root = out / "checkpoints"
    outcome, printed = train_here(capsys, "checkpoint.keep=1", "train.max_steps=4", f"resume={root / 'step_0000002'}", f"output_dir={out}")
    assert outcome == "ok", printed
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000004", "step_0000006"]
    assert load_file(str(out / "model.safetensors")).keys() == load_weights(root / "step_0000004").keys()
    assert all((load_file(str(out / "model.safetensors"))[k] == v).all() for k, v in load_weights(root / "step_0000004").items())


def test_one_flipped_byte_of_the_same_size_is_caught_by_its_sha256(finished, tmp_path, capsys):
    """One byte of the newest checkpoint's weights flipped in place: same size, the safetensors header intact, so only
    the sha256 can tell (the truncated and planted files of other tests stop at the size or the parse first).
    resume=PATH to it stops in one line, exit 2, nothing changed; resume=auto skips it with a warning naming the
    mismatch and continues from step 3."""
    out = copy_of(finished, tmp_path)
    step6 = out / "checkpoints" / "step_0000006"
    shard = step6 / "shards" / "rank00000-000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # the last byte of the last tensor's data (the header is at the start)
    shard.write_bytes(data)
    mismatch = "shards/rank00000-000.safetensors does not match its sha256 in the manifest"
    before = snapshot(out)
    named = run(warm_cmd(1, *TINY, f"resume={step6}", f"output_dir={out}"), env=launch_env(tmp_path))
    assert named.returncode == 2 and "Traceback" not in named.output, named.output[-2000:]
    assert [line for line in named.stderr.splitlines() if line.startswith("error:")] == [
        f"error: resume: {str(step6)!r} is not a valid checkpoint ({mismatch})"
    ]
    assert snapshot(out) == before
    outcome, printed = train_here(capsys, f"output_dir={out}")
    warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
    assert outcome == "ok" and warnings == [f"warning: skipping checkpoint {step6}: {mismatch}"], printed[-2000:]
    assert f"resumed from {out / 'checkpoints' / 'step_0000003'} at step 3" in printed
    assert verify(step6) is None  # written again by the resumed run


# ---------------------------------------------------------------- a finished run is never trained again


LAUNCH_LINES = ("no CUDA GPU found", "notice: RANK=")  # what a 2-process launch says on this machine before the run does


def one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip() and not line.startswith(LAUNCH_LINES)]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output[-3000:]
    return lines[0]


@pytest.mark.parametrize(("gone", "nproc"), [("deleted", 1), ("a_file", 2), ("summary_of_an_earlier_version", 1), ("kept", 1)])
def test_a_finished_run_launched_again_is_done_and_changes_nothing(finished, tmp_path, gone, nproc):
    """Its checkpoints/ deleted to save space, or replaced by a file (or, for a summary.json of an earlier version
    that records no config, deleted: config.yaml says what finished; or kept): the same command says it is done in
    one line, exit 0 on every rank, and no file changes (the lock file is gone again). Before, it trained from step 0
    over the run (with its checkpoints kept: resumed at step 6 and wrote model.safetensors and summary.json again)."""
    out = copy_of(finished, tmp_path)
    if gone != "kept":
        shutil.rmtree(out / "checkpoints")
    if gone == "a_file":
        (out / "checkpoints").write_text("not a folder\n")
    if gone == "summary_of_an_earlier_version":
        summary = json.loads((out / "summary.json").read_text())
        summary.pop("config", None)
        (out / "summary.json").write_text(json.dumps(summary))
    before = snapshot(out)
    result = run(warm_cmd(nproc, *TINY, f"output_dir={out}"), env=launch_env(tmp_path))  # 2: every rank exits alike
    line = one_line(result)
    assert result.returncode == 0 and f"output_dir {out} holds a finished run (6 steps, val loss " in line, result.output[-3000:]
    assert "nothing to train" in line and ("checkpoints is a file" in line) == (gone == "a_file")
    assert snapshot(out) == before and not (out / LOCK).exists()


def test_a_finished_run_with_only_an_older_checkpoint_trains_the_steps_after_it(finished, tmp_path, capsys):
    """Its last checkpoint removed (a user redoing the last steps): the same command resumes from step 3, as before."""
    out = copy_of(finished, tmp_path)
    shutil.rmtree(out / "checkpoints" / "step_0000006")
    outcome, printed = train_here(capsys, f"output_dir={out}")
    assert outcome == "ok" and f"resumed from {out / 'checkpoints' / 'step_0000003'} at step 3" in printed, printed
    assert (out / "checkpoints" / "step_0000006").is_dir() and [r["step"] for r in read_metrics(out) if r["kind"] == "train"] == list(
        range(1, 7)
    )


def test_a_finished_run_without_checkpoints_is_not_trained_again_with_another_config(finished, tmp_path, capsys):
    """A longer train.max_steps (or any other change) without a checkpoint to continue from: one line naming the
    change and the two ways on, exit 2, nothing changed. Before, it trained from step 0 over the finished run."""
    out = copy_of(finished, tmp_path)
    shutil.rmtree(out / "checkpoints")
    before = snapshot(out)
    result = run(warm_cmd(1, *TINY, "train.max_steps=9", f"output_dir={out}"), env=launch_env(tmp_path))
    line = one_line(result)
    assert result.returncode == 2 and line.startswith(f"error: resume=auto: output_dir {out} holds a run that finished at step 6"), line
    assert "train.max_steps 6 -> 9" in line and "resume=PATH" in line and "new output_dir" in line
    outcome, _ = train_here(capsys, "train.learning_rate=0.003", f"output_dir={out}")
    assert "train.learning_rate 0.001 -> 0.003" in outcome and "resume=PATH" in outcome
    assert snapshot(out) == before


def test_a_checkpoint_renamed_to_a_later_step_is_neither_resumed_from_nor_pruned(finished, tmp_path, capsys):
    """step_0000003 copied to step_0099999: resume=auto takes the real newest (step 6) with a notice naming the copy,
    and keep=2 prunes by the manifests' steps: steps 6 and 9 stay, and so does the copy. Before, the run resumed from
    the copy at step 3 and trained again over the real step 6."""
    out = copy_of(finished, tmp_path)
    root = out / "checkpoints"
    shutil.copytree(root / "step_0000003", root / "step_0099999")
    outcome, printed = train_here(capsys, "train.max_steps=9", "checkpoint.keep=2", f"output_dir={out}")
    assert outcome == "ok", printed
    assert f"resumed from {root / 'step_0000006'} at step 6" in printed
    assert f"warning: skipping checkpoint {root / 'step_0099999'}: its manifest says step 3" in printed
    assert sorted(p.name for p in root.iterdir()) == ["step_0000006", "step_0000009", "step_0099999"]


# ---------------------------------------------------------------- torn files


def test_a_torn_last_metrics_line_is_dropped_and_a_bad_line_stops_before_anything_is_written(finished, tmp_path, capsys):
    torn = copy_of(finished, tmp_path, "torn")
    with open(torn / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 7, "lo')  # SIGKILL during an append
    outcome, printed = train_here(capsys, "train.max_steps=8", f"output_dir={torn}")
    assert outcome == "ok", printed
    assert "dropped its half-written last line" in printed
    assert [r["step"] for r in read_metrics(torn) if r["kind"] == "train"] == list(range(1, 9))

    bad = copy_of(finished, tmp_path, "bad")
    lines = (bad / "metrics.jsonl").read_text().splitlines(keepends=True)
    (bad / "metrics.jsonl").write_text("".join(lines[:2] + ["not json\n"] + lines[2:]))
    before = snapshot(bad)
    outcome, _ = train_here(capsys, "train.max_steps=8", f"output_dir={bad}")
    assert "metrics.jsonl: line 3 is not a JSON record" in outcome and "\n" not in outcome
    assert snapshot(bad) == before  # config.yaml included: it is written only after metrics.jsonl was read


# ---------------------------------------------------------------- what may change on resume


def test_a_new_learning_rate_applies_from_the_resumed_step_and_config_yaml_says_so(finished, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    new = ("train.max_steps=9", "train.learning_rate=0.003", "train.lr_decay_steps=9")
    outcome, printed = train_here(capsys, *new, f"output_dir={out}")
    assert outcome == "ok", printed
    assert "notice: resumed with train.learning_rate 0.001 -> 0.003, train.lr_decay_steps 6 -> 9, train.max_steps 6 -> 9" in printed
    assert printed.count("resumed from") == 1, printed  # once, on a resume that also changes the schedule
    cfg = load_config([*TINY, *new])[0].train
    logged = {r["step"]: r["lr"] for r in read_metrics(out) if r["kind"] == "train"}
    for step in range(7, 10):  # the LR logged at step k is the one step k used: lr_at(k - 1) of the new schedule
        assert logged[step] == pytest.approx(lr_at(step - 1, cfg), rel=1e-12), (step, logged)
    assert "learning_rate: 0.003" in (out / "config.yaml").read_text()
    assert "learning_rate: 0.003" in (out / "checkpoints" / "step_0000009" / "config.yaml").read_text()


def test_the_keys_that_may_change_on_resume_are_the_documented_ones():
    from helpers import doc_section
    from parallel_train.run.resume_config import MAY_CHANGE

    section = doc_section("configuration", "What may change on resume")
    assert all(f"`{key}`" in section for key in MAY_CHANGE), [k for k in MAY_CHANGE if f"`{k}`" not in section]


# ---------------------------------------------------------------- one run per output_dir


def test_a_second_launch_into_a_running_folder_stops_naming_the_holder(tmp_path):
    """The first run hangs after step 1 holding output_dir's lock; a second launch there stops in one line naming
    it and changes nothing; once the first is SIGKILLed the OS has released the lock: a third run takes it."""
    out = tmp_path / "run"
    env = launch_env(tmp_path, **{faults.ENV: "hang@1"})
    holder = subprocess.Popen(
        train_cmd(*TINY, f"output_dir={out}"),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for line in holder.stdout:  # until it hangs: from then on nothing in output_dir changes
            if "hangs after step 1" in line:
                break
        assert holder.poll() is None, "the first run ended instead of hanging"
        held = json.loads((out / LOCK).read_text())
        assert held["pid"] == holder.pid and held["host"] and held["started"]
        before = snapshot(out)
        second = run(warm_cmd(1, *TINY, f"output_dir={out}"), env=launch_env(tmp_path))
        errors_ = [line for line in second.output.splitlines() if line.startswith("error:")]
        assert second.returncode == 2 and len(errors_) == 1 and "Traceback" not in second.output, second.output[-2000:]
        assert f"is in use by another run (host {held['host']}, pid {holder.pid}, started" in errors_[0]
        assert snapshot(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK).exists()  # left by the killed run: a file, not a lock
    lock, why = RunLock.take(out)
    assert why is None and json.loads((out / LOCK).read_text())["pid"] != holder.pid
    lock.release()
    assert not (out / LOCK).exists()


def test_a_file_system_without_locks_is_said_once_and_the_run_goes_on(tmp_path, monkeypatch):
    """Lustre without -o flock answers flock with ENOSYS, NFS mounted nolock with ENOLCK: one warning, no error."""
    import errno
    import fcntl

    from parallel_train.run.output_dir import lock_output_dir

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    said: list[str] = []
    lock = lock_output_dir(tmp_path, True, said.append)
    assert said == [
        f"warning: output_dir {tmp_path} cannot be locked (Function not implemented): nothing stops a second run from writing there"
    ]
    assert json.loads((tmp_path / LOCK).read_text())["pid"]  # it still says who runs here
    lock.release()
    assert not (tmp_path / LOCK).exists()
