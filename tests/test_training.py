"""Real training runs: one process, two gloo processes, accumulation, resume, precision.

One module-scoped set of runs serves several tests (each launch costs seconds): the same global batch
of 8 as 1 process x 8, 2 processes x 4 and 1 process x 4 micro-steps x 2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import TINY, accelerate_cmd, check, launch_env, read_metrics, run, summary, train_losses, warm_cmd

pytestmark = pytest.mark.multiprocess

# eval: 3 global batches of eval.batch_size's default, train.batch_size x data-parallel ranks: 8 for 1 x 8 and for
# 2 x 4, so both evaluate the same 24 samples (each rank its slice of every batch).
GLOBAL8 = (*TINY, "train.learning_rate=1e-2", "eval.iters=3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    env = launch_env(tmp)
    out = {name: tmp / name for name in ("single", "ddp", "accum", "resumed")}
    check(run(warm_cmd(1, *GLOBAL8, "train.batch_size=8", f"output_dir={out['single']}"), env=env))
    # a real `accelerate launch --config_file accelerate_configs/multi_cpu.yaml` (docs/topologies.md)
    ddp = check(run(accelerate_cmd("multi_cpu", *GLOBAL8, "train.batch_size=4", f"output_dir={out['ddp']}"), env=env))
    check(run(warm_cmd(1, *GLOBAL8, "train.batch_size=2", "train.gradient_accumulation_steps=4", f"output_dir={out['accum']}"), env=env))
    # Stop after 3 steps, then continue to 6 with resume=auto (the default).
    check(run(warm_cmd(1, *GLOBAL8, "train.batch_size=8", "train.max_steps=3", f"output_dir={out['resumed']}"), env=env))
    resumed = check(run(warm_cmd(1, *GLOBAL8, "train.batch_size=8", f"output_dir={out['resumed']}"), env=env))
    return out, {"ddp": ddp, "resumed": resumed}


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def test_single_process_run_writes_every_output_and_learns(runs):
    out = runs[0]["single"]
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "model.safetensors", "vocab.json"):
        assert (out / name).is_file(), name
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["batch_size"] == 8
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert {"step", "loss", "lr", "tokens_per_sec", "step_time_s", "data_time_frac", "mfu"} <= set(train[0])
    assert [r["step"] for r in evals] == [3, 6] and all({"val_loss", "val_accuracy"} <= set(r) for r in evals)
    assert 0 < evals[-1]["val_accuracy"] < 1
    assert train[-1]["loss"] < train[0]["loss"]
    s = summary(out)
    assert s["steps"] == 6 and s["world_size"] == 1 and s["distributed_type"] == "NO"
    assert s["final_train_loss"] == train[-1]["loss"] and s["final_val_loss"] == evals[-1]["val_loss"]
    assert s["best_val_loss"] == min(r["val_loss"] for r in evals)
    for key in ("tokens_per_sec", "wall_time_s", "time_to_first_step_s", "peak_memory_mb"):
        assert s[key] > 0
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_0000003", "step_0000006"]
    # Canonical names: exactly the parameters of the plain model.
    assert "blocks.0.attn.q.weight" in weights(out) and not any(k.startswith("module.") for k in weights(out))


def test_two_gloo_processes_form_one_ddp_group(runs):
    out, logs = runs
    s = summary(out["ddp"])
    assert s["world_size"] == 2 and s["distributed_type"] == "MULTI_CPU"
    assert "2 processes (MULTI_CPU" in logs["ddp"].output and "backend gloo" in logs["ddp"].output
    assert logs["ddp"].output.count("[parallel_train] done") == 1  # only the main process reports


def test_two_processes_x_batch_4_equal_one_process_x_batch_8(runs):
    out = runs[0]
    single, ddp = train_losses(out["single"]), train_losses(out["ddp"])
    assert single.keys() == ddp.keys()
    for step in single:
        assert ddp[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)
    lrs = {name: [r["lr"] for r in read_metrics(out[name]) if r["kind"] == "train"] for name in ("single", "ddp")}
    assert lrs["single"] == lrs["ddp"]  # the scheduler steps once per optimizer step, whatever the world size
    # The same validation samples by default (eval.batch_size = batch_size x data-parallel ranks = 8 on both).
    assert summary(out["ddp"])["final_val_loss"] == pytest.approx(summary(out["single"])["final_val_loss"], rel=1e-5)
    # Accuracy is a ratio of sums over the eval set: the same whatever the ranks.
    assert summary(out["ddp"])["final_val_metrics"]["val_accuracy"] == summary(out["single"])["final_val_metrics"]["val_accuracy"]
    a, b = weights(out["single"]), weights(out["ddp"])
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4)  # Adam amplifies float noise on near-zero grads


def test_accumulation_4_x_batch_2_equals_batch_8(runs):
    out = runs[0]
    single, accum = train_losses(out["single"]), train_losses(out["accum"])
    for step in single:
        assert accum[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)
    a, b = weights(out["single"]), weights(out["accum"])
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4)  # Adam amplifies float noise on near-zero grads


def test_resume_continues_the_step_count_exactly(runs):
    out, logs = runs
    assert "resumed from" in logs["resumed"].output and "at step 3" in logs["resumed"].output
    assert sorted(train_losses(out["resumed"])) == [1, 2, 3, 4, 5, 6]
    assert train_losses(out["resumed"]) == train_losses(out["single"])
    a, b = weights(out["single"]), weights(out["resumed"])
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical to the uninterrupted run


def test_seed_mlp_example_on_two_processes(tmp_path):
    # Two --config files merge in order, the later one winning; the start banner names both.
    (tmp_path / "two_processes.yaml").write_text("train:\n  batch_size: 32\n  max_steps: 20\n")
    out = tmp_path / "out"
    r = check(
        run(
            # model.n_embd is GPT's key: the MLP ignores it (one notice) instead of failing on GPT's n_head rule
            warm_cmd(
                2,
                "--config",
                "configs/seed_mlp.yaml",
                "--config",
                str(tmp_path / "two_processes.yaml"),
                "model.n_embd=130",
                f"output_dir={out}",
            ),
            env=launch_env(tmp_path),
        )
    )
    s = summary(out)
    assert s["world_size"] == 2 and s["steps"] == 20
    losses = train_losses(out)
    assert losses[20] < losses[10]
    assert "2 processes (MULTI_CPU" in r.output and "engine: data parallel" in r.output
    assert f"config configs/seed_mlp.yaml + {tmp_path / 'two_processes.yaml'} |" in r.output
    assert r.stderr.count("notice: ignoring model.n_embd (a key of model.name=gpt, not of model.name=mlp)") == 1


def test_bf16_and_fp16_train_and_an_fp16_overflow_is_the_scalers_not_a_fault(tmp_path):
    """bf16 autocasts; fp16 scales the loss (parallel/precision.py). A forced overflow (inf gradients in step 2's first
    micro-batch, the loss finite) is skipped by the scaler, which lowers its scale, and with the default
    train.max_skipped_steps=0 the run goes on: the guard does not count it as a non-finite step."""
    r = check(run(warm_cmd(1, *TINY, "train.mixed_precision=bf16", f"output_dir={tmp_path / 'bf16'}"), env=launch_env(tmp_path)))
    assert summary(tmp_path / "bf16")["mixed_precision"] == "bf16" and "precision bf16" in r.output
    out = tmp_path / "fp16"
    env = launch_env(tmp_path, ACCELERATE_MIXED_PRECISION="fp16", PARALLEL_TRAIN_FAULT="overflow@2")
    r = check(run(warm_cmd(1, *TINY, "train.gradient_accumulation_steps=2", f"output_dir={out}"), env=env))
    assert "[fault] inf gradients at step 2" in r.output and "precision fp16" in r.output
    s = summary(out)
    assert s["mixed_precision"] == "fp16" and s["skipped_by_scaler_steps"] == 1 and s["steps"] == 6
    records = {m["step"]: m for m in read_metrics(out) if m["kind"] == "train"}
    assert records[1]["skipped_by_scaler"] == 0 and records[2]["skipped_by_scaler"] == 1
    assert all(math.isfinite(m["loss"]) for m in records.values())
    scaler = json.loads((out / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())["grad_scaler"]
    assert scaler["scale"] == 2.0**15  # halved once from 2**16 by the overflow


def test_cpu_flag_that_starts_one_process_is_refused(tmp_path):
    from helpers import ACCELERATE

    r = run([ACCELERATE, "launch", "--cpu", "--num_processes", "2", "train.py", *TINY, f"output_dir={tmp_path}"], env=launch_env(tmp_path))
    assert r.returncode != 0, r.output
    assert "error: the launcher was asked for 2 processes but 1 formed the process group" in r.output, r.output[-3000:]


def test_evaluation_before_the_first_log_step(tmp_path):
    """eval.interval below train.log_interval: the eval line has no train loss yet and says so."""
    out = tmp_path / "run"
    result = check(
        run(
            warm_cmd(1, *TINY, "train.max_steps=2", "eval.interval=1", "train.log_interval=5", f"output_dir={out}"),
            env=launch_env(tmp_path),
        )
    )
    assert "step 1: train loss n/a, val loss" in result.output and summary(out)["final_val_loss"] > 0
