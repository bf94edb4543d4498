#!/usr/bin/env bash
# Pipeline parallelism on two GPUs (not needed by the tests; prepared for when two GPUs are available).
#
#   bash scripts/bench/gpu_pipeline_bench.sh [OUT_DIR]        about 5 minutes on two recent GPUs
#
# 1. In-process executor: one process, stages on cuda:0 and cuda:1, M = 1, 4, 8 micro-batches, against
#    the same model on one GPU. With M=1 only one GPU works at a time (the classic two-GPU recipe);
#    with M>1 the asynchronous launches overlap the stages: see the speed-up, the measured bubble and
#    each run's pipeline_timeline.png.
# 2. Multi-process executor: torchrun with 2 processes, GPipe against 1F1B at M=8: peak memory of
#    stage 0 (rank 0) should drop with 1F1B (at most S micro-batches in flight instead of M).
# Results: OUT_DIR/results.md (a table) and one run folder per cell (summary.json, timeline PNG).
# PARALLEL_TRAIN_SYNC_DEBUG (default error): torch.cuda.set_sync_debug_mode around every step but the first, so a
# host-device sync in a step that neither logs nor agrees stops the cell (warn: only say it; empty: off).
set -euo pipefail
export PARALLEL_TRAIN_SYNC_DEBUG=${PARALLEL_TRAIN_SYNC_DEBUG-error}
cd "$(dirname "$0")/../.."
OUT=${1:-runs/gpu_pipeline_bench}
PY=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 2 ]; then
  echo "error: this benchmark needs 2 CUDA GPUs, found $NGPU" >&2
  exit 2
fi
mkdir -p "$OUT"
# A GPT-2-small-shaped model on the character corpus: big enough that the GPUs, not Python, set the pace.
MODEL=(model.n_layer=12 model.n_head=12 model.n_embd=768 model.block_size=256 train.batch_size=32
       train.max_steps=60 train.log_interval=10 train.warmup_steps=0 eval.interval=0 eval.iters=2
       checkpoint.interval=0 tracker=none train.mixed_precision=bf16 resume=none)
export WANDB_MODE=disabled

run() {  # name, then the command
  local name=$1; shift
  rm -rf "${OUT:?}/$name"
  echo "== $name: $*"
  "$@" "output_dir=$OUT/$name" > "$OUT/$name.log" 2>&1 || { echo "failed: see $OUT/$name.log"; tail -5 "$OUT/$name.log"; exit 1; }
}

run single_gpu "$PY" train.py "${MODEL[@]}"
for M in 1 4 8; do
  run "inprocess_m$M" "$PY" train.py "${MODEL[@]}" parallel.pipeline_stages=2 "parallel.stage_devices=[cuda:0,cuda:1]" "parallel.microbatches=$M"
done
for S in gpipe 1f1b; do
  run "multiprocess_${S}_m8" "$TORCHRUN" --nproc-per-node 2 --master-port "$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
      train.py "${MODEL[@]}" parallel.pipeline_stages=2 parallel.microbatches=8 "parallel.schedule=$S"
done

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def s(name):
    return json.loads((out / name / "summary.json").read_text())
base = s("single_gpu")["tokens_per_sec"]
rows = ["| run | tok/s | speed-up vs 1 GPU | ideal | bubble measured | bubble ideal | peak memory rank 0 (MiB) |", "|---|---|---|---|---|---|---|",
        f"| one GPU | {base:,.0f} | 1.00x | - | - | - | {s('single_gpu')['peak_memory_mb']:,.0f} |"]
for name, m in [("inprocess_m1", 1), ("inprocess_m4", 4), ("inprocess_m8", 8), ("multiprocess_gpipe_m8", 8), ("multiprocess_1f1b_m8", 8)]:
    r = s(name)
    bubble = r.get("pipeline_bubble_measured")
    rows.append(f"| {name} | {r['tokens_per_sec']:,.0f} | {r['tokens_per_sec'] / base:.2f}x | {2 * m / (m + 1):.2f}x | "
                f"{'-' if bubble is None else f'{bubble:.0%}'} | {1 / (m + 1):.0%} | {r['peak_memory_mb']:,.0f} |")
text = "\n".join(rows)
(out / "results.md").write_text(text + "\n")
print(text)
EOF
echo "timelines: $OUT/*/pipeline_timeline.png"
