"""Generated bad config (issue 34 item 3), in process: every key of the config schema (config/sections.py, each
model's Config in models/) given a value of the wrong type, out of its declared range, empty, or not among its
choices; every section given a value or an unknown key; and every key a run does not read (config/usage.py's
table, another model's keys) set where it is not read. Nothing here lists a key: a new key, model or row of the
table is covered without a new test.

Each case is `load_config` and `check_source` on the overrides, what `train.py` does before anything heavy (the
CLI turns the UserError into `error: ...` and exit 2): one line naming the key; or a documented success, a value
equal to the key's default (a key set to its default changes nothing: config/usage.py) or the one `notice:` line
naming a key the run does not read (docs/configuration.md); never another exception; no input changed. The same
cases are also written in a --config file (a seeded sample by default, all under -m slow), and a seeded 40 of them
go through train.py itself under -m slow (exit 2 and one `error:` line, as the CLI prints it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import pytest
import yaml

from generated import Case, Unchanged, assert_message, assert_result, drawn, named, params, through_train_py
from parallel_train.config.load import load_config
from parallel_train.config.sections import Config
from parallel_train.config.usage import ROWS
from parallel_train.core.fields import INT_MAX, fields_of, hints
from parallel_train.data.sources import check_source
from parallel_train.errors import UserError
from parallel_train.models import MODELS

REPO = Path(__file__).resolve().parents[1]
HF = "{places}/hf"
# What each model needs to load at all beside its name (a Hugging Face model names its folder, the seed MLP takes
# feature vectors).
NEEDS = {"hf": [f"model.hf_path={HF}"], "mlp": ["data.path=random"]}


def base(model: str) -> list[str]:
    return [f"model.name={model}", *NEEDS.get(model, [])]


# Settings under which some keys are not read: a usage row's key is set under the first of these that leaves it
# unread (a new row whose choice is none of these fails test_every_unread_key_has_a_context).
CONTEXTS = (
    [],
    ["data.path=synthetic"],
    ["data.path=random"],
    ["train.optimizer=sgd"],
    ["train.lr_schedule=constant"],
    base("hf"),
    ["data.format=chat"],
    ["parallel.pipeline_stages=2"],
    ["model.flavor=llama"],
)
DOCUMENTED_DEFAULT = "its default (config/usage.py: a key set to its default changes nothing)"


def schema() -> list[tuple[str, str, dataclasses.Field, type, object]]:
    """(model name, key, field, type, default) of every key: each model's own keys under that model, the keys every
    model has and every other section's under the default model."""
    keys = []
    common = fields_of(MODELS["gpt"].Config())
    for name, model in MODELS.items():
        cfg = model.Config(name=name)
        for key, f in fields_of(cfg).items():
            if name == "gpt" or key not in common:
                keys.append((name, f"model.{key}", f, hints(type(cfg))[f.name], getattr(cfg, f.name)))
    cfg = Config()
    for section, sf in fields_of(cfg).items():
        node = getattr(cfg, sf.name)
        if section == "model":
            continue
        if not dataclasses.is_dataclass(node):
            keys.append(("gpt", section, sf, hints(Config)[sf.name], node))
            continue
        for key, f in fields_of(node).items():
            keys.append(("gpt", f"{section}.{key}", f, hints(type(node))[f.name], getattr(node, f.name)))
    return keys


def bad_values(tp: type, meta: dict) -> list[tuple[str, str]]:
    """(what is wrong, the command-line value) for a key of type `tp` with its declared choices and range."""
    wrong = {
        int: ["abc", "[1,2]", "1.5", "true"],
        float: ["abc", "[1]", "true"],
        bool: ["maybe", "[1]", "2"],
        str: ["[a,b]", "{a: 1}"],
    }.get(tp, ["{a: 1}", "5"])  # a list
    values = [("empty", "")] + [("type", v) for v in wrong]
    if meta.get("choices"):
        values.append(("choice", "no_such_choice"))
    if tp in (int, float):
        low = meta["above"] if meta.get("above") is not None else meta.get("min")
        high = meta["below"] if meta.get("below") is not None else meta.get("max")
        if low is not None:  # just past the bound: min - 1, or the exclusive bound itself
            values.append(("range", str(low - (1 if meta.get("min") is not None else 0))))
        if high is not None or tp is int:  # every integer is at most INT_MAX (core/fields.py)
            values.append(("range", str(high + (1 if meta.get("max") is not None else 0) if high is not None else INT_MAX + 1)))
        if tp is float:
            values += [("range", "nan"), ("range", "inf")]
    return list(dict.fromkeys(values))


def other_value(tp: type, meta: dict, default: object) -> str:
    """A valid value other than the default (for keys the run does not read)."""
    if tp is bool:
        return str(not default).lower()
    if meta.get("choices"):
        return next(c for c in meta["choices"] if c != default)
    if tp in (int, float):
        value = default + 1
        return str(value if math.isfinite(value) and (meta.get("max") is None or value <= meta["max"]) else default / 2)
    return "other" if tp is str else "[x]"


def value_cases() -> list[Case]:
    return [
        Case(f"{model}:{key}={value}:{what}", (key,), {"argv": [*base(model), f"{key}={value}"], "default": default})
        for model, key, f, tp, default in schema()
        for what, value in bad_values(tp, f.metadata)
    ]


def section_cases() -> list[Case]:
    cases = []
    for section, sf in fields_of(Config()).items():
        if dataclasses.is_dataclass(getattr(Config(), sf.name)):
            cases.append(Case(f"{section}=5:section", (section,), {"argv": [f"{section}=5"]}))
            cases.append(Case(f"{section}.no_such_key=1:unknown", (f"{section}.no_such_key",), {"argv": [f"{section}.no_such_key=1"]}))
    return [*cases, Case("no_such_key=1:unknown", ("no_such_key",), {"argv": ["no_such_key=1"]})]


def unread_cases() -> list[Case]:
    """Every usage row's key, set to a value other than its default under the first context that leaves it unread;
    every model's own keys given with another model."""
    types = {key: (tp, f.metadata, default) for _, key, f, tp, default in schema()}
    cases = []
    for row in ROWS:
        tp, meta, default = types[row.key]
        cases.append(Case(f"{row.key}:unread", (row.key,), {"key": row.key, "value": other_value(tp, meta, default)}))
    for model in MODELS:
        own = fields_of(MODELS[model].Config())
        for other, key, f, tp, default in schema():
            if other != model and key.startswith("model.") and key.split(".", 1)[1] not in own:
                argv = [*base(model), f"{key}={other_value(tp, f.metadata, default)}"]
                cases.append(Case(f"{model}:{key}:another_models", (key,), {"argv": argv}))
    return cases


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> Path:
    """The inputs the cases name: a model folder (the config layer only checks it holds config.json)."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text("{}")
    return root


def outcome(argv: list[str], places: Path, capsys) -> tuple[object, str, str | None]:
    """(the loaded config or None, the notice lines, the UserError's message or None): what train.py's start does."""
    with Unchanged(places):
        try:
            cfg, _ = load_config([a.replace("{places}", str(places)) for a in argv])
            check_source(cfg)
            error = None
        except UserError as e:
            cfg, error = None, str(e)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return cfg, "\n".join(line for line in err.splitlines() if line.startswith("notice:")), error


def assert_case(case: Case, places: Path, capsys, record_property, argv: list[str]) -> None:
    cfg, notices, error = outcome(argv, places, capsys)
    if error is not None:
        assert_message(error, case)
        return record_property("outcome", "one-line")
    if notices:
        assert notices.count("\n") == 0 and named(notices, case.names), f"{case.id}: {notices}"
        return record_property("outcome", "notice")
    key = case.names[0]
    value = _value(cfg, key)
    assert "default" in case.data and value == case.data["default"], f"{case.id}: accepted without a word: {key}={value!r}"
    record_property("outcome", "success")


def _value(cfg: Config, key: str) -> object:
    node = cfg
    for part in key.split("."):
        node = getattr(node, fields_of(node)[part].name)
    return node


# Known failures (case id -> why), each a strict xfail: the fix that mends one removes its line.
KNOWN: dict[str, str] = {}


@pytest.mark.parametrize("case", params(value_cases() + section_cases(), KNOWN, default=None))
def test_a_bad_value_is_one_line_naming_the_key(case, places, capsys, record_property):
    assert_case(case, places, capsys, record_property, case.data["argv"])


@pytest.mark.parametrize("case", params(value_cases() + section_cases(), {}, default=30, seed=35))
def test_a_bad_value_in_a_config_file_is_one_line_naming_the_key(case, places, capsys, record_property):
    """The same cases written in a --config file: YAML types each value as it types an override; sections hold them."""
    tree: dict = {}
    for setting in case.data["argv"]:
        key, raw = setting.replace("{places}", str(places)).split("=", 1)
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = yaml.safe_load(raw) if raw else ""
    path = places / "yaml" / f"{hashlib.sha256(case.id.encode()).hexdigest()[:16]}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(tree))
    assert_case(case, places, capsys, record_property, ["--config", str(path)])


@pytest.mark.parametrize("case", params(unread_cases(), KNOWN, default=None))
def test_a_key_the_run_does_not_read_is_one_notice_or_one_error(case, places, capsys, record_property):
    argv = case.data.get("argv")
    if argv is None:
        context = next(c for c in CONTEXTS if not unread_in(c, case.data["key"], places))
        argv = [*context, f"{case.data['key']}={case.data['value']}"]
    cfg, notices, error = outcome(argv, places, capsys)
    if error is not None:
        assert_message(error, case)
        return record_property("outcome", "one-line")
    assert notices.count("\n") == 0 and named(notices, case.names), f"{case.id}: not one notice naming it: {notices!r}"
    record_property("outcome", "notice")


def unread_in(context: list[str], key: str, places: Path) -> bool:
    """Whether a run of `context` reads `key` (True: look further)."""
    from parallel_train.config.usage import BY_KEY

    cfg, _ = load_config([a.replace("{places}", str(places)) for a in context])
    return BY_KEY[key].reads(cfg)


def errors(case: Case) -> bool:
    """Not an empty value of a key whose default is empty (that one trains: a documented success)."""
    return not (case.id.endswith(":empty") and not case.data.get("default", "x"))


@pytest.mark.parametrize("case", params(drawn(filter(errors, value_cases() + section_cases()), 40), {}, default=0))
def test_a_bad_value_through_train_py_is_one_error_line(case, places, tmp_path, record_property):
    """The same cases, some of them, as train.py says them: exit 2 and one `error:` line, nothing else changed."""
    with Unchanged(places, REPO / "data"):
        result = through_train_py([a.replace("{places}", str(places)) for a in case.data["argv"]], tmp_path)
    assert_result(result, case, record_property)


def test_every_unread_key_has_a_context(places):
    from parallel_train.config.usage import BY_KEY

    missing = [key for key in BY_KEY if all(unread_in(c, key, places) for c in CONTEXTS)]
    assert not missing, f"no context of CONTEXTS leaves these keys unread; add one: {missing}"
