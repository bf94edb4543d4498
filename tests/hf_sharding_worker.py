"""Run under `torchrun --nproc-per-node 2 tests/hf_sharding_worker.py MODEL_FOLDER...`: FSDP2 (`fully_shard`) and
tensor parallelism (`parallelize_module`) of model.name=hf models on CPU/gloo, checked against unsharded copies.

FSDP2: each decoder layer (the adapter's `decoder_layers()`, read from the model's `_no_split_modules`) is its own
FSDP unit, then the root: what an FSDP2 engine does, and accelerate's fsdp.yaml on GPUs. Checks that two sharded
steps equal the unsharded ones, that the whole state dict comes back with the model's own names (a tied weight
once), and that it loads into a fresh sharded model that then continues exactly.
Tensor parallel (models with a plan in transformers: the Llama): the adapter's `tensor_parallel_plan(2)` cuts
every attention and MLP projection, the embedding and lm_head over the 2 ranks; both ranks see the whole batch;
logits and two training steps equal the unsharded model's.
"""

from __future__ import annotations

import copy
import gc
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

from dtensors import is_sharded, shard_like, to_full  # noqa: E402
from parallel_train.losses import loss_fn  # noqa: E402
from parallel_train.models.hf import HFCausalLM, HFConfig  # noqa: E402

T, B, VOCAB = 16, 2, 256  # B rows per rank; the reference sees both ranks' rows
ADAM = {"lr": 1e-2, "eps": 1e-3}  # a large eps: Adam would blow float noise in near-zero gradients up into full steps


def build(folder: str, pretrained: bool = True) -> HFCausalLM:
    torch.manual_seed(5)  # random weights (pretrained=False) differ from the folder's
    return HFCausalLM(HFConfig(name="hf", hf_path=folder, block_size=T, hf_pretrained=pretrained), VOCAB)


def shard(model: HFCausalLM, mesh) -> HFCausalLM:
    layers = model.decoder_layers()
    assert len(layers) == 2, [type(m).__name__ for m in layers]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model, optimizer, x, y) -> None:
    loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check(folder: str, rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (B * world, T + 1), generator=g) for _ in range(3)]
    mine = slice(rank * B, (rank + 1) * B)

    reference = build(folder)
    sharded = shard(copy.deepcopy(reference), mesh)
    assert all(is_sharded(p) for p in sharded.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAM)
    opt = torch.optim.AdamW(sharded.parameters(), **ADAM)
    for batch in batches[:2]:
        step(reference, ref_opt, batch[:, :-1], batch[:, 1:])  # mean over all rows = mean of the ranks' means
        step(sharded, opt, batch[mine, :-1], batch[mine, 1:])

    # The whole model on rank 0 (what accelerator.get_state_dict does under FSDP2): the model's own names.
    model_state = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    want = reference.state_dict()
    if rank == 0:
        assert sorted(model_state) == sorted(want), sorted(set(model_state) ^ set(want))
        assert "lm_head.weight" in want or reference.tied  # a tied weight is stored once, under its first name
        for key, value in model_state.items():
            torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-5, msg=key)

    # Load: a fresh sharded model (other weights) continues exactly like the unsharded one.
    resumed = shard(build(folder, pretrained=False), mesh)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), **ADAM)
    current = resumed.state_dict()  # whole tensors in, each rank keeps its slice (as a checkpoint of the earlier format loads)
    resumed.load_state_dict({k: shard_like(v, current[k]) for k, v in want.items()})
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAM)  # both optimizers start afresh here
    batch = batches[2]
    step(reference, ref_opt, batch[:, :-1], batch[:, 1:])
    step(resumed, resumed_opt, batch[mine, :-1], batch[mine, 1:])
    for (name, p), ref in zip(resumed.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(to_full(p), ref, rtol=1e-4, atol=1e-5, msg=name)
    print(f"hf fsdp {reference.config.model_type} rank {rank}/{world} ok", flush=True)


def check_tensor_parallel(folder: str, rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    reference = build(folder)
    plan = reference.tensor_parallel_plan(world)
    assert {"model.embed_tokens", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"} <= plan.keys()
    cut = parallelize_module(copy.deepcopy(reference), mesh, plan)
    q = cut.model.layers[0].self_attn.q_proj.weight
    assert is_sharded(q) and q.to_local().shape[0] == q.shape[0] // world  # each rank: half the heads' rows
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAM)
    opt = torch.optim.AdamW(cut.parameters(), **ADAM)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch = torch.randint(0, VOCAB, (B, T + 1), generator=g)  # the same batch on both ranks
        torch.testing.assert_close(cut(batch[:, :-1]), reference(batch[:, :-1]), rtol=1e-4, atol=1e-5)
        step(reference, ref_opt, batch[:, :-1], batch[:, 1:])
        step(cut, opt, batch[:, :-1], batch[:, 1:])
    for (name, p), ref in zip(cut.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(to_full(p), ref, rtol=1e-4, atol=1e-5, msg=name)
    check_loss_parallel(reference, plan, mesh, world)
    print(f"hf tp {reference.config.model_type} rank {rank}/{world} ok", flush=True)


def check_loss_parallel(reference: HFCausalLM, plan: dict, mesh, world: int) -> None:
    """Loss parallel (parallel/sharding.py): the logits stay a DTensor cut by vocabulary, no rank holds them whole, and
    cross-entropy on the shards (torch's loss_parallel) equals the unsplit model's, gradients too."""
    from torch.distributed.tensor.parallel import loss_parallel

    from parallel_train.losses import loss_sum
    from parallel_train.parallel.sharding import logits_by_vocabulary

    cut = copy.deepcopy(reference)
    parallelize_module(cut, mesh, logits_by_vocabulary(cut, plan))
    batch = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(2))
    with loss_parallel():
        logits = cut(batch[:, :-1])
        assert is_sharded(logits) and logits.placements[0].is_shard(2) and logits.to_local().shape[-1] == logits.shape[-1] // world
        loss = loss_sum(logits, batch[:, 1:])
        loss.backward()
    want = loss_sum(reference(batch[:, :-1]), batch[:, 1:])
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-5, atol=1e-5)
    grad = cut.model.layers[0].self_attn.q_proj.weight.grad
    torch.testing.assert_close(to_full(grad), reference.model.layers[0].self_attn.q_proj.weight.grad, rtol=1e-4, atol=1e-5)
    check_metrics_on_shards(cut, reference, batch)


def check_metrics_on_shards(cut, reference: HFCausalLM, batch: torch.Tensor) -> None:
    """Evaluation under loss parallel (parallel/vocab_metrics.py): loss and accuracy from the logits cut by vocabulary
    equal those of the whole logits (a tie across the two slices included: the lower index wins, as argmax's), and
    nothing gathers them whole; another metric gets them gathered once."""
    from torch.distributed.tensor import DTensor

    from parallel_train.eval_metrics import TASK_METRICS, Metric, metric_stats
    from parallel_train.parallel.vocab_metrics import cut_by_vocabulary, stats_on_shards

    x, y = batch[:, :-1], batch[:, 1:].clone()
    y[0, 1:4] = -100  # targets that count nowhere
    y[0, 0] = 0  # the tied row below: right only if the lower index wins
    with torch.no_grad():
        logits, whole = cut(x), reference(x)
    local = logits.to_local()  # this rank's slice (the DTensor's own storage)
    local[0, 0, 0] = 50.0  # the row's maximum on both slices: vocabulary index 0 (rank 0) and V/2 (rank 1)
    whole[0, 0, 0] = whole[0, 0, local.shape[-1]] = 50.0
    assert cut_by_vocabulary(logits) and not cut_by_vocabulary(whole)
    metrics = {name: TASK_METRICS[name] for name in ("loss", "perplexity", "accuracy")}
    gather = DTensor.full_tensor
    DTensor.full_tensor = None  # any whole gather fails here
    try:
        got = stats_on_shards(logits, y, metrics)
    finally:
        DTensor.full_tensor = gather
    want = metric_stats(whole, y, metrics)
    for name in metrics:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    mine = {"mine": Metric(lambda lg, t: torch.ones(t.shape[0], 2) * lg.shape[-1], lambda totals: totals[0])}
    assert stats_on_shards(logits, y, mine)["mine"][0, 0] == whole.shape[-1]  # gathered whole for a metric of its own


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a failed rank must not hang the other
    for folder in sys.argv[1:]:
        check(folder, dist.get_rank(), dist.get_world_size())
        if "llama" in folder:  # GPT-2 has no plan in transformers (and ties its embeddings)
            check_tensor_parallel(folder, dist.get_rank(), dist.get_world_size())
        gc.collect()  # free the sharded models before the process group goes (see tests/fsdp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
