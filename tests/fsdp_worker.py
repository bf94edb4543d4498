"""Run under `torchrun --nproc-per-node 2 tests/fsdp_worker.py OUT`: FSDP2 (`fully_shard`) and tensor parallelism
(`parallelize_module`) on CPU/gloo, checkpointed.

What accelerate does for accelerate_configs/fsdp.yaml on GPUs (each `Block` its own FSDP unit, then the root),
minus accelerate itself (its prepare() cannot shard on CPU). Checks that each rank writes its own shards of the
model and the optimizer (nothing gathered), synchronously and in the background, and that a checkpoint loads back
into a sharded model and continues like the unsharded one (to float rounding). Rank 0 leaves OUT/expected.safetensors
(the whole state, gathered here only to check) for the test, which loads the checkpoint on one process. The same
for a tensor-parallel MLP (column- and row-wise shards, a replicated bias): OUT/tp and OUT/tp_expected.safetensors.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from dtensors import is_sharded, to_full  # noqa: E402
from parallel_train.checkpoint.checkpointer import Checkpointer, checkpoint_name, load_rank_state  # noqa: E402
from parallel_train.checkpoint.manifest import verify  # noqa: E402
from parallel_train.checkpoint.named_state import (
    RankState,  # noqa: E402
    rank_tensors,  # noqa: E402
)
from parallel_train.losses import loss_fn  # noqa: E402
from parallel_train.models.gpt import GPT, Block, GPTConfig  # noqa: E402

VOCAB, T, B = 17, 8, 4  # B rows per rank; the reference sees both ranks' rows. 17 rows: uneven shards (9 + 8)
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


def same_content(a: Path, b: Path) -> bool:
    if a.suffix != ".safetensors":
        return a.read_bytes() == b.read_bytes()
    with safe_open(str(a), "pt") as x, safe_open(str(b), "pt") as y:
        keys = set(x.keys())
        return keys == set(y.keys()) and x.metadata() == y.metadata() and all(torch.equal(x.get_tensor(k), y.get_tensor(k)) for k in keys)


def rank_state(model, optimizer) -> RankState:
    return RankState(model.state_dict(), model, optimizer)


def check(rank: int, world: int, out: Path) -> None:
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

    # Save, synchronously and in the background: each rank writes its own shards, nothing is gathered.
    files = {"trainer_state.json": json.dumps({"step": 2})}
    for name, background in (("sync", False), ("async", True)):
        saver = Checkpointer(out / name, keep=1, background=background, timeout_s=120)
        saver.write(2, rank_state(sharded, opt), files)
        saver.finish()
    folder = out / "sync" / checkpoint_name(2)
    assert verify(folder) is None and verify(out / "async" / checkpoint_name(2)) is None
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    assert {meta["rank"] for name, meta in manifest.items() if name.startswith("shards/")} == {0, 1}, manifest
    for name in manifest:  # the background write wrote the same (safetensors' header order is not fixed)
        assert same_content(folder / name, out / "async" / checkpoint_name(2) / name), name

    # What a one-process load must find: the whole state, gathered here (test-only) in checkpoint keys.
    tensors, _ = rank_tensors(rank_state(sharded, opt))
    expected = {k: to_full(v).detach().clone() for k, v in tensors.items()}
    if rank == 0:
        save_file(expected, str(out / "expected.safetensors"))

    # Load into a fresh sharded model (other weights, other lr): it continues like the unsharded one (to rounding).
    resumed = shard(build(seed=2), mesh)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    load_rank_state(folder, rank_state(resumed, resumed_opt))
    assert resumed_opt.param_groups[0]["lr"] == 1e-2
    batch = batches[2]
    step(reference, ref_opt, batch[:, :-1], batch[:, 1:])
    step(resumed, resumed_opt, batch[mine, :-1], batch[mine, 1:])
    for (name, p), ref in zip(resumed.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(to_full(p), ref, rtol=1e-4, atol=1e-6, msg=name)
    print(f"fsdp rank {rank}/{world} ok", flush=True)


def tensor_parallel_mlp() -> torch.nn.Sequential:
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def check_tensor_parallel(rank: int, world: int, out: Path) -> None:
    """Megatron-style MLP: the first Linear column-wise (Shard(0)), the second row-wise (Shard(1), bias Replicate)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(tensor_parallel_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(5))).pow(2).mean().backward()
    optimizer.step()
    saver = Checkpointer(out / "tp", keep=1, timeout_s=120)
    saver.write(1, rank_state(model, optimizer), {"trainer_state.json": json.dumps({"step": 1})})
    tensors, _ = rank_tensors(rank_state(model, optimizer))
    expected = {k: to_full(v).detach().clone() for k, v in tensors.items()}
    if rank == 0:
        save_file(expected, str(out / "tp_expected.safetensors"))
    print(f"tensor parallel rank {rank}/{world} ok", flush=True)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a failed rank must not hang the other
    check(dist.get_rank(), dist.get_world_size(), Path(sys.argv[1]))
    check_tensor_parallel(dist.get_rank(), dist.get_world_size(), Path(sys.argv[1]))
    # Free the sharded models before the process group goes: left to interpreter shutdown, FSDP2's state on gloo
    # aborted the process ("terminate called without an active exception") in about 1 run in 10 on a loaded machine.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
