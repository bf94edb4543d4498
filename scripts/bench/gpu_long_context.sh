#!/usr/bin/env bash
# Long-context benchmark of context parallelism (parallel.cp, configs/long_context.yaml's layout): a Llama built here
# (no network: random weights, a byte-level tokenizer trained on data/tinyshakespeare.txt) trained at several sequence
# lengths under cp=1, 2 and 4 (as many as the GPUs allow), full activation checkpointing, bf16. Prints rank 0's peak
# memory (torch.cuda.max_memory_allocated) and tokens/s per cell: the peak should fall about as 1/cp at one length.
#
#   bash scripts/bench/gpu_long_context.sh [OUT_DIR]            on a GPU machine (medium model: 8 layers, 1024 wide, ~0.1B)
#   bash scripts/bench/gpu_long_context.sh --dry-run [OUT_DIR]  anywhere: tiny model, short lengths, on CPU (gloo)
#
# Environment: PYTHON (default .venv/bin/python, else python3), STEPS (default 6; dry run 2), LENGTHS (default
# "8192 16384 32768 65536"; dry run "64 128"), CPS (default "1 2 4", each kept where the GPUs suffice). A cell that
# runs out of memory says failed. Results: OUT_DIR/gpu_long_context.md and .json, one run folder and log per cell.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  --dry-run) DRY_RUN=1; OUT=${2:-runs/gpu_long_context_dry} ;;
  -*) echo "error: unknown argument '$1' (use --dry-run [OUT_DIR], or OUT_DIR)" >&2; exit 2 ;;
  *) DRY_RUN=0; OUT=${1:-runs/gpu_long_context} ;;
esac
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
[ -x "$TORCHRUN" ] || TORCHRUN="$PY -m torch.distributed.run"
# shellcheck source=scripts/bench/gpu_common.sh
source scripts/bench/gpu_common.sh  # torchrun_cell
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

echo "== environment"
"$PY" -c "import torch; print(f'torch {torch.__version__} | CUDA GPUs {torch.cuda.device_count()}' + ''.join(f' | {torch.cuda.get_device_name(i)}' for i in range(torch.cuda.device_count())))"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$DRY_RUN" = 1 ]; then
  LENGTHS=${LENGTHS:-"64 128"}
  STEPS=${STEPS:-2}
  MAX_RANKS=2
  SIZE="tiny"
  export OMP_NUM_THREADS=1
else
  if [ "$NGPU" -lt 1 ]; then
    echo "error: no CUDA GPU found; run with --dry-run to rehearse on CPU" >&2
    exit 2
  fi
  LENGTHS=${LENGTHS:-"8192 16384 32768 65536"}
  STEPS=${STEPS:-6}
  MAX_RANKS=$NGPU
  SIZE="medium"
fi
CPS=${CPS:-"1 2 4"}

# ---- the model, built locally: a Llama (GQA, RoPE) whose heads cp=4 divides, and its tokenizer
mkdir -p "$OUT"
MODEL="$OUT/llama_$SIZE"
"$PY" - "$MODEL" "$SIZE" <<'PY'
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

folder, size = Path(sys.argv[1]), sys.argv[2]
if (folder / "config.json").exists():
    sys.exit(0)
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(["data/tinyshakespeare.txt"], trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
dims = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8)
if size == "tiny":
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
config = LlamaConfig(vocab_size=512, max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, **dims)
LlamaForCausalLM(config).save_pretrained(folder)
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
print(f"built {folder}: {sum(p.numel() for p in LlamaForCausalLM(config).parameters()):,} parameters")
PY

rm -f "$OUT/cells.txt"
FAILED=0
for cp in $CPS; do
  [ "$cp" -le "$MAX_RANKS" ] || continue
  for T in $LENGTHS; do
    cell="cp${cp}-T${T}"
    run_dir="$OUT/$cell"
    rm -rf "$run_dir"
    args=(--config configs/long_context.yaml "model.hf_path=$MODEL" model.hf_pretrained=false "model.block_size=$T"
          data.path=data/tinyshakespeare.txt "parallel.cp=$cp" parallel.dp_shard=1 train.gradient_accumulation_steps=1
          "train.max_steps=$STEPS" "train.lr_decay_steps=$STEPS" train.warmup_steps=1 train.log_interval=1
          eval.interval=0 eval.iters=1 checkpoint.interval=0 tracker=none resume=none "output_dir=$run_dir")
    [ "$DRY_RUN" = 1 ] && args+=(train.mixed_precision=no)
    CELLS="$OUT/cells.txt" torchrun_cell "$cell" "$cp $T" "$run_dir.log" "$cp" "${args[@]}"
  done
done

# ---- the table
"$PY" - "$OUT" "$DRY_RUN" "$STEPS" <<'PY'
import json, sys
from pathlib import Path

out, dry_run, steps = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
rows, cells = [], []
for line in (out / "cells.txt").read_text().splitlines():
    cell, status, cp, length = line.split()
    path = out / cell / "summary.json"
    s = json.loads(path.read_text()) if status == "ok" and path.exists() else {}
    cells.append({"cell": cell, "status": status, "cp": int(cp), "length": int(length),
                  **{k: s.get(k) for k in ("tokens_per_sec", "peak_memory_mb", "peak_memory_reserved_mb", "final_train_loss")}})
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    rows.append(f"| {length} | {cp} | {f(s.get('tokens_per_sec'), ',.0f')} | {f(s.get('peak_memory_mb'), ',.0f')} | "
                f"{f(s.get('peak_memory_reserved_mb'), ',.0f')} | {status} |")
what = "DRY RUN on CPU (tiny model; peak memory is host RSS)" if dry_run else "a ~0.1B Llama built locally, bf16, full checkpointing"
table = (f"{what}, {steps} steps per cell, batch 1\n\n| sequence length | cp | tokens/s | peak memory rank 0 (MB) | "
         "reserved (MB) | status |\n|---:|---:|---:|---:|---:|---|\n" + "\n".join(rows) + "\n")
(out / "gpu_long_context.md").write_text(table)
(out / "gpu_long_context.json").write_text(json.dumps({"dry_run": dry_run, "cells": cells}, indent=1))
print("\n" + table)
PY
exit $FAILED
