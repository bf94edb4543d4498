# Sourced by scripts/bench/gpu_bench.sh and gpu_moe.sh (run from the repository root): their arguments (--dry-run,
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
