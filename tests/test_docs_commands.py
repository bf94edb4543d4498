"""Every command the docs show resolves, in process and without a launch: for each command of README.md and
docs/*.md (BENCHMARKS.md's dated records aside) that runs train.py (directly, under accelerate launch or torchrun,
or through scripts/launch_multinode.sh and the SLURM scripts) or a script of scripts/, the files it names exist, its
`--config` files and `section.key=value` overrides load through the config loader (every key known, every value
parsed and validated), and a Python script's arguments pass its own argparse (parsed, then stopped before it does
anything). Commands that need a GPU, SLURM or the Hub are resolved the same way, not run. The launchers' own flags
(accelerate launch, torchrun) are tests/test_docs_names.py's: it reads them from their --help.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import sys
from pathlib import Path

import pytest

from helpers import REPO
from parallel_train.config.load import load_config
from parallel_train.errors import UserError
from test_docs_names import ALLOWED_PATHS, CODE_SPAN, command_lines, created_by_the_docs, tokens

PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "BENCHMARKS.md")]
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
# What runs train.py with the arguments that follow it: train.py itself, the multi-node launcher, the SLURM scripts.
TRAINS = re.compile(r"(?:\./)?(?:train\.py|scripts/launch_multinode\.sh|scripts/slurm/\w+\.sbatch)")
SCRIPT = re.compile(r"(?:\./)?scripts/[\w/]+\.py")
OVERRIDE = re.compile(r"[a-z_]+(?:\.[a-z_][a-z0-9_]*)?=.*")
# Models the docs build with the reader (the guide's char_rnn, tests/test_guide.py trains it) or stand for theirs.
READERS_MODELS = {"char_rnn", "yours"}


class Parsed(Exception):
    """Raised in place of a script's work once its argparse has accepted the arguments."""


def commands(text: str) -> list[tuple[int, str, list[str], bool]]:
    """(line, program, its arguments, whether the command is whole) for each train.py or scripts/ command: a line of
    a code block is whole; a code span of the prose may be a fragment (`scripts/export.py --format hf`)."""
    spans = {m.group(0).strip("`") for m in CODE_SPAN.finditer(text)}
    found = []
    for line, command in command_lines(text):
        words = tokens(command)
        whole = command not in spans
        segment: list[str] = []
        for word in [*words, ";"]:
            if word not in SEPARATORS:
                segment.append(word)
                continue
            found += programs(line, segment, whole)
            segment = []
    return found


def programs(line: int, words: list[str], whole: bool) -> list[tuple[int, str, list[str], bool]]:
    """The program of one simple command and the arguments it gets (after `...`, a launcher's elided flags, what
    follows is train.py's)."""
    for i, word in enumerate(words):
        if TRAINS.fullmatch(word) or SCRIPT.fullmatch(word):
            return [(line, word.removeprefix("./"), words[i + 1 :], whole)]
        if word == "..." and i and words[0] in ("accelerate", "torchrun") and any(OVERRIDE.fullmatch(w) for w in words[i:]):
            return [(line, "train.py", words[i + 1 :], False)]
    return []


def config_args(args: list[str]) -> list[str]:
    """The arguments the config loader reads: `--config FILE` and `section.key=value`, placeholders left out."""
    kept, i = [], 0
    while i < len(args):
        if args[i] == "--config" and i + 1 < len(args):
            kept += args[i : i + 2]
            i += 2
            continue
        if args[i].startswith("--config=") or OVERRIDE.fullmatch(args[i]):
            kept.append(args[i])
        i += 1
    return kept


def reader_owns(path: str) -> bool:
    """A file the docs name as the reader's own (configs/my_run.yaml) or one a page's code creates."""
    return path in created_by_the_docs() or any(re.fullmatch(allowed, path) for allowed in ALLOWED_PATHS)


def load_problem(args: list[str]) -> str | None:
    configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    if any(reader_owns(c) for c in configs) or any(a.removeprefix("model.name=") in READERS_MODELS for a in args):
        return None  # the reader's config or model: its keys are still ones train.py --help lists (test_docs_names.py)
    try:
        load_config(config_args(args))
    except UserError as e:
        return f"the config loader refuses it: {e}"
    return None


def parse_problem(script: str, args: list[str], whole: bool) -> str | None:
    """Run the script as python would, with argparse stopped once it has parsed: None if it accepts the arguments."""
    original_args, original_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_args(self, *a, **k):
        depth[0] += 1
        try:
            original_args(self, *a, **k)
        finally:
            depth[0] -= 1
        raise Parsed

    def parse_known_args(self, *a, **k):
        result = original_known(self, *a, **k)
        if not depth[0]:
            raise Parsed
        return result

    path = REPO / script
    err, argv, syspath, environ = io.StringIO(), sys.argv, list(sys.path), dict(os.environ)  # a script may set a variable
    sys.argv, sys.path[:0] = [str(path), *[a for a in args if a != "..."]], [str(path.parent)]
    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = parse_args, parse_known_args
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(path), run_name="__main__")
    except Parsed:
        return None
    except SystemExit as e:
        message = err.getvalue().strip().splitlines()[-1:] or [f"exit {e.code}"]
        if not whole and re.search(r"required|expected one argument", message[0]):
            return None  # a fragment in the prose names a flag, not the whole command
        return f"its argparse refuses it: {message[0]}"
    except UserError as e:
        return f"it refuses it: {e}"
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = original_args, original_known
        sys.argv, sys.path[:] = argv, syspath
        os.environ.clear()
        os.environ.update(environ)
    return "it ran to the end without parsing arguments (not argparse: check it another way)"


def command_problems(line: int, program: str, args: list[str], whole: bool) -> list[str]:
    where = f"{line}: {program} {' '.join(args)}".strip()
    if not (REPO / program).is_file():
        return [] if reader_owns(program) else [f"{where}: no file {program}"]
    named = [a for a in args if re.fullmatch(r"(configs|accelerate_configs)/[\w.-]+\.yaml", a)]
    problems = [f"{where}: no file {a}" for a in named if not (REPO / a).is_file() and not reader_owns(a)]
    if TRAINS.fullmatch(program) or "load_config" in (REPO / program).read_text():
        problem = load_problem(args)
        problems += [f"{where}: {problem}"] if problem else []
    if program.endswith(".py") and program != "train.py" and "argparse" in (REPO / program).read_text():
        problem = parse_problem(program, args, whole)
        problems += [f"{where}: {problem}"] if problem else []
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_command_a_page_shows_resolves(page: Path, monkeypatch):
    monkeypatch.chdir(REPO)  # the docs' paths are the repository root's
    problems = [p for found in commands(page.read_text()) for p in command_problems(*found)]
    assert not problems, f"{page.relative_to(REPO)}: commands that do not resolve:\n" + "\n".join(problems)


def test_the_command_check_catches_a_bad_key_value_config_file_and_flag(monkeypatch):
    monkeypatch.chdir(REPO)
    page = (
        "```bash\n"
        "python train.py train.max_step=3\n"
        "torchrun --nproc-per-node 2 train.py parallel.tp=two\n"
        "python train.py --config configs/gone.yaml\n"
        "python scripts/sample.py --run runs/x --max-new-tokens 5\n"
        "python scripts/export.py runs/x out --format onnx\n"
        "python scripts/estimate_memory.py --world 8 model.n_layers=2\n"
        "python scripts/sample3.py\n"
        "python train.py --config configs/shakespeare_char_cpu.yaml train.max_steps=5 && python scripts/sample.py --run runs/x\n"
        "```\n\n"
        "Fine in the prose: `scripts/export.py --format hf`; `accelerate launch --config_file accelerate_configs/cpu.yaml ... "
        "train.batch_size=2`. Not: `torchrun ... train.batch_size=-1`.\n"
    )
    found = [p for f in commands(page) for p in command_problems(*f)]
    expected = [
        (2, "unknown config key 'train.max_step'"),
        (3, "parallel.tp: expected an integer, got 'two'"),
        (4, "no file configs/gone.yaml"),
        (4, "--config configs/gone.yaml: no such file"),
        (5, "unrecognized arguments: --max-new-tokens 5"),
        (6, "argument --format: invalid choice: 'onnx'"),
        (7, "unknown config key 'model.n_layers'"),
        (8, "no file scripts/sample3.py"),
        (12, "train.batch_size: must be >= 1, got -1"),
    ]
    assert len(found) == len(expected) and all(p.startswith(f"{n}: ") and e in p for p, (n, e) in zip(found, expected, strict=True)), found
