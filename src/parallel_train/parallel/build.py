"""Which engine runs this config and launch, and one line that describes the launch.

parallel.stage_devices given          -> pipeline in one process over those devices (parallel/pipeline/inprocess.py)
parallel.pipeline_stages > 1          -> one pipeline stage per process (parallel/pipeline/distributed.py), on the mesh
parallel.dp_shard or parallel.tp > 1  -> the device mesh: FSDP2 / HSDP / tensor parallel (parallel/mesh_engine.py);
  also an FSDP launch config (fsdp.yaml, fsdp_tp.yaml, hsdp.yaml), which shards on CPU too
otherwise                             -> data parallel: DDP, or DeepSpeed via accelerate (parallel/ddp_engine.py)

The mesh (parallel/mesh.py) is resolved from the keys, the launch config and the world size first: a product that is
not the world size is a one-line error before anything is built.
"""

from __future__ import annotations

import os
import socket

import torch
from torch import nn

from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.parallel.context_parallel import refuse_unsupported
from parallel_train.parallel.ddp_engine import DataParallelEngine, OptimizerFactory
from parallel_train.parallel.engine import Engine
from parallel_train.parallel.mesh import MeshLayout, resolve_layout
from parallel_train.parallel.mesh_engine import MeshEngine
from parallel_train.parallel.model_init import Whole
from parallel_train.parallel.pipeline.distributed import MultiProcessPipelineEngine
from parallel_train.parallel.pipeline.inprocess import InProcessPipelineEngine
from parallel_train.parallel.precision import Precision


def data_parallel_size(cfg: Config, world: int) -> int:
    """How many shards each global batch is cut into under this config and launch (the engine's dp_size)."""
    if cfg.parallel.stage_devices or (cfg.parallel.pipeline_stages > 1 and world == 1):
        return world  # every process runs all the stages: one replica each (build_engine words a pipeline in one process)
    return resolve_layout(cfg, world).dp


def multi_process_layout(cfg: Config, world: int) -> MeshLayout | None:
    """The mesh of a launch over several processes; None for one process (all its stages in it, if any)."""
    return None if cfg.parallel.stage_devices or world == 1 else resolve_layout(cfg, world)


def splits_the_model(cfg: Config, world: int) -> bool:
    """Whether no rank is meant to hold the whole model: pipeline stages over processes, FSDP2, tensor parallel."""
    layout = multi_process_layout(cfg, world)
    return layout is not None and (layout.pp > 1 or layout.sharded)


def shards_parameters(cfg: Config, world: int) -> bool:
    """Whether each rank holds a slice of every parameter (FSDP2, HSDP, tensor parallel): the host allocator's
    choice (observe/perf.py). From the config and the world size alone, so every rank decides alike."""
    layout = multi_process_layout(cfg, world)
    return layout is not None and layout.sharded


def build_engine(cfg: Config, accelerator, model: nn.Module, init, make_optimizer: OptimizerFactory, precision: Precision, probe) -> Engine:
    """The engine for this config and launch. It takes ownership of the model (on the meta device when the model
    can start there: parallel/model_init.py), cuts it, has `init` fill the part this rank holds, and builds the optimizer
    over those parameters (`make_optimizer(module)`). `probe()`: a batch for parallel.split=time."""
    p = cfg.parallel
    refuse_unsupported(cfg, accelerator.num_processes)
    if p.stage_devices:
        if p.tp > 1 or p.dp_shard > 1:
            raise UserError(
                "parallel.stage_devices (all stages in one process) combines with data parallelism only; for parallel.tp or "
                "parallel.dp_shard leave stage_devices empty and launch one process per stage"
            )
        return InProcessPipelineEngine(cfg, accelerator, model, init, make_optimizer, precision, probe)
    if p.pipeline_stages > 1 and accelerator.num_processes == 1:
        S = p.pipeline_stages
        raise UserError(
            f"parallel.pipeline_stages={S} in one process needs parallel.stage_devices (one device per stage, e.g. "
            f"[{','.join(['cpu'] * S)}] or [{','.join(f'cuda:{i}' for i in range(S))}]), or launch {S} processes: "
            f"torchrun --nproc-per-node {S} train.py ..."
        )
    layout = resolve_layout(cfg, accelerator.num_processes)
    if layout.pp > 1:
        return MultiProcessPipelineEngine(cfg, accelerator, model, init, make_optimizer, precision, probe, layout)
    if layout.sharded:
        return MeshEngine(cfg, accelerator, model, init, make_optimizer, precision, layout)
    return DataParallelEngine(cfg, accelerator, model, make_optimizer, precision, init)


def describe(accelerator) -> str:
    """`2 processes (MULTI_CPU, backend gloo, 1 node, host h)`: the launch, for the start banner."""
    dist = accelerator.distributed_type.value
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NUM_MACHINES", "0")) or 0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    nodes = nodes or max(1, accelerator.num_processes // max(1, local))
    kind = (
        "1 process" if accelerator.num_processes == 1 else f"{accelerator.num_processes} processes"
    )  # the engine line says how they split the work
    return f"{kind} ({dist}, backend {backend}, {nodes} node{'s' if nodes > 1 else ''}, host {socket.gethostname()})"


def whole_start_notice(init: object, cfg: Config, world: int) -> str | None:
    """A notice when a model that is split over the ranks starts whole on every rank (no meta-device start)."""
    if not (isinstance(init, Whole) and splits_the_model(cfg, world)):
        return None
    return (
        f"notice: model.name={cfg.model.name} has no init_weights(name, module), so every rank builds the whole model "
        "before it is sharded; add one for a meta-device start (models/gpt.py, src/parallel_train/parallel/model_init.py)"
    )
