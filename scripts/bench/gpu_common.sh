# Sourced by scripts/bench/gpu_bench.sh, gpu_moe.sh and gpu_long_context.sh (run from the repository root): their arguments (--dry-run,
# --steps N, --out DIR; -h prints the calling script's header, its lines 2 to HELP_LINES) and the python and torchrun
# they launch with (PYTHON, default .venv/bin/python, else python3; TORCHRUN beside it).
parse_gpu_args() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      --steps) STEPS="$2"; shift ;;
      --out) OUT="$2"; shift ;;
      -h|--help) sed -n "2,${HELP_LINES}p" "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "error: unknown argument '$1' (use --dry-run, --steps N, --out DIR)" >&2; exit 2 ;;
    esac
    shift
  done
  if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
  fi
  TORCHRUN="$(dirname "$PYTHON")/torchrun"
  [ -x "$TORCHRUN" ] || TORCHRUN="$PYTHON -m torch.distributed.run"
}

# torchrun_cell NAME RECORD LOG NPROC ARGS...: train.py ARGS on NPROC processes (a free port), its output in LOG; appends
# "NAME ok RECORD" (or "NAME failed RECORD", then FAILED=1 and LOG's tail on stderr) to $CELLS. The free port from $PYTHON (else $PY).
torchrun_cell() {
  local name=$1 record=$2 log=$3 n=$4 port
  shift 4
  port=$("${PYTHON:-$PY}" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  echo "== $name: $TORCHRUN --nproc-per-node $n train.py $*"
  if $TORCHRUN --nproc-per-node "$n" --master-port "$port" train.py "$@" > "$log" 2>&1; then
    echo "$name ok $record" >> "$CELLS"
  else
    echo "$name failed $record" >> "$CELLS"; FAILED=1; tail -5 "$log" >&2
  fi
}
