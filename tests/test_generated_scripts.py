"""Generated bad command lines (issue 34 item 3) for every script of scripts/ (not scripts/bench/: the maintainers'
measuring tools, tested by tests/test_perf.py and test_memory_measured.py). Each script's own argparse parser is
read (captured as the script builds it), and from it: each required argument left out; each typed option given
a word, and a negative number; each option of a closed set given another value; each destination (an argument
whose help says the script writes it) equal to a source (or to another destination), and a destination that
cannot be written (a path under a regular file: tests run as root, where chmod 0o555 stops nothing). A new
script, argument or destination is covered without a new test; a destination needs valid inputs (VALID) to be
reached, which a test checks.

Each case runs the script (forked from the warm launcher, tests/helpers.py) and asserts exit 2 with one `error:`
line naming the argument or path, or a documented success; never a traceback; the inputs unchanged.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import runpy
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from generated import Case, Unchanged, assert_result, params
from helpers import REPO, TINY, check, launch_env, run, warm_cmd, warm_script

SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py"))


class Captured(BaseException):
    """Raised instead of parsing: carries the parser the script built."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(script: str) -> argparse.ArgumentParser:
    """The script's parser, as its main() builds it (parse_known_args is what every parse_args call reaches)."""

    def capture(self, *args, **kwargs):
        raise Captured(self)

    saved, argv = argparse.ArgumentParser.parse_known_args, sys.argv
    argparse.ArgumentParser.parse_known_args, sys.argv = capture, [script]
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            runpy.run_path(str(REPO / "scripts" / script), run_name="__main__")
    except Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_known_args, sys.argv = saved, argv
    raise AssertionError(f"scripts/{script} parsed no command line")


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def required(action: argparse.Action) -> bool:
    return action.required or (not action.option_strings and action.nargs not in ("?", "*"))


def writes(action: argparse.Action) -> bool:
    """A destination: a path (no closed set of values, not a flag) whose help says the script writes it."""
    return not action.choices and action.nargs != 0 and bool(re.search(r"\b(to write|writes?)\b", action.help or ""))


def reads(action: argparse.Action) -> bool:
    return not writes(action) and (action.type is Path or action.dest in ("input", "source"))


def names(action: argparse.Action) -> tuple[str, ...]:
    return (*action.option_strings, action.dest, *([action.metavar] if isinstance(action.metavar, str) else []))


def command(parser: argparse.ArgumentParser, values: dict[str, object]) -> list[str]:
    """A command line of `values` (dest -> value; True: a flag), positionals in the parser's order."""
    argv = []
    for a in arguments(parser):
        if a.dest not in values:
            continue
        value = values[a.dest]
        if not a.option_strings:
            argv.append(str(value))
        elif value is True:
            argv.append(a.option_strings[0])
        else:
            argv += [a.option_strings[0], str(value)]
    return argv


def placeholder(action: argparse.Action) -> str:
    return str(action.choices[0]) if action.choices else "1" if action.type in (int, float) else "x"


def script_cases() -> list[Case]:
    cases = []
    for script in SCRIPTS:
        parser = parser_of(script)
        actions = arguments(parser)
        filled = {a.dest: placeholder(a) for a in actions if required(a)}
        positionals = [a for a in actions if required(a) and not a.option_strings]
        for a in actions:
            base = {"script": script}
            if required(a):  # a positional left out: the next ones shift, and argparse names the last as missing
                argv = command(parser, {k: v for k, v in filled.items() if k != a.dest})
                later = positionals[positionals.index(a) + 1 :] if a in positionals else []
                cases.append(Case(f"{script}:missing:{a.dest}", sum(map(names, later), names(a)), {**base, "argv": argv}))
            if a.type in (int, float):
                cases.append(Case(f"{script}:type:{a.dest}", names(a), {**base, "argv": command(parser, {**filled, a.dest: "abc"})}))
                cases.append(Case(f"{script}:negative:{a.dest}", names(a), {**base, "valid": True, "set": {a.dest: "-4"}}))
            if a.choices:
                argv = command(parser, {**filled, a.dest: "no_such_choice"})
                cases.append(Case(f"{script}:choice:{a.dest}", names(a), {**base, "argv": argv}))
        every = tuple(n for a in actions for n in names(a))
        cases.append(Case(f"{script}:nothing", every, {"script": script, "argv": []}))  # no argument at all
        for a in [a for a in actions if reads(a)]:  # a source that is not there
            cases.append(
                Case(
                    f"{script}:absent:{a.dest}",
                    ("no_such_path",),
                    {"script": script, "valid": True, "set": {a.dest: "{root}/no_such_path"}},
                )
            )
        destinations = [a for a in actions if writes(a)]
        for d in destinations:
            for s in [a for a in actions if reads(a)] + [o for o in destinations if o is not d]:
                same = {d.dest: "@" + s.dest}  # the value of that argument
                cases.append(Case(f"{script}:same:{d.dest}={s.dest}", (*names(d), *names(s)), {**base, "valid": True, "set": same}))
            cases.append(Case(f"{script}:unwritable:{d.dest}", ("not_a_folder",), {**base, "valid": True, "set": {d.dest: "{blocked}"}}))
    return cases


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """What the valid command lines read: a corpus, a run folder with metrics.jsonl (made by a tiny run on first
    use: only export.py and sample.py need its weights), and a regular file that no path can go under."""
    root = tmp_path_factory.mktemp("inputs")  # root/in: what the scripts read; root/out: where they may write
    (root / "out").mkdir()
    root = root / "in"
    root.mkdir()
    (root / "corpus.txt").write_text((REPO / "data" / "tinyshakespeare.txt").read_text()[:20000])
    (root / "not_a_folder").write_text("a file\n")
    (root / "metrics_run").mkdir()
    rows = [{"kind": "train", "step": s, "loss": 3.0 - s / 10, "lr": 1e-3} for s in range(1, 4)]
    (root / "metrics_run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "root": root,
        "out": root.parent / "out",
        "corpus": root / "corpus.txt",
        "metrics": root / "metrics_run",
        "blocked": root / "not_a_folder" / "out",
    }


def trained_run(inputs: dict[str, Path]) -> Path:
    out = inputs["root"] / "run"
    if not (out / "model.safetensors").exists():
        check(run(warm_cmd(1, *TINY, "train.max_steps=2", "eval.interval=2", f"output_dir={out}"), env=launch_env(inputs["root"])))
    return out


# script -> the valid values its destinations need to be reached ("{name}": an input of the fixture; run: a tiny run).
VALID = {
    "check_env.py": {"no_bench": True},
    "export.py": {"source": "{run}"},
    "make_tiny_chat_model.py": {"model_dir": "{out}/model", "chats_file": "{out}/chats.jsonl", "conversations": "4"},
    "plot_metrics.py": {"runs": "{metrics}"},
    "prepare_data.py": {"input": "{corpus}", "output": "{out}/prepared", "tokenizer": "char", "num_proc": "1"},
    "sample.py": {"run": "{run}", "max_new_tokens": "4"},
    "estimate_memory.py": {"world": "1"},
}
# Where a case is documented to succeed (case id -> the page that says so).
SUCCESS = {
    **{
        f"{script}:negative:seed": f"scripts/{script} --help: --seed seeds torch and random, which take any integer"
        for script in ("sample.py", "make_tiny_chat_model.py")
    },
    "check_env.py:nothing": "scripts/check_env.py's docstring: `python scripts/check_env.py` checks this machine, one process",
}
# Known failures (case id -> why), each a strict xfail: the fix that mends one removes its line.
KNOWN: dict[str, str] = {}


def resolve(value: object, inputs: dict[str, Path], values: dict[str, object]) -> object:
    """A VALID value with the inputs filled in; `@dest`: the value of that argument (a destination equal to it)."""
    if isinstance(value, str) and value.startswith("@"):
        return resolve(values[value[1:]], inputs, values)
    if not isinstance(value, str) or "{" not in value:
        return value
    if "{run}" in value:
        inputs["run"] = trained_run(inputs)
    return value.format(**{k: str(v) for k, v in inputs.items()})


def argv_of(case: Case, inputs: dict[str, Path]) -> list[str]:
    if "argv" in case.data:
        return case.data["argv"]
    values = {**VALID[case.data["script"]], **case.data["set"]}
    return command(parser_of(case.data["script"]), {k: resolve(v, inputs, values) for k, v in values.items()})


def cheap(case: Case) -> bool:
    """Not a case that needs a trained run (export.py, sample.py past their parsing: a tiny run first, 10-20 s)."""
    return "argv" in case.data or "{run}" not in json.dumps(VALID[case.data["script"]])


def test_every_script_has_valid_inputs():
    assert set(SCRIPTS) == set(VALID), "a script of scripts/ has no VALID entry, or VALID names one that is gone"


@pytest.mark.parametrize(
    "case",
    params(
        [c if c.id not in SUCCESS else Case(c.id, c.names, c.data, SUCCESS[c.id]) for c in script_cases()], KNOWN, default=4, cheap=cheap
    ),
)
def test_a_bad_command_line_is_one_line_naming_the_argument(case, inputs, record_property):
    argv = argv_of(case, inputs)
    with Unchanged(inputs["root"], REPO / "data"):
        result = run(warm_script(f"scripts/{case.data['script']}", *argv), env=launch_env(inputs["root"]), timeout=120)
    assert_result(result, case, record_property)
