"""The promises at the edges a user reaches after a crash, a requeue or a misconfigured node: a user error from any
rank, and the launch environment. (The leaked-environment cases are in the bad-input catalogue, tests/test_bad_inputs.py.)
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from helpers import TINY, launch_env, run, torchrun_cmd
from parallel_train import errors, faults
from parallel_train.launch_env import check_launch_env

pytestmark = pytest.mark.multiprocess


# ---------------------------------------------------------------- a user error on any rank


def test_a_user_error_on_one_rank_is_printed_by_that_rank(tmp_path):
    """Only rank 1 raises (after step 2): its line reaches stderr with its rank and host, once; the run ends non-zero
    well within parallel.timeout_s. (Before, errors were printed by rank 0 only: this run said nothing.)"""
    started = time.monotonic()
    result = run(
        torchrun_cmd(2, *TINY, "parallel.timeout_s=90", f"output_dir={tmp_path / 'run'}"),
        env=launch_env(tmp_path, **{faults.ENV: "user_error@2:rank=1"}),
    )
    lines = [line for line in result.stderr.splitlines() if "[fault] a user error" in line]
    assert result.returncode != 0 and time.monotonic() - started < 90, result.output[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 (host ") and "rank 1 only, at step 2" in lines[0], result.output[-3000:]


@pytest.mark.slow  # the same path, before the process group exists (the launcher's store): a misconfigured second node
def test_a_user_error_on_one_rank_before_the_process_group_is_printed_by_that_rank(tmp_path):
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
