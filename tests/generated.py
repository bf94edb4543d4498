"""What the generated-input harness shares (tests/test_generated_config.py, test_generated_task_data.py,
test_generated_scripts.py): cases as pytest parameters (a seeded sample in the default suite, every case under
`-m slow`, the known failures as strict xfails), and the one check every case passes: exit 2 with one `error:` line
naming the key, column or file, or a documented success; never a traceback; no input changed.

Each case records its outcome as a junit property (`outcome`: one-line, success or notice), which this module counts
per kind:

    pytest -m 'slow or not slow' tests/test_generated_*.py --junitxml=FILE -o junit_family=legacy
    python tests/generated.py FILE
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import TINY, Result, launch_env, run, snapshot, warm_cmd

TRACEBACK = "Traceback (most recent call last)"
SEED = 34  # the default suite's sample: the same cases at every run, so a failure is reproducible


@dataclass(frozen=True)
class Case:
    """One generated bad input: `names` are the words (key, column, file, argument) its one line must hold, any of
    them; `success` says where a case that runs is documented to succeed (then it is not an error)."""

    id: str
    names: tuple[str, ...]
    data: dict = field(default_factory=dict, compare=False, hash=False)
    success: str = ""


def params(
    cases: Iterable[Case], known: dict[str, str], default: int | None, cheap: Callable[[Case], bool] = lambda c: True, seed: int = SEED
) -> list:
    """pytest parameters of `cases`: all of them, `default` of the `cheap` ones (a seeded draw; None: all) in the
    default suite and the rest marked slow; a case of `known` (id -> why) is a strict xfail, so that the fix that
    mends it says so."""
    cases = list(cases)
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids), "two generated cases share an id"
    assert not (stale := set(known) - set(ids)), f"KNOWN names cases that are no longer generated: {sorted(stale)}"
    pool = [c.id for c in cases if cheap(c)]
    chosen = set(ids) if default is None else set(random.Random(seed).sample(pool, min(default, len(pool))))
    out = []
    for case in cases:
        marks = [] if case.id in chosen else [pytest.mark.slow]
        if case.id in known:
            marks.append(pytest.mark.xfail(strict=True, reason=known[case.id]))
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def drawn(cases: Iterable[Case], n: int, seed: int = SEED) -> list[Case]:
    """A seeded draw of n cases, in their order: the ones the slow suite also runs through train.py."""
    cases = list(cases)
    keep = set(random.Random(seed).sample(range(len(cases)), min(n, len(cases))))
    return [c for i, c in enumerate(cases) if i in keep]


def through_train_py(argv: list[str], tmp: Path) -> Result:
    """train.py (forked from the warm launcher) on the tiny settings into tmp/out, then `argv` (which wins over both)."""
    return run(warm_cmd(1, *TINY, f"output_dir={tmp / 'out'}", *argv), env=launch_env(tmp), timeout=240)


def named(text: str, names: tuple[str, ...]) -> bool:
    """Whether the text names one of `names` (in any case: a positional's dest is its MODEL_DIR in the docs)."""
    return any(n.lower() in text.lower() for n in names)


def assert_message(message: str, case: Case) -> None:
    """A UserError's message (in process): one line naming the case's key, column or file."""
    assert "\n" not in message.strip(), f"{case.id}: not one line: {message!r}"
    assert named(message, case.names), f"{case.id}: the line names none of {case.names}: {message!r}"


def assert_result(result: Result, case: Case, record: Callable[[str, str], None]) -> None:
    """A launch's result: exit 2 with exactly one `error:` line naming the case, or exit 0 where documented; never a
    traceback."""
    out = result.output
    assert TRACEBACK not in out, f"{case.id}: a traceback (exit {result.returncode}):\n{out[-3000:]}"
    if result.returncode == 0 and case.success:
        record("outcome", "success")
        return
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, f"{case.id}: exit {result.returncode}, {len(errors)} error lines:\n{out[-3000:]}"
    assert_message(errors[0], case)
    others = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("error:", "notice:", "warning:"))]
    assert not others, f"{case.id}: more than the error line on stderr: {others[:5]}"
    record("outcome", "one-line")


class Unchanged:
    """`with Unchanged(folder, ...)`: every file under the folders has the same size, mtime and hash after the block
    (tests/helpers.py's snapshot); paths that do not exist are skipped."""

    def __init__(self, *folders: Path):
        self.folders = [f for f in folders if f.exists()]

    def __enter__(self):
        self.before = [snapshot(f) if f.is_dir() else snapshot_file(f) for f in self.folders]
        return self

    def __exit__(self, *exc):
        after = [snapshot(f) if f.is_dir() else snapshot_file(f) for f in self.folders]
        for folder, old, new in zip(self.folders, self.before, after, strict=True):
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            assert not changed, f"files changed outside output_dir under {folder}: {changed[:5]}"
        return False


def snapshot_file(path: Path) -> dict[str, tuple[int, int, str]]:
    return {path.name: (path.stat().st_size, path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())}


def counts(xml: str) -> dict[str, Counter]:
    """{test: Counter(outcome)} of a junit file: one-line, success, notice, xfail, failed."""
    import xml.etree.ElementTree as ET

    out: dict[str, Counter] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "xfail" if case.find("skipped") is not None else "failed" if failed else props.get("outcome", "passed")
        out.setdefault(f"{case.get('classname')}::{case.get('name').split('[')[0]}", Counter())[outcome] += 1
    return out


if __name__ == "__main__":
    for test, outcomes in counts(sys.argv[1]).items():
        print(f"{test}: {sum(outcomes.values())} cases, {dict(outcomes)}")
