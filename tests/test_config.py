"""Config: defaults <- YAML <- overrides, typed coercion, one-line errors naming the key, --help."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from helpers import run, warm_cmd
from parallel_train.config.load import UniqueKeyLoader, config_from_dict, load_config, sections
from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.models import MODELS


def test_defaults_are_the_shakespeare_baseline():
    cfg, path = load_config([])
    assert path is None
    assert (cfg.model.name, cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == ("gpt", 4, 4, 128, 64)
    assert (cfg.train.batch_size, cfg.train.max_steps, cfg.train.learning_rate) == (12, 2000, 1e-3)
    assert cfg.data.path.endswith("data/tinyshakespeare.txt")


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  n_layer: 2\n  dropout: 0.1\ntrain:\n  learning_rate: 3.0e-4\n  batch_size: 8\noutput_dir: x\n")
    cfg, path = load_config(
        [
            "--config",
            str(f),
            "train.batch_size=4",
            "train.min_lr=1e-5",
            "parallel.stage_devices=[cpu,cpu]",
            "parallel.pipeline_stages=2",
            "model.bias=false",
        ]
    )
    assert path == str(f)
    assert cfg.model.n_layer == 2 and cfg.model.dropout == 0.1
    assert cfg.train.learning_rate == 3e-4 and cfg.train.batch_size == 4  # override wins over the file
    assert cfg.train.min_lr == 1e-5  # "1e-5" is a string to YAML 1.1; still a float here
    assert cfg.parallel.stage_devices == ["cpu", "cpu"] and cfg.model.bias is False
    assert cfg.output_dir == "x"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model.n_layers=3"], "unknown config key 'model.n_layers'"),
        (["optim.lr=1"], "unknown config key 'optim.lr'"),
        (["train.batch_size=abc"], "train.batch_size: expected an integer"),
        (["train.batch_size=2.5"], "train.batch_size: expected an integer"),
        (["train.batch_size=0"], "train.batch_size: must be >= 1"),
        (["model.n_head=3"], "model.n_embd (128) must be divisible by model.n_head (3)"),
        (["model.dropout=1.5"], "model.dropout: must be in [0, 1)"),
        (["model.bias=maybe"], "model.bias: expected true or false"),
        (["train.learning_rate=fast"], "train.learning_rate: expected a number"),
        (["tracker=mlflow"], "tracker: must be one of wandb, tensorboard, none"),
        (["model.name=resnet"], "model.name: unknown model 'resnet'"),
        (["train=3"], "config key 'train' is a section"),
        (["parallel.pipeline_stages=2", "parallel.stage_devices=[cpu]"], "parallel.stage_devices: 1 devices given for 2 pipeline stages"),
        (["--config", "/nonexistent.yaml"], "--config /nonexistent.yaml: no such file"),
        (["bogus"], "unexpected argument 'bogus'"),
    ],
)
def test_bad_values_name_the_key(args, needle):
    with pytest.raises(UserError) as e:
        load_config(args)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(["--config", str(f)])
    f.write_text("- a list\n")
    with pytest.raises(UserError, match="expected a mapping"):
        load_config(["--config", str(f)])


def test_two_config_files_merge_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  n_layer: 2\ntrain:\n  batch_size: 8\n  max_steps: 5\n")
    (tmp_path / "b.yaml").write_text("train:\n  max_steps: 7\n")
    cfg, path = load_config(["--config", str(tmp_path / "a.yaml"), f"--config={tmp_path / 'b.yaml'}", "train.batch_size=4"])
    assert path == f"{tmp_path / 'a.yaml'} + {tmp_path / 'b.yaml'}"  # what the start banner shows
    assert (cfg.model.n_layer, cfg.train.max_steps, cfg.train.batch_size) == (2, 7, 4)  # a, then b, then the overrides


def test_a_key_written_twice_in_one_file_names_the_key_and_both_lines(tmp_path):
    f = tmp_path / "twice.yaml"
    f.write_text("model:\n  n_layer: 2\ntrain:\n  batch_size: 8\nmodel:\n  n_head: 2\n")
    with pytest.raises(UserError, match=r"twice.yaml: key 'model' is written twice \(lines 1 and 5\)"):
        load_config(["--config", str(f)])
    f.write_text("model:\n  n_layer: 2\n  n_head: 2\n  n_layer: 3\n")
    with pytest.raises(UserError, match=r"key 'n_layer' is written twice \(lines 2 and 4\)"):
        load_config(["--config", str(f)])
    # A YAML merge (`<<: *anchor`) is not a key written twice: the keys written next to it override the merged ones.
    merged = yaml.load("base: &base {batch_size: 2, max_steps: 3}\ntrain:\n  <<: *base\n  batch_size: 4\n", Loader=UniqueKeyLoader)
    assert merged["train"] == {"batch_size": 4, "max_steps": 3}


def test_cli_error_is_one_line_exit_2_without_traceback():
    r = run(warm_cmd(1, "model.n_head=3"), timeout=120)  # train.py's entry point (a cold `python train.py`: test_bad_inputs.py)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: model.n_embd (128) must be divisible by model.n_head (3)"
    assert "Traceback" not in r.output


def test_a_model_owns_its_keys_and_rules(capsys):
    cfg, _ = load_config(["--config", "configs/seed_mlp.yaml", "model.n_embd=130"])  # GPT's key and rule, not the MLP's
    assert type(cfg.model).__name__ == "MLPConfig" and not hasattr(cfg.model, "n_embd")
    assert "notice: ignoring model.n_embd (a key of model.name=gpt, not of model.name=mlp)" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"unknown config key 'model.hiden': model.name=mlp has block_size, hidden, in_features"):
        load_config(["model.name=mlp", "model.hiden=3"])
    # model.name may come after the model's keys: it decides which keys model.* has
    cfg, _ = load_config(["model.hidden=7", "model.name=mlp"])
    assert cfg.model.hidden == 7
    # A config saved before models owned their keys held every model's keys: it still loads, silently.
    old = {"model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "in_features": 10, "hidden": 50}}
    assert config_from_dict(old).model.n_layer == 2 and capsys.readouterr().err == ""


def _numeric_keys() -> list[tuple[str, type]]:
    keys = []
    for prefix, section in sections(Config()):
        keys += [(prefix + f.name, f.type) for f in dataclasses.fields(section) if f.type in ("int", "float", int, float)]
    for model in MODELS.values():
        keys += [(f"model.{f.name}", f.type) for f in dataclasses.fields(model.Config) if f.type in ("int", "float", int, float)]
    return sorted(set(keys))


@pytest.mark.parametrize("key, kind", _numeric_keys())
def test_every_numeric_key_refuses_values_its_consumer_cannot_hold(key, kind):
    """No numeric key reaches torch with a value it cannot take: an integer of 10**20 overflowed into a traceback,
    and a float that is not finite poisons the run."""
    model = (
        [f"model.name={next(n for n, m in MODELS.items() if key[6:] in {f.name for f in dataclasses.fields(m.Config)})}"]
        if key.startswith("model.")
        else []
    )
    for value in ("nan", "inf", "-inf") if kind in ("float", float) else ("100000000000000000000", "-100000000000000000000"):
        with pytest.raises(UserError) as e:
            load_config([*model, f"{key}={value}"])
        assert str(e.value).startswith(f"{key}: must be") and "\n" not in str(e.value), str(e.value)
