"""Every accelerate config validates, and every launch path that runs on CPU really forms the world it promises.

The launches are real processes (gloo); cpu.yaml's one process is forked warm with the environment accelerate gives
it. Covered elsewhere, not repeated here: `accelerate launch` with multi_cpu.yaml
(tests/test_training.py::test_two_gloo_processes_form_one_ddp_group), a one-process `accelerate launch`
(tests/test_training.py::test_cpu_flag_that_starts_one_process_is_refused) and `torchrun --nproc-per-node 2`
(tests/test_reliability.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import (
    ACCELERATE,
    PYTHON,
    REPO,
    TINY,
    TORCHRUN,
    Result,
    accelerate_args,
    accelerate_warm,
    check,
    doc_section,
    free_port,
    launch_env,
    read_metrics,
    run,
    run_together,
    summary,
)

CONFIGS = REPO / "accelerate_configs"
# name -> (distributed_type, num_processes, num_machines, mixed_precision)
EXPECTED = {
    "cpu": ("NO", 1, 1, "no"),
    "multi_cpu": ("MULTI_GPU", 2, 1, "no"),
    "single_gpu": ("NO", 1, 1, "bf16"),
    "multi_gpu": ("MULTI_GPU", 8, 1, "bf16"),
    "multi_node": ("MULTI_GPU", 16, 2, "bf16"),
    "fsdp": ("FSDP", 8, 1, "bf16"),
    "fsdp_tp": ("FSDP", 8, 1, "bf16"),
    "hsdp": ("FSDP", 8, 1, "bf16"),
    "deepspeed_zero2": ("DEEPSPEED", 8, 1, "bf16"),
    "deepspeed_zero3": ("DEEPSPEED", 8, 1, "bf16"),
}
STEPS = 6  # TINY's train.max_steps


def test_every_config_loads_validates_and_is_documented():
    from accelerate.commands.config.config_args import load_config_from_file

    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert set(EXPECTED) <= set(names), set(EXPECTED) - set(names)
    table = doc_section("topologies", "Pick a config and launch")
    for name in names:
        path = CONFIGS / f"{name}.yaml"
        config = load_config_from_file(str(path))  # accelerate's own loader: unknown keys are an error
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ") and f"accelerate launch --config_file accelerate_configs/{name}.yaml" in path.read_text(), name
        assert f"accelerate_configs/{name}.yaml" in table, f"{name}.yaml is missing from the table in docs/topologies.md"
        if name not in EXPECTED:
            continue
        dist_type, nproc, machines, precision = EXPECTED[name]
        assert (config.distributed_type.value, config.num_processes, config.num_machines, config.mixed_precision) == (
            dist_type,
            nproc,
            machines,
            precision,
        ), name
        args = accelerate_args(name)  # how `accelerate launch` reads it (nested fsdp/deepspeed keys become flags)
        assert args.num_processes == nproc and args.mixed_precision == precision, name
        assert (args.use_fsdp, args.use_deepspeed) == (dist_type == "FSDP", dist_type == "DEEPSPEED"), name
    assert accelerate_args("deepspeed_zero2").zero_stage == 2 and accelerate_args("deepspeed_zero3").zero_stage == 3
    assert accelerate_args("deepspeed_zero3").zero3_save_16bit_model is True  # else get_state_dict cannot consolidate
    for name, sizes in (("fsdp_tp", (1, 4, 2)), ("hsdp", (2, 4, 1))):  # the parallelism_config block (product = num_processes)
        args = accelerate_args(name)
        assert args.use_parallelism_config and str(args.fsdp_version) == "2", name
        assert (args.parallelism_config_dp_replicate_size, args.parallelism_config_dp_shard_size, args.parallelism_config_tp_size) == sizes
    requirements = (REPO / "requirements-deepspeed.txt").read_text()
    assert re.search(r"^deepspeed==", requirements, re.M) and re.search(r"^transformers==", requirements, re.M)


def test_multi_node_yaml_takes_the_node_values_from_the_command_line():
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = accelerate_args(
        "multi_node", "--num_processes", "4", "--machine_rank", "1", "--main_process_ip", "10.1.2.3", "--main_process_port", "29411"
    )
    prepare_multi_gpu_env(args)  # what accelerate hands to torch's elastic launcher
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "2", 1) and args.rdzv_endpoint == "10.1.2.3:29411"
    # accelerate 1.15 ignores the file's rdzv_backend (its flag defaults to "static"): the commands pass it.
    assert args.rdzv_backend == "static"
    assert accelerate_args("multi_node", "--rdzv_backend", "c10d").rdzv_backend == "c10d"
    header = (CONFIGS / "multi_node.yaml").read_text()
    assert "--rdzv_backend c10d" in header and "--rdzv_backend c10d" in (REPO / "scripts" / "launch_multinode.sh").read_text()


def test_fsdp_yaml_is_fsdp2_wrapping_every_gpt_block():
    """Build accelerate's FSDP plugin from the environment the launcher would set, and its wrap policy for our GPT."""
    from accelerate.utils import FullyShardedDataParallelPlugin, patch_environment
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.launch import prepare_multi_gpu_env

    from parallel_train.models.gpt import GPT, Block, GPTConfig

    env = prepare_multi_gpu_env(accelerate_args("fsdp"))
    with patch_environment(**{k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8), vocab_size=11)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [name for name, module in model.named_modules() if policy(module)]
    assert wrapped == ["blocks.0", "blocks.1", "blocks.2"] and all(isinstance(model.get_submodule(n), Block) for n in wrapped)


def test_more_processes_than_gpus_is_refused_with_the_fix():
    from parallel_train.errors import UserError
    from parallel_train.parallel.accelerator import check_gpus_per_node

    check_gpus_per_node(4, 4)
    with pytest.raises(UserError, match=r"8 processes were started on this node but it has 4 GPU\(s\).*--num_processes 4 train.py"):
        check_gpus_per_node(8, 4)  # multi_gpu.yaml's default of 8 on a 4-GPU machine


def test_deepspeed_style_optimizer_state_is_skipped_not_fatal():
    """DeepSpeed ZeRO's optimizer.state_dict() has flat partitions and no per-parameter "state" (DeepSpeed cannot run
    here, so a stand-in with that shape): checkpoints keep the model and say the optimizer state is missing."""
    import torch

    from parallel_train.checkpoint.named_state import RankState, load_optimizer_by_name, rank_tensors

    model = torch.nn.Linear(2, 2)

    class ZeroLikeOptimizer:
        param_groups = [{"params": list(model.parameters()), "lr": 0.1}]

        def state_dict(self):
            return {"zero_stage": 2, "base_optimizer_state": {}, "single_partition_of_fp32_groups": []}

    tensors, meta = rank_tensors(RankState(model.state_dict(), model, ZeroLikeOptimizer()))
    assert sorted(tensors) == ["model/bias", "model/weight"] and "DeepSpeed ZeRO" in meta["missing"]
    real = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_optimizer_by_name(RankState({}, model, real), {}, meta)  # a DeepSpeed checkpoint into a torch optimizer: starts fresh
    assert real.param_groups[0]["lr"] == 0.5 and not real.state


# ---------------------------------------------------------------- real launches of train.py


def assert_finished(out: Path, world: int, logs: list[Result]) -> None:
    """World size as promised, every rank reached the last checkpoint, the shared files written once."""
    assert summary(out)["world_size"] == world
    final = out / "checkpoints" / f"step_{STEPS:07d}"
    assert sorted(p.name for p in final.glob("rng_rank*.safetensors")) == [f"rng_rank{r}.safetensors" for r in range(world)]
    train_steps = [m["step"] for m in read_metrics(out) if m["kind"] == "train"]
    assert train_steps == list(range(1, STEPS + 1))  # one writer: no step logged twice
    assert sum(r.output.count("[parallel_train] done") for r in logs) == 1


def test_cpu_yaml_trains_one_process(tmp_path):
    """cpu.yaml's environment (what `accelerate launch` gives its one process), forked warm. The one-process launcher
    itself: tests/test_training.py::test_cpu_flag_that_starts_one_process_is_refused (and, slow, its SIGTERM)."""
    cmd, extra = accelerate_warm("cpu", *TINY, f"output_dir={tmp_path / 'out'}")
    r = check(run(cmd, env=launch_env(tmp_path, **extra)))
    assert extra["ACCELERATE_USE_CPU"] == "True" and extra["ACCELERATE_MIXED_PRECISION"] == "no"
    assert_finished(tmp_path / "out", 1, [r])
    assert "1 process (" in r.output


@pytest.mark.multiprocess
@pytest.mark.slow
def test_accelerate_launch_with_the_users_default_config(tmp_path):
    """`accelerate config default` writes $HF_HOME/accelerate/default_config.yaml; `accelerate launch` reads it."""
    env = launch_env(tmp_path, HF_HOME=str(tmp_path / "hf"))
    check(run([ACCELERATE, "config", "default"], env=env, timeout=120))
    assert (tmp_path / "hf" / "accelerate" / "default_config.yaml").is_file()
    r = check(run([ACCELERATE, "launch", "train.py", *TINY, f"output_dir={tmp_path / 'out'}"], env=env))
    assert_finished(tmp_path / "out", 1, [r])


def two_node_env(tmp_path: Path) -> dict[str, str]:
    return launch_env(tmp_path, HF_HOME=str(tmp_path / "hf"))  # no user default config may leak in


@pytest.mark.multiprocess
def test_two_machines_on_one_host_multi_node_yaml(tmp_path):
    """Two `accelerate launch` "machines" on one host form one job; the shared output_dir is written by rank 0 only."""
    port, out = free_port(), tmp_path / "out"
    cmds = [
        [
            ACCELERATE,
            "launch",
            "--config_file",
            "accelerate_configs/multi_node.yaml",
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--rdzv_backend",
            "c10d",
            "train.py",
            *TINY,
            f"output_dir={out}",
        ]
        for rank in (0, 1)
    ]
    # One host only: node 1's c10d agent could bind the shared port before node 0's accelerate checks that it is
    # free (a ConnectionError). Real nodes have a port each; here node 1 starts a little later.
    cmds[1] = ["sh", "-c", 'sleep 3 && exec "$@"', "sh", *cmds[1]]
    logs = [check(r) for r in run_together(cmds, [two_node_env(tmp_path)] * 2, timeout=420)]
    assert_finished(out, 2, logs)
    assert "2 processes (MULTI_CPU, backend gloo, 2 nodes" in "".join(r.output for r in logs)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_two_nodes_c10d_rendezvous(tmp_path):
    port, out = free_port(), tmp_path / "out"
    cmds = [
        [
            TORCHRUN,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "two-nodes",
            "train.py",
            *TINY,
            f"output_dir={out}",
        ]
        for rank in (0, 1)
    ]
    logs = run_together(cmds, [two_node_env(tmp_path)] * 2, timeout=420)
    for r in logs:
        if r.returncode != 0:
            # torch elastic's shutdown race, after every worker succeeded: the agent that hosts the c10d store may
            # exit first, and the other agent's last poll of the store then fails. Anything else is a failure.
            assert "has failed to shutdown the rendezvous" in r.stderr and "RendezvousConnectionError" in r.stderr, check(r)
    assert_finished(out, 2, logs)


# ---------------------------------------------------------------- two network namespaces, a real interface between them


def can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        return False
    probe = f"ptprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_in_network_namespaces_over_a_veth_pair(tmp_path):
    """Each "node" in its own network namespace (own address, own hostname), joined by a veth pair: the
    rendezvous and gloo cross a real interface. Runs the pre-flight, then training, via scripts/launch_multinode.sh."""
    if not can_make_namespaces():
        pytest.skip("needs root, iproute2 (apt-get install -y iproute2) and network namespaces")
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    nodes = [{"ns": f"pt{tag}n{i}", "dev": f"pt{tag}v{i}", "ip": f"{subnet}.{i + 1}", "host": f"pt-node{i}"} for i in (0, 1)]
    hosts = "127.0.0.1 localhost\n" + "".join(f"{n['ip']} {n['host']}\n" for n in nodes)

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    try:
        for n in nodes:
            sh("ip", "netns", "add", n["ns"])
            Path(f"/etc/netns/{n['ns']}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{n['ns']}/hosts").write_text(hosts)  # `ip netns exec` mounts it over /etc/hosts
        sh("ip", "link", "add", nodes[0]["dev"], "type", "veth", "peer", "name", nodes[1]["dev"])
        for n in nodes:
            sh("ip", "link", "set", n["dev"], "netns", n["ns"])
            sh("ip", "-n", n["ns"], "addr", "add", f"{n['ip']}/24", "dev", n["dev"])
            sh("ip", "-n", n["ns"], "link", "set", n["dev"], "up")
            sh("ip", "-n", n["ns"], "link", "set", "lo", "up")

        def launch(script: str, *args: str) -> list[Result]:
            cmds, envs = [], []
            for rank, n in enumerate(nodes):
                cmds.append(
                    [
                        "ip",
                        "netns",
                        "exec",
                        n["ns"],
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        f'hostname {n["host"]} && exec bash scripts/launch_multinode.sh "$@"',
                        "sh",
                        *args,
                    ]
                )
                envs.append(
                    launch_env(
                        tmp_path,
                        HF_HOME=str(tmp_path / "hf"),
                        NODE_RANK=str(rank),
                        NNODES="2",
                        GPUS_PER_NODE="1",
                        MASTER_ADDR=nodes[0]["ip"],
                        MASTER_PORT="29400",
                        SCRIPT=script,
                        ACCELERATE=ACCELERATE,
                        GLOO_SOCKET_IFNAME=n["dev"],
                        PATH=f"{Path(PYTHON).parent}:{os.environ['PATH']}",
                    )
                )
            return [check(r) for r in run_together(cmds, envs, timeout=600)]

        pre = launch("scripts/check_env.py", "--sizes", "64K,4M", "--json", str(tmp_path / "preflight.json"))
        assert "[check_env] 2 rank(s) on 2 host(s)" in "".join(r.output for r in pre)
        report = json.loads((tmp_path / "preflight.json").read_text())
        seen = {r["host"]: r["GLOO_SOCKET_IFNAME"] for r in report["ranks"]}  # each node sees only its own end
        assert seen == {n["host"]: f"{n['dev']} -> {n['dev']} {n['ip']}" for n in nodes}, seen
        assert report["problems"] == [] and all(b["busbw_GBps"] > 0 for b in report["allreduce"])
        out = tmp_path / "out"
        logs = launch("train.py", *TINY, f"output_dir={out}")
        assert_finished(out, 2, logs)
        assert "2 nodes, host pt-node" in "".join(r.output for r in logs)
    finally:
        for n in nodes:
            subprocess.run(["ip", "netns", "del", n["ns"]], capture_output=True)  # also removes its end of the veth pair
            shutil.rmtree(f"/etc/netns/{n['ns']}", ignore_errors=True)
