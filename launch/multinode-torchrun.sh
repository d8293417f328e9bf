#!/usr/bin/env bash
# Multi-node training with torchrun and c10d rendezvous: run this same script on every node
# (by hand, pdsh, or a scheduler). The agents meet at RDZV_ENDPOINT, form one job of
# NNODES x NPROC ranks and, with MAX_RESTARTS > 0, restart the workers of every node together
# after a failure; moetrain then resumes from the last complete checkpoint (checkpoint.resume=auto).
# With COMMAND=prepare the same job runs `moetrain prepare` instead: every rank tokenizes its
# share of the documents and rank 0 writes the index (data.output_dir must be on a filesystem
# every node sees); a rerun after a failure keeps the finished work.
#
# Usage: bash launch/multinode-torchrun.sh [CONFIG.yaml] [key=value ...]
#
#   CONFIG         config file (default configs/tiny-cpu.yaml; a first argument ending in .yaml or
#                  .yml takes its place); must be readable at the same path on every node
#   NNODES         number of nodes, or MIN:MAX for an elastic range (default 2)
#   NPROC          processes per node (default: GPUs on this node, or 2 without GPUs)
#   MASTER_ADDR    host of the rendezvous store, reachable from every node (default 127.0.0.1)
#   MASTER_PORT    its TCP port (default 29500)
#   RDZV_BACKEND   c10d (default; node ranks are assigned at rendezvous) or static (ranks are
#                  NODE_RANK, MASTER_ADDR is the rank-0 node)
#   RDZV_ID        job id shared by all nodes (default moetrain; use e.g. $SLURM_JOB_ID)
#   NODE_RANK      this node's rank, required for RDZV_BACKEND=static (default 0)
#   MAX_RESTARTS   restarts of the whole worker group after a failure (default 3)
#   RDZV_TIMEOUT   seconds to wait for all nodes to join (default 900)
#   LOCAL_ADDR     address this node announces to the others (default: torchrun's choice, the
#                  FQDN; set it when hostnames do not resolve between nodes)
#   SHUTDOWN_TIMEOUT  seconds workers get to checkpoint after SIGTERM before SIGKILL (default 120)
#   PYTHON         interpreter (default .venv/bin/python if present, else python3)
#   OMP_NUM_THREADS   threads per process (default on CPU: cores / NPROC, at least 1)
#   COMMAND        the moetrain command each rank runs: train (default) or prepare
#   DRY_RUN        1 = print the torchrun command line instead of running it
#
# Example, two nodes with 8 GPUs each (run on both):
#   NNODES=2 MASTER_ADDR=node01 RDZV_ID=run42 bash launch/multinode-torchrun.sh configs/mixtral-1b-8gpu.yaml
# A prepare over the same two nodes, 8 ranks each (each with its share of the node's cores):
#   COMMAND=prepare NNODES=2 NPROC=8 MASTER_ADDR=node01 RDZV_ID=prep42 bash launch/multinode-torchrun.sh configs/mixtral-1b-8gpu.yaml
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/tiny-cpu.yaml}
if [ $# -gt 0 ] && [[ $1 == *.yaml || $1 == *.yml ]]; then
  CONFIG=$1
  shift
fi
NNODES=${NNODES:-2}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
RDZV_ID=${RDZV_ID:-moetrain}
NODE_RANK=${NODE_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}
COMMAND=${COMMAND:-train}
case "$COMMAND" in
  train | prepare) ;;
  *)
    echo "multinode-torchrun.sh: COMMAND must be train or prepare; got '$COMMAND'" >&2
    exit 2
    ;;
esac

# shellcheck source=launch/common.sh
source launch/common.sh

cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC"
  --max-restarts "$MAX_RESTARTS" --shutdown-timeout "$SHUTDOWN_TIMEOUT")
case "$RDZV_BACKEND" in
  c10d)
    cmd+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
      --rdzv-conf "join_timeout=$RDZV_TIMEOUT")
    ;;
  static)
    cmd+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
    ;;
  *)
    echo "multinode-torchrun.sh: RDZV_BACKEND must be c10d or static; got '$RDZV_BACKEND'" >&2
    exit 2
    ;;
esac
if [ -n "${LOCAL_ADDR:-}" ]; then
  cmd+=(--local-addr "$LOCAL_ADDR")
fi
cmd+=(-m moetrain "$COMMAND" "$CONFIG" "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
