"""The documentation holds together: every relative link and #anchor in README.md and docs/*.md resolves, the README
stays a front page (short, the two commands at the top, no figure that changes with each re-measurement), and every
docs page says what it covers and links back. Reads files only: no launches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import REPO

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
