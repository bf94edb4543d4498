#!/usr/bin/env bash
# Multi-node training without SLURM: run this script on every node, each with its own NODE_RANK.
#
#   node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/launch_multinode.sh --config configs/my_run.yaml
#   node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/launch_multinode.sh --config configs/my_run.yaml
#   pre-flight first (same variables):  SCRIPT=scripts/check_env.py bash scripts/launch_multinode.sh
#   see the command without running it: bash scripts/launch_multinode.sh --dry-run ...   (or DRY_RUN=1)
#
# Arguments after the options go to train.py (config overrides). Settings come from the environment:
#   NODE_RANK      this node's index, 0 .. NNODES-1 (required; SLURM's SLURM_NODEID when set)
#   MASTER_ADDR    node 0's address, reachable from every node (required)
#   MASTER_PORT    rendezvous port on node 0, open between the nodes (29400)
#   NNODES         number of nodes (2)
#   GPUS_PER_NODE  processes per node (the GPUs nvidia-smi lists; 1 without GPUs)
#   LAUNCHER       accelerate (default, uses CONFIG) or torchrun
#   CONFIG         accelerate config (accelerate_configs/multi_node.yaml; fsdp.yaml etc. work too)
#   SCRIPT         the program to launch (train.py)
#   MAX_RESTARTS   elastic restarts of all workers after a failure (0); resume=auto continues from the newest checkpoint
#   RDZV_ID        torchrun's job id, the same on every node (parallel_train)
# The rendezvous is c10d: global ranks follow the order in which nodes join; global rank 0 writes the outputs.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
die() { echo "error: $*" >&2; exit 2; }

NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-}}
[[ -n $NODE_RANK ]] || die "NODE_RANK is not set: run NODE_RANK=0 on the first node, NODE_RANK=1 on the second, ..."
[[ -n ${MASTER_ADDR:-} ]] || die "MASTER_ADDR is not set: give node 0's address, e.g. MASTER_ADDR=10.0.0.1"
MASTER_PORT=${MASTER_PORT:-29400}
NNODES=${NNODES:-2}
if [[ -z ${GPUS_PER_NODE:-} ]]; then
    GPUS_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ $GPUS_PER_NODE -gt 0 ]] || GPUS_PER_NODE=1
fi
LAUNCHER=${LAUNCHER:-accelerate}
CONFIG=${CONFIG:-accelerate_configs/multi_node.yaml}
SCRIPT=${SCRIPT:-train.py}
MAX_RESTARTS=${MAX_RESTARTS:-0}
[[ $NODE_RANK =~ ^[0-9]+$ && $NODE_RANK -lt $NNODES ]] || die "NODE_RANK=$NODE_RANK: must be 0 .. $((NNODES - 1)) for NNODES=$NNODES"

case $LAUNCHER in
    accelerate)
        [[ -f $CONFIG ]] || die "CONFIG=$CONFIG: no such file; pick one in accelerate_configs/"
        cmd=("${ACCELERATE:-accelerate}" launch --config_file "$CONFIG" --num_machines "$NNODES"
             --num_processes "$((NNODES * GPUS_PER_NODE))" --machine_rank "$NODE_RANK"
             --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" --rdzv_backend c10d)
        if [[ $MAX_RESTARTS -gt 0 ]]; then cmd+=(--max_restarts "$MAX_RESTARTS"); fi
        ;;
    torchrun)
        cmd=("${TORCHRUN:-torchrun}" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK"
             --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-parallel_train}")
        if [[ $MAX_RESTARTS -gt 0 ]]; then cmd+=(--max-restarts "$MAX_RESTARTS"); fi
        ;;
    *) die "LAUNCHER=$LAUNCHER: use accelerate or torchrun" ;;
esac
cmd+=("$SCRIPT" "$@")

if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
    exit 0
fi
echo "[launch_multinode] node $NODE_RANK of $NNODES on $(hostname): ${cmd[*]}" >&2
exec "${cmd[@]}"
