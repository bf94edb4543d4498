#!/usr/bin/env python3
"""Pre-flight check before a long (multi-node) run: the same software on every rank, a working network, its speed.

Start it exactly like the training run, with the same launcher, nodes and processes:

    python scripts/check_env.py                                   # this machine, one process
    torchrun --nproc-per-node 8 scripts/check_env.py              # or --nnodes 2 --rdzv-backend c10d ...
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank R ... scripts/check_env.py
    srun --ntasks-per-node 8 python scripts/check_env.py          # SLURM, one task per GPU, no launcher

Every rank reports its host, Python, torch, CUDA, NCCL, gloo, accelerate and datasets versions and its devices,
and checks NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (the interfaces exist and are up) and MASTER_ADDR:MASTER_PORT
(resolves; reachable). Rank 0 prints one table, then times an all-reduce of a few sizes (latency, algorithm and
bus bandwidth as nccl-tests reports them: busbw = algbw * 2(n-1)/n).
Exit code 0: all good. 1: a problem, named with its ranks and hosts. 2: bad arguments.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone, no install step
from parallel_train.errors import OneLineParser  # noqa: E402 (errors.py imports nothing of the template)

# The columns that must be equal on every rank (device names may differ on purpose: only a warning).
VERSIONS = ("python", "torch", "cuda", "nccl", "gloo", "accelerate", "datasets")
# Test-only: "RANK:key=value[,RANK:key=value]" makes that rank report a fake value, to prove mismatch detection.
FAKE_ENV = "PARALLEL_TRAIN_CHECK_ENV_FAKE"


# ---------------------------------------------------------------- who am I (any launcher)


def launch_info() -> dict:
    """Rank, world size and rendezvous address from torchrun/accelerate, from srun, or a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, accelerate launch (both use torch's elastic agent)
        launcher = "torchrun/accelerate" if "TORCHELASTIC_RUN_ID" in env else "env"
        return {
            "rank": int(env["RANK"]),
            "world": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "launcher": launcher,
            "addr": env.get("MASTER_ADDR", "127.0.0.1"),
            "port": int(env.get("MASTER_PORT", 29500)),
        }
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun python scripts/check_env.py: one task per process
        addr = env.get("MASTER_ADDR") or slurm_head_node()
        port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return {
            "rank": int(env["SLURM_PROCID"]),
            "world": int(env["SLURM_NTASKS"]),
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "launcher": "srun",
            "addr": addr,
            "port": port,
        }
    return {"rank": 0, "world": 1, "local_rank": 0, "launcher": "python", "addr": "127.0.0.1", "port": free_port()}


def slurm_head_node() -> str:
    try:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True, text=True, check=True
        ).stdout.split()
        return hosts[0]
    except (OSError, KeyError, IndexError, subprocess.CalledProcessError):
        return os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- what do I have


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def devices() -> str:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    return f"cpu ({os.cpu_count()} cores)"


def local_report(info: dict) -> dict:
    nccl = "none"
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    report = {
        "rank": info["rank"],
        "local_rank": info["local_rank"],
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "nccl": nccl,
        "gloo": "yes" if dist.is_gloo_available() else "no",
        "accelerate": version("accelerate"),
        "datasets": version("datasets"),
        "devices": devices(),
    }
    for item in filter(None, os.environ.get(FAKE_ENV, "").split(",")):
        rank, _, assignment = item.partition(":")
        key, _, value = assignment.partition("=")
        if int(rank) == info["rank"]:
            report[key] = value
    return report


# ---------------------------------------------------------------- network settings


def interfaces() -> dict[str, bool]:
    """Network interfaces of this host (this network namespace) -> is it up (IFF_UP)."""
    result = {}
    for path in sorted(Path("/sys/class/net").glob("*")):
        try:
            result[path.name] = bool(int((path / "flags").read_text(), 16) & 0x1)
        except (OSError, ValueError):
            result[path.name] = False
    return result


def ipv4_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24])
        except OSError:
            return None


def check_ifname(var: str, have: dict[str, bool]) -> tuple[str, list[str]]:
    """NCCL_SOCKET_IFNAME takes prefixes, `=` for exact names, `^` to exclude; GLOO_SOCKET_IFNAME exact names."""
    value = os.environ.get(var, "")
    if not value:
        return "unset (auto)", []
    spec = value
    if spec.startswith("^"):
        return f"{value} (exclude list)", []
    exact = var.startswith("GLOO") or spec.startswith("=")
    problems, chosen = [], []
    for entry in filter(None, spec.lstrip("=").split(",")):
        matches = [n for n in have if (n == entry if exact else n.startswith(entry))]
        if not matches:
            problems.append(f"{var}={value}: no interface {entry!r}{'' if exact else '*'} on this host (it has: {', '.join(have)})")
        elif not any(have[n] for n in matches):
            problems.append(f"{var}={value}: interface {', '.join(matches)} is down")
        chosen += [f"{n} {ipv4_address(n) or 'no IPv4'}" for n in matches if have[n]]
    return f"{value} -> {'; '.join(chosen) or 'nothing usable'}", problems


def check_master(info: dict) -> tuple[str, list[str]]:
    """MASTER_ADDR resolves; under torchrun/accelerate the agent's store already listens there, so connect."""
    addr, port = info["addr"], info["port"]
    if port == 0:  # `torchrun --master-port 0` hands port 0 to the workers instead of a free port
        return f"{addr}:0", ["MASTER_PORT is 0: torchrun does not pick a free port for its workers; give a free port (e.g. 29400)"]
    try:
        ip = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        return f"{addr}:{port}", [
            f"MASTER_ADDR {addr!r} does not resolve on this host ({e.strerror}); give an address or a name in /etc/hosts"
        ]
    where = f"{addr}:{port} ({ip})"
    if info["launcher"] == "torchrun/accelerate" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        try:
            socket.create_connection((ip, port), timeout=10).close()
        except OSError as e:
            return where, [f"cannot reach the rendezvous store at {where}: {e.strerror or e}; check the address, the port and firewalls"]
        return where + " reachable", []
    if info["rank"] == 0 and info["launcher"] in ("srun", "python"):
        try:  # rank 0 will host the store here: the port must be free
            with socket.socket() as s:
                s.bind(("", port))
        except OSError as e:
            return where, [f"MASTER_PORT {port} cannot be used on this host ({e.strerror}); choose another port"]
    return where, []


def hostname_problem() -> str | None:
    """c10d rendezvous tells the other nodes this host's name: it must not resolve to loopback."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"hostname {socket.gethostname()!r} does not resolve"
    if ip.startswith("127."):
        return f"hostname {socket.gethostname()!r} resolves to {ip} (loopback) here: other nodes cannot reach it by name"
    return None


# ---------------------------------------------------------------- rank 0: compare and print


def mismatches(reports: list[dict]) -> list[str]:
    """One line per version that differs: which ranks (and hosts) differ from rank 0."""
    problems = []
    ref = reports[0]
    for key in VERSIONS:
        odd = [r for r in reports if r[key] != ref[key]]
        if odd:
            who = ", ".join(f"rank {r['rank']} ({r['host']}) has {r[key]}" for r in odd)
            problems.append(f"version mismatch: {key} differs across ranks: {who}; rank 0 ({ref['host']}) has {ref[key]}")
    return problems


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(row) for row in cells)])


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def allreduce_bench(sizes: list[int], iters: int, device: torch.device, world: int) -> list[dict]:
    """Time all_reduce(SUM) of float32 buffers; the slowest rank's time counts, as in nccl-tests."""
    check = torch.full((4,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(check)
    if not torch.all(check == world * (world + 1) / 2):
        raise RuntimeError(f"all_reduce returned {check.tolist()}, expected {world * (world + 1) / 2}: the network corrupts data")
    results = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4), device=device)
        for _ in range(2):  # warm-up: connections, buffers
            dist.all_reduce(buf)
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync(device)
        seconds = torch.tensor([(time.perf_counter() - t0) / iters], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        t = seconds.item()
        nbytes = buf.numel() * 4
        algbw = nbytes / t / 1e9
        results.append({"bytes": nbytes, "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world - 1) / world})
    return results


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def human(nbytes: int) -> str:
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:g}{unit}"
    return f"{nbytes}"


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8K,1M,16M", help="all-reduce sizes in bytes (K/M/G suffixes), comma-separated")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces per size")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for every rank to join")
    parser.add_argument("--no-bench", action="store_true", help="skip the all-reduce timing")
    parser.add_argument("--json", help="rank 0 also writes the full report to this file")
    args = parser.parse_args(argv)
    if args.iters < 1 or not args.timeout > 0:
        parser.error(f"--iters must be >= 1 and --timeout > 0, got {args.iters} and {args.timeout:g}")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # written at the end: say it before the checks
        parser.error(f"--json {args.json}: its folder does not exist; give a file in an existing folder")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except (ValueError, IndexError):
        print(f"error: --sizes {args.sizes!r}: give sizes like 8K,1M,16M", file=sys.stderr)
        return 2

    info = launch_info()
    rank, world = info["rank"], info["world"]
    report = local_report(info)
    have = interfaces()
    problems = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        report[var], found = check_ifname(var, have)
        problems += found
    report["master"], found = check_master(info)
    problems += found
    report["hostname_warning"] = hostname_problem()
    report["problems"] = problems
    for p in problems:  # on this rank's own log too: if the group never forms, rank 0 cannot print them
        print(f"[check_env] rank {rank} ({report['host']}): FAIL {p}", file=sys.stderr, flush=True)
    if problems:
        return 1  # joining would fail or hang until the timeout; the problems are printed above

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(info["local_rank"])
    device = torch.device("cuda", info["local_rank"]) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", info["addr"])
    os.environ.setdefault("MASTER_PORT", str(info["port"]))
    try:
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method="env://", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout)
        )
    except Exception as e:  # noqa: BLE001 (any failure to join is reported the same way)
        print(
            f"[check_env] rank {rank} ({report['host']}): FAIL could not join the process group at {report['master']} "
            f"within {args.timeout:g} s: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    reports: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(reports, report)

    problems = [f"rank {r['rank']} ({r['host']}): {p}" for r in reports for p in r["problems"]] + mismatches(reports)
    warnings = []
    if len({r["host"] for r in reports}) > 1:
        warnings += [f"rank {r['rank']}: {r['hostname_warning']}" for r in reports if r["hostname_warning"] and r["local_rank"] == 0]
    if len({r["devices"] for r in reports}) > 1:
        warnings.append("the ranks see different devices (see the table)")
    bench = []
    if not problems and not args.no_bench and world > 1:
        bench = allreduce_bench(sizes, args.iters, device, world)

    if rank == 0:
        print(
            f"[check_env] {world} rank(s) on {len({r['host'] for r in reports})} host(s), launcher {info['launcher']}, "
            f"backend {dist.get_backend()}, master {report['master']}"
        )
        print(table(reports, ["rank", "host", "local_rank", *VERSIONS, "devices"]))
        print(table(reports, ["rank", "host", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"]))
        if bench:
            print(f"all_reduce (float32, sum, {world} ranks, mean of {args.iters}, slowest rank):")
            rows = [
                {
                    "size": human(b["bytes"]),
                    "time (us)": f"{b['time_us']:.1f}",
                    "algbw (GB/s)": f"{b['algbw_GBps']:.3f}",
                    "busbw (GB/s)": f"{b['busbw_GBps']:.3f}",
                }
                for b in bench
            ]
            print(table(rows, ["size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"]))
        for w in warnings:
            print(f"[check_env] warning: {w}")
        for p in problems:
            print(f"[check_env] FAIL {p}")
        print("[check_env] " + ("FAILED: fix the problems above before training" if problems else "OK: all ranks agree"), flush=True)
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "world_size": world,
                        "launcher": info["launcher"],
                        "ranks": reports,
                        "problems": problems,
                        "warnings": warnings,
                        "allreduce": bench,
                    },
                    indent=1,
                )
            )
    dist.barrier()
    dist.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
