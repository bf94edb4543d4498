"""Every measured figure on a page names what prints it. A figure is a number with a unit of time (s, ms, min), of
size (MB, GiB, ...), of speed (tok/s, samples/s, GB/s), a percentage, a ratio (1.6x) or a loss, in the prose or a table of
README.md or docs/*.md (docs/BENCHMARKS.md keeps the dated records, each with its command). Its source is named in
the same block (a paragraph, a list item, a table with the paragraphs just above and below it), or is the command in
the code block right before or after it: a benchmark (`scripts/bench/...`), the estimator or the pre-flight check
(`estimate_memory.py`, `check_env.py`), a test (`test_...`), a command in a code span (`python ...`, `torchrun ...`:
a run prints its loss and time), a constant of the code (`FULL_HASH_LIMIT`), or a link to BENCHMARKS.md, where the
measured tables live. A figure inside a code span is a value the reader types (`--max-shard-size 5GB`), not a
measurement. Reads files only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import REPO
from test_docs import CODE_SPAN, FENCED, ITEM

PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "BENCHMARKS.md")]
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.]){NUMBER}(?:\s?[-–]\s?{NUMBER})?"
    r"(?:\s?(?:ms|s|seconds?|min|minutes?|hours?|[KMGT]i?B(?:/s)?|tok(?:ens)?/s|samples/s|%)|x)(?![\w/])"
    r"|\bloss(?:es)?\b[^.\d]{0,20}?\*{0,2}\d+\.\d{2,}"  # a loss: `val loss **1.8633**`, `losses (1.1002`
)
# A constant the code defines at a module's top (`FULL_HASH_LIMIT = 1 << 30`): the figure is a setting, named.
CONSTANTS = {
    name
    for folder in ("src", "scripts", "tests")
    for path in (REPO / folder).rglob("*.py")
    for name in re.findall(r"^([A-Z][A-Z0-9_]{3,})\s*(?::[^=\n]*)?=", path.read_text(), re.M)
}
SOURCE = re.compile(
    r"scripts/bench/|(?:estimate_memory|check_env)\.py|\btest_\w+|BENCHMARKS\.md"
    rf"|`(?:{'|'.join(sorted(CONSTANTS))})`"
    r"|`(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?(?:python3?|torchrun|accelerate launch|bash|pytest)\b[^`]*`"
)
COMMAND = re.compile(r"\b(?:python3?|torchrun|accelerate|bash|pytest)\b")  # a code block that runs something
# Figures that are no measurement, each for a reason (the block that starts so is left out).
NOT_MEASURED = {
    "Activations come on top": "guide.md's 8B arithmetic: bytes per parameter and per activation, the model's shape given",
    "| mesh | fp32 weights + AdamW": "the same arithmetic, tabled (the estimator's command follows it)",
    "A 7B model": "the 7B models' parameters against the 8B's, and the 8B's fp32 bytes",
    "One device cannot hold": "parallelism.md's worked example: the estimator's table above, read (its command above it)",
    "Tensor parallelism with sequence and loss": "the same worked example, read",
    "so 2 stages with 1 micro-batch": "the bubble formula of the block above, evaluated",
    "`model.task=masked-lm`": "run_mlm's masking proportions (80% mask, 10% random, 10% kept), a rule",
    "- **NFS**": "the NFS server's lease time (NFSv4's default), not the template's",
    "- torchrun forwards SIGTERM": "torchrun's grace period and the SLURM option the reader writes, not measured",
}


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each block of a page: runs of non-blank lines; a fenced code block is one block."""
    found: list[tuple[int, str]] = []
    fenced = {m.start(): m.group(0) for m in FENCED.finditer(text)}
    offset, line, current, start = 0, 1, [], 1
    rows = text.split("\n")
    i = 0
    while i < len(rows):
        if offset in fenced:
            if current:
                found.append((start, "\n".join(current)))
            code = fenced[offset]
            found.append((line, code))
            n = code.count("\n") + 1
            offset, line, i, current = offset + len(code) + 1, line + n, i + n, []
            continue
        row = rows[i]
        if row.strip() and current and ITEM.match(row) and not is_table(current[0]):  # a list item is a block
            found.append((start, "\n".join(current)))
            current = []
        if row.strip():
            start = line if not current else start
            current.append(row)
        elif current:
            found.append((start, "\n".join(current)))
            current = []
        offset, line, i = offset + len(row) + 1, line + 1, i + 1
    return found + ([(start, "\n".join(current))] if current else [])


def is_code(block: str) -> bool:
    return block.startswith(("```", "~~~", "    "))


def is_table(block: str) -> bool:
    return block.lstrip().startswith("|")


def unsourced(text: str) -> list[str]:
    """'line: figures: the block's opening' for each block with a measured figure and no source beside it."""
    found = blocks(text)
    problems = []
    for i, (line, block) in enumerate(found):
        if is_code(block) or any(block.lstrip().startswith(o) for o in NOT_MEASURED):
            continue
        figures = FIGURE.findall(CODE_SPAN.sub("", block))
        before, after = found[i - 1][1] if i else "", found[i + 1][1] if i + 1 < len(found) else ""
        beside = [block, *(b for b in (before, after) if is_code(b)), *([before] if is_table(block) or is_table(before) else [])]
        if figures and not any((COMMAND if is_code(b) else SOURCE).search(b) for b in beside):
            problems.append(f"{line}: {', '.join(figures)}: {' '.join(block.split())[:120]}")
    return problems


def test_the_figure_rule_catches_a_figure_without_its_script():
    page = (
        "# T\n\nA launch costs about 1 s, 5-8 s fresh.\n\n"
        "Steps 10-30x slower; 43 KB of tensors; 9% apart.\n\n"
        "Measured by `python scripts/bench/data.py`: 3.3 GB.\n\n"
        "| run | time |\n|---|---|\n| a | 64 s |\n\n"
        "```bash\npython train.py\n```\n\nIt printed 12.2 s.\n\n"
        "Shards of `--max-shard-size 5GB`; 2 x 4 == 1 x 8; 2000 steps.\n\n"
        "Far from any script: 90 s, and val loss **1.8633**.\n"
    )
    assert [p.split(":")[0:2] for p in unsourced(page)] == [
        ["3", " 1 s, 5-8 s"],
        ["5", " 10-30x, 43 KB, 9%"],
        ["21", " 90 s, loss **1.8633"],
    ], unsourced(page)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_measured_figure_names_what_prints_it(page: Path):
    problems = unsourced(page.read_text())
    assert not problems, (
        f"{page.relative_to(REPO)}: figures with no script, test or command beside them (name it, move the figure to "
        "docs/BENCHMARKS.md with its command and link it, or cut it):\n" + "\n".join(problems)
    )
