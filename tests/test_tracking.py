"""Trackers on real launches: wandb offline (no key, no network), tensorboard, none.

The wandb runs read back wandb's own offline run file (`run-<id>.wandb`, a LevelDB-style log of
protobuf records, the file `wandb sync` uploads) to check what would reach the server.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import matplotlib
import pytest
import yaml

from helpers import TINY, check, free_port, launch_env, read_metrics, run, warm_cmd
from parallel_train.checkpoint.writer import LISTING

pytestmark = pytest.mark.multiprocess

FEW = (*TINY, "train.max_steps=4", "train.lr_decay_steps=4", "eval.interval=2", "checkpoint.interval=2")
RUN_FILES = {"checkpoints", "config.yaml", "metrics.jsonl", "metrics.png", "model.safetensors", "summary.json", "vocab.json", LISTING}


def no_credentials_env(tmp_path: Path) -> dict[str, str]:
    """WANDB_MODE unset, no API key, and a HOME without ~/.netrc: what a fresh clone sees."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = launch_env(tmp_path, HOME=str(home), MPLCONFIGDIR=matplotlib.get_cachedir())
    env.pop("WANDB_MODE")
    for key in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_PROJECT", "NETRC"):
        env.pop(key, None)
    return env


def wandb_records(run_file: Path) -> list:
    """Decode a .wandb file: 7-byte header, then 32 KiB blocks of (crc, length, type) chunks."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    records, pos, block, pending = [], 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a block too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding up to the end of the block
            pos += block - pos % block if pos % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start a record, MIDDLE/LAST extend it
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def records_of(records: list, kind: str) -> list:
    return [r for r in records if r.WhichOneof("record_type") == kind]


def history(records: list) -> dict[tuple[int, str], float]:
    """(step, key) -> value of every wandb.log call in the run file."""
    out: dict[tuple[int, str], float] = {}
    for r in records_of(records, "history"):
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        out.update({(items["_step"], k): v for k, v in items.items() if not k.startswith("_")})
    return out


def expected_tracker_values(metrics: list[dict]) -> dict[tuple[int, str], float]:
    """What the trackers must hold: every number of metrics.jsonl, as train/<key> or val/<key>."""
    out: dict[tuple[int, str], float] = {}
    for r in metrics:
        prefix = "val/" if r["kind"] == "eval" else "train/"
        out.update(
            {
                (r["step"], prefix + k.removeprefix("val_")): v
                for k, v in r.items()
                if k not in ("step", "kind") and isinstance(v, (int, float))
            }
        )
    return out


def test_wandb_offline_without_credentials_on_two_processes_then_resume(tmp_path):
    out, env = tmp_path / "run", no_credentials_env(tmp_path)
    first = check(run(warm_cmd(2, *FEW, "tracker=wandb", f"output_dir={out}"), env=env))  # accelerate launch: test_topologies

    # One line says why it is offline; at the end, how to upload. Both once (main process only).
    assert first.output.count("no credentials found") == 1, first.output
    sync_lines = [line for line in first.output.splitlines() if "wandb sync " in line]
    assert len(sync_lines) == 1, first.output
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, run_dirs  # only the main process created a run
    assert sync_lines[0].endswith(f"wandb sync {run_dirs[0]}")
    assert RUN_FILES | {"wandb"} == {p.name for p in out.iterdir()}
    assert not (Path(env["HOME"]) / ".cache" / "wandb").exists() and not (Path(env["HOME"]) / "wandb").exists()

    run_id = json.loads((out / "checkpoints" / "step_0000004" / "trainer_state.json").read_text())["run_id"]
    records = wandb_records(next(run_dirs[0].glob("run-*.wandb")))
    (run_record,) = records_of(records, "run")
    assert run_record.run.run_id == run_id and run_dirs[0].name.endswith(run_id)
    # The resolved config, section by section, as config.yaml holds it.
    logged = {item.key: json.loads(item.value_json) for r in records_of(records, "config") for item in r.config.update}
    saved = yaml.safe_load((out / "config.yaml").read_text())
    for section in ("model", "data", "train", "eval", "checkpoint", "parallel"):
        assert logged[section] == saved[section], section
    assert logged["tracker"] == "wandb" and logged["output_dir"] == str(out)
    assert history(records) == expected_tracker_values(read_metrics(out))

    # Resume from the step-2 checkpoint on one process: the same wandb run id continues.
    (out / "checkpoints" / "step_0000004").rename(tmp_path / "moved_away")
    second = check(run(warm_cmd(1, *FEW, "tracker=wandb", f"output_dir={out}"), env=env))
    assert "resumed from" in second.output and second.output.count("wandb sync ") == 1
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(run_id) for d in run_dirs)
    resumed = wandb_records(next(run_dirs[1].glob("run-*.wandb")))
    assert records_of(resumed, "run")[0].run.run_id == run_id
    assert {step for step, _ in history(resumed)} == {3, 4}  # the steps trained after the checkpoint


def test_tensorboard_holds_the_same_metrics_as_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    check(run(warm_cmd(2, *FEW, "tracker=tensorboard", f"output_dir={out}"), env=launch_env(tmp_path)))
    assert RUN_FILES | {"tensorboard"} == {p.name for p in out.iterdir()}
    event_files = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files  # one writer: the main process
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert logged == pytest.approx(expected_tracker_values(read_metrics(out)), rel=1e-6)  # float32 in event files
    # The resolved config is logged too, flattened: tensorboard's hparams take scalars only.
    hparams = yaml.safe_load(next((out / "tensorboard").glob("*/hparams.yml")).read_text())
    assert hparams["model.n_layer"] == 2 and hparams["output_dir"] == str(out)


def test_tracker_none_writes_nothing_extra(tmp_path):
    out = tmp_path / "run"
    result = check(run(warm_cmd(1, *FEW, "tracker=none", f"output_dir={out}"), env=launch_env(tmp_path)))
    assert RUN_FILES == {p.name for p in out.iterdir()}
    assert "tracker none" in result.output and "wandb" not in result.output


@pytest.mark.slow
def test_wandb_with_a_key_but_no_reachable_server_logs_offline_at_once(tmp_path):
    out, env = tmp_path / "run", no_credentials_env(tmp_path)
    port = free_port()  # nothing listens there: wandb itself would retry for minutes, then fail
    env.update(WANDB_API_KEY="0" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{port}")
    result = check(run(warm_cmd(1, *FEW, "tracker=wandb", f"output_dir={out}"), env=env, timeout=120))
    assert f"wandb: cannot reach 127.0.0.1:{port}, logging offline" in result.output
    assert "tracker wandb (offline)" in result.output and len(list((out / "wandb").glob("offline-run-*"))) == 1
