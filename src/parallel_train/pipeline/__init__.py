"""Pipeline (model) parallelism: split a model into stages by module name and run them on several
devices in one process (executor 1, inprocess.py) or one stage per process (executor 2, distributed.py).

Which one runs: `parallel.stage_devices` given -> executor 1 in every process (DDP across processes);
not given and more than one process -> executor 2. The trainer prints the engine's name at start.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel_train.config import Config
from parallel_train.errors import UserError


def build_pipeline_engine(cfg: Config, accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, val_loader):
    p = cfg.parallel
    if p.stage_devices:
        from parallel_train.pipeline.inprocess import InProcessPipelineEngine

        return InProcessPipelineEngine(cfg, accelerator, model, optimizer, val_loader)
    if accelerator.num_processes > 1:
        from parallel_train.pipeline.distributed import MultiProcessPipelineEngine

        return MultiProcessPipelineEngine(cfg, accelerator, model, optimizer, val_loader)
    S = p.pipeline_stages
    raise UserError(
        f"parallel.pipeline_stages={S} in one process needs parallel.stage_devices (one device per stage, e.g. "
        f"[{','.join(['cpu'] * S)}] or [{','.join(f'cuda:{i}' for i in range(S))}]), or launch {S} processes: "
        f"torchrun --nproc-per-node {S} train.py ..."
    )
