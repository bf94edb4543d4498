"""Checkpoints that scale: every rank writes its own part, saves can overlap training, any topology loads them,
earlier checkpoints still load, the export equals the run's weights, and no file of a checkpoint can run code.

Real processes (gloo), real kills. Covered elsewhere: bit-identical resume after SIGKILL and after a kill during a
synchronous save, 2 processes -> 1 process (tests/test_reliability.py); the bad-input catalogue (test_bad_inputs.py).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import PYTHON, TINY, WarmCmd, check, launch_env, run, summary, train_losses, warm_cmd, warm_script
from parallel_train import faults
from parallel_train.checkpoint import checkpointer
from parallel_train.checkpoint.export import index_files, load_weights, whole_tensor
from parallel_train.checkpoint.manifest import MANIFEST, sha256
from parallel_train.errors import UserError

pytestmark = pytest.mark.multiprocess

BASE = (*TINY, "model.dropout=0.1")  # 6 steps, checkpoints at 3 and 6, dropout on (per-rank RNG must be restored)


def same_bytes(a: Path, b: Path) -> bool:
    return (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def ref1(tmp_path_factory) -> Path:
    """One process, synchronous saves, never interrupted."""
    tmp = tmp_path_factory.mktemp("ref1")
    check(run(warm_cmd(1, *BASE, f"output_dir={tmp / 'run'}"), env=launch_env(tmp)))
    return tmp / "run"


# ---------------------------------------------------------------- topology moves


def load_on_one_process(folder: Path, model: torch.nn.Module, expected_file: Path) -> torch.optim.Optimizer:
    """Load a checkpoint into a plain model and a fresh AdamW; every tensor must equal the whole state."""
    from parallel_train.checkpoint.named_state import RankState, rank_tensors

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpointer.load_rank_state(folder, RankState(model.state_dict(), model, optimizer))
    loaded, _ = rank_tensors(RankState(model.state_dict(), model, optimizer))
    expected = load_file(str(expected_file))
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    exported = load_weights(folder)  # what scripts/export.py writes: the model's whole weights
    assert sorted(exported) == sorted(model.state_dict()) and all(torch.equal(exported[k], expected[f"model/{k}"]) for k in exported)
    return optimizer


def test_fsdp2_and_tensor_parallel_checkpoints_written_by_each_rank_load_on_one_process(tmp_path):
    """FSDP2 over 2 gloo ranks writes its shards (tests/fsdp_worker.py: sync and background saves, 2 -> 2 exact), and
    so does a tensor-parallel MLP; here one process loads each checkpoint into a plain model and optimizer."""
    from fsdp_worker import ADAM, build, tensor_parallel_mlp

    out = tmp_path / "fsdp"
    cmd = WarmCmd(2, "tests/fsdp_worker.py", (str(out),))  # 2 ranks forked warm (tests/warm_launcher.py)
    result = check(run(cmd, env=launch_env(tmp_path), timeout=300))
    assert "fsdp rank 0/2 ok" in result.stdout and "tensor parallel rank 1/2 ok" in result.stdout
    optimizer = load_on_one_process(out / "sync" / checkpointer.checkpoint_name(2), build(seed=3), out / "expected.safetensors")
    assert optimizer.param_groups[0]["lr"] == ADAM["lr"]
    load_on_one_process(out / "tp" / checkpointer.checkpoint_name(1), tensor_parallel_mlp(), out / "tp_expected.safetensors")


def test_ddp_background_saves_resume_as_a_two_stage_pipeline(tmp_path):
    """2-process DDP with checkpoint.async=true: both ranks write shards; its step-3 checkpoint resumes as a
    2-stage pipeline (each stage loads its own parameters by name) with the same global batch, and, dropout off,
    steps 4-6 give the DDP run's losses and final weights (1e-5)."""
    ddp, pipe = tmp_path / "ddp", tmp_path / "pipe"
    check(run(warm_cmd(2, *TINY, "checkpoint.async=true", f"output_dir={ddp}"), env=launch_env(tmp_path)))
    saved = ddp / "checkpoints" / "step_0000003"
    files = json.loads((saved / MANIFEST).read_text())["files"]
    assert {meta["rank"] for name, meta in files.items() if name.startswith("shards/")} == {0, 1}, files
    assert summary(ddp)["checkpoint_blocking_s"] > 0
    pipeline = ("train.batch_size=8", "parallel.pipeline_stages=2", "parallel.microbatches=2", f"resume={saved}", f"output_dir={pipe}")
    moved = check(run(warm_cmd(2, *TINY, *pipeline), env=launch_env(tmp_path)))
    assert f"resumed from {saved} at step 3" in moved.output, moved.output[-3000:]
    files = json.loads((pipe / "checkpoints" / "step_0000006" / MANIFEST).read_text())["files"]
    assert {meta["rank"] for name, meta in files.items() if name.startswith("shards/")} == {0, 1}  # each stage its own
    got, want = train_losses(pipe), train_losses(ddp)
    assert sorted(got) == [4, 5, 6] and all(got[s] == pytest.approx(want[s], abs=1e-5) for s in got), (got, want)
    a, b = load_file(str(pipe / "model.safetensors")), load_file(str(ddp / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in b:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)


# ---------------------------------------------------------------- background saves


def test_kill_during_a_background_write_leaves_the_previous_checkpoint(ref1, tmp_path):
    out = tmp_path / "run"
    env = launch_env(tmp_path, **{faults.ENV: "kill_in_save@6"})
    killed = run(warm_cmd(1, *BASE, "checkpoint.async=true", f"output_dir={out}"), env=env)
    assert killed.returncode == -signal.SIGKILL and "SIGKILL while saving checkpoint 6 (in the background)" in killed.output
    root = out / "checkpoints"
    assert list((root / ".tmp-step_0000006" / "shards").glob("*.safetensors")) and not (root / ".tmp-step_0000006" / MANIFEST).exists()
    assert [p.name for p in checkpointer.list_checkpoints(root)] == ["step_0000003"]
    resumed = check(run(warm_cmd(1, *BASE, "checkpoint.async=true", f"output_dir={out}"), env=launch_env(tmp_path)))
    assert "resumed from" in resumed.output and "step_0000003" in resumed.output
    assert same_bytes(out, ref1)  # background saves hold exactly what synchronous ones do
    assert summary(out)["checkpoint_blocking_s"] > 0 and not list(root.glob(".tmp-*"))


def test_a_kill_right_before_the_manifest_leaves_the_old_set_of_checkpoints(ref1, tmp_path):
    """SIGKILL in rank 0's seal of checkpoint 6, right before its manifest is written: the folder is renamed to step_*
    only after the manifest, so checkpoints/ lists exactly the old set (step 3), each verifies, and resume=auto
    continues from step 3 to the weights of the run never killed. (Renamed first, a step_6 without manifest is listed.)"""
    out = tmp_path / "run"
    killed = run(warm_cmd(1, *BASE, f"output_dir={out}"), env=launch_env(tmp_path, **{faults.ENV: "kill_in_seal@6"}))
    assert killed.returncode == -signal.SIGKILL and "SIGKILL before the manifest of checkpoint 6" in killed.output, killed.output[-2000:]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003"]
    assert all(checkpointer.verify(p) is None for p in checkpointer.list_checkpoints(root))
    assert not (root / ".tmp-step_0000006" / MANIFEST).exists()  # killed where it was meant to be
    resumed = check(run(warm_cmd(1, *BASE, f"output_dir={out}"), env=launch_env(tmp_path)))
    assert f"resumed from {root / 'step_0000003'} at step 3" in resumed.output and "warning: skipping" not in resumed.output
    assert same_bytes(out, ref1) and not list(root.glob(".tmp-*"))


# ---------------------------------------------------------------- checkpoints of earlier versions


def to_earlier_format(folder: Path) -> None:
    """Rewrite a checkpoint the way this template wrote them before sharded saves: whole model.safetensors,
    optimizer.safetensors keyed `name/state`, a manifest without ranks."""
    shards = sorted((folder / "shards").glob("*.safetensors"))
    save_file(load_weights(folder), str(folder / "model.safetensors"))
    save_file({k: whole_tensor(e) for k, e in index_files(shards, prefix="optimizer/").items()}, str(folder / "optimizer.safetensors"))
    shutil.rmtree(folder / "shards")
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(folder.iterdir()) if p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line(ref1, tmp_path):
    """Loading the format before sharded saves was dropped (docs/reliability.md): one line says so, nothing changes."""
    step3 = tmp_path / "run" / "checkpoints" / "step_0000003"
    shutil.copytree(ref1 / "checkpoints" / "step_0000003", step3)
    to_earlier_format(step3)
    r = run(warm_cmd(1, *BASE, f"resume={step3}", f"output_dir={tmp_path / 'new'}"), env=launch_env(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.output, r.output[-2000:]
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        f"error: resume: {step3} was written by an earlier version of this template (one whole model.safetensors, no shards/), "
        "which this version no longer reads; continue it with the version that wrote it"
    ]


# ---------------------------------------------------------------- export


def test_export_script_writes_the_runs_final_weights(ref1, tmp_path):
    check(run(warm_script("scripts/export.py", str(ref1), str(tmp_path / "one")), env=launch_env(tmp_path), timeout=120))
    assert same_bytes(tmp_path / "one", ref1)  # the run's model.safetensors is the export of its last checkpoint
    step3 = ref1 / "checkpoints" / "step_0000003"
    check(
        run(
            warm_script("scripts/export.py", str(step3), str(tmp_path / "sharded"), "--max-shard-size", "40KB"),
            env=launch_env(tmp_path),
            timeout=120,
        )
    )
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "sharded" / f).stat().st_size <= 40_000 + 8_000 for f in files)
    weights = {k: v for f in files for k, v in load_file(str(tmp_path / "sharded" / f)).items()}
    expected = load_weights(step3)
    assert sorted(weights) == sorted(index["weight_map"]) == sorted(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


# ---------------------------------------------------------------- no code from a checkpoint


class Payload:
    """Unpickling this runs `touch MARKER`: if the marker appears, a checkpoint executed code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def resume_in_process(out: Path, capsys) -> tuple[str, list[str]]:
    """What `python train.py ... resume=auto` does, in this process (a finished run resumes in about a second):
    ("ok" | the one-line error, the warning lines printed)."""
    from parallel_train.cli import main

    try:
        outcome = "ok" if main([*BASE, f"output_dir={out}", "resume=auto"]) == 0 else "failed"
    except UserError as e:
        outcome = str(e)
    printed = capsys.readouterr()
    return outcome, [line for line in (printed.out + printed.err).splitlines() if line.startswith("warning:")]


def plant(folder: Path, name: str, marker: Path, protocol: int, rehash: bool) -> None:
    """Replace one file by a pickle that would create `marker`; with `rehash`, rewrite the manifest to match."""
    (folder / name).write_bytes(pickle.dumps(Payload(marker), protocol=protocol))
    if rehash and name != MANIFEST:
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["files"][name].update(size=(folder / name).stat().st_size, sha256=sha256(folder / name))
        (folder / MANIFEST).write_text(json.dumps(manifest))


def sweep(ref: Path, tmp_path: Path, capsys, variants: list[tuple[int, bool]]) -> None:
    newest = ref / "checkpoints" / "step_0000006"
    names = sorted(p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file())
    assert {"manifest.json", "shards/rank00000-000.safetensors", "optimizer.json", "trainer_state.json", "rng_rank0.safetensors"} <= set(
        names
    )
    for name in names:
        for protocol, rehash in variants:
            case = f"{name}, protocol {protocol}{', manifest rewritten' if rehash else ''}"
            out, marker = tmp_path / f"case{len(list(tmp_path.iterdir()))}", tmp_path / "pwned"
            shutil.copytree(ref, out)
            plant(out / "checkpoints" / "step_0000006", name, marker, protocol, rehash)
            outcome, warnings = resume_in_process(out, capsys)
            assert not marker.exists(), f"{case}: a checkpoint executed code"
            if outcome == "ok":  # it fell back to the older checkpoint with one warning, or never read the file
                fell_back = len(warnings) == 1 and "skipping checkpoint" in warnings[0] and "step_0000006" in warnings[0]
                assert fell_back or (rehash and name == "config.yaml" and not warnings), f"{case}: {warnings}"
            else:  # stopped with one line naming the file
                assert "\n" not in outcome and Path(name).name in outcome, f"{case}: {outcome}"
            shutil.rmtree(out)


def test_a_pickle_planted_in_any_file_of_a_checkpoint_never_runs(ref1, tmp_path, capsys):
    """Every file of the newest checkpoint in turn replaced by a malicious pickle, the manifest rewritten to match (a
    careful attacker: every file is read, as its hash matches: a one-line error, or the file is never read). With the
    manifest as written (the hash catches it: resume falls back to step 3 with one warning; the same check as
    tests/test_run_edges.py's flipped byte) and every protocol: slow, below."""
    sweep(ref1, tmp_path, capsys, [(0, True)])


@pytest.mark.slow
def test_planted_pickles_of_every_protocol_never_run(ref1, tmp_path, capsys):
    sweep(ref1, tmp_path, capsys, [(p, rehash) for p in range(pickle.HIGHEST_PROTOCOL + 1) for rehash in (False, True)])


@pytest.mark.slow
def test_bench_checkpoint_script_end_to_end(tmp_path):
    """scripts/bench/checkpoint.py on a tiny model: every row of the table, and train.py's summary figures."""
    out = tmp_path / "bench"
    cmd = [PYTHON, "scripts/bench/checkpoint.py", "--layers", "1", "--width", "64", "--vocab", "64", "--repeats", "1", "--saves", "1"]
    check(run([*cmd, "--out", str(out)], env=launch_env(tmp_path), timeout=900))
    table = (out / "bench_checkpoint.md").read_text()
    for row in (
        "| DDP (replicated) | gathered |",
        "| DDP (replicated) | async |",
        "| FSDP2 (sharded) | sharded |",
        "| true | 2 |",
        "| false | 1 |",
    ):
        assert row in table, table
