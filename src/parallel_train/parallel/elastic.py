"""Elastic restarts (`torchrun --max-restarts N`, `accelerate launch --max_restarts N`) that really restart.

When a worker dies, torch's elastic agent stops the others and starts the whole group again; each new
worker then continues from the newest checkpoint (resume=auto). The agent keeps ONE key-value store for
the whole job, and `init_process_group` writes its rendezvous keys there without a per-attempt prefix:
a restarted worker can read the address of a worker from the previous attempt and fail ("Connection
refused") or hang (measured with torch 2.13, static and c10d rendezvous, about 2 restarts in 5).

The fix here: each worker counts its own starts in the store (`add` is atomic), and since the agent
restarts every worker of the job once per attempt, the counts agree; the process group's keys go under
that count. Only under an elastic agent with restarts enabled; otherwise accelerate creates the group.
A worker that crashed before reaching this point leaves its count behind: the next attempt then waits
for parallel.timeout_s and fails instead of training with mismatched peers.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch


def restarts_enabled() -> bool:
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
        and int(os.environ.get("WORLD_SIZE", "1")) > 1
    )


def init_process_group_for_restarts(timeout_s: int) -> None:
    """Create the default process group with keys namespaced per attempt (before the Accelerator exists;
    accelerate then uses this group). The backend is the one accelerate would pick: NCCL on GPUs (with
    gloo for CPU tensors), gloo on CPU."""
    if not restarts_enabled() or torch.distributed.is_initialized():
        return
    dist = torch.distributed
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    attempt = store.add(f"parallel_train/starts/rank{rank}", 1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo",
        store=dist.PrefixStore(f"parallel_train/attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
