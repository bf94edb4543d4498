"""The memory estimator against measured runs: each rank's estimate within 0.9-1.1 of its measured peak.

The measurement is scripts/bench/memory_matrix.py's (its table in docs/BENCHMARKS.md covers every CPU layout): each
rank's peak resident memory over its second optimizer step, with freed memory handed back at once
(scripts/bench/rank_peak.py), less that of a tiny model of the same layout; the estimate is the estimator's total,
less its total for the tiny model. Here a few cells, on a smaller model than the table's and forked from the warm
launcher, so that the default suite stays fast; the rest of the layouts under -m slow.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from helpers import REPO, WarmCmd, check, launch_env, run

sys.path.insert(0, str(REPO / "scripts" / "bench"))
import memory_matrix  # noqa: E402

# About 3.4M parameters (54 MB of state) and 40-60 MB of activations: far above the measurement's noise (about 1 MB).
SMALL = ("model.n_layer=4", "model.n_embd=256", "model.n_head=4", "model.block_size=128", "train.batch_size=8", "model.vocab_size=256")


def warm(tmp_path):
    def launcher(nproc: int, script: str, args: list[str], env: dict[str, str]) -> None:
        check(run(WarmCmd(nproc, script, tuple(args)), env=launch_env(tmp_path, **{k: env[k] for k in ("RANK_PEAK_DIR",)}), timeout=120))

    return launcher


def ratios(tmp_path, cell_id: str, folders: dict[str, str] | None = None, small: bool = True) -> list[float]:
    cell = memory_matrix.CELLS[cell_id]
    if small and cell.model == memory_matrix.GPT:
        cell = replace(cell, model=SMALL)
    ranks = memory_matrix.run_cell(cell, tmp_path, folders or {}, warm(tmp_path))
    return [r["estimated"] / r["measured"] for r in ranks]


@pytest.mark.multiprocess
@pytest.mark.parametrize("cell_id", ["one-op", "pp2-1f1b"])
def test_estimate_is_within_ten_percent_of_each_ranks_measured_peak(tmp_path, cell_id):
    """Selective checkpointing in one process and a 2-stage 1F1B pipeline (its two ranks hold different stages,
    micro-batches in flight and receive buffers): every rank's estimate / measured in 0.9-1.1."""
    got = ratios(tmp_path, cell_id)
    assert all(0.9 <= x <= 1.1 for x in got), (cell_id, got)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cell_id",
    [
        "one-full",
        "ddp2",
        "fsdp2",
        "tp2",
        "dp2xtp2",
        "pp4-gpipe",
        "pp4-interleaved1f1b",
        "pp2xtp2-1f1b",
        "hf-pp2xtp2-1f1b",
        "lora-one",
        "lora-fsdp2",
        "tp2-bf16",
        "pp2-1f1b-bf16",
        "bert-cls-fsdp2",
        "cp2",
        "cp2xfsdp2",
        "cp2-full",
        "ep2",
        "ep2xfsdp2",
        "ep2xfsdp2-full",
        "hf-moe-fsdp2",
        "hf-moe-ep2",
    ],
)
def test_more_layouts_are_within_ten_percent(tmp_path, cell_id):
    """The rest of the table's kinds: full checkpointing, DDP, FSDP2, tensor parallel, DP x TP, 4-stage pipelines, TP inside
    pipeline stages (sequence and loss parallel there; GPT and a Hub Llama), LoRA, bf16 through the layers of tensor
    parallel and of pipeline stages (FSDP2's policy over one data-parallel rank), a BERT classifier on dict batches under FSDP2,
    context parallel (cp=2, cp=2 x dp_shard=2, cp=2 fully checkpointed), the GPT's experts under expert parallel (ep=2;
    ep=2 x edp 2 over 4 processes, also fully checkpointed), a Hub Qwen3-MoE under FSDP2 and under ep=2;
    on the table's own models (the small one leaves a 4-stage rank a few MB, within the measurement's noise, and has
    too few layers for 4 ranks of two stages)."""
    folders = memory_matrix.write_folders(tmp_path / "models", [cell_id])
    got = ratios(tmp_path, cell_id, folders, small=False)
    assert all(0.9 <= x <= 1.1 for x in got), (cell_id, got)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_context_parallel_halves_rank_0s_activation_peak(tmp_path):
    """parallel.cp=2: what rank 0's step adds at its peak above the weights and optimizer state (activations, scratch,
    FSDP2's gathered blocks; rank_peak.py's peak - start, less the tiny model's) is about half of one process's at the
    same sequence length (a little more: FSDP2's gathered weights, which one process has not), and the estimator's
    figure for it is within 0.9-1.1 of each."""
    one, cp = (
        memory_matrix.run_cell(replace(memory_matrix.CELLS[c], model=SMALL), tmp_path / c, {}, warm(tmp_path)) for c in ("one", "cp2")
    )
    assert 0.45 <= cp[0]["step"] / one[0]["step"] <= 0.65, (cp[0], one[0])
    assert all(0.9 <= r["step_estimated"] / r["step"] <= 1.1 for r in (*one, *cp)), (one, cp)
