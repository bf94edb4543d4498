"""The scripts' arguments, in process (each script's parse() or main(), no launch): a value a script would ignore or
misread is one line (issue 34: --device-gib -4 was accepted; --dtype and --max-shard-size were dropped by the format
that does not read them; sample.py on a classifier run asked whether it was a training run's folder)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml

from helpers import REPO
from parallel_train.errors import UserError


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(call, match: str) -> str:
    with pytest.raises(UserError, match=match) as e:
        call()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("value", ["-4", "0", "nan", "inf", "lots"])
def test_estimate_memory_refuses_a_device_size_that_is_not_a_positive_number(value):
    cli = script("estimate_memory")
    refused(lambda: cli.parse(["--world", "2", "--device-gib", value]), r"^argument --device-gib: .*a number of GiB above 0")
    assert cli.parse(["--world", "2", "--device-gib", "40"])[0].device_gib == 40.0
    refused(lambda: cli.parse(["--world", "0"]), r"^argument --world: .*a whole number >= 1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-shard-size", "5GB", "--format", "hf"], r"^--max-shard-size: applies to --format safetensors only"),
        (["--dtype", "bfloat16"], r"^--dtype: applies to --format hf only"),
        (["--dtype", "bfloat16", "--format", "safetensors"], r"^--dtype: applies to --format hf only"),
    ],
)
def test_export_refuses_an_option_its_format_does_not_read(tmp_path, args, message):
    cli = script("export")
    refused(lambda: cli.parse([str(tmp_path), *args]), message)
    assert cli.parse([str(tmp_path), "--format", "hf", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert cli.parse([str(tmp_path), "--max-shard-size", "5GB"]).max_shard_size == "5GB"


def test_sample_on_a_classifier_run_says_what_it_samples_from(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_bytes(b"")  # never read: the task is refused first
    tree = {"model": {"name": "hf", "hf_path": str(tmp_path / "bert"), "task": "sequence-classification"}, "data": {"path": "rows.csv"}}
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    cli = script("sample")
    monkeypatch.setattr(sys, "argv", ["sample.py", "--run", str(run)])
    refused(cli.main, r"model.task=sequence-classification: scripts/sample.py generates text from model.task=causal-lm runs only")
