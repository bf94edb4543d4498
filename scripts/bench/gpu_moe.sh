#!/usr/bin/env bash
# GPU benchmark of configs/moe_finetune.yaml (a Hub MoE, LoRA on attention, the experts split by expert parallel): the recipe as written,
# its model.hf_path a small Qwen3-MoE built here, no network (scripts/make_tiny_chat_model.py --experts 32: 12 layers
# x 1024, 32 experts of 384, 4 per token, a BPE of Tiny Shakespeare; save_pretrained), on chat rows of Shakespeare's
# lines; on 1 GPU and on all of them (torchrun, FSDP2 and expert parallel over N). Per cell: tokens/s, MFU (6 x the active parameters per
# token, plus attention), each rank's peak memory (max_memory_allocated) beside scripts/estimate_memory.py's figure.
#
#   bash scripts/bench/gpu_moe.sh                        on a GPU machine: a few minutes
#   bash scripts/bench/gpu_moe.sh --dry-run              anywhere: print the commands, run nothing
#   bash scripts/bench/gpu_moe.sh --steps 100 --out runs/gpu_moe
#
# Environment: PYTHON (default .venv/bin/python, else python3), GPUS (default: the GPUs found; 8 in a dry run),
# EP (parallel.ep of the N-GPU cell; default N, the recipe's layout), PEAK_TFLOPS (the
# GPU's bf16 peak where src/parallel_train/observe/perf.py does not know it). Writes OUT/gpu_moe.md and gpu_moe.json.
set -euo pipefail
export PARALLEL_TRAIN_SYNC_DEBUG=${PARALLEL_TRAIN_SYNC_DEBUG-error}

cd "$(dirname "$0")/../.."
DRY_RUN=0
STEPS=40
OUT=runs/gpu_moe
HELP_LINES=14
# shellcheck source=scripts/bench/gpu_common.sh
source scripts/bench/gpu_common.sh
parse_gpu_args "$@"
if [ -n "${GPUS:-}" ]; then
  NGPU=$GPUS
elif [ "$DRY_RUN" = 1 ]; then
  NGPU=8
else
  NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
fi
if [ "$DRY_RUN" = 0 ] && [ "$NGPU" -lt 1 ]; then
  echo "error: no CUDA GPU found; --dry-run prints the commands" >&2
  exit 2
fi
EP=${EP:-}  # the multi-GPU cell's parallel.ep; empty: every GPU (the recipe's layout)
MODEL="$OUT/qwen3_moe"
CHATS="$OUT/chats.jsonl"
BUILD=("$PYTHON" scripts/make_tiny_chat_model.py "$MODEL" "$CHATS" --layers 12 --width 1024 --vocab 8192 --experts 32 --conversations 20000)
COUNTS="1 $([ "$NGPU" -gt 1 ] && echo "$NGPU")"

run() {  # print the command; run it unless a dry run
  echo "== $*"
  [ "$DRY_RUN" = 1 ] || "$@"
}

[ "$DRY_RUN" = 1 ] || mkdir -p "$OUT"
[ "$DRY_RUN" = 1 ] || rm -f "$OUT/cells.txt"
[ -d "$MODEL" ] && [ "$DRY_RUN" = 0 ] || run "${BUILD[@]}"
FAILED=0
for n in $COUNTS; do
  ep=$([ "$n" = 1 ] && echo 1 || echo "${EP:-$n}")
  cell="gpus${n}-ep${ep}"
  run_dir="$OUT/$cell"
  args=(--config configs/moe_finetune.yaml "model.hf_path=$MODEL" "data.path=$CHATS" model.block_size=1024
        "parallel.dp_shard=$n" "parallel.ep=$ep" "train.max_steps=$STEPS" "train.lr_decay_steps=$STEPS" train.warmup_steps=5
        train.log_interval=10 eval.interval=0 eval.iters=1 checkpoint.interval=0 tracker=none resume=none
        ${PEAK_TFLOPS:+"train.peak_tflops=$PEAK_TFLOPS"} "output_dir=$run_dir")
  [ "$DRY_RUN" = 1 ] || rm -rf "$run_dir" "$run_dir.peaks"
  if [ "$DRY_RUN" = 1 ]; then
    echo "== $PYTHON scripts/estimate_memory.py --world $n --json ${args[*]} > $run_dir.estimate.json"
  else
    "$PYTHON" scripts/estimate_memory.py --world "$n" --json "${args[@]}" > "$run_dir.estimate.json" 2> "$run_dir.estimate.log" || true
  fi
  port=$([ "$DRY_RUN" = 1 ] && echo 29500 || "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  cmd=($TORCHRUN --nproc-per-node "$n" --master-port "$port" scripts/bench/gpu_rank_peak.py "${args[@]}")
  echo "== $cell: GPU_PEAK_DIR=$run_dir.peaks ${cmd[*]}"
  [ "$DRY_RUN" = 1 ] && continue
  if GPU_PEAK_DIR="$run_dir.peaks" "${cmd[@]}" > "$run_dir.log" 2>&1; then
    echo "$cell ok $n $ep" >> "$OUT/cells.txt"
  else
    echo "$cell failed $n $ep" >> "$OUT/cells.txt"; FAILED=1; tail -5 "$run_dir.log" >&2
  fi
done
[ "$DRY_RUN" = 1 ] && exit 0

# ---- the table: one row per rank
"$PYTHON" - "$OUT" "$STEPS" <<'EOF'
import json, sys, time
from pathlib import Path

out, steps = Path(sys.argv[1]), sys.argv[2]
rows, cells = [], []
f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
for line in (out / "cells.txt").read_text().splitlines():
    cell, status, n, ep = line.split()
    path = out / cell / "summary.json"
    s = json.loads(path.read_text()) if status == "ok" and path.exists() else {}
    try:
        estimates = json.loads((out / f"{cell}.estimate.json").read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        estimates = []
    for rank in range(int(n)):
        peak_file = out / f"{cell}.peaks" / f"rank{rank}.json"
        peak = json.loads(peak_file.read_text()) if peak_file.exists() else {}
        est = estimates[rank]["total"] / 2**20 if rank < len(estimates) and estimates[rank].get("total") else None
        measured = peak.get("allocated_mb")
        ratio = est / measured if est and measured else None
        cells.append({"cell": cell, "status": status, "gpus": int(n), "ep": int(ep), "rank": rank, "tokens_per_sec": s.get("tokens_per_sec"),
                      "mfu": s.get("mfu"), "active_params": s.get("active_params"), "peak_allocated_mb": measured,
                      "peak_reserved_mb": peak.get("reserved_mb"), "estimated_mb": est, "estimate_over_measured": ratio})
        first = rank == 0
        rows.append(f"| {cell if first else ''} | {rank} | {f(s.get('tokens_per_sec') if first else None, ',.0f')} | "
                    f"{f(s.get('mfu') if first else None, '.1%')} | {f(measured, ',.0f')} | {f(peak.get('reserved_mb'), ',.0f')} | "
                    f"{f(est, ',.0f')} | {f(ratio, '.2f')} | {status} |")
table = (f"configs/moe_finetune.yaml on a small Qwen3-MoE built here, {steps} steps per cell; {time.strftime('%Y-%m-%d %H:%M %Z')}\n\n"
         "| cell | rank | tokens/s | MFU (active) | peak allocated (MB) | peak reserved (MB) | estimated (MB) | estimate / measured "
         "| status |\n|---|---:|---:|---:|---:|---:|---:|---:|---|\n" + "\n".join(rows) + "\n")
(out / "gpu_moe.md").write_text(table)
(out / "gpu_moe.json").write_text(json.dumps({"steps": int(steps), "cells": cells}, indent=1))
print("\n" + table)
print(f"wrote {out / 'gpu_moe.md'} and {out / 'gpu_moe.json'}")
EOF
exit $FAILED
