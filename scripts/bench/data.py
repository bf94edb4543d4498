#!/usr/bin/env python3
"""Data at scale, measured: memory and start-up against corpus size, prepare throughput, data wait per step.

    python scripts/bench/data.py                     all three tables (about 25 minutes on 2 cores; 6 GB of disk under /tmp)
    python scripts/bench/data.py --tables rss --sizes 10,100
    python scripts/bench/data.py --update-docs       also write the tables into docs/BENCHMARKS.md
    python scripts/bench/data.py --bpc runs/shakespeare_bpe runs/default     val loss in bits per character

1. rss: corpora of 10 MB, 100 MB, 1 GB (Tiny Shakespeare repeated) under --work. Each is trained on for 5 steps
   in a fresh `python train.py` (the baseline GPT), once by today's in-memory path (data.path=FILE) and once
   prepared (scripts/prepare_data.py --tokenizer char, then data.path=FOLDER). Peak RSS is the process's own
   (wait4's ru_maxrss), time to first step is summary.json's (from process start: imports count). The in-memory
   path is not run above --old-max-mb: at about 16 bytes per byte of text it would need 16 GB for 1 GB.
2. throughput: MB of text per second that prepare_data.py turns into shards (char, byte, bpe:8192 trained
   here, and that BPE's tokenizer.json: encoding only) at num_proc 1 and 2, next to nanoGPT's method on the
   same text (its data/openwebtext/prepare.py: an unbatched `datasets.map(num_proc)` appending the
   end-of-text token, then 1024 contiguous shards concatenated into one np.memmap), with the same tokenizers
   (tiktoken downloads its files; there is no network here). The text is a jsonl of 4 KB documents.
3. datatime: data_time_frac (the share of a step spent waiting for the batch) on prepared data, for the
   baseline config and for a 124M-shaped GPT (configs/gpt2_124m.yaml at batch 2, fp32, no compile: on CPU a
   step takes seconds, so the absolute wait per step is the figure to carry to a GPU), one thread each; and the
   train loader alone (no model) at each config's micro-batch, prepared and in memory.
Writes WORK/bench_data.json and prints the tables; the corpora are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import DOC, REPO, update_docs

from parallel_train.core.json_text import json_text  # JSON without NaN (null instead)

PYTHON = sys.executable
DOC_START, DOC_END = "<!-- bench_data:start -->", "<!-- bench_data:end -->"
STEPS5 = ("train.max_steps=5", "eval.iters=10", "checkpoint.interval=0", "tracker=none", "resume=none", "train.log_interval=5")


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def measured(cmd: list[str], timeout: float = 3600, threads: int | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS of the process in MB, its output): wait4 reports the child's own maximum RSS."""
    t = time.perf_counter()
    environment = {**env(), "OMP_NUM_THREADS": str(threads)} if threads else env()
    proc = subprocess.Popen(cmd, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    out = proc.stdout.read()  # until the process closes it (it exits)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or time.monotonic() > deadline:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return time.perf_counter() - t, usage.ru_maxrss / 1024, out


def make_corpus(path: Path, mb: int) -> Path:
    if not path.exists() or path.stat().st_size < mb * 10**6:
        base = (REPO / "data" / "tinyshakespeare.txt").read_bytes()
        with open(path, "wb") as f:
            for _ in range(mb * 10**6 // len(base) + 1):
                f.write(base)
    return path


def load() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------- 1. memory and start-up against corpus size


def rss_table(work: Path, sizes: list[int], old_max_mb: int) -> list[dict]:
    rows = []
    for mb in sizes:
        corpus = make_corpus(work / f"corpus_{mb}mb.txt", mb)
        prepared = work / f"prepared_{mb}mb"
        t_prep, rss_prep, out = measured([PYTHON, "scripts/prepare_data.py", "--input", str(corpus), "--output", str(prepared),
                                          "--tokenizer", "char", "--num_proc", "2"])  # fmt: skip
        row = {"mb": mb, "prepare_s": round(t_prep, 1), "prepare_rss_mb": round(rss_prep), "prepare_line": out.strip().splitlines()[-1]}
        for name, path in (("old", corpus), ("prepared", prepared)):
            if name == "old" and mb > old_max_mb:
                continue
            run_dir = work / f"run_{name}_{mb}"
            shutil.rmtree(run_dir, ignore_errors=True)
            wall, rss, _ = measured([PYTHON, "train.py", f"data.path={path}", f"output_dir={run_dir}", *STEPS5])
            first = json.loads((run_dir / "summary.json").read_text())["time_to_first_step_s"]
            row[name] = {"wall_s": round(wall, 1), "rss_mb": round(rss), "first_step_s": round(first, 1), "setup_s": data_setup(path),
                         "load": round(load(), 2)}  # fmt: skip
            shutil.rmtree(run_dir, ignore_errors=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def data_setup(path: Path) -> float:
    """Seconds from `load_data` to the first train batch and the eval loader, imports excluded: the part of the
    start that depends on the data (the rest is importing torch and building the model, the same for both paths)."""
    out = subprocess.run([PYTHON, "-c", f"""
import json, sys, time
sys.path.insert(0, {str(REPO / "src")!r})
from parallel_train.config.load import load_config
from parallel_train.data.text import train_loader, val_loader
from parallel_train.data.sources import load_data
cfg, _ = load_config(["data.path={path}"])
t = time.perf_counter()
data = load_data(cfg)
next(iter(train_loader(data, cfg, 1, 0, 0, pin_memory=False)))
val_loader(data, cfg, 1)
print(json.dumps(time.perf_counter() - t))
"""], cwd=REPO, env=env(), capture_output=True, text=True, check=True)  # fmt: skip
    return round(json.loads(out.stdout.strip().splitlines()[-1]), 2)


def format_rss(rows: list[dict]) -> str:
    lines = [
        "| corpus | in-memory: peak RSS | first step | data set-up | prepared: peak RSS | first step | data set-up | prepare once (char, 2 procs) | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        old, new = r.get("old"), r["prepared"]
        old_cells = f"{old['rss_mb']:,} MB | {old['first_step_s']} s | {old['setup_s']} s" if old else "not run (about 16 GB) | - | -"
        lines.append(
            f"| {r['mb']:,} MB | {old_cells} | {new['rss_mb']:,} MB | {new['first_step_s']} s | {new['setup_s']} s | {r['prepare_s']} s, "
            f"{r['prepare_rss_mb']:,} MB RSS | {new['load']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- 2. prepare throughput


def make_documents(work: Path, mb: int) -> Path:
    """A jsonl of ~4 KB documents (the size of an OpenWebText document) cut from the repeated corpus."""
    path = work / f"documents_{mb}mb.jsonl"
    if not path.exists():
        text = make_corpus(work / f"corpus_{mb}mb.txt", mb).read_text()[: mb * 10**6]
        with open(path, "w") as f:
            for i in range(0, len(text), 4000):
                f.write(json.dumps({"text": text[i : i + 4000]}) + "\n")
    return path


def nanogpt_worker(documents: str, tokenizer: str, num_proc: int, out: str) -> None:
    """nanoGPT's data/openwebtext/prepare.py, with a local tokenizer in place of tiktoken's GPT-2."""
    import datasets
    import numpy as np

    sys.path.insert(0, str(REPO / "src"))
    from parallel_train.data.tokenizers import load_tokenizer

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    enc = load_tokenizer(tokenizer)
    eot = enc.eot if enc.eot is not None else 10
    # tiktoken's encode_ordinary returns a list of ids: the closest calls of these tokenizers
    encode = (
        (lambda t: list(t.encode("utf-8"))) if enc.kind == "byte" else (lambda t: enc.tokenizer.encode(t, add_special_tokens=False).ids)
    )

    def process(example):
        ids = encode(example["text"])
        ids.append(eot)
        return {"ids": ids, "len": len(ids)}

    dset = datasets.load_dataset("json", data_files=documents, split="train", cache_dir=out + "/hf")
    tokenized = dset.map(process, remove_columns=["text"], num_proc=num_proc if num_proc > 1 else None, cache_file_name=out + "/tok.arrow")
    arr_len = np.sum(tokenized["len"], dtype=np.uint64)
    arr = np.memmap(out + "/train.bin", dtype=np.uint16, mode="w+", shape=(arr_len,))
    total_batches, idx = min(1024, len(tokenized)), 0  # nanoGPT: 1024 (its datasets are large)
    for batch_idx in range(total_batches):
        batch = tokenized.shard(num_shards=total_batches, index=batch_idx, contiguous=True).with_format("numpy")
        arr_batch = np.concatenate(batch["ids"])
        arr[idx : idx + len(arr_batch)] = arr_batch
        idx += len(arr_batch)
    arr.flush()
    print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": int(arr_len)}))


def throughput_table(work: Path, mb: int) -> list[dict]:
    documents = make_documents(work, mb)
    text_mb = documents.stat().st_size / 1e6
    rows = []
    bpe_file = work / "prepared_bpe8192_1" / "tokenizer.json"
    for tokenizer in ("char", "byte", "bpe:8192", "tokenizer.json"):
        for procs in (1, 2):
            spec = str(bpe_file) if tokenizer == "tokenizer.json" else tokenizer
            out = work / f"prepared_{tokenizer.replace(':', '')}_{procs}"
            shutil.rmtree(out, ignore_errors=True)
            _, rss, _ = measured([PYTHON, "scripts/prepare_data.py", "--input", str(documents), "--output", str(out), "--tokenizer", spec,
                                  "--num_proc", str(procs)])  # fmt: skip
            meta = json.loads((out / "prepared.json").read_text())
            rows.append(dict(method="prepare_data.py", tokenizer=tokenizer, procs=procs, seconds=meta["prepare_seconds"], rss_mb=round(rss),
                             tokens=meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"], load=round(load(), 2)))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    for tokenizer in ("byte", "tokenizer.json"):
        for procs in (1, 2):
            out = work / f"nanogpt_{tokenizer}_{procs}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            spec = str(bpe_file) if tokenizer == "tokenizer.json" else tokenizer
            _, rss, text = measured([PYTHON, __file__, "--nanogpt-worker", str(documents), spec, str(procs), str(out)])
            result = json.loads(text.strip().splitlines()[-1])
            rows.append(dict(method="nanoGPT's method", tokenizer=tokenizer, procs=procs, seconds=round(result["seconds"], 2), rss_mb=round(rss),
                             tokens=result["tokens"], load=round(load(), 2)))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    for r in rows:
        r["mb_s"] = round(text_mb / r["seconds"], 2)
    return rows


def format_throughput(rows: list[dict], text_mb: float) -> str:
    names = {"tokenizer.json": "the bpe:8192 tokenizer.json (encoding only)", "bpe:8192": "bpe:8192 (training it, then encoding)"}
    lines = [f"| method ({text_mb:.0f} MB of text, 4 KB documents) | tokenizer | num_proc | MB/s | seconds | tokens | peak RSS | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['method']} | {names.get(r['tokenizer'], r['tokenizer'])} | {r['procs']} | {r['mb_s']} | {r['seconds']} | {r['tokens']:,} | "
            f"{r['rss_mb']:,} MB | {r['load']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- 3. data wait per step


def datatime_table(work: Path) -> list[dict]:
    prepared = work / "prepared_shakespeare_char"
    measured([PYTHON, "scripts/prepare_data.py", "--input", "data/tinyshakespeare.txt", "--output", str(prepared), "--tokenizer", "char"])
    big = work / "prepared_100mb_byte"
    measured([PYTHON, "scripts/prepare_data.py", "--input", str(make_corpus(work / "corpus_100mb.txt", 100)), "--output", str(big),
              "--tokenizer", "byte", "--num_proc", "2"])  # fmt: skip
    cells = [
        ("baseline GPT (configs/shakespeare_char_cpu.yaml), 200 steps", prepared,
         ["--config", "configs/shakespeare_char_cpu.yaml", "train.max_steps=200", "eval.interval=0", "eval.iters=10"]),
        ("124M-shaped GPT (configs/gpt2_124m.yaml, batch 2 x 1024, fp32, eager), 4 steps", big,
         ["--config", "configs/gpt2_124m.yaml", "train.max_steps=4", "train.batch_size=2", "train.gradient_accumulation_steps=1",
          "train.mixed_precision=no", "train.compile=false", "train.log_interval=1", "eval.interval=0", "eval.iters=1"]),
    ]  # fmt: skip
    rows = []
    for name, data, args in cells:
        run_dir = work / "run_datatime"
        shutil.rmtree(run_dir, ignore_errors=True)
        measured(
            [
                PYTHON,
                "train.py",
                *args,
                f"data.path={data}",
                f"output_dir={run_dir}",
                "tracker=none",
                "checkpoint.interval=0",
                "resume=none",
            ],
            threads=1,  # on a shared machine two spin-waiting threads make every step erratic
        )
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in line][
            1:
        ]  # warm-up out
        frac = statistics.mean(r["data_time_frac"] for r in records)
        step = statistics.mean(r["step_time_s"] for r in records)
        rows.append({"cell": name, "data_time_frac": frac, "step_s": step, "wait_ms": frac * step * 1000, "load": round(load(), 2)})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    baseline = ["--config", "configs/shakespeare_char_cpu.yaml"]
    rows.append(loader_alone("baseline, prepared", [*baseline, f"data.path={prepared}"]))
    rows.append(loader_alone("baseline, in memory (the default job)", baseline))
    rows.append(loader_alone("124M, prepared (rank 3 of 8)", ["--config", "configs/gpt2_124m.yaml", f"data.path={big}"], 8, 3, 300))
    return rows


def loader_alone(label: str, args: list[str], world: int = 1, rank: int = 0, batches: int = 1000) -> dict:
    """The train loader by itself (no model): milliseconds per micro-batch, median of 3 rounds."""
    out = subprocess.run([PYTHON, "-c", f"""
import json, statistics, sys, time
sys.path.insert(0, {str(REPO / "src")!r})
from parallel_train.config.load import load_config
from parallel_train.data.text import train_loader
from parallel_train.data.sources import load_data
cfg, _ = load_config({args!r})
it = iter(train_loader(load_data(cfg), cfg, {world}, {rank}, 1000, pin_memory=False))
next(it)
rounds = []
for _ in range(3):
    t = time.perf_counter()
    for _ in range({batches}):
        x, y = next(it)
    rounds.append((time.perf_counter() - t) / {batches} * 1000)
print(json.dumps({{"ms": statistics.median(rounds), "shape": list(x.shape)}}))
"""], cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    row = {"cell": f"{label}: the train loader alone, batches of {result['shape'][0]} x {result['shape'][1] + 1} tokens",
           "data_time_frac": None, "step_s": None, "wait_ms": result["ms"], "load": round(load(), 2)}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def format_datatime(rows: list[dict]) -> str:
    lines = ["| run (prepared data) | data_time_frac | step time | data wait per step | load |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["data_time_frac"] is None:
            lines.append(f"| {r['cell']} | - | - | {r['wait_ms']:.2f} ms per batch | {r['load']} |")
        else:
            lines.append(
                f"| {r['cell']} | {r['data_time_frac']:.2%} | {r['step_s'] * 1000:,.0f} ms | {r['wait_ms']:.2f} ms | {r['load']} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------- bits per character


def bits_per_char(run_dir: Path) -> str:
    """A run's final val loss (nats per token) in bits per character of its validation text, comparable across tokenizers."""
    import math

    import yaml

    sys.path.insert(0, str(REPO / "src"))
    from parallel_train.config.load import config_from_dict
    from parallel_train.data.prepared import is_prepared, read_meta
    from parallel_train.data.text import load_corpus
    from parallel_train.data.tokenizers import load_saved

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    loss = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    if is_prepared(cfg.data.path):
        val = read_meta(Path(cfg.data.path))[0]["splits"]["val"]
        tokens, chars = val["tokens"], val["chars"]
    else:  # the in-memory path: its split is the last val_fraction of the corpus's tokens
        tok, text = load_saved(run_dir), load_corpus(cfg.data)
        ids = tok.encode(text)
        tokens = int(len(ids) * cfg.data.val_fraction)
        chars = len(tok.decode(ids[len(ids) - tokens :].tolist()))
    bpc = loss / math.log(2) * tokens / chars
    return f"{run_dir}: val loss {loss:.4f} nats/token, {chars / tokens:.3f} characters/token, {bpc:.4f} bits/character"


# ---------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--nanogpt-worker":
        documents, tokenizer, procs, out = sys.argv[2:6]
        return nanogpt_worker(documents, tokenizer, int(procs), out)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="rss,throughput,datatime", help="which tables to measure")
    ap.add_argument("--sizes", default="10,100,1000", help="corpus sizes in MB for the rss table")
    ap.add_argument("--old-max-mb", type=int, default=100, help="largest corpus for the in-memory path (16 bytes of RAM per byte)")
    ap.add_argument("--throughput-mb", type=int, default=20, help="MB of text for the throughput table")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_data"), help="corpora, prepared folders and runs")
    ap.add_argument("--keep", action="store_true", help="keep the corpora and prepared folders")
    ap.add_argument("--update-docs", action="store_true", help=f"write the tables into {DOC.relative_to(REPO)} between its markers")
    ap.add_argument("--bpc", type=Path, nargs="+", help="only print these runs' val loss in bits per character")
    args = ap.parse_args()
    if args.bpc:
        return print("\n".join(bits_per_char(run) for run in args.bpc))
    args.work.mkdir(parents=True, exist_ok=True)
    tables, results = args.tables.split(","), {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        if "rss" in tables:
            results["rss"] = rss_table(args.work, [int(s) for s in args.sizes.split(",")], args.old_max_mb)
        if "throughput" in tables:
            results["throughput"] = throughput_table(args.work, args.throughput_mb)
        if "datatime" in tables:
            results["datatime"] = datatime_table(args.work)
    finally:
        (args.work / "bench_data.json").write_text(json_text(results, indent=1))
        if not args.keep:
            for p in args.work.iterdir():
                if p.name != "bench_data.json":
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
    parts = [
        f"Measured {started} by `python scripts/bench/data.py --tables {args.tables}` ({os.cpu_count()} cores; load = 1-minute load average)."
    ]
    if "rss" in results:
        parts.append(format_rss(results["rss"]))
    if "throughput" in results:
        parts.append(format_throughput(results["throughput"], args.throughput_mb))
    if "datatime" in results:
        parts.append(format_datatime(results["datatime"]))
    text = "\n\n".join(parts)
    print(text)
    if args.update_docs:
        update_docs(text, DOC_START, DOC_END)


if __name__ == "__main__":
    main()
