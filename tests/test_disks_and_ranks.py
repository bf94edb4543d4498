"""A run's edges across ranks and disks: a full disk (real, and injected on one rank of two), ranks that agree on one
resume checkpoint when one lists or reads less, and a user error raised on any rank printed once by the rank it
happened on. The one-run edges (resume=auto, finished runs, torn files, one run per output_dir) are in
tests/test_run_edges.py.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import TINY, check, launch_env, read_metrics, run, torchrun_cmd, warm_cmd
from parallel_train import errors, faults
from parallel_train.checkpoint.manifest import verifiers, verify
from parallel_train.errors import UserError
from parallel_train.parallel.launch_env import check_launch_env

pytestmark = pytest.mark.multiprocess


# ---------------------------------------------------------------- full disks


def mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True).returncode == 0


def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_once_space_is_freed(tmp_path):
    """A real full disk: a 700 kB tmpfs holds checkpoint 3 but not checkpoint 6. Skipped where tmpfs cannot be
    mounted (not root); the fault-injected full disk below runs everywhere."""
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "700k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out, env = disk / "run", launch_env(tmp_path)
        full = run(warm_cmd(1, *TINY, f"output_dir={out}"), env=env)
        errors_ = [line for line in full.output.splitlines() if line.startswith("error:")]
        assert full.returncode == 2 and len(errors_) == 1 and "Traceback" not in full.output, full.output[-3000:]
        assert (
            "error: checkpoint step_0000006: writing shards/rank00000-000.safetensors on rank 0 failed (No space left on device)"
            in errors_[0]
        )
        assert "free in" in errors_[0] and "removed .tmp-step_0000006" in errors_[0]
        root = out / "checkpoints"
        assert [p.name for p in root.iterdir()] == ["step_0000003"] and verify(root / "step_0000003") is None
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        resumed = check(run(warm_cmd(1, *TINY, f"output_dir={out}"), env=env))
        assert f"resumed from {root / 'step_0000003'} at step 3" in resumed.output
        assert [r["step"] for r in read_metrics(out) if r["kind"] == "train"] == list(range(1, 7))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_failed_metrics_write_is_one_line_naming_the_file_and_the_space(tmp_path):
    """/dev/full answers every write with ENOSPC, a full disk without root."""
    from types import SimpleNamespace

    from parallel_train.observe.tracking import MetricsLog

    metrics, record = MetricsLog(Path("/dev/full"), SimpleNamespace(is_main_process=True), "none"), {"kind": "train", "step": 1}
    with pytest.raises(UserError) as failed:
        metrics.log(record)
    line, size = str(failed.value), len(json.dumps(record)) + 1
    assert line.startswith(f"writing /dev/full failed (No space left on device): it needs {size} B,") and "free on its file system" in line


def test_ranks_agree_on_one_resume_and_on_a_full_disk(tmp_path):
    """Three launches of 2 processes, one story:
    1. rank 1's part of checkpoint 6 hits a full disk in the background write (checkpoint.async): every rank stops
       with the same line, printed once; the temporary folder is gone and checkpoint 3 verifies.
    2. relaunched while rank 1 lists checkpoints/ as a stale cache would (nothing from step 3 on): rank 0 chooses
       step 3 for both (before, rank 1 would have started from step 0 and the ranks would have hung).
    3. rank 1 cannot read the files of the chosen checkpoint (step 6): one line names rank 1 and the file."""
    out, env = tmp_path / "run", launch_env(tmp_path)
    full = run(warm_cmd(2, *TINY, "checkpoint.async=true", f"output_dir={out}"), env={**env, faults.ENV: "enospc@6:rank=1"})
    errors_ = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert full.returncode != 0 and len(errors_) == 1, full.output[-3000:]
    assert errors_[0].startswith(
        "error: checkpoint step_0000006: writing shards/rank00001-000.safetensors on rank 1 failed (No space left on device)"
    )
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_0000003"] and verify(root / "step_0000003") is None

    resumed = check(run(warm_cmd(2, *TINY, f"output_dir={out}"), env={**env, faults.ENV: "stale_listing@3:rank=1"}))
    assert f"resumed from {root / 'step_0000003'} at step 3" in resumed.output
    assert [r["step"] for r in read_metrics(out) if r["kind"] == "train"] == list(range(1, 7))

    blind = run(warm_cmd(2, *TINY, "train.max_steps=8", f"output_dir={out}"), env={**env, faults.ENV: "unreadable@6:rank=1"})
    errors_ = [line for line in blind.stderr.splitlines() if line.startswith("error:")]
    assert blind.returncode != 0 and len(errors_) == 1, blind.output[-3000:]
    assert errors_[0].startswith("error: rank 1 (host ") and f"cannot read {root / 'step_0000006'}/" in errors_[0]


def test_the_listing_faults_act_on_the_rank_they_name():
    """The stale-listing and unreadable faults above act on the rank they name only (here: this process, rank 0)."""
    saved = list(faults.FAULTS)
    try:
        faults.FAULTS[:] = faults.parse("stale_listing@6:rank=0; unreadable@3:rank=1")
        assert faults.hidden(6, listing=True) and faults.hidden(9, listing=True) and not faults.hidden(3, listing=True)
        assert not faults.hidden(3, listing=False)
    finally:
        faults.FAULTS[:] = saved


def test_verification_is_spread_over_the_ranks():
    files = {"a": {"size": 10, "rank": 0}, "b": {"size": 30, "rank": 1}, "c": {"size": 20, "rank": 1}, "d": {"size": 5, "rank": 0}}
    assert verifiers(files, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}  # as written: each rank its own files
    assert verifiers(files, 3) == {"b": 0, "c": 1, "a": 2, "d": 2}  # another world size: dealt out by size
    assert set(verifiers(files, 1).values()) == {0}


# ---------------------------------------------------------------- a user error on any rank


def test_a_user_error_on_one_rank_is_printed_by_that_rank(tmp_path):
    """Only rank 1 raises (after step 2): its line reaches stderr with its rank and host, once; the run ends non-zero
    well within parallel.timeout_s. (Before, errors were printed by rank 0 only: this run said nothing.)"""
    started = time.monotonic()
    result = run(
        warm_cmd(2, *TINY, "parallel.timeout_s=60", f"output_dir={tmp_path / 'run'}"),
        env=launch_env(tmp_path, **{faults.ENV: "user_error@2:rank=1"}),
    )
    lines = [line for line in result.stderr.splitlines() if "[fault] a user error" in line]
    assert result.returncode != 0 and time.monotonic() - started < 60, result.output[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 (host ") and "rank 1 only, at step 2" in lines[0], result.output[-3000:]


@pytest.mark.slow  # the same path, before the process group exists (the launcher's store): a misconfigured second node
def test_a_user_error_on_one_rank_before_the_process_group_is_printed_by_that_rank(tmp_path):
    # torchrun: the point is its agent's store, which exists before the process group (the warm launcher has none)
    result = run(torchrun_cmd(2, *TINY, f"output_dir={tmp_path / 'run'}"), env=launch_env(tmp_path, **{faults.ENV: "user_error@0:rank=1"}))
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: rank 1 (host "), result.output[-3000:]


def test_ranks_that_fail_alike_print_once_and_a_rank_that_fails_alone_says_so(monkeypatch):
    """errors.failed_alike on a real TCPStore, two ranks as two threads."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")

    def together(messages: list[str], wait_s: float) -> list[tuple[bool, bool]]:
        out: list = [None] * len(messages)
        threads = [
            threading.Thread(target=lambda i=i, m=m: out.__setitem__(i, errors.failed_alike(store, m, 2, wait_s)))
            for i, m in enumerate(messages)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    alike = together(["bad key x", "bad key x"], wait_s=10)
    assert all(a for a, _ in alike) and sorted(first for _, first in alike) == [False, True]  # one prints, plainly
    assert together(["only here"], wait_s=0.3) == [(False, True)]  # alone: it prints with its rank and host
    assert [a for a, _ in together(["rank 0's", "rank 1's"], wait_s=0.3)] == [False, False]


def test_a_launch_by_hand_with_the_whole_environment_is_let_through_with_a_notice():
    said: list[str] = []
    check_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, notice=said.append)
    assert said and "waits for the other 1 at h:1" in said[0]
    check_launch_env({"RANK": "1", "TORCHELASTIC_RUN_ID": "x"})  # torchrun set them: nothing to check
    check_launch_env({"RANK": "0"})  # a one-process world
