"""The device mesh: how the processes split the work between data, tensor and pipeline parallelism.

Five axes, outermost first (`DIMS`):

    dp_replicate   whole copies of the model (DDP), or, with dp_shard, the replicas of HSDP
    dp_shard       FSDP2: parameters, gradients and optimizer state cut into dp_shard slices
    cp             context parallel: each sequence cut into cp parts (parallel/context_parallel.py); FSDP2 shards
                   over dp_shard x cp, and the cp ranks of a group read the same batch (one data-parallel rank)
    pp             pipeline stages (parallel.pipeline_stages)
    tp             tensor parallel: every layer cut by heads / columns (the model's plan)

Their product is the world size. Ranks are laid out row-major in that order, so tensor-parallel ranks are
neighbours (one node: they talk in every layer) and, with tp = 1, rank = dp_rank x stages + pp_rank, the
layout the multi-process pipeline always had. Ranks that differ only in pp or tp read the same batch: the
data-parallel size is dp_replicate x dp_shard (data/batch_sampler.py); cp ranks read the same batch too, each
keeping its part of every sequence.

Where the sizes come from, in order: the keys `parallel.dp_replicate`, `parallel.dp_shard`, `parallel.tp`,
`parallel.pipeline_stages`; an accelerate launch config with a `parallelism_config` block (accelerate's own
`ParallelismConfig`, e.g. accelerate_configs/fsdp_tp.yaml) for the keys left at 1; an FSDP launch config
(fsdp.yaml) with dp_shard left at 1 shards over every process the other axes leave. With dp_replicate,
dp_shard and tp all 1, data-parallel replicas fill the world (plain DDP), as before the mesh existed.
Anything else whose product is not the world size is a one-line error.

`MeshLayout` is plain arithmetic (no process group): scripts/estimate_memory.py uses it without launching.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.parallel.context_parallel import refuse_compositions, refuse_unsupported
from parallel_train.parallel.expert_parallel import check_expert_layout
from parallel_train.parallel.hf_expert_parallel import check_hub_layout

DIMS = ("dp_replicate", "dp_shard", "cp", "pp", "tp")
TRUE = ("1", "true", "yes")


@dataclass(frozen=True)
class MeshLayout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism (parallel/expert_parallel.py): the experts split over the dp_shard ranks; not an axis

    @property
    def sizes(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in DIMS}

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.pp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors: FSDP2, tensor or context parallel (or HSDP, or DDP x TP as HSDP with shard size 1)."""
        return self.dp_shard > 1 or self.tp > 1 or self.cp > 1

    def coordinate(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis (row-major in DIMS order)."""
        coords = {}
        for dim in reversed(DIMS):
            rank, coords[dim] = divmod(rank, getattr(self, dim))
        return {dim: coords[dim] for dim in DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        """`dp_shard 2 x tp 2` (the axes above 1; `1 process` when there are none)."""
        active = [f"{dim} {size}" for dim, size in self.sizes.items() if size > 1] + [f"ep {self.ep}"] * (self.ep > 1)
        return " x ".join(active) or "1 process"


def launch_sizes(env: dict[str, str] | None = None) -> dict[str, int]:
    """Mesh sizes the launcher asked for: an accelerate config's `parallelism_config` block arrives as
    PARALLELISM_CONFIG_* variables, read with accelerate's own ParallelismConfig (its rules, its names)."""
    env = os.environ if env is None else env
    if not any(k.startswith("PARALLELISM_CONFIG_") and k.endswith("_SIZE") for k in env):
        return {}
    from accelerate.parallelism_config import ParallelismConfig

    names = {"dp_replicate": "DP_REPLICATE_SIZE", "dp_shard": "DP_SHARD_SIZE", "tp": "TP_SIZE", "cp": "CP_SIZE", "sp": "SP_SIZE"}
    try:
        pc = ParallelismConfig(**{f"{k}_size": int(env.get(f"PARALLELISM_CONFIG_{v}", "1")) for k, v in names.items()})
    except ValueError as e:
        raise UserError(f"the launch config's parallelism_config: {str(e).splitlines()[0]}") from None
    if pc.cp_size > 1 or pc.sp_size > 1:
        raise UserError(
            f"the launch config's parallelism_config asks for cp_size={pc.cp_size}, sp_size={pc.sp_size}: context and "
            "sequence parallelism are not read from a launch config; set parallel.cp=N (docs/parallelism.md) and leave both at 1"
        )
    return {"dp_replicate": pc.dp_replicate_size, "dp_shard": pc.dp_shard_size, "tp": pc.tp_size}


def resolve_layout(cfg: Config, world: int, env: dict[str, str] | None = None) -> MeshLayout:
    """The mesh for these keys, this launch and this world size, or a one-line error."""
    env = os.environ if env is None else env
    refuse_unsupported(cfg, world)
    p = cfg.parallel
    sizes = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp}
    for dim, size in launch_sizes(env).items():
        if sizes[dim] == 1:
            sizes[dim] = size
        elif size not in (1, sizes[dim]):
            raise UserError(
                f"parallel.{dim}={sizes[dim]} but the launch config's parallelism_config says {dim}_size={size}; give the size in one place"
            )
    pp, cp = p.pipeline_stages, p.cp
    r, s, t = sizes["dp_replicate"], sizes["dp_shard"], sizes["tp"]
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in TRUE and (s > 1 or t > 1):
        raise UserError(
            f"parallel.dp_shard={s}, parallel.tp={t} under DeepSpeed: ZeRO shards the model its own way and cannot be combined "
            "with the template's mesh; launch with accelerate_configs/fsdp.yaml (or torchrun) instead, or leave dp_shard and tp at 1"
        )
    fsdp_launch = env.get("ACCELERATE_USE_FSDP", "").lower() in TRUE
    if fsdp_launch and s == 1 and world % (r * t * pp * cp) == 0:
        s = world // (r * t * pp * cp)  # fsdp.yaml: shard over every process the other axes leave
    if p.ep > 1 and s == 1 and world % (r * t * pp * cp) == 0:
        s = world // (r * t * pp * cp)  # expert parallelism: its ranks are the FSDP2 ranks, which fill what the others leave
    if r == s == t == 1:
        if world % (pp * cp):
            raise UserError(
                f"parallel.pipeline_stages={pp} does not divide the world size {world}; launch a multiple of {pp} processes "
                f"(stages x data-parallel replicas), e.g. torchrun --nproc-per-node {pp} train.py ..."
            )
        r = world // (pp * cp)  # plain data parallelism: replicas fill the world
    check_expert_layout(p.ep, s)
    check_hub_layout(cfg.model.name, p.ep, r, t, pp)
    refuse_compositions(cfg, t, pp)
    layout = MeshLayout(dp_replicate=r, dp_shard=s, cp=cp, pp=pp, tp=t, ep=p.ep)
    if layout.world != world:
        raise UserError(
            f"the mesh dp_replicate x dp_shard x cp x pipeline_stages x tp = {r} x {s} x {cp} x {pp} x {t} = {layout.world} (parallel.* "
            f"keys and the launch config), but {world} process{'es were' if world > 1 else ' was'} launched; launch {layout.world} "
            f"processes or change parallel.dp_replicate / dp_shard / cp / tp / pipeline_stages so that the product is {world}"
        )
    return layout


def build_device_mesh(layout: MeshLayout, device_type: str):
    """torch's DeviceMesh over every process, one named axis per entry of DIMS (axes of size 1 included, so
    every engine can ask for any axis). Needs the process group (the Accelerator starts it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(layout.sizes.values()), mesh_dim_names=DIMS)


def data_parallel_mesh(mesh, layout: MeshLayout):
    """The mesh FSDP2 shards over: 1-D over dp_shard, or 2-D (dp_replicate, dp_shard) for HSDP (replicate
    across the first axis, shard across the second; a shard axis of size 1 is DDP for DTensor parameters).
    With context parallelism: over dp_shard x cp flattened (context_parallel_mesh)."""
    if layout.cp > 1:
        return context_parallel_mesh(mesh, layout)
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]


def context_parallel_mesh(mesh, layout: MeshLayout):
    """FSDP2's mesh under context parallelism (torchtitan's dp_shard_cp): dp_shard x cp flattened into one shard axis,
    with dp_replicate in front for HSDP. Every parameter is then cut over the cp ranks too, and its gradient averaged
    over them (the mesh engine scales the loss by cp: the parts of one sequence add up)."""
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard_cp"] if layout.dp_replicate > 1 else shard


def share_line(layout: MeshLayout, local: int, total: int) -> str:
    """`mesh dp_shard 2 x tp 2; rank 0 holds 0.21M of 0.83M parameters (25.0%)`, for the start banner."""
    return (
        f"mesh {layout.describe()}; rank 0 holds {local / 1e6:.2f}M of {total / 1e6:.2f}M parameters ({100 * local / max(1, total):.1f}%)"
    )


def mesh_summary(layout: MeshLayout, local: int) -> dict[str, Any]:
    """summary.json's `mesh` (axis -> size) and `local_param_numel` (parameter elements rank 0 holds)."""
    return {"mesh": layout.sizes, "local_param_numel": local}
