"""Run under `torchrun --nproc-per-node 2`: FSDP2 (`fully_shard`) on CPU/gloo, checked against an unsharded copy.

What accelerate does for accelerate_configs/fsdp.yaml on GPUs (each `Block` its own FSDP unit, then the root),
minus accelerate itself (its prepare() cannot shard on CPU). Checks that the template's checkpoint helpers turn
sharded state into whole tensors with canonical names, and load them back into a sharded model.
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

from parallel_train.checkpoint import load_optimizer_by_name, optimizer_state_by_name  # noqa: E402
from parallel_train.dtensor_state import is_sharded, load_full_state_dict, to_full  # noqa: E402
from parallel_train.losses import loss_fn  # noqa: E402
from parallel_train.models.gpt import (  # noqa: E402
    GPT,
    Block,
    GPTConfig,  # noqa: E402
)

VOCAB, T, B = 17, 8, 4  # B rows per rank; the reference sees both ranks' rows
# A large eps: the attention key bias gets a zero gradient (softmax ignores it), and with a tiny eps Adam would
# blow float rounding noise in that gradient up into full-size steps that differ between the two runs.
ADAM = {"lr": 1e-2, "eps": 1e-3}


def build(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=T, dropout=0.0), VOCAB)


def shard(model: GPT, mesh) -> GPT:
    for module in model.modules():  # fsdp.yaml: TRANSFORMER_BASED_WRAP on GPT._no_split_modules
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model, optimizer, x, y) -> None:
    loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (B * world, T + 1), generator=g) for _ in range(3)]
    mine = slice(rank * B, (rank + 1) * B)

    reference = build(seed=1)
    sharded = shard(copy.deepcopy(reference), mesh)
    assert all(is_sharded(p) for p in sharded.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAM)
    opt = torch.optim.AdamW(sharded.parameters(), **ADAM)
    for batch in batches[:2]:
        step(reference, ref_opt, batch[:, :-1], batch[:, 1:])  # mean over all rows = mean of the ranks' means
        step(sharded, opt, batch[mine, :-1], batch[mine, 1:])

    # Save: whole tensors, canonical names, equal to the unsharded run, on rank 0 (the writer) only.
    tensors, meta = optimizer_state_by_name(sharded, opt)
    ref_tensors, ref_meta = optimizer_state_by_name(reference, ref_opt)
    if rank == 0:
        assert sorted(tensors) == sorted(ref_tensors), sorted(set(tensors) ^ set(ref_tensors))
        assert "blocks.0.attn.q.weight/exp_avg" in tensors
        for key, value in tensors.items():
            assert not is_sharded(value) and value.shape == ref_tensors[key].shape, key
            torch.testing.assert_close(value, ref_tensors[key], rtol=1e-4, atol=1e-6, msg=key)
    else:
        assert not any(key.endswith("/exp_avg") for key in tensors)  # gathered, then dropped: host RAM
    assert meta["param_groups"] == ref_meta["param_groups"]
    shared = [tensors, meta]
    dist.broadcast_object_list(shared, src=0)  # as if every rank read the checkpoint file
    tensors, meta = shared
    # What accelerator.get_state_dict does under FSDP2: the whole model on rank 0.
    model_state = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert sorted(model_state) == sorted(reference.state_dict())
        for key, value in model_state.items():
            torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-4, atol=1e-6, msg=key)

    # Load: a fresh sharded model (other weights) continues exactly like the unsharded one.
    resumed = shard(build(seed=2), mesh)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    load_full_state_dict(resumed, reference.state_dict())
    load_optimizer_by_name(resumed, resumed_opt, tensors, meta)
    assert resumed_opt.param_groups[0]["lr"] == 1e-2
    batch = batches[2]
    step(reference, ref_opt, batch[:, :-1], batch[:, 1:])
    step(resumed, resumed_opt, batch[mine, :-1], batch[mine, 1:])
    for (name, p), ref in zip(resumed.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(to_full(p), ref, rtol=1e-4, atol=1e-6, msg=name)
    print(f"fsdp rank {rank}/{world} ok", flush=True)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a failed rank must not hang the other
    check(dist.get_rank(), dist.get_world_size())
    # Free the sharded models before the process group goes: left to interpreter shutdown, FSDP2's state on gloo
    # aborted the process ("terminate called without an active exception") in about 1 run in 10 on a loaded machine.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
