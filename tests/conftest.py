"""pytest hooks of the suite: tell tests/helpers.py when pytest-timeout will stop the current test, so that every
launch is capped to end (and its process group killed) before then.

pytest-timeout's own extension hooks (`pytest_timeout_set_timer`, `pytest_timeout_cancel_timer`) are called when it
starts and cancels a test's timer, with the test's timeout whatever set it (pyproject's `timeout`, `--timeout`,
`@pytest.mark.timeout`). These implementations only take note and return None, so pytest-timeout still sets its
own timer. Optional hooks: without pytest-timeout they are never called and launches keep their own limits.

Also: every test the session collected, before `-m`/`-k` deselect any (helpers.COLLECTED), so that tests/test_docs.py's
check of what the pages call slow reads this collection instead of collecting the suite again (10 s) when the whole
suite runs.
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


@pytest.hookimpl(tryfirst=True)  # before the mark plugin's own implementation deselects the slow tests
def pytest_collection_modifyitems(session, config, items):
    found: dict[str, list[bool]] = {}
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        for name in {item.name, getattr(item, "originalname", item.name)}:  # with and without its parameters
            found.setdefault(name, []).append(slow)
    helpers.COLLECTED = (found, {str(item.path) for item in items})
