"""Expert parallelism (`parallel.ep`, parallel/expert_parallel.py): the layout and its refusals in process; under -m slow,
2 processes with ep=2 against one process (losses, balancing loss, expert load, final weights), what each rank's
checkpoint part holds, and resuming an ep=2 checkpoint on one process and the other way round."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import check, launch_env, read_metrics, run, warm_cmd
from parallel_train.config.load import load_config
from parallel_train.errors import UserError
from parallel_train.parallel.mesh import resolve_layout
from test_moe import RUN, assert_same

EP = ("model.n_experts=4", "model.experts_per_token=2")


def layout(world: int, *keys: str):
    cfg, _ = load_config([*EP, *keys])
    return resolve_layout(cfg, world, env={})


def test_ep_takes_the_fsdp2_ranks_and_refuses_what_it_does_not_build():
    got = layout(2, "parallel.ep=2")  # the dp_shard ranks fill the world, as ep asks
    assert (got.dp_shard, got.ep, got.dp_replicate, got.sharded) == (2, 2, 1, True) and got.describe() == "dp_shard 2 x ep 2"
    assert layout(2, "parallel.ep=2", "parallel.dp_shard=2").ep == 2
    for keys, words in [
        (("parallel.ep=2", "model.n_experts=0"), "parallel.ep=2: expert parallelism splits the GPT's or a Hugging Face MoE's experts"),
        (("parallel.ep=2", "model.n_experts=3"), "not divisible by parallel.ep=2"),
        (("parallel.ep=2", "parallel.tp=2"), "parallel.tp=2"),
    ]:
        with pytest.raises(UserError, match=words):
            load_config([*EP, *keys])
    got = layout(4, "parallel.ep=2", "parallel.dp_shard=4")  # the experts FSDP-sharded over the 2 "edp" ranks EP leaves
    assert (got.dp_shard, got.ep) == (4, 2)
    for world, keys in [
        (2, ("parallel.ep=4", "parallel.dp_shard=2")),
        (4, ("parallel.ep=2", "parallel.dp_replicate=2", "parallel.dp_shard=2")),
    ]:
        with pytest.raises(UserError, match="expert parallelism runs over the FSDP2 ranks alone"):
            layout(world, *keys)


LAUNCHES = {
    "ref": (1, ()),
    "ep2": (2, ("train.batch_size=2", "parallel.ep=2")),
    "ep2_to_1": (1, ("resume={ep2}/checkpoints/step_0000003",)),
    # ep=2 x 2 "edp" ranks: each expert weight cut by expert over ep, then by its second dim over edp (4 processes)
    "ep2_edp2": (4, ("train.batch_size=1", "parallel.ep=2", "parallel.dp_shard=4")),
    "ep2_edp2_to_1": (1, ("resume={ep2_edp2}/checkpoints/step_0000003",)),
    "1_to_ep2": (2, ("train.batch_size=2", "parallel.ep=2", "resume={ref}/checkpoints/step_0000003")),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """name -> its output folder, each launch run once per module."""
    outs: dict[str, object] = {}

    def get(name: str):
        if name not in outs:
            n, extra = LAUNCHES[name]
            folders = {k: get(k) for k in ("ep2", "ep2_edp2", "ref") if any("{" + k + "}" in e for e in extra)}
            out = tmp_path_factory.mktemp(name)
            check(run(warm_cmd(n, *RUN, *(e.format(**folders) for e in extra), f"output_dir={out / 'out'}"), env=launch_env(out)))
            outs[name] = out / "out"
        return outs[name]

    return get


def train_records(folder) -> list[dict]:
    return [r for r in read_metrics(folder) if r["kind"] == "train"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ep2", pytest.param("ep2_edp2", marks=pytest.mark.slow)])  # ep2: the layout's default test
def test_ep2_equals_one_process_with_the_balancing_loss_on(launched, name):
    ref, ep2 = launched("ref"), launched(name)
    assert_same(train_records(ep2), train_records(ref))
    want, got = load_file(ref / "model.safetensors"), load_file(ep2 / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
    assert json.loads((ep2 / "summary.json").read_text())["mesh"]["dp_shard"] == LAUNCHES[name][0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_ep2_each_rank_holds_half_the_experts(launched):
    """Each rank's checkpoint part holds 2 of the 4 experts of every expert weight: rank r those from 2r."""
    shards = launched("ep2") / "checkpoints" / "step_0000003" / "shards"
    for rank in (0, 1):
        with safe_open(shards / f"rank0000{rank}-000.safetensors", "pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for name in ("blocks.0.mlp.fc", "blocks.1.mlp.proj", "blocks.0.mlp.fc_bias"):
                assert f.get_slice(f"model/{name}").get_shape()[0] == 2
                assert offsets[f"model/{name}"]["saved_offsets"][0] == 2 * rank


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_ep2_checkpoint_resumes_on_one_process_and_the_other_way_round(launched):
    ref = train_records(launched("ref"))
    for name in ("ep2_to_1", "1_to_ep2", "ep2_edp2_to_1"):  # a resume's log holds steps 4-6
        assert_same([r for r in ref if r["step"] <= 3] + train_records(launched(name)), ref)


def test_the_memory_estimate_under_ep_holds_half_the_experts_and_gathers_none():
    """Rank 0 holds what FSDP2 over the same 2 ranks holds (half of every tensor, the experts cut by expert, 2 of 4), but
    FSDP2 never gathers the experts: the estimate's buffers lose the two blocks' whole experts (fp32)."""
    from parallel_train.parallel.memory_estimate import estimate

    def rank0(*keys: str):
        cfg, _ = load_config([*EP, "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16", *keys])
        return estimate(cfg, 2, 65, (torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long)))[1][0]

    ep, fsdp = rank0("parallel.ep=2"), rank0("parallel.dp_shard=2")
    experts = 4 * (32 * 128 * 2 + 128 + 32)  # one layer's fc, proj and their biases, all 4 experts
    assert ep.param_numel == fsdp.param_numel and fsdp.fsdp_buffers - ep.fsdp_buffers == 2 * 4 * experts
