"""Build the Accelerator for whatever launched us, and refuse launches that would silently go wrong.

The same train.py runs under `python`, `accelerate launch` (any config) and `torchrun`. This module:
- falls back to CPU processes (gloo) when no GPU exists, with one notice, so GPU configs rehearse on a laptop;
- leaves mixed precision to the template (parallel/precision.py: the same autocast and loss scaler on every engine, on
  CPU and GPU), except under DeepSpeed, whose engine takes it from accelerate;
- checks that the process group really has the size the launcher was asked for (accelerate's `--cpu`
  and MULTI_CPU-without-mpirun paths start ONE process without a word);
- says in one line when DeepSpeed cannot run here and what runs instead (FSDP runs on CPU too: the mesh
  engine shards with plain torch, parallel/mesh_engine.py).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.parallel.elastic import init_process_group_for_restarts

TRUE = ("1", "true", "yes")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in TRUE


def requested_precision(cfg: Config) -> str:
    if cfg.train.mixed_precision != "auto":
        return cfg.train.mixed_precision
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()


def _parent_accelerate_num_processes() -> int | None:
    """How many processes the parent `accelerate launch` was asked for, if it is our parent."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if "launch" not in argv or not any(Path(a).name.startswith("accelerate") for a in argv[:3]):
        return None
    args = argv[argv.index("launch") + 1 :]
    config_file = None
    for i, a in enumerate(args):
        for flag in ("--num_processes", "--num-processes"):
            if a == flag and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
        if a in ("--config_file", "--config-file") and i + 1 < len(args):
            config_file = args[i + 1]
        if a.startswith(("--config_file=", "--config-file=")):
            config_file = a.split("=", 1)[1]
        if not a.startswith("-") and a.endswith(".py"):
            break
    if config_file is None:
        from accelerate.commands.config import default_config_file

        config_file = default_config_file
    try:
        import yaml

        return int(yaml.safe_load(Path(config_file).read_text()).get("num_processes", 1))
    except Exception:
        return None


def deepspeed_runs(cuda: bool | None = None) -> bool:
    """A DeepSpeed launch config on a machine with GPUs (without them accelerate runs DDP instead)."""
    return _env_true("ACCELERATE_USE_DEEPSPEED") and (torch.cuda.is_available() if cuda is None else cuda)


def make_accelerator(cfg: Config, notice) -> Accelerator:  # noqa: F821 (lazy import below)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    precision = requested_precision(cfg)
    if cuda:
        check_gpus_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    if (
        not cuda
        and not _env_true("ACCELERATE_USE_CPU")
        and (int(os.environ.get("WORLD_SIZE", "1")) > 1 or "ACCELERATE_DYNAMO_BACKEND" in os.environ)
    ):
        notice("no CUDA GPU found: running these processes on CPU (gloo backend) instead")
    if _env_true("ACCELERATE_USE_DEEPSPEED") and not cuda:
        notice("DeepSpeed needs GPUs; on CPU accelerate falls back to plain DDP, so this run is DDP, not DeepSpeed")
    # A launch config's parallelism_config block: the template builds the device mesh itself (parallel/mesh.py reads the
    # sizes from PARALLELISM_CONFIG_* with accelerate's ParallelismConfig), on CPU as on GPU. Left set, the
    # Accelerator would build a second mesh without the pipeline axis, and refuse to on CPU (not "multi-device").
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    if _env_true("ACCELERATE_USE_DEEPSPEED") and cuda:
        notice(
            "DeepSpeed ZeRO: checkpoints hold the whole model but not the optimizer state (ZeRO partitions it); "
            "a resumed run restarts the optimizer's moments. accelerate_configs/fsdp.yaml keeps them"
        )

    log_with = None if cfg.tracker == "none" else cfg.tracker
    init_process_group_for_restarts(cfg.parallel.timeout_s)  # only under torchrun/accelerate --max-restarts N
    accelerator = Accelerator(
        cpu=not cuda,
        mixed_precision=precision if deepspeed_runs(cuda) else "no",  # parallel/precision.py does it on every other engine
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        log_with=log_with,
        project_dir=cfg.output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.parallel.timeout_s))],
    )
    check_world_size(accelerator)
    return accelerator


def check_gpus_per_node(processes: int, gpus: int) -> None:
    """One process per GPU: more processes than GPUs on a node would fail deep inside CUDA (invalid device ordinal)."""
    if processes > gpus:
        raise UserError(
            f"{processes} processes were started on this node but it has {gpus} GPU(s): start one process per GPU, "
            f"e.g. `accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes {gpus} train.py` "
            f"(on N nodes: --num_processes {gpus}xN)"
        )


def check_world_size(accelerator) -> None:
    """Fail, rather than train on fewer processes than the launcher was asked for."""
    expected = int(os.environ.get("WORLD_SIZE", "0")) or _parent_accelerate_num_processes() or 1
    if accelerator.num_processes != expected:
        raise UserError(
            f"the launcher was asked for {expected} processes but {accelerator.num_processes} formed the process group. "
            "On CPU, `accelerate launch --cpu --num_processes N` and MULTI_CPU configs without mpirun start one process: "
            "use `accelerate launch --config_file accelerate_configs/multi_cpu.yaml train.py` or `torchrun --nproc-per-node N train.py`"
        )
