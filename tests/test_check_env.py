"""scripts/check_env.py: the pre-flight check, under python, accelerate launch, torchrun and srun-style env."""

from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import ACCELERATE, PYTHON, REPO, WarmCmd, check, free_port, launch_env, run, run_together, warm_script

SCRIPT = str(REPO / "scripts" / "check_env.py")


def load_module():
    spec = importlib.util.spec_from_file_location("check_env", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interface_rules_sizes_and_mismatch_report(monkeypatch):
    ce = load_module()
    have = {"lo": True, "eth0": True, "eth1": False, "ib0": False}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth")  # NCCL: a prefix
    assert ce.check_ifname("NCCL_SOCKET_IFNAME", have)[1] == []
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=eth")  # exact: no interface is called "eth"
    assert "no interface 'eth'" in ce.check_ifname("NCCL_SOCKET_IFNAME", have)[1][0]
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^docker,lo")  # exclusions need no check
    assert ce.check_ifname("NCCL_SOCKET_IFNAME", have)[1] == []
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert ce.check_ifname("GLOO_SOCKET_IFNAME", have)[1] == ["GLOO_SOCKET_IFNAME=ib0: interface ib0 is down"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth")  # gloo takes exact names
    assert "no interface 'eth' on this host" in ce.check_ifname("GLOO_SOCKET_IFNAME", have)[1][0]
    assert [ce.parse_size(s) for s in ("8K", "1M", "2GB", "100")] == [8192, 2**20, 2**31, 100]
    base = {
        "host": "a",
        "python": "3.11",
        "torch": "2.13",
        "cuda": "12.8",
        "nccl": "2.27",
        "gloo": "yes",
        "accelerate": "1.15",
        "datasets": "5.2",
    }
    reports = [dict(base, rank=0), dict(base, rank=1, host="b", torch="2.12"), dict(base, rank=2, host="b", torch="2.12")]
    assert ce.mismatches(reports) == [
        "version mismatch: torch differs across ranks: rank 1 (b) has 2.12, rank 2 (b) has 2.12; rank 0 (a) has 2.13"
    ]


def test_single_process_passes_and_a_missing_interface_fails(tmp_path):
    r = check(run(warm_script(SCRIPT, "--json", str(tmp_path / "report.json")), env=launch_env(tmp_path), timeout=120))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 1 and report["launcher"] == "python" and report["problems"] == []
    assert "OK: all ranks agree" in r.stdout and "torch" in r.stdout.splitlines()[1]
    r = run(warm_script(SCRIPT), env=launch_env(tmp_path, GLOO_SOCKET_IFNAME="nosuchif9"), timeout=120)
    assert r.returncode == 1 and "GLOO_SOCKET_IFNAME=nosuchif9: no interface 'nosuchif9' on this host" in r.stderr


@pytest.mark.multiprocess
def test_two_ranks_table_allreduce_and_version_mismatch(tmp_path):
    # accelerate launch: every rank joins, one table, all-reduce timings with nccl-tests' bus bandwidth.
    env = launch_env(tmp_path, GLOO_SOCKET_IFNAME="lo")
    r = check(
        run(
            [
                ACCELERATE,
                "launch",
                "--config_file",
                "accelerate_configs/multi_cpu.yaml",
                SCRIPT,
                "--sizes",
                "4K,256K",
                "--iters",
                "3",
                "--json",
                str(tmp_path / "ok.json"),
            ],
            env=env,
            timeout=240,
        )
    )
    report = json.loads((tmp_path / "ok.json").read_text())
    assert report["world_size"] == 2 and [x["rank"] for x in report["ranks"]] == [0, 1] and report["problems"] == []
    assert [b["bytes"] for b in report["allreduce"]] == [4096, 262144]
    for b in report["allreduce"]:  # n = 2: busbw = algbw * 2(n-1)/n = algbw
        assert b["time_us"] > 0 and b["busbw_GBps"] == pytest.approx(b["algbw_GBps"])
    assert r.stdout.count("[check_env] 2 rank(s) on 1 host(s)") == 1 and "lo -> lo 127.0.0.1" in r.stdout

    # Rank 1 pretends to run another torch: rank 0 names it and every rank exits 1 (2 ranks forked warm, as torchrun
    # would start them: the launch itself was shown above).
    fake = launch_env(tmp_path, PARALLEL_TRAIN_CHECK_ENV_FAKE="1:torch=0.0.0-fake")
    r = run(WarmCmd(2, "scripts/check_env.py", ("--no-bench",)), env=fake, timeout=240)
    assert r.returncode != 0
    assert "FAIL version mismatch: torch differs across ranks: rank 1 (" in r.stdout and "has 0.0.0-fake" in r.stdout
    assert "FAILED: fix the problems above" in r.stdout


@pytest.mark.multiprocess
def test_srun_style_environment_without_a_launcher(tmp_path):
    """What `srun --ntasks 2 python scripts/check_env.py` gives each task: SLURM_* variables, no RANK."""
    port = free_port()
    envs = []
    for task in (0, 1):
        env = launch_env(
            tmp_path,
            SLURM_PROCID=str(task),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(task),
            SLURM_JOB_ID="4242",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(name, None)
        envs.append(env)
    results = run_together([[PYTHON, SCRIPT, "--sizes", "4K", "--json", str(tmp_path / "srun.json")]] * 2, envs, timeout=180)
    for r in results:
        check(r)
    report = json.loads((tmp_path / "srun.json").read_text())
    assert report["launcher"] == "srun" and report["world_size"] == 2 and len(report["allreduce"]) == 1
