"""pytest hooks of the suite: tell tests/helpers.py when pytest-timeout will stop the current test, so that every
launch is capped to end (and its process group killed) before then.

pytest-timeout's own extension hooks (`pytest_timeout_set_timer`, `pytest_timeout_cancel_timer`) are called when it
starts and cancels a test's timer, with the test's timeout whatever set it (pyproject's `timeout`, `--timeout`,
`@pytest.mark.timeout`). These implementations only take note and return None, so pytest-timeout still sets its
own timer. Optional hooks: without pytest-timeout they are never called and launches keep their own limits.
"""

from __future__ import annotations

import time

import pytest

import helpers


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    helpers.TEST_DEADLINE = time.monotonic() + settings.timeout if settings.timeout else None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item):
    helpers.TEST_DEADLINE = None
