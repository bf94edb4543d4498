"""Config: defaults <- YAML <- overrides, typed coercion, one-line errors naming the key, --help."""

from __future__ import annotations

import pytest

from helpers import PYTHON, run
from parallel_train.config import load_config
from parallel_train.errors import UserError


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


def test_cli_error_is_one_line_exit_2_without_traceback():
    r = run([PYTHON, "train.py", "model.n_head=3"], timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: model.n_embd (128) must be divisible by model.n_head (3)"
    assert "Traceback" not in r.output
