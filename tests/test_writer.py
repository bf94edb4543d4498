"""Nothing lost, by construction (issue 34): everything a run or a script writes goes through checkpoint/writer.py.

In this process, on folders made here (no launch): the listing of hashes and what it refuses, a run's output_dir that
holds anything a run never writes (a model folder), the files a run would replace, and a finished run whose config
cannot be read. The launches (a run into its own model.hf_path; a finished run's hf/ edited, then extended) are in
tests/test_export_safety.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from helpers import TINY, snapshot
from parallel_train.checkpoint.writer import check_file, listed, write_file, write_folders
from parallel_train.config.load import load_config
from parallel_train.errors import UserError
from parallel_train.run.export_dir import check_target
from parallel_train.run.finished import decide, meet_finished_run
from parallel_train.run.output_dir import LOCK, check_output_dir, check_run_files


def model_folder(folder: Path) -> Path:
    """What save_pretrained leaves: config.json, model.safetensors, tokenizer.json."""
    folder.mkdir(parents=True)
    for name, text in {"config.json": "{}", "model.safetensors": "weights", "tokenizer.json": "{}"}.items():
        (folder / name).write_text(text)
    return folder


def write_export(folder: Path, text: str = "weights") -> str:
    folder.mkdir()
    (folder / "model.safetensors").write_text(text)
    return f"wrote {folder}"


# ---------------------------------------------------------------- the listing: hashes, not sizes and mtimes


def test_an_exported_file_edited_with_its_size_and_mtime_kept_is_never_replaced(tmp_path):
    """The old list held sizes and mtimes: an edit of the same size with its mtime restored passed, and the next
    export replaced it. The sha256 tells: check_target and write_folders refuse in one line naming it, and it stays."""
    out = tmp_path / "out"
    write_folders(out, write_export)
    assert set(listed(out)) == {"model.safetensors"}
    edited = out / "model.safetensors"
    st = edited.stat()
    edited.write_text("WEIGHTS")  # the same size
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (edited.stat().st_size, edited.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(UserError, match=r"^.*/out holds files no export wrote \(model\.safetensors\)"):
        check_target(out, tmp_path / "checkpoint", "safetensors")
    with pytest.raises(UserError, match=r"/out holds files the template did not write or that changed since \(model\.safetensors\)"):
        write_folders(out, write_export)
    assert edited.read_text() == "WEIGHTS" and not list(tmp_path.glob(".out.tmp-*"))


def test_a_file_is_replaced_only_when_listed_unchanged(tmp_path):
    """write_file writes and lists; a user's file, or one changed since, is refused in one line naming it."""
    write_file(tmp_path / "summary.json", "{}")
    write_file(tmp_path / "summary.json", '{"a": 1}')  # its own, unchanged: replaced
    (tmp_path / "summary.json").write_text("mine")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"summary\.json: changed since the template wrote it, so it is not replaced"):
        write_file(tmp_path / "summary.json", "{}")
    with pytest.raises(UserError, match=r"notes\.txt: not written by this template, so it is not replaced"):
        check_file(tmp_path / "notes.txt")
    assert (tmp_path / "summary.json").read_text() == "mine"


# ---------------------------------------------------------------- a run's output_dir


def test_an_output_dir_holding_a_model_is_refused_before_anything_is_written(tmp_path):
    """output_dir = model.hf_path (a save_pretrained folder): the run replaced its model.safetensors and tokenizer.json,
    exit 0. Now one line naming what is there, and nothing written."""
    model = model_folder(tmp_path / "model")
    before = snapshot(model)
    for resume in ("auto", "none"):
        with pytest.raises(UserError, match=r"^output_dir: .*/model' holds config\.json, which no run writes \(a model folder"):
            check_output_dir(SimpleNamespace(output_dir=str(model), resume=resume))
    assert snapshot(model) == before and sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    (model / "config.json").unlink()  # only names a run writes, but not its files: refused before the run trains
    with pytest.raises(UserError, match=r"model\.safetensors: not written by this template"):
        check_run_files(model, ())
    assert snapshot(model) == {k: v for k, v in before.items() if k != "config.json"}


def test_a_new_empty_crashed_or_earlier_run_folder_is_a_runs(tmp_path):
    """What must keep working: a new or empty folder, the lock and config.yaml of a crashed early start, the temporary
    files of a write under way, and a run folder of a version before the listing (its files listed once)."""
    for name, entries in {"new": None, "empty": [], "crashed": [LOCK, "config.yaml", ".config.yaml.tmp"]}.items():
        out = tmp_path / name
        if entries is not None:
            out.mkdir()
            for entry in entries:
                (out / entry).write_text("")
        assert check_output_dir(SimpleNamespace(output_dir=str(out), resume="auto")) == out
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for name in ("config.yaml", "summary.json", "model.safetensors", "vocab.json", "metrics.jsonl"):
        (earlier / name).write_text(name)
    (earlier / "checkpoints").mkdir()
    (earlier / ".hf.tmp-12345").mkdir()
    check_output_dir(SimpleNamespace(output_dir=str(earlier), resume="auto"))
    check_run_files(earlier, ("hf",))
    assert set(listed(earlier)) == {"config.yaml", "summary.json", "model.safetensors", "vocab.json"}
    (earlier / "summary.json").write_text("edited")
    with pytest.raises(UserError, match=r"summary\.json: changed since the template wrote it"):
        check_run_files(earlier, ())


def test_a_runs_hf_folder_holding_a_users_file_is_refused_before_the_run_trains(tmp_path):
    write_folders(tmp_path / "hf", lambda folder: write_export(folder))
    check_run_files(tmp_path, ("hf",))
    (tmp_path / "hf" / "README.md").write_text("my model card")
    with pytest.raises(UserError, match=r"/hf holds files the template did not write or that changed since \(README\.md\)"):
        check_run_files(tmp_path, ("hf",))
    check_run_files(tmp_path, ())  # a run that does not write hf/ leaves it alone


# ---------------------------------------------------------------- a finished run whose config cannot be read


def finished_run(tmp_path: Path, summary: str, config_yaml: str | None = None) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(summary)
    if config_yaml is not None:
        (out / "config.yaml").write_text(config_yaml)
    return out


@pytest.mark.parametrize(
    "case", ["summary_not_json", "summary_config_empty", "summary_config_foreign", "config_yaml_corrupt", "config_yaml_without_keys"]
)
def test_a_finished_run_whose_config_cannot_be_read_is_never_done_for_another_config(tmp_path, case):
    """A summary.json that is not JSON, or whose `config` is empty or holds none of a config's keys, or one of an
    earlier version (no config, no steps) beside a config.yaml that is corrupt or holds none of them: compared with
    nothing, it compared equal to any launch, which was then "done" with exit 0. Now it is never done: without a
    checkpoint to continue from, one line naming summary.json."""
    cfg, _ = load_config([*TINY, "train.max_steps=9", f"output_dir={tmp_path / 'run'}"])
    summary = {"steps": 6, "final_val_loss": 2.0}
    text = {
        "summary_not_json": "{not json",
        "summary_config_empty": json.dumps({**summary, "config": {}}),
        "summary_config_foreign": json.dumps({**summary, "config": {"note": "mine"}}),
    }.get(case, json.dumps({"final_val_loss": 2.0}))
    config_yaml = {"config_yaml_corrupt": "model: [unclosed", "config_yaml_without_keys": yaml.safe_dump({"note": "mine"})}.get(case)
    out = finished_run(tmp_path, text, config_yaml)
    rerun = meet_finished_run(cfg, out)  # what the trainer asks; no checkpoint: done_from(None) is the verdict
    assert rerun.done is None and rerun.done_from(None, cfg.train.max_steps) is None, rerun
    with pytest.raises(UserError) as refused:
        rerun.refuse_unless(None)
    assert str(refused.value).startswith(f"resume=auto: output_dir {out} holds a run that finished at step ")
    assert f"{out / 'summary.json'} does not say which config it finished with" in str(refused.value)


def test_a_finished_run_with_its_config_is_done_only_for_that_config(tmp_path):
    """The control: the summary's own config is done for itself and refused for another."""
    cfg, _ = load_config([*TINY, f"output_dir={tmp_path / 'run'}"])
    out = finished_run(tmp_path, json.dumps({"steps": 6, "final_val_loss": 2.0, "config": cfg.to_dict()}))
    assert "nothing to train" in decide(cfg, out)["done"]
    other, _ = load_config([*TINY, "train.max_steps=9", f"output_dir={out}"])
    assert "train.max_steps 6 -> 9" in decide(other, out)["refusal"]
