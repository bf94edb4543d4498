"""scripts/export.py never deletes or changes anything it did not write (issue 26, items 1 and 6).

Real exports through the script (forked warm) of two tiny finished runs made once: a GPT and a model.name=hf Llama
(tests/hf_tiny.py). Each loss the old script caused has its test: an export into the run itself, into a folder
holding a user's file, into a checkpoint (its default destination: resume=auto then skipped it as damaged). Then
what must keep working (an earlier export replaced whole, the run's own hf/ written again) and the disks that fail:
read-only (a read-only bind mount, and a file where a parent folder should be), full (a tiny tmpfs) and a failure
between two folders. Mounts need root (the tests run as root here); those cases are skipped without it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import hf_tiny
from helpers import TINY, check, launch_env, run, snapshot, warm_cmd, warm_script
from parallel_train.checkpoint.manifest import verify
from parallel_train.checkpoint.writer import LISTING, write_folders
from parallel_train.errors import UserError

pytestmark = pytest.mark.multiprocess

# TINY's schedule (6 steps, checkpoints at 3 and 6) on a tiny Llama reading bytes (its vocabulary holds 300 ids).
HF = (*(key for key in TINY if not key.startswith("model.")), "model.name=hf", "model.block_size=16", "data.tokenizer=byte")


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("gpt")
    check(run(warm_cmd(1, *TINY, f"output_dir={tmp / 'run'}"), env=launch_env(tmp)))
    return tmp / "run"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A finished model.name=hf run: checkpoints 3 and 6, its own hf/ written at the end."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("llama")
    model = hf_tiny.save_model(hf_tiny.llama_config(), tmp / "llama")  # no tokenizer of its own: HF reads bytes
    check(run(warm_cmd(1, *HF, f"model.hf_path={model}", f"output_dir={tmp / 'run'}"), env=launch_env(tmp)))
    return tmp / "run"


def export(tmp_path: Path, *args: str):
    return run(warm_script("scripts/export.py", *map(str, args)), env=launch_env(tmp_path), timeout=180)


def one_line(result) -> str:
    """The one error line of a refused export or run (exit 2, no traceback)."""
    lines = [line for line in result.output.splitlines() if line.strip() and not line.startswith("no CUDA GPU found")]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output[-3000:]
    return lines[0]


def mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def umount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True)


# ---------------------------------------------------------------- each loss of the old script


@pytest.mark.parametrize("case", ["safetensors", "hf", "checkpoint"])
def test_an_export_into_the_run_itself_is_refused_and_every_file_of_the_run_stays(gpt, llama, tmp_path, case):
    """The old script rewrote the run's model.safetensors, deleted the whole run (--format hf), or wrote into the
    checkpoint; now one line, and every file of the run is as it was (size, mtime, sha256)."""
    run_dir = tmp_path / "run"  # a copy: the old script deleted the run
    shutil.copytree({"safetensors": gpt, "hf": llama, "checkpoint": gpt}[case], run_dir)
    out = run_dir / "checkpoints" / "step_0000006" if case == "checkpoint" else run_dir
    before = snapshot(run_dir)
    line = one_line(export(tmp_path, run_dir, out, *(["--format", "hf"] if case == "hf" else [])))
    kind = "a checkpoint" if case == "checkpoint" else "a run folder (config.yaml, metrics.jsonl, summary.json, checkpoints/)"
    assert line.startswith(f"error: {out} is {kind}: an export never writes into"), line
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_an_export_into_a_folder_holding_a_users_file_is_refused_and_the_file_stays(gpt, llama, tmp_path, fmt):
    """The old --format hf deleted the folder first (the user's file with it); the old safetensors export wrote beside it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    line = one_line(export(tmp_path, llama if fmt == "hf" else gpt, mine, "--format", fmt))
    assert line == (
        f"error: {mine} holds files no export wrote (notes.txt): an export never deletes them; give a new or empty folder "
        "as OUT, or move them away first"
    )
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "my notes"


def test_a_checkpoint_export_goes_beside_the_run_and_resume_auto_continues_from_that_checkpoint(llama, tmp_path):
    """The old default wrote CHECKPOINT/hf: the manifest failed and the next resume=auto skipped the newest checkpoint.
    Now the default is RUN/exports/step_NNNNNNN-hf; the checkpoint still verifies and the run continues from it."""
    run_dir = tmp_path / "run"
    shutil.copytree(llama, run_dir)
    newest = run_dir / "checkpoints" / "step_0000006"
    result = check(export(tmp_path, newest, "--format", "hf"))
    model = llama.parent / "llama"  # the fixture's model folder
    resumed = check(run(warm_cmd(1, *HF, f"model.hf_path={model}", "train.max_steps=7", f"output_dir={run_dir}"), env=launch_env(tmp_path)))
    assert f"resumed from {newest} at step 6" in resumed.output and "skipping" not in resumed.output, resumed.output[-3000:]
    assert f"Hugging Face model folder: {run_dir / 'exports' / 'step_0000006-hf'}" in result.output
    assert (run_dir / "exports" / "step_0000006-hf" / "config.json").is_file() and verify(newest) is None


# ---------------------------------------------------------------- a run writes only what is its own (issue 34)


def test_a_run_into_its_own_model_folder_is_refused_before_anything_is_written(llama, tmp_path):
    """output_dir = model.hf_path (a save_pretrained folder): the run replaced the model's model.safetensors, exit 0.
    Now one line naming what a run never writes, exit 2, and the model folder is as it was."""
    model = tmp_path / "llama"
    shutil.copytree(llama.parent / "llama", model)
    before = snapshot(model)
    line = one_line(run(warm_cmd(1, *HF, f"model.hf_path={model}", f"output_dir={model}"), env=launch_env(tmp_path)))
    assert line.startswith(f"error: output_dir: {str(model)!r} holds config.json"), line
    assert "which no run writes" in line and snapshot(model) == before


def test_a_finished_run_extended_stops_before_training_when_its_hf_folder_holds_a_users_file(llama, tmp_path):
    """A model card added to RUN/hf and its config.json edited, then the run extended (resume=auto, more steps): its
    final write replaced hf/ whole, the card deleted and the edit undone. Now it stops in one line naming them before
    it trains (no checkpoint past step 6), and every file of the run is as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(llama, run_dir)
    (run_dir / "hf" / "README.md").write_text("# my model card\n")
    config = run_dir / "hf" / "config.json"
    config.write_text(config.read_text() + "\n")
    before = snapshot(run_dir)
    model = llama.parent / "llama"
    line = one_line(run(warm_cmd(1, *HF, f"model.hf_path={model}", "train.max_steps=9", f"output_dir={run_dir}"), env=launch_env(tmp_path)))
    assert line.startswith(
        f"error: {run_dir / 'hf'} holds files the template did not write or that changed since (README.md, config.json): "
        "it never deletes them"
    ), line
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------- what keeps working


def test_an_earlier_export_is_replaced_whole_and_the_runs_own_hf_folder_written_again(gpt, llama, tmp_path):
    """An export's folder lists what it wrote (LISTING): re-exporting replaces it whole (no shard of the sharded export
    is left beside the single file); the run's own hf/ (written by the run, listed too) is written again by
    `export.py RUN --format hf`."""
    out = tmp_path / "out"
    check(export(tmp_path, gpt, out, "--max-shard-size", "40KB"))
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    check(export(tmp_path, gpt, out))
    assert sorted(p.name for p in out.iterdir()) == [LISTING, "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == (gpt / "model.safetensors").read_bytes()
    assert not list(tmp_path.glob(".out.tmp-*"))
    own = llama / "hf"
    assert (own / LISTING).is_file()
    result = check(export(tmp_path, llama, "--format", "hf"))
    assert f"Hugging Face model folder: {own}" in result.output and (own / "config.json").is_file()


# ---------------------------------------------------------------- disks that fail


@pytest.mark.parametrize("how", ["read-only mount", "file as parent"])
def test_a_read_only_destination_is_one_line(gpt, tmp_path, how):
    """The old script ended in a traceback. A read-only bind mount (root), or a file where OUT's parent should be."""
    if how == "read-only mount":
        (tmp_path / "src").mkdir()
        (tmp_path / "ro").mkdir()
        if not mount("-o", "bind,ro", str(tmp_path / "src"), str(tmp_path / "ro")):
            pytest.skip("cannot bind-mount here (needs root)")
        out, reason = tmp_path / "ro" / "out", "Read-only file system"
    else:
        (tmp_path / "ro").write_text("a file")
        out, reason = tmp_path / "ro" / "out", "Not a directory"
    try:
        line = one_line(export(tmp_path, gpt, out))
    finally:
        umount(tmp_path / "ro")
    assert line == f"error: writing {out} failed ({reason}): nothing was changed there; give a writable folder as OUT"


def test_a_read_only_run_with_the_default_hf_destination_says_to_give_out_elsewhere(llama, tmp_path):
    """The run on a read-only mount: the default OUT (RUN/hf) cannot be written; one line that says what to do."""
    view = tmp_path / "view"
    view.mkdir()
    if not mount("-o", "bind,ro", str(llama), str(view)):
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        before = snapshot(view)
        line = one_line(export(tmp_path, view, "--format", "hf"))
        assert snapshot(view) == before
    finally:
        umount(view)
    assert line == (
        f"error: writing {view / 'hf'} failed (Read-only file system): nothing was changed there; "
        f"give OUT elsewhere: python scripts/export.py {view} OUT --format hf"
    )


def test_a_full_disk_mid_export_leaves_the_earlier_export_and_no_half_folder(gpt, tmp_path):
    """A 200 kB tmpfs holds one export of the run (124 kB) but not a second beside it: the second fails in one line
    naming the free space, the first is as it was, and nothing else is left on the disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not mount("-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        check(export(tmp_path, gpt, disk / "out"))
        before = snapshot(disk)
        line = one_line(export(tmp_path, gpt, disk / "out", "--max-shard-size", "40KB"))
        assert snapshot(disk) == before and [p.name for p in disk.iterdir()] == ["out"]
    finally:
        umount(disk)
    assert line.startswith(f"error: writing {disk / 'out'} failed (No space left on device; ") and line.endswith(
        " free on its file system): nothing was changed there; free space, or give OUT on another disk"
    )


def test_a_failure_between_two_folders_puts_the_first_back(tmp_path):
    """A LoRA export writes OUT and OUT-adapter: when the second cannot be put in place (here a mount point, which
    cannot be moved: EBUSY), the first is put back as it was; an exception inside the export leaves both too."""

    def write(folder: Path, text: str) -> str:
        for path in (folder, folder.with_name(folder.name + "-adapter")):
            path.mkdir()
            (path / "weights").write_text(text)
        return f"wrote {folder}"

    out = tmp_path / "out"
    assert write_folders(out, lambda f: write(f, "old")) == f"wrote {out}"
    (tmp_path / "out-adapter" / "weights").unlink()
    if not mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path / "out-adapter")):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        before = snapshot(tmp_path)
        with pytest.raises(UserError, match=f"^writing {out} failed \\(Device or resource busy\\): nothing was changed there"):
            write_folders(out, lambda f: write(f, "new"))
        assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out", "out-adapter"]
    finally:
        umount(tmp_path / "out-adapter")
    before = snapshot(tmp_path)
    with pytest.raises(ZeroDivisionError):
        write_folders(out, lambda f: write(f, "new") and 1 / 0)
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out", "out-adapter"]
