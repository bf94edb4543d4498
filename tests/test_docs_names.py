"""Every name the docs give resolves: each path under scripts/, configs/, accelerate_configs/, src/parallel_train/,
tests/, data/ and docs/ that a tracked .md file names exists; each config key it names (`train.max_steps`,
`model.lora_rank=8`) is one `train.py --help` lists, with a value among the key's choices where it has choices; each
`--flag` given to a command it shows (`python scripts/X.py --flag`, `train.py --config`, `accelerate launch --flag`,
`torchrun --flag`) is one that command accepts, read from its own `--help` (each run once, all at once: no launch).
A renamed script, key or flag fails here naming the page and line that still use the old name.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, REPO, check, doc_section, launch_env, run
from test_docs import CODE_SPAN, FENCED

PACKAGE = REPO / "src" / "parallel_train"
SUBPACKAGES = "|".join(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
# A path from the repository root, or a module from the package's root (`data/sources.py`, `parallel/ddp_engine.py`).
# `1f28b97:scripts/benchmark.py` (git's name for a file at a commit) is looked up at that commit.
PATH = re.compile(
    r"(?<![\w./:-])(?:([0-9a-f]{7,40}):)?(?:\.\./)*((?:scripts|configs|accelerate_configs|src/parallel_train|parallel_train|tests|data|docs)/[\w./*<>{}-]*"
    rf"|(?:{SUBPACKAGES})/\w+\.py\b)"
)
KEY = re.compile(r"(?<![\w./$-])(model|data|train|eval|checkpoint|parallel)\.([a-z_][a-z0-9_]*)\b(?![(.]\w|\()(?:=([^\s`'\",)|]*))?")
BARE_FILE = re.compile(r"(?<![\w./-])([A-Za-z_]\w*\.(?:py|sh|sbatch))\b")  # a script or module by its name alone
# A placeholder in a path stands for any name: an upper-case word (NAME.yaml, step_NNNNNNN), <page>, {a,b}.
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]{2,}|N{3,}|<[^>]*>|\{[^}]*\}")
# `train.py`, `model.safetensors`: a file name, not a config key (a key is never named like a file type).
FILE_TYPES = {"py", "yaml", "yml", "json", "jsonl", "safetensors", "txt", "csv", "tsv", "parquet", "bin", "md", "sh", "pkl", "pt", "log"}
NEW_FILE = re.compile(r"^# new file: (\S+)", re.M)  # a path a code block of the guide creates (tests/test_guide.py)

# Paths the docs name that the repository does not hold, each for a reason (fullmatched). Besides these: a path git
# ignores is an output (runs/, prepared data/NAME/), and a path a page's `# new file:` block creates is the reader's.
ALLOWED_PATHS = {
    r"data/my_\w+(\.\w+)?|configs/my_\w+\.yaml|data/dialogue\.tsv|src/parallel_train/models/net\.py": "the reader's own file, named as an example",
    r"data/wordpiece\.json|data/chats\.jsonl": "written by a command the guide shows (train_tokenizer.py, make_tiny_chat_model.py)",
    r"data/tinyshakespeare/input\.txt": "the corpus's path in karpathy/char-rnn, where data/README.md says it came from",
    r"script\.py": "the reader's own script (guide.md: from a hand-written DDP script)",
    r"my_\w+\.py|FILE\.py": "the reader's own file a key names (eval.metric=FILE.py:FUNCTION)",
    r"model\.py": "nanoGPT's model.py (performance.md: what configs/shakespeare_char_cpu.yaml copies from it)",
}

# Dotted names the docs give that are not config keys, each for a reason (fullmatched). Besides these: a Python
# expression (`model.state_dict()`, `model.module.x`) and anything in a Python code block.
ALLOWED_KEYS = {
    r"model\.rnn_residual": "a key of the guide's own char_rnn model, which the guide adds",
    r"model\.n_layers": "reliability.md's example of a misspelt key and the error it gives",
    r"model\.vocab": "a field of a tokenizer.json",
    r"model\.(embed_tokens|layers|norm)": "a Hugging Face causal LM's modules, where a pipeline cuts it",
}


def tracked(*patterns: str) -> list[str]:
    """The repository's files (tracked, or new and not ignored) that match the patterns; none outside a git checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=REPO, capture_output=True, text=True
    )
    return sorted({name for name in listed.stdout.split() if (REPO / name).exists()}) if listed.returncode == 0 else []


PAGES = [REPO / name for name in tracked("*.md")]
FILE_NAMES = {Path(name).name for name in tracked()}
IDS = [p.relative_to(REPO).as_posix() for p in PAGES]
# Which files are the repository's and which are outputs is git's answer (an unpacked release has no .git).
pytestmark = pytest.mark.skipif(not PAGES, reason="not a git checkout: git ls-files lists no pages")


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def fenced_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, language) of every fenced code block."""
    return [(m.start(), m.end(), m.group(0).split("\n", 1)[0].strip("`~ ").lower()) for m in FENCED.finditer(text)]


# ---------------------------------------------------------------- paths


def created_by_the_docs() -> set[str]:
    return {path for page in PAGES for path in NEW_FILE.findall(page.read_text())}


def ignored_by_git(path: str) -> bool:
    """An output (runs/, a prepared data/NAME/ folder): git ignores it, as a folder when it is named like one."""
    forms = [path, path.rstrip("/") + "/"] if not Path(path).suffix else [path]
    return any(subprocess.run(["git", "check-ignore", "-q", form], cwd=REPO).returncode == 0 for form in forms)


def path_problem(path: str, created: set[str]) -> str | None:
    """Why the path a page names does not resolve, or None."""
    path = path.rstrip(".,:;*")
    if path.startswith("parallel_train/"):
        path = "src/" + path
    pattern = PLACEHOLDER.sub("*", path)
    if (REPO / path).exists() or (PACKAGE / path).exists() or ("*" in pattern and next(REPO.glob(pattern.rstrip("/")), None) is not None):
        return None
    if path in created or any(re.fullmatch(allowed, path) for allowed in ALLOWED_PATHS) or ignored_by_git(path):
        return None
    return f"names {path}, which does not exist"


def path_problems(text: str, created: set[str]) -> list[str]:
    problems = []
    for m in PATH.finditer(text):
        rev, path = m.groups()
        if rev:
            at_commit = subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=REPO, capture_output=True)
            problem = None if at_commit.returncode == 0 else f"names {rev}:{path}, which commit {rev} does not hold"
        else:
            problem = path_problem(path, created)
        if problem:
            problems.append(f"{line_of(text, m.start())}: {problem}")
    for m in BARE_FILE.finditer(text):
        name = m.group(1)
        if name not in FILE_NAMES | {Path(p).name for p in created} and not any(re.fullmatch(a, name) for a in ALLOWED_PATHS):
            problems.append(f"{line_of(text, m.start())}: names {name}, which no file of the repository is called")
    return problems


# ---------------------------------------------------------------- config keys


def help_keys(help_text: str) -> dict[str, list[str] | None]:
    """Every key train.py --help lists (model-specific ones too) -> its choices (None: any value of its type)."""
    keys = {}
    for key, kind in re.findall(r"^  ([a-z_]+\.[a-z_][a-z0-9_]*)\s+(\S+)\s+default", help_text, re.M):
        keys[key] = kind.split("|") if "|" in kind else None
    return keys


def key_problems(text: str, keys: dict[str, list[str] | None]) -> list[str]:
    """Config keys a page names outside Python code blocks (where `model.train()` is a variable's method)."""
    python = [(start, end) for start, end, lang in fenced_spans(text) if lang in ("python", "py")]
    problems = []
    for m in KEY.finditer(text):
        section, name, value = m.groups()
        if name in FILE_TYPES or any(start <= m.start() < end for start, end in python):
            continue
        key, where, value = f"{section}.{name}", line_of(text, m.start()), (value or "").rstrip(".,:;")
        if any(re.fullmatch(allowed, key) for allowed in ALLOWED_KEYS):
            continue
        if key not in keys:
            problems.append(f"{where}: names the config key {key}, which train.py --help does not list")
        elif value and keys[key] and value not in keys[key] and not re.search(r"[A-Z]{2,}|\.\.\.|[<{$]", value):
            problems.append(f"{where}: {key}={value}, but {key} takes {'|'.join(keys[key])}")
    return problems


# ---------------------------------------------------------------- flags of the commands the docs show

SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", "$(", "`"}
FLAG = re.compile(r"--[A-Za-z][\w-]*")


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line, command) for each line of a shell code block, fenced or indented (a trailing backslash joins the next
    line), and for each code span of the prose."""
    found: list[tuple[int, str]] = []
    for start, end, lang in fenced_spans(text):
        if lang in SHELL_BLOCKS:
            body = text[start:end].split("\n")[1:-1]
            found += joined(line_of(text, start) + 1, body)
    outside = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # the prose, with its line numbers kept
    rows = outside.split("\n")
    indented = [
        (i, row[4:])
        for i, row in enumerate(rows)
        if row.startswith("    ") and (i == 0 or not rows[i - 1].strip() or rows[i - 1].startswith("    "))
    ]
    found += [(i + 1, row) for i, row in indented if not row.lstrip().startswith(("-", "*", "|"))]
    found += [(line_of(outside, m.start()), m.group(0).strip("`")) for m in CODE_SPAN.finditer(outside)]
    return found


def joined(first: int, body: list[str]) -> list[tuple[int, str]]:
    commands, pending, at = [], "", first
    for i, row in enumerate(body):
        if not pending:
            at = first + i
        pending += row.rstrip("\\") + " "
        if not row.rstrip().endswith("\\"):
            commands.append((at, pending))
            pending = ""
    return commands + ([(at, pending)] if pending else [])


def tokens(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.commenters = "#"
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unclosed quote in a span that is not a whole command
        return command.split()


def program(token: str, following: str) -> str | None:
    """The program whose flags follow this token: train.py, a script of scripts/, torchrun, accelerate launch."""
    token = token.removeprefix("./")
    if token == "train.py" or re.fullmatch(r"scripts/[\w/.-]+\.(py|sh|sbatch)", token):
        return token
    if re.fullmatch(r"[\w/.-]+\.(py|sh|sbatch)", token) and (REPO / "scripts" / token).is_file():
        return f"scripts/{token}"  # named from scripts/: `sample.py --chat`, `bench/benchmark.py --quick`
    if Path(token).name == "torchrun" or token == "torch.distributed.run":
        return "torchrun"
    if Path(token).name == "accelerate" and following == "launch":
        return "accelerate launch"
    return None


def flags_given(command: str) -> list[tuple[str, str]]:
    """(program, --flag) for each flag the command gives to train.py, a script, torchrun or accelerate launch."""
    words, given, owner, first = tokens(command), [], None, True
    for i, word in enumerate(words):
        if word in SEPARATORS or word.startswith((">", "<", "2>")):
            owner, first = None, True
            continue
        if first and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", word):  # VAR=value before the command
            continue
        found = program(word, words[i + 1] if i + 1 < len(words) else "")
        if found:
            owner = found
        elif first:
            owner = None  # another command (git, pip, sbatch, python): its own flags are not checked here
        elif owner and FLAG.fullmatch(word.split("=", 1)[0]):
            given.append((owner, word.split("=", 1)[0]))
        first = False
    return given


def flag_problems(text: str, accepted: dict[str, set[str]]) -> list[str]:
    problems = []
    for line, command in command_lines(text):
        for owner, flag in flags_given(command):
            if owner in accepted and flag not in accepted[owner]:
                problems.append(f"{line}: {owner} {flag}: {owner} takes no {flag} (its --help)")
    return problems


def programs_named() -> set[str]:
    return {owner for page in PAGES for _, command in command_lines(page.read_text()) for owner, _ in flags_given(command)}


# Every program's --help in one process, which imports torch once (a process each would take seconds apiece):
# train.py's help text, torchrun's and accelerate launch's own parsers, each argparse script run with --help.
HELP_READER = """
import contextlib, io, json, os, runpy, sys
sys.path.insert(0, "src")
from parallel_train.config.load import help_text
from torch.distributed.run import get_args_parser
from accelerate.commands.launch import launch_command_parser
scripts, sys.argv = sys.argv[1:], ["accelerate", "launch", "--help"]  # accelerate's parser reads sys.argv
helps = {"train.py": help_text(), "torchrun": get_args_parser().format_help(), "accelerate launch": launch_command_parser().format_help()}
for script in scripts:
    sys.argv, out = [script, "--help"], io.StringIO()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python puts a script's folder first
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    helps[script] = out.getvalue()
print(json.dumps(helps))
"""


@pytest.fixture(scope="module")
def names(tmp_path_factory) -> tuple[dict[str, list[str] | None], dict[str, set[str]]]:
    """(config keys -> choices, program -> the flags it accepts), from each program's own --help. A script without
    argparse (bare_loop.py, the shell scripts) takes the flags its source names."""
    scripts = sorted(p for p in programs_named() if p.startswith("scripts/") and (REPO / p).exists())
    parsed = [s for s in scripts if "argparse" in (REPO / s).read_text()]
    env = launch_env(tmp_path_factory.mktemp("help"))
    helps = json.loads(check(run([PYTHON, "-c", HELP_READER, *parsed], env=env, timeout=120)).stdout)
    assert all(helps[s].startswith("usage:") for s in parsed), {s: helps[s][:200] for s in parsed}
    accepted = {name: set(FLAG.findall(text)) for name, text in helps.items()}
    accepted["train.py"] = {*FLAG.findall(helps["train.py"].splitlines()[0]), "--help"}  # its usage line: --config
    accepted |= {s: set(FLAG.findall((REPO / s).read_text())) for s in scripts if s not in parsed}
    return help_keys(helps["train.py"]), accepted


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_script_key_and_flag_a_page_names_exists(page: Path, names):
    keys, accepted = names
    text = page.read_text()
    problems = path_problems(text, created_by_the_docs()) + key_problems(text, keys) + flag_problems(text, accepted)
    where = page.relative_to(REPO).as_posix()
    assert not problems, "stale names (fix the page, or see ALLOWED_* in this file):\n" + "\n".join(f"{where}:{p}" for p in problems)


def test_the_checks_catch_a_renamed_script_key_value_and_flag(names):
    keys, accepted = names
    page = (
        "Run `python scripts/sample2.py --run runs/x`, then\n\n"
        "```bash\ntorchrun --nproc-per-node 2 --nproc 2 train.py --cfg x.yaml train.max_step=3 parallel.schedule=zb\n"
        "python scripts/sample.py --run runs/x \\\n  --max-new-tokens 5  # sample.py spells it --max_new_tokens\n```\n\n"
        "    accelerate launch --num-procs 2 train.py\n\n"
        "Fine: `configs/NAME.yaml`, `data/my_corpus.txt`, `runs/x/step_NNNNNNN`, `model.state_dict()`, `git log --oneline`,"
        " `1f28b97:scripts/benchmark.py`, `parallel.schedule=zbv`, `data/sources.py`, `sample.py --chat`.\n\n"
        "Not: `sample3.py`, `1f28b97:scripts/bench/benchmark.py`, `bench/benchmark.py --fast`.\n"
    )
    found = path_problems(page, set()) + key_problems(page, keys) + flag_problems(page, accepted)
    assert found == [
        "1: names scripts/sample2.py, which does not exist",
        "13: names 1f28b97:scripts/bench/benchmark.py, which commit 1f28b97 does not hold",
        "13: names sample3.py, which no file of the repository is called",
        "4: names the config key train.max_step, which train.py --help does not list",
        "4: parallel.schedule=zb, but parallel.schedule takes gpipe|1f1b|interleaved1f1b|interleavedzb|zbv|dualpipev",
        "4: torchrun --nproc: torchrun takes no --nproc (its --help)",
        "4: train.py --cfg: train.py takes no --cfg (its --help)",
        "5: scripts/sample.py --max-new-tokens: scripts/sample.py takes no --max-new-tokens (its --help)",
        "9: accelerate launch --num-procs: accelerate launch takes no --num-procs (its --help)",
        "13: scripts/bench/benchmark.py --fast: scripts/bench/benchmark.py takes no --fast (its --help)",
    ], found


# ---------------------------------------------------------------- the file map and the room table against the tree
#
# docs/contributing.md's "Project layout" table maps the package file by file: a row per room (its `name/` in the room
# column; a row without one is the package's top level), its files in the last column, named from the room (`engine.py`,
# `pipeline/` and the `split.py` inside it) or from the package (`tasks/task.py`). README's room table names each room.

MAP_NAME = re.compile(r"`([\w/]+(?:\.py|/))`")


@functools.cache
def package_files() -> list[str]:
    """Every module and subpackage of the package, from its root: `cli.py`, `parallel/`, `parallel/pipeline/split.py`."""
    found = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    found += [p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE]
    return sorted(found)


def table_rows(section: str, header: str) -> list[list[str]]:
    """The cells of each body row of the section's table whose header row starts with `header`."""
    rows, inside = [], False
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            inside = False
        elif not inside and cells[0].startswith(header):
            inside = True
        elif inside and not set("".join(cells)) <= set("-: "):
            rows.append(cells)
    return rows


def map_rows(section: str) -> list[tuple[str, list[str]]]:
    """(room, names in its files column) for each row of the file map: the room is `parallel/`, or '' (the top level)."""
    rows = []
    for cells in table_rows(section, "floor"):
        room = re.fullmatch(r"`(\w+/)`", cells[1])
        rows.append((room.group(1) if room else "", MAP_NAME.findall(cells[2])))
    return rows


def resolves(room: str, name: str) -> list[str]:
    """The package files (as package_files() writes them) a name in a room's row stands for."""
    files = package_files()
    if "/" in name.rstrip("/") and (PACKAGE / name).exists():  # named from the package: `tasks/task.py`
        return [name]
    return [f for f in files if f.startswith(room) and (f.removesuffix("/").rsplit("/", 1)[-1] + ("/" if f.endswith("/") else "")) == name]


def map_problems(rows: list[tuple[str, list[str]]], outside: set[str]) -> list[str]:
    """Names the map gives that are no file of its room, and package files the map does not name."""
    problems, named = [], set()
    for room, names in rows:
        for name in names:
            found = resolves(room, name)
            elsewhere = name in outside or (REPO / name).exists() or (PACKAGE / room / name).exists()  # scripts/, __init__.py
            if not found and not elsewhere:
                problems.append(f"names {name} in the row of {room or 'the top level'}, which is no file there")
            named.update(found)
        named.add(room)
    problems += [f"names nowhere {f}" for f in package_files() if f not in named]
    return problems


def test_the_file_map_names_every_module_and_only_modules_that_exist():
    rows = map_rows(doc_section("contributing", "Project layout"))
    assert len(rows) >= 5, "docs/contributing.md's Project layout has no file map"
    problems = map_problems(rows, outside={"train.py"})  # the entry, at the repository's root
    assert not problems, "docs/contributing.md's file map against src/parallel_train:\n" + "\n".join(problems)


def test_the_readme_room_table_names_every_room():
    rows = table_rows(doc_section("README", "Where to change what"), "room")
    assert rows, "README's Where to change what has no room table"
    rooms = {f for f in package_files() if f.endswith("/") and f.count("/") == 1}
    named = {name for cells in rows for name in MAP_NAME.findall(cells[0])}
    missing = sorted(rooms - named)
    stale = sorted(n for n in named if not (PACKAGE / n).exists())
    assert not missing and not stale, f"README's room table: rooms missing {missing}; names no file {stale}"


def test_the_map_check_catches_a_missing_and_a_stale_module():
    rows = [("", ["cli.py", "gone.py"]), ("parallel/", ["engine.py", "pipeline/", "split.py"])]
    problems = map_problems(rows, outside=set())
    assert "names gone.py in the row of the top level, which is no file there" in problems
    assert "names nowhere parallel/build.py" in problems and "names nowhere parallel/pipeline/split.py" not in problems
