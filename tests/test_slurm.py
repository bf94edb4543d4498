"""SLURM batch scripts and the no-SLURM multi-node recipe: valid shell, and the exact commands they would run.

SLURM cannot run here: the tests render the commands for a fake allocation (SLURM_* variables and a stub
`scontrol` on PATH), then parse them with accelerate's and torchrun's own argument parsers.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, launch_env

SCRIPTS = ["scripts/launch_multinode.sh", "scripts/slurm/train_multinode.sbatch", "scripts/slurm/train_single_node.sbatch"]


SETTINGS = (
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "GPUS_PER_NODE",
    "LAUNCHER",
    "CONFIG",
    "SCRIPT",
    "MAX_RESTARTS",
    "RDZV_ID",
    "PREFLIGHT",
    "DRY_RUN",
)


def bash(script: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in launch_env().items() if not k.startswith("SLURM_") and k not in SETTINGS}  # a CI job may run under SLURM
    return subprocess.run(["bash", script, *args], cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=60)


def accelerate_args(command: str):
    from accelerate.commands.launch import launch_command_parser

    argv = shlex.split(command)
    assert argv[:2] == ["accelerate", "launch"], command
    return launch_command_parser().parse_args(argv[2:])


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_valid_bash(script):
    r = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert Path(REPO / script).read_text().startswith("#!")


@pytest.fixture
def fake_allocation(tmp_path) -> dict[str, str]:
    """Two nodes gpu-a01, gpu-a02 with 4 GPUs each, as sbatch would describe them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu-a[01-02]" ] && printf "gpu-a01\\ngpu-a02\\n"\n')
    scontrol.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-a[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_SUBMIT_DIR": str(REPO),
    }


def test_multinode_sbatch_renders_one_launcher_per_node(fake_allocation):
    r = bash(
        "scripts/slurm/train_multinode.sbatch",
        "--dry-run",
        "--config",
        "configs/shakespeare_char_cpu.yaml",
        "train.max_steps=100",
        **fake_allocation,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = lines[0]
    assert header.startswith("# allocation: 2 nodes (gpu-a01 gpu-a02), 4 processes per node, head gpu-a01:")
    port = int(header.rsplit(":", 1)[1])
    assert 0 < port < 65536
    # Pre-flight, then training: one srun, one launcher per node.
    srun = [line for line in lines if "srun " in line]
    assert srun[0] == "SCRIPT=scripts/check_env.py srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash scripts/launch_multinode.sh"
    assert srun[1] == (
        "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash scripts/launch_multinode.sh "
        "--config configs/shakespeare_char_cpu.yaml train.max_steps=100"
    )
    nodes = [line.split(": ", 1)[1] for line in lines if line.startswith("  node ")]
    assert len(nodes) == 4  # (pre-flight + training) x 2 nodes
    for rank, command in enumerate(nodes[2:]):
        args = accelerate_args(command)
        assert args.config_file == "accelerate_configs/multi_node.yaml" and args.rdzv_backend == "c10d"
        assert (args.num_machines, args.num_processes, args.machine_rank) == (2, 8, rank)
        assert (args.main_process_ip, args.main_process_port) == ("gpu-a01", port)
        assert args.training_script == "train.py" and args.training_script_args == [
            "--config",
            "configs/shakespeare_char_cpu.yaml",
            "train.max_steps=100",
        ]
    assert accelerate_args(nodes[0]).training_script == "scripts/check_env.py"


def test_multinode_sbatch_with_torchrun_and_restarts(fake_allocation):
    from torch.distributed.run import get_args_parser

    r = bash(
        "scripts/slurm/train_multinode.sbatch",
        "--dry-run",
        "x=1",
        LAUNCHER="torchrun",
        MASTER_PORT="29411",
        MAX_RESTARTS="3",
        PREFLIGHT="0",
        **fake_allocation,
    )
    assert r.returncode == 0, r.stderr
    nodes = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if line.startswith("  node ")]
    assert len(nodes) == 2 and "pre-flight" not in r.stdout
    for rank, command in enumerate(nodes):
        argv = shlex.split(command)
        assert argv[0] == "torchrun"
        args = get_args_parser().parse_args(argv[1:])
        assert (args.nnodes, args.nproc_per_node, args.node_rank, args.max_restarts) == ("2", "4", rank, 3)
        assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "gpu-a01:29411", "4242")
        assert (args.training_script, args.training_script_args) == ("train.py", ["x=1"])


def test_single_node_sbatch_renders():
    r = bash(
        "scripts/slurm/train_single_node.sbatch", "--dry-run", "train.max_steps=100", SLURM_GPUS_ON_NODE="4", SLURM_SUBMIT_DIR=str(REPO)
    )
    assert r.returncode == 0, r.stderr
    preflight, train = r.stdout.splitlines()
    assert preflight.startswith("srun --nodes=1 --ntasks=1 accelerate launch") and preflight.endswith("scripts/check_env.py")
    args = accelerate_args(train.removeprefix("srun --nodes=1 --ntasks=1 "))
    assert (args.config_file, args.num_processes, args.main_process_port) == ("accelerate_configs/multi_gpu.yaml", 4, 0)
    assert args.training_script == "train.py" and args.training_script_args == ["train.max_steps=100"]


def test_launch_multinode_renders_and_refuses_missing_settings():
    r = bash(
        "scripts/launch_multinode.sh",
        "--dry-run",
        "train.max_steps=5",
        NODE_RANK="1",
        MASTER_ADDR="10.0.0.1",
        GPUS_PER_NODE="8",
        MAX_RESTARTS="2",
    )
    assert r.returncode == 0, r.stderr
    args = accelerate_args(r.stdout.strip())
    assert (args.num_machines, args.num_processes, args.machine_rank, args.max_restarts) == (2, 16, 1, 2)
    assert (args.main_process_ip, args.main_process_port, args.rdzv_backend) == ("10.0.0.1", 29400, "c10d")
    assert args.training_script_args == ["train.max_steps=5"]
    for env, message in [
        ({"MASTER_ADDR": "h"}, "error: NODE_RANK is not set"),
        ({"NODE_RANK": "0"}, "error: MASTER_ADDR is not set"),
        ({"NODE_RANK": "2", "MASTER_ADDR": "h"}, "error: NODE_RANK=2: must be 0 .. 1 for NNODES=2"),
        ({"NODE_RANK": "0", "MASTER_ADDR": "h", "LAUNCHER": "mpirun"}, "error: LAUNCHER=mpirun"),
    ]:
        r = bash("scripts/launch_multinode.sh", "--dry-run", **env)
        assert r.returncode == 2 and r.stderr.startswith(message), (env, r.stderr)


def test_sbatch_outside_slurm_says_so():
    r = bash("scripts/slurm/train_multinode.sbatch", "--dry-run")
    assert r.returncode == 2 and "error: not inside a SLURM allocation" in r.stderr
