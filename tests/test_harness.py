"""The harness itself: a launch never outlives its test, even when the test's pytest-timeout is shorter than the
launch's own timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import helpers
from helpers import run


def gone(pid: int, wait_s: float = 10) -> bool:
    """The process has exited (a zombie counts: it runs nothing) within wait_s."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(helpers.MARGIN_S + 4)
def test_a_launch_longer_than_the_test_timeout_is_killed_with_its_group_before_pytest_timeout(tmp_path):
    """The launch asks for 900 s under a test timeout of MARGIN_S + 4 s: it is stopped after about 4 s by the harness,
    which kills its whole process group (here a shell and the sleep it started), and the test fails on the harness's
    terms, not pytest-timeout's."""
    assert helpers.TEST_DEADLINE is not None, "conftest.py did not record pytest-timeout's deadline"
    pidfile = tmp_path / "child.pid"
    with pytest.raises(AssertionError, match=r"timed out after \d+s \(capped to end before pytest-timeout stops the test\)"):
        run(["sh", "-c", f"sleep 600 & echo $! > {pidfile}; wait"], timeout=900)
    assert gone(int(pidfile.read_text())), "the launch's child outlived it"
