#!/usr/bin/env bash
# GPU benchmark of configs/gpt2_124m.yaml (GPT-2 small, synthetic data): bf16 on/off x torch.compile on/off,
# on one GPU and, where the machine has more, on all of them (torchrun, DDP over NCCL). Writes a markdown
# table (tokens/s, MFU, step time, peak memory, time to first step) and a JSON file.
#
#   bash scripts/bench/gpu_bench.sh                       on a GPU machine: about 10 minutes on one H100/H200
#   bash scripts/bench/gpu_bench.sh --dry-run             anywhere: tiny model, a few steps, on CPU (1 and 2 processes)
#   bash scripts/bench/gpu_bench.sh --steps 100 --out runs/gpu_bench
#
# Environment: PYTHON (default .venv/bin/python, else python3), COMPILE_MODES (default "false true"),
# PRECISIONS (default "bf16 no"; "no" is fp32 with TF32 matmuls), GPU_COUNTS (default "1 N", N = GPUs found),
# MESH (default 1 with 2+ GPUs, 0 in a dry run): also the device-mesh cells (FSDP2, FSDP x TP, TP, HSDP,
# TP x PP on N GPUs), each beside scripts/estimate_memory.py's prediction for it: $OUT/mesh.md and mesh.json.
# MFU uses the peak of the GPU from src/parallel_train/observe/perf.py (A100/H100/H200); set PEAK_TFLOPS for others.
# PARALLEL_TRAIN_SYNC_DEBUG (default error): torch.cuda.set_sync_debug_mode around every step but the first, so a
# host-device sync in a step that neither logs nor agrees stops the cell (warn: only say it; empty: off).
set -euo pipefail
export PARALLEL_TRAIN_SYNC_DEBUG=${PARALLEL_TRAIN_SYNC_DEBUG-error}

cd "$(dirname "$0")/../.."
DRY_RUN=0
STEPS=""
OUT=runs/gpu_bench
HELP_LINES=13
# shellcheck source=scripts/bench/gpu_common.sh
source scripts/bench/gpu_common.sh
parse_gpu_args "$@"

# ---- environment check: what a GPU figure means depends on all of this
echo "== environment"
"$PYTHON" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()} | torch {torch.__version__} | CUDA build {torch.version.cuda} | host {platform.node()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name} | {p.total_memory / 2**30:.0f} GiB | compute capability {p.major}.{p.minor}")
    print(f"bf16 supported: {torch.cuda.is_bf16_supported()} | NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} | "
          f"cuDNN {torch.backends.cudnn.version()}")
else:
    print("no CUDA GPU visible to torch")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version,memory.used,utilization.gpu --format=csv || true
NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")

if [ "$DRY_RUN" = 1 ]; then
  echo "== dry run: tiny GPT on CPU (no GPU needed), 1 and 2 processes"
  SIZE=(model.n_layer=2 model.n_head=2 model.n_embd=64 model.block_size=64 model.vocab_size=512 data.num_samples=20000
        train.batch_size=2 train.gradient_accumulation_steps=1 train.log_interval=4)
  STEPS=${STEPS:-12}
  COUNTS=${GPU_COUNTS:-"1 2"}
  export OMP_NUM_THREADS=1
else
  if [ "$NGPU" -lt 1 ]; then
    echo "error: no CUDA GPU found; run with --dry-run to rehearse on CPU" >&2
    exit 2
  fi
  SIZE=(train.log_interval=10)
  STEPS=${STEPS:-60}
  COUNTS=${GPU_COUNTS:-"1 $([ "$NGPU" -gt 1 ] && echo "$NGPU")"}
fi
PRECISIONS=${PRECISIONS:-"bf16 no"}
COMPILE_MODES=${COMPILE_MODES:-"false true"}

mkdir -p "$OUT"
rm -f "$OUT/cells.txt"
FAILED=0
for n in $COUNTS; do
  for precision in $PRECISIONS; do
    for compile in $COMPILE_MODES; do
      cell="gpus${n}-${precision}-compile_${compile}"
      run_dir="$OUT/$cell"
      rm -rf "$run_dir"
      args=(--config configs/gpt2_124m.yaml "${SIZE[@]}" "train.max_steps=$STEPS" "train.lr_decay_steps=$STEPS"
            "train.mixed_precision=$precision" "train.compile=$compile" eval.interval=0 eval.iters=1
            checkpoint.interval=0 tracker=none resume=none "output_dir=$run_dir")
      if [ "$n" = 1 ]; then
        cmd=("$PYTHON" train.py "${args[@]}")
      else
        port=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
        cmd=($TORCHRUN --nproc-per-node "$n" --master-port "$port" train.py "${args[@]}")
      fi
      echo "== $cell: ${cmd[*]}"
      mkdir -p "$run_dir"
      if "${cmd[@]}" > "$run_dir.log" 2>&1; then
        echo "$cell ok $n $precision $compile" >> "$OUT/cells.txt"
      else
        echo "$cell failed $n $precision $compile" >> "$OUT/cells.txt"
        FAILED=1
        tail -5 "$run_dir.log" >&2
      fi
    done
  done
done

# ---- the table
"$PYTHON" - "$OUT" "$DRY_RUN" "$STEPS" <<'EOF'
import json, sys, time
from pathlib import Path

out, dry_run, steps = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
rows, cells = [], []
header = ("| devices | precision | compile | tokens/s | tokens/s per device | MFU | step (ms) | peak memory (MB) | "
          "first step (s) | status |\n|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
for line in (out / "cells.txt").read_text().splitlines():
    cell, status, n, precision, compile_ = line.split()
    summary_path = out / cell / "summary.json"
    s = json.loads(summary_path.read_text()) if status == "ok" and summary_path.exists() else {}
    train = [json.loads(r) for r in (out / cell / "metrics.jsonl").read_text().splitlines() if '"train"' in r] \
        if (out / cell / "metrics.jsonl").exists() else []
    step_ms = 1000 * sorted(r["step_time_s"] for r in train[1:])[len(train[1:]) // 2] if len(train) > 1 else None
    tok = s.get("tokens_per_sec")
    mfu = s.get("mfu")
    cells.append({"cell": cell, "status": status, "devices": int(n), "precision": precision, "compile": compile_ == "true",
                  "tokens_per_sec": tok, "mfu": mfu, "step_ms": step_ms, **{k: s.get(k) for k in
                  ("peak_memory_mb", "peak_memory_reserved_mb", "time_to_first_step_s", "final_train_loss")}})
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    rows.append(f"| {n} | {precision if precision != 'no' else 'fp32 (tf32)'} | {compile_} | {fmt(tok, ',.0f')} | "
                f"{fmt(tok / int(n) if tok else None, ',.0f')} | {fmt(mfu, '.1%')} | {fmt(step_ms, '.1f')} | "
                f"{fmt(s.get('peak_memory_mb'), ',.0f')} | {fmt(s.get('time_to_first_step_s'), '.1f')} | {status} |")
what = "DRY RUN on CPU (tiny model; figures mean nothing)" if dry_run else "configs/gpt2_124m.yaml"
table = (f"{what}, {steps} steps per cell, steady state (first log interval left out); {time.strftime('%Y-%m-%d %H:%M %Z')}\n\n"
         + header + "\n" + "\n".join(rows) + "\n")
(out / "gpu_bench.md").write_text(table)
(out / "gpu_bench.json").write_text(json.dumps({"dry_run": dry_run, "steps": int(steps), "cells": cells}, indent=1))
print("\n" + table)
print(f"wrote {out / 'gpu_bench.md'} and {out / 'gpu_bench.json'}")
EOF
# ---- the device mesh: measured peak memory (torch.cuda.max_memory_allocated of rank 0) against the estimate
if [ "${MESH:-$([ "$DRY_RUN" = 0 ] && [ "$NGPU" -ge 2 ] && echo 1 || echo 0)}" = 1 ]; then
  N=$([ "$DRY_RUN" = 1 ] && echo 4 || echo "$NGPU")
  MESH_CELLS=("tp2:2:parallel.tp=2" "fsdp:$N:parallel.dp_shard=$N")
  if [ "$N" -ge 4 ]; then
    MESH_CELLS+=("fsdp_tp2:$N:parallel.dp_shard=$((N / 2)) parallel.tp=2" "hsdp:$N:parallel.dp_replicate=2 parallel.dp_shard=$((N / 2))"
                 "tp2_pp2:4:parallel.tp=2 parallel.pipeline_stages=2 parallel.microbatches=4 parallel.schedule=1f1b")
  fi
  rm -f "$OUT/mesh_cells.txt"
  for cell in "${MESH_CELLS[@]}"; do
    IFS=: read -r name n keys <<< "$cell"
    run_dir="$OUT/mesh_$name"
    rm -rf "$run_dir"
    # shellcheck disable=SC2206
    args=(--config configs/gpt2_124m.yaml "${SIZE[@]}" $keys "train.max_steps=$STEPS" "train.lr_decay_steps=$STEPS"
          train.mixed_precision=bf16 train.compile=false eval.interval=0 eval.iters=1 checkpoint.interval=0 tracker=none
          resume=none "output_dir=$run_dir")
    "$PYTHON" scripts/estimate_memory.py --world "$n" --json "${args[@]}" > "$run_dir.estimate.json" 2> "$run_dir.estimate.log" || true
    CELLS="$OUT/mesh_cells.txt" torchrun_cell "$name" "$n" "$run_dir.log" "$n" "${args[@]}"
  done
  "$PYTHON" - "$OUT" "$DRY_RUN" <<'EOF2'
import json, sys
from pathlib import Path

out, dry_run = Path(sys.argv[1]), sys.argv[2] == "1"
rows, cells = [], []
for line in (out / "mesh_cells.txt").read_text().splitlines():
    name, status, n = line.split()
    s = json.loads((out / f"mesh_{name}" / "summary.json").read_text()) if status == "ok" else {}
    try:
        est = json.loads((out / f"mesh_{name}.estimate.json").read_text())["ranks"][0]
    except (OSError, ValueError, KeyError):
        est = {}
    measured = s.get("peak_memory_mb")
    predicted = est.get("total") / 2**20 if est.get("total") else None
    ratio = predicted / measured if predicted and measured else None
    cells.append({"cell": name, "status": status, "processes": int(n), "mesh": s.get("mesh"), "tokens_per_sec": s.get("tokens_per_sec"),
                  "local_param_numel": s.get("local_param_numel"), "estimated_param_numel": est.get("param_numel"),
                  "peak_memory_mb": measured, "estimated_mb": predicted, "estimate_over_measured": ratio})
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    rows.append(f"| {name} | {n} | {f(s.get('tokens_per_sec'), ',.0f')} | {f(s.get('local_param_numel'), ',')} | "
                f"{f(est.get('param_numel'), ',')} | {f(measured, ',.0f')} | {f(predicted, ',.0f')} | {f(ratio, '.2f')} | {status} |")
what = "DRY RUN on CPU (peak memory is host RSS: not comparable with the estimate)" if dry_run else "configs/gpt2_124m.yaml, bf16"
table = (f"{what}: device mesh cells, rank 0\n\n| cell | processes | tokens/s | parameters held | estimated | peak memory (MB, "
         "max_memory_allocated) | estimated (MB) | estimate / measured | status |\n|---|---:|---:|---:|---:|---:|---:|---:|---|\n"
         + "\n".join(rows) + "\n")
(out / "mesh.md").write_text(table)
(out / "mesh.json").write_text(json.dumps({"dry_run": dry_run, "cells": cells}, indent=1))
print("\n" + table)
EOF2
fi
exit $FAILED
