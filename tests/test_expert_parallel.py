"""Expert parallelism (`parallel.ep`, parallel/expert_parallel.py): the layout and its refusals in process; 2 processes
with ep=2 against one process (losses, balancing loss, expert load, final weights), and under -m slow the same for ep=2
with FSDP of the experts, with tensor parallel and with HSDP (4 processes each), what each rank's checkpoint part holds,
and resuming each layout's checkpoint on one process (and one process's under ep=2)."""

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
    ]:
        with pytest.raises(UserError, match=words):
            load_config([*EP, *keys])
    got = layout(4, "parallel.ep=2", "parallel.dp_shard=4")  # the experts FSDP-sharded over the 2 "edp" ranks EP leaves
    assert (got.dp_shard, got.ep) == (4, 2)
    # with tensor parallel, or HSDP's replicas: the dp_shard ranks fill what those axes leave
    assert layout(4, "parallel.ep=2", "parallel.tp=2").sizes == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "pp": 1, "tp": 2}
    assert layout(4, "parallel.ep=2", "parallel.dp_replicate=2").describe() == "dp_replicate 2 x dp_shard 2 x ep 2"
    for world, keys in [(2, ("parallel.ep=4", "parallel.dp_shard=2")), (4, ("parallel.ep=2", "parallel.tp=4"))]:
        with pytest.raises(UserError, match="expert parallelism runs over the FSDP2 ranks"):
            layout(world, *keys)


def test_a_moe_under_tensor_parallel_runs_whole_on_each_rank():
    """The plan gathers a MoE layer's input from the sequence shards and cuts its output back; router and experts uncut."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from parallel_train.models.gpt import GPT, GPTConfig

    plan = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, n_experts=4), vocab_size=11).tensor_parallel_plan(2)
    assert isinstance(plan["blocks.1.mlp"], PrepareModuleInputOutput)
    assert not [name for name in plan if ".mlp." in name]


GPIPE = ("parallel.schedule=gpipe", "parallel.microbatches=1")
STAGES4 = ("model.n_layer=4", "parallel.pipeline_stages=2", "parallel.stages_per_rank=2")
LAUNCHES = {
    "ref": (1, ()),
    "ep2": (2, ("train.batch_size=2", "parallel.ep=2")),
    "ep2_to_1": (1, ("resume={ep2}/checkpoints/step_0000003",)),
    # ep=2 x 2 "edp" ranks: each expert weight cut by expert over ep, then by its second dim over edp (4 processes)
    "ep2_edp2": (4, ("train.batch_size=1", "parallel.ep=2", "parallel.dp_shard=4")),
    "ep2_edp2_to_1": (1, ("resume={ep2_edp2}/checkpoints/step_0000003",)),
    "1_to_ep2": (2, ("train.batch_size=2", "parallel.ep=2", "resume={ref}/checkpoints/step_0000003")),
    # ep=2 over dp_shard x tensor parallel 2 (attention and the dense layers cut; each MoE layer whole on both tp ranks)
    "ep2_tp2": (4, ("train.batch_size=2", "parallel.ep=2", "parallel.tp=2")),
    "ep2_tp2_to_1": (1, ("resume={ep2_tp2}/checkpoints/step_0000003",)),
    # HSDP: 2 replicas, each ep=2 over its 2 dp_shard ranks (the experts replicated over the replicas)
    "ep2_hsdp": (4, ("train.batch_size=1", "parallel.ep=2", "parallel.dp_replicate=2")),
    "ep2_hsdp_to_1": (1, ("resume={ep2_hsdp}/checkpoints/step_0000003",)),
    # 2 pipeline stages (one MoE layer each): the pipeline's micro-batches are the reference's accumulation micro-steps
    "pp2": (2, (*GPIPE, "parallel.pipeline_stages=2")),
    "ep2_pp2": (4, (*GPIPE, "train.batch_size=2", "parallel.ep=2", "parallel.pipeline_stages=2")),
    "ep2_pp2_to_1": (1, ("resume={ep2_pp2}/checkpoints/step_0000003",)),
    # 1f1b over 2 x 2 micro-batches of 2 against one process accumulating the same 4 micro-batches
    "ref_micro": (1, ("train.batch_size=2", "train.gradient_accumulation_steps=4")),
    "pp2_1f1b": (2, ("parallel.pipeline_stages=2", "parallel.schedule=1f1b", "parallel.microbatches=2")),
    # 4 layers as 4 stages on 2 ranks (2 stage views each): interleaved 1f1b, and zero-bubble ZB-V (its backward split)
    "ref4_micro": (1, ("model.n_layer=4", "train.batch_size=2", "train.gradient_accumulation_steps=4")),
    "interleaved": (2, (*STAGES4, "parallel.schedule=interleaved1f1b", "parallel.microbatches=2")),
    "zbv": (2, (*STAGES4, "parallel.schedule=zbv", "parallel.microbatches=4", "train.batch_size=8", "train.gradient_accumulation_steps=1")),
    # the llama flavor's SwiGLU experts (a third stacked weight, gate) under ep=2 x tensor parallel 2
    "llama_ref": (1, ("model.flavor=llama",)),
    "llama_ep2_tp2": (4, ("model.flavor=llama", "train.batch_size=2", "parallel.ep=2", "parallel.tp=2")),
}
PIPELINES = [("pp2_1f1b", "ref_micro"), ("interleaved", "ref4_micro"), ("zbv", "ref4_micro")]  # -m slow
# dp_replicate, dp_shard, tp, pp
MESH = {"ep2": (1, 2, 1, 1), "ep2_edp2": (1, 4, 1, 1), "ep2_tp2": (1, 2, 2, 1), "ep2_hsdp": (2, 2, 1, 1), "ep2_pp2": (1, 2, 1, 2)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """name -> its output folder, each launch run once per module."""
    outs: dict[str, object] = {}

    def get(name: str):
        if name not in outs:
            n, extra = LAUNCHES[name]
            folders = {k: get(k) for k in LAUNCHES if any("{" + k + "}" in e for e in extra)}
            out = tmp_path_factory.mktemp(name)
            check(run(warm_cmd(n, *RUN, *(e.format(**folders) for e in extra), f"output_dir={out / 'out'}"), env=launch_env(out)))
            outs[name] = out / "out"
        return outs[name]

    return get


def train_records(folder) -> list[dict]:
    return [r for r in read_metrics(folder) if r["kind"] == "train"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(  # ep2: the layout's default test
    "name", ["ep2", *(pytest.param(name, marks=pytest.mark.slow) for name in ("ep2_edp2", "ep2_tp2", "ep2_hsdp", "ep2_pp2"))]
)
def test_ep2_equals_one_process_with_the_balancing_loss_on(launched, name):
    ref, ep2 = launched("ref"), launched(name)
    assert_same(train_records(ep2), train_records(ref))
    want, got = load_file(ref / "model.safetensors"), load_file(ep2 / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
    mesh = json.loads((ep2 / "summary.json").read_text())["mesh"]
    assert (mesh["dp_replicate"], mesh["dp_shard"], mesh["tp"], mesh["pp"]) == MESH[name]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_llama_flavors_experts_under_ep2_x_tp2_equal_one_process(launched):
    """SwiGLU experts (fc, proj and gate, each cut by expert over ep) inside a tensor-parallel model: losses, aux loss,
    expert load and final weights as one process."""
    ref, got = launched("llama_ref"), launched("llama_ep2_tp2")
    assert_same(train_records(got), train_records(ref))
    want, have = load_file(ref / "model.safetensors"), load_file(got / "model.safetensors")
    assert sorted(have) == sorted(want) and any(k.endswith("mlp.gate") for k in want)
    for key in want:
        torch.testing.assert_close(have[key], want[key], rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "ref"),
    [("pp2", "ref"), *(pytest.param(*p, marks=pytest.mark.slow) for p in PIPELINES)],
)
def test_a_moe_over_pipeline_stages_equals_one_process_accumulating_its_micro_batches(launched, name, ref):
    """Each stage's balancing loss reaches the schedule's backward (pipeline/balance.py): the first stage's MoE layer
    trains as in one process whose accumulation micro-steps are the pipeline's micro-batches (the pipeline's default test)."""
    assert_same(train_records(launched(name)), train_records(launched(ref)))
    want, got = load_file(launched(ref) / "model.safetensors"), load_file(launched(name) / "model.safetensors")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


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
    for name in ("ep2_to_1", "1_to_ep2", "ep2_edp2_to_1", "ep2_tp2_to_1", "ep2_hsdp_to_1", "ep2_pp2_to_1"):  # steps 4-6 logged
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


@pytest.mark.parametrize(("world", "dtype"), [(4, torch.float32), (2, torch.bfloat16)])
def test_a_checkpointed_moe_block_frees_its_gathered_experts_after_its_forward(monkeypatch, world, dtype):
    """ep=2 x edp=2 (the experts gathered over edp) and ep=2 under bf16 (cast to the rows' dtype): after a checkpointed
    MoE block's forward no gathered copy is alive (backward's recomputation gathers them again); without checkpointing
    autograd keeps each until the block's backward (the check's control). On the fake process group, rank 0."""
    import gc
    import weakref

    from torch.distributed.device_mesh import init_device_mesh

    from parallel_train.models.activation_checkpoint import Checkpointing
    from parallel_train.models.moe import MoE
    from parallel_train.parallel import expert_parallel
    from parallel_train.parallel.memory_estimate import fake_world

    copies, gather = [], expert_parallel.local_tensor

    def recorded(t, to):
        out = gather(t, to)
        if out is not None:  # no gate: not the llama flavor
            copies.append(weakref.ref(out.untyped_storage()))
        return out

    monkeypatch.setattr(expert_parallel, "local_tensor", recorded)
    with fake_world(world):
        moe = MoE(16, 64, 4, 2, bias=True, dropout=0.0)
        moe.init_weights(0.02, 0.02)
        moe.router.to(dtype)  # FSDP2's bf16 policy casts the dense layers; the experts are cast by local_tensor
        expert_parallel.shard_experts(moe, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)), 2)
        alive = {}
        for mode in ("full", "none"):
            copies.clear()
            out = Checkpointing(mode).run(0, moe, torch.randn(8, 16, dtype=dtype, requires_grad=True))
            gc.collect()
            alive[mode] = sum(ref() is not None for ref in copies)
            del out
    assert len(copies) == 4 and alive == {"full": 0, "none": 2}, alive  # fc and proj, which the matmuls save; the biases' adds save none
