"""The documentation holds together: every relative link and #anchor in README.md and docs/*.md resolves, the README
stays a front page (short, the two commands at the top, no figure that changes with each re-measurement), every
docs page says what it covers and links back, the Python version claimed is the one CI runs, and no page presents a
slow test as part of the default suite. Reads files only, except one `pytest --collect-only` (which tests are slow is
pytest's answer, not this file's).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import PYTHON, REPO, check, launch_env, run

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TRAIN = "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/python train.py"
TEST = "python3 -m venv .venv && .venv/bin/pip install -r requirements-dev.txt && .venv/bin/python -m pytest"

FENCED = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks (whose `# comments` are not headings and whose brackets are not links)."""
    return FENCED.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text, lower case, punctuation dropped,
    each space a hyphen. Inline code keeps its text, a link keeps its label."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"\*+", "", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, title in HEADING.findall(prose(path.read_text())):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(CODE_SPAN.sub("", prose(path.read_text())))


def test_slug_follows_github():
    assert slug("Why one process per GPU (DDP), not `nn.DataParallel`") == "why-one-process-per-gpu-ddp-not-nndataparallel"
    assert slug("Template overhead: train.py against a bare loop") == "template-overhead-trainpy-against-a-bare-loop"
    assert slug("2a. A local file in a format of your own") == "2a-a-local-file-in-a-format-of-your-own"
    assert slug("Trackers: `tracker=wandb` (default), `tensorboard`, `none`") == "trackers-trackerwandb-default-tensorboard-none"
    assert slug("Cutting the model: `parallel.split`") == "cutting-the-model-parallelsplit"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path):
    found = links(page)
    assert found, f"{page.name} links nowhere"
    broken = []
    for target in found:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not checked offline
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/ (at most 250)"
    top = "\n".join(lines[:30])
    assert TRAIN in top and TEST in top, "the train and test commands must be in the README's first 30 lines"
    # Figures that change with every re-measurement (times, losses) belong in docs/performance.md.
    measured = re.findall(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:s|seconds?|min|minutes?)\b|\bloss\W{0,4}\d", prose("\n".join(lines)))
    assert not measured, f"measured figures on the front page: {measured}; say 'a few minutes' or link docs/performance.md"


def test_readme_links_every_docs_page_and_names_every_launch_config():
    readme = (REPO / "README.md").read_text()
    linked = {target.partition("#")[0] for target in links(REPO / "README.md")}
    assert {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} <= linked
    for config in sorted((REPO / "accelerate_configs").glob("*.yaml")):
        assert f"accelerate_configs/{config.name}" in readme, f"{config.name} is missing from the README's launch table"


@pytest.mark.parametrize("page", PAGES[1:], ids=[p.name for p in PAGES[1:]])
def test_every_docs_page_opens_with_what_it_covers_and_a_link_back(page: Path):
    text = prose(page.read_text())
    assert text.startswith("# "), f"{page.name} starts with its title"
    first_paragraph = text.split("\n\n")[1]
    assert "](../README.md" in first_paragraph, f"{page.name}: the first paragraph links back to the README"


def test_the_python_version_claimed_is_the_one_ci_runs():
    ci = re.search(r'python-version: "([\d.]+)"', (REPO / ".github" / "workflows" / "ci.yml").read_text())
    assert ci, "ci.yml names no python-version"
    version = ci.group(1)
    assert f"Python {version}+ on Linux" in (REPO / "README.md").read_text()
    assert re.search(rf'^requires-python = ">={re.escape(version)}"', (REPO / "pyproject.toml").read_text(), re.M)


# ---------------------------------------------------------------- slow tests are not claimed for the default suite
#
# How a page names a test: a test function's name (`test_...`, optionally with its parameters, `test_x[hsdp]`) or
# `tests/test_file.py::test_...`, anywhere in prose or a table, outside fenced code blocks. A claim is made by the
# span that holds the name: a sentence of prose (ended by . ; ! or ? and a space, or by the paragraph) or one cell
# of a table. The rule: a span that names a slow test says so, with the word "slow" (`-m slow`, "the slow test"),
# and does not say "default"; a span that needs both is written as two. A name must be one pytest collects.
# "Slow" is pytest's own collection (`-m slow`): a name is slow when every test it covers is (a parametrized
# function with a default parameter is not).

NAMED_TEST = re.compile(r"(?<![\w.])(?:tests/\w+\.py::)?(test_\w+(?:\[[^\]\s`]*\])?)(?![\w.\[])")
SPAN_END = re.compile(r"(?<=[.;!?])\s+(?=\S)")
REPORT_PLUGIN = """
import json, os


def pytest_collection_finish(session):
    found = {}
    for item in session.items:
        slow = item.get_closest_marker("slow") is not None
        for name in {item.name, getattr(item, "originalname", item.name)}:  # with and without its parameters
            found.setdefault(name, []).append(slow)
    with open(os.environ["SLOW_REPORT"], "w") as f:
        json.dump(found, f)
"""


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, bool]:
    """Every test pytest collects (slow or not): name -> whether every test of that name is marked slow. This session's
    own collection when it took every test file (conftest.py), else a collection of the whole suite in a subprocess."""
    import helpers

    found, files = helpers.COLLECTED or ({}, set())
    if {str(p) for p in (REPO / "tests").glob("test_*.py")} <= files:
        return {name: all(flags) for name, flags in found.items()}
    tmp = tmp_path_factory.mktemp("collect")
    (tmp / "slow_report.py").write_text(REPORT_PLUGIN)
    env = launch_env(tmp, SLOW_REPORT=str(tmp / "report.json"), PYTHONPATH=str(tmp))
    cmd = [PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "slow_report", "-p", "no:cacheprovider", "-m", "slow or not slow"]
    check(run(cmd, env=env, timeout=300))
    return {name: all(flags) for name, flags in json.loads((tmp / "report.json").read_text()).items()}


def claim_spans(text: str) -> list[str]:
    """The sentences of a page's prose and the cells of its tables, outside fenced code blocks."""
    spans: list[str] = []
    for paragraph in prose(text).split("\n\n"):
        lines = paragraph.splitlines()
        for row in (line for line in lines if line.lstrip().startswith("|")):
            spans += [cell for cell in re.split(r"(?<!\\)\|", row) if cell.strip()]
        rest = " ".join(line for line in lines if not line.lstrip().startswith("|"))
        spans += SPAN_END.split(rest)
    return spans


def slow_claim_problems(text: str, collected: dict[str, bool]) -> list[str]:
    problems = []
    for span in claim_spans(text):
        words = NAMED_TEST.sub("", span)  # "slow" and "default" as words of the span, not parts of a test's name
        says_slow = re.search(r"\bslow\b", words) is not None  # `-m slow` counts: it is how a page says it
        says_default = re.search(r"\bdefault\b", CODE_SPAN.sub("", words), re.I) is not None  # not `accelerate config default`
        for name in NAMED_TEST.findall(span):
            if name not in collected:
                problems.append(f"names {name}, which pytest does not collect: {span.strip()[:200]}")
            elif collected[name] and (not says_slow or says_default):
                problems.append(f"names the slow test {name} without saying 'slow' (or next to 'default'): {span.strip()[:200]}")
    return problems


def test_the_slow_claim_rule_catches_a_page_that_calls_a_slow_test_default():
    known = {"test_fast": False, "test_long": True, "test_mixed": False, "test_mixed[b]": True}
    page = (
        "The default suite checks it (`test_long`). ZB-V is in the default suite (`test_fast`).\n\n"
        "| layout | tested |\n|---|---|\n| tp | real launch (`tests/test_x.py::test_long`) |\n\n"
        "`-m slow` adds `test_long`; the default suite runs `test_mixed` and `test_mixed[b]` (a slow one).\n\n"
        "```\npytest -k test_long  # in the default suite: fenced code is not a claim\n```\n"
        "Renamed: `test_gone` in the default suite."
    )
    found = slow_claim_problems(page, known)
    assert [p.split(",")[0].split(" without")[0] for p in found] == [
        "names the slow test test_long",  # a sentence that says default
        "names the slow test test_long",  # a table cell that says neither
        "names the slow test test_mixed[b]",  # its span says slow, but default too
        "names test_gone",
    ], found


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_no_page_presents_a_slow_test_as_part_of_the_default_suite(page: Path, collected):
    assert len(collected) > 100 and any(collected.values()) and not all(collected.values())
    problems = slow_claim_problems(page.read_text(), collected)
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


# ---------------------------------------------------------------- every page readable on a laptop screen
#
# A paragraph is a block of consecutive non-empty lines outside fenced code blocks, indented code and tables; a
# heading or a list item starts a new one. None is over 600 characters (a list item counts alone: a list is the way
# to split a long enumeration). BENCHMARKS.md and CHANGELOG.md keep their dated records whole, so they are left out.

PARAGRAPH_LIMIT = 600
ITEM = re.compile(r"\s*(?:[-*+]|\d+\.)\s")


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text joined by spaces) of each paragraph of a Markdown page."""
    found, current, start, previous_blank, in_code = [], [], 0, True, False
    lines = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text).split("\n")
    for i, line in enumerate(lines, 1):
        in_code = line.startswith("    ") and (previous_blank or in_code) and not ITEM.match(line) and not current
        previous_blank = not line.strip()
        if not line.strip() or line.lstrip().startswith(("|", "#")) or in_code or (ITEM.match(line) and current):
            if current:
                found.append((start, " ".join(part.strip() for part in current)))
            current = [line] if ITEM.match(line) and line.strip() else []
            start = i
            continue
        if not current:
            start = i
        current.append(line)
    return found + ([(start, " ".join(part.strip() for part in current))] if current else [])


def test_paragraphs_are_found_as_a_reader_sees_them():
    page = "# T\n\nOne\ntwo.\n- an item\n  going on\n- another\n\n| a | b |\n\n```\ncode\n\nmore\n```\n\n    indented\n    code\n\nlast"
    assert paragraphs(page) == [(3, "One two."), (5, "- an item going on"), (7, "- another"), (20, "last")]


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in ("BENCHMARKS.md", "CHANGELOG.md")], ids=lambda p: p.name)
def test_no_paragraph_is_longer_than_a_laptop_screen_shows(page: Path):
    long = [f"line {line}: {len(text)} characters" for line, text in paragraphs(page.read_text()) if len(text) > PARAGRAPH_LIMIT]
    assert not long, f"{page.relative_to(REPO)}: paragraphs over {PARAGRAPH_LIMIT} characters (split, tighten or list):\n" + "\n".join(long)
