"""A step that never waits on the host (issue 27, items 9 and 5): no host read on a step that neither logs nor agrees,
on every engine; the guard's agreement is one copy back; throughput is counted on the host in the task's units.

Each layout is one warm launch of tests/sync_probe.py (train.py with every host read of each step counted by a
TorchFunctionMode; it says what counts): 4 tiny steps, logging and agreeing at the last only. Steps 1-3 must read
nothing (the pipeline's step 1 is torch's shape exchange between stages, done once); step 4 agrees with one copy back.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import WarmCmd, check, launch_env, read_metrics, run
from parallel_train.core.task import units_in
from parallel_train.errors import UserError
from parallel_train.observe.messages import train_line
from parallel_train.observe.perf import SYNC_DEBUG, sync_checked, sync_debug_mode
from parallel_train.tasks.registry import TASKS

STEPS = (
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=16",
    "train.batch_size=4",
    "train.max_steps=4",
    "train.warmup_steps=1",
    "train.lr_decay_steps=4",
    "train.log_interval=100",  # the last step only: it logs and agrees
    "eval.interval=0",
    "eval.iters=1",
    "checkpoint.interval=0",
    "tracker=none",
)
PADDED = ("data.format=instruction", "data.tokenizer=byte", "model.block_size=64")  # ignored targets: the count all-reduced
LAYOUTS = {
    "one_process": (1, ()),
    "ddp": (2, ()),
    "ddp_padded": (2, PADDED),
    "fsdp2": (2, ("parallel.dp_shard=2",)),
    "tp": (2, ("parallel.tp=2",)),
    # the GPT's experts and their balancing loss: counts all-reduced every micro-batch, read at log steps only
    "ddp_moe": (2, ("model.n_experts=4", "model.experts_per_token=2", "train.gradient_accumulation_steps=2")),
    "pipeline": (2, ("parallel.pipeline_stages=2", "parallel.microbatches=2")),
    # executor 1 (stages on devices of one process), untimed: the timeline only when asked for
    "pipeline_one_process": (
        1,
        ("parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]", "parallel.microbatches=2", "parallel.timeline=false"),
    ),
}


SECOND = {"ddp"}  # DDP's step without ignored targets: a second launch of the path ddp_moe runs by default (slow)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(k, marks=([pytest.mark.multiprocess] if n > 1 else []) + ([pytest.mark.slow] if k in SECOND else []))
        for k, (n, _) in LAYOUTS.items()
    ],
)
def test_no_host_read_on_a_step_that_neither_logs_nor_agrees(tmp_path, layout):
    nproc, keys = LAYOUTS[layout]
    if keys == PADDED:  # prompts the model is not taught (targets -100) and answers it is, padded to the block
        rows = [{"prompt": "Who art thou? " * (1 + i % 3), "completion": "A servant."} for i in range(40)]
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        keys = (*keys, f"data.path={tmp_path / 'rows.jsonl'}")
    probe = tmp_path / "reads"
    probe.mkdir()
    env = launch_env(tmp_path, SYNC_PROBE_OUT=str(probe), **{SYNC_DEBUG: "error"})
    r = check(run(WarmCmd(nproc, "tests/sync_probe.py", (*STEPS, *keys, f"output_dir={tmp_path / 'out'}")), env=env, timeout=240))
    assert f"notice: {SYNC_DEBUG}=error checks CUDA devices only; this run is on cpu: not checked" in r.output
    for rank in range(nproc):
        reads = {int(step): calls for step, calls in json.loads((probe / f"rank{rank}.json").read_text()).items()}
        quiet = (2, 3) if layout.startswith("pipeline") else (1, 2, 3)
        assert all(reads[step] == [] for step in quiet), f"rank {rank}: host reads in a step that neither logs nor agrees: {reads}"
        # The last step agrees: one collective, one copy back (and nothing else reads).
        assert len(reads[4]) == 1 and reads[4][0].startswith("tolist at parallel_train/guards.py"), reads[4]
    assert [r for r in read_metrics(tmp_path / "out") if r["kind"] == "train"][-1]["tokens_per_sec"] > 0
    if layout.startswith("pipeline"):  # the schedule picture is drawn only when the timeline is asked for
        assert (tmp_path / "out" / "pipeline_timeline.png").exists() == (layout == "pipeline")


def test_sync_debug_switch_is_checked_and_off_on_the_cpu(monkeypatch):
    """PARALLEL_TRAIN_SYNC_DEBUG (set by scripts/bench/gpu_bench.sh, gpu_pipeline_bench.sh and gpu_moe.sh): a wrong value is one
    line; on the CPU the switch is named and left off (set_sync_debug_mode is CUDA's)."""
    monkeypatch.delenv(SYNC_DEBUG, raising=False)
    assert sync_debug_mode(torch.device("cpu")) == (None, None)
    monkeypatch.setenv(SYNC_DEBUG, "loud")
    with pytest.raises(UserError, match=f"^{SYNC_DEBUG}='loud': expected warn or error"):
        sync_debug_mode(torch.device("cpu"))
    monkeypatch.setenv(SYNC_DEBUG, "error")
    mode, notice = sync_debug_mode(torch.device("cpu"))
    assert mode is None and "checks CUDA devices only" in notice
    assert sync_debug_mode(torch.device("cuda", 0)) == ("error", None)  # what a GPU run would set around its steps
    with sync_checked(None):  # off: nothing called
        pass
    for script in ("scripts/bench/gpu_bench.sh", "scripts/bench/gpu_pipeline_bench.sh", "scripts/bench/gpu_moe.sh"):
        text = open(os.path.join(os.path.dirname(__file__), "..", script)).read()
        assert f"export {SYNC_DEBUG}=" in text, script


def test_throughput_counts_the_tasks_units_on_the_host():
    """Samples for classification; tokens that are not padding for LM tasks (the attention mask, else the labels that
    count); a label column is never tokens. Counted from the CPU batch."""
    ids = torch.ones(2, 6, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    labels = torch.tensor([[5, 5, 5, -100, -100, -100], [-100, 5, 5, 5, 5, -100]])
    assert units_in(TASKS["causal-lm"], {"input_ids": ids, "attention_mask": mask, "labels": labels}) == 8
    assert units_in(TASKS["token-classification"], {"input_ids": ids, "labels": labels}) == 7  # no mask: labels that count
    assert units_in(TASKS["causal-lm"], (ids, labels)) == 7  # the template's tuples: their targets that count
    assert units_in(TASKS["sequence-classification"], {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}) == 2
    pixels = {"pixel_values": torch.zeros(3, 3, 4, 4), "labels": torch.tensor([0, 1, 0])}
    assert units_in(TASKS["image-classification"], pixels) == 3
    record = {"step": 1, "loss": 1.0, "lr": 1e-3, "step_time_s": 0.1, "data_time_frac": 0.0, "mfu": None}
    assert "| 12.5 samples/s |" in train_line({**record, "samples_per_sec": 12.5}, 10)
    assert "| 1,234 tok/s |" in train_line({**record, "tokens_per_sec": 1234.0}, 10)
