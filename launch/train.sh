#!/usr/bin/env bash
# Train with the launcher that fits this machine: all local GPUs under `deepspeed` (or `torchrun`
# when DeepSpeed's launcher is missing), or CPU processes under `torchrun` with gloo.
#
# Usage: bash launch/train.sh [CONFIG.yaml] [key=value ...]     (extra arguments = overrides)
#
#   CONFIG       config file (default: configs/tiny-cpu.yaml; a first argument ending in .yaml or
#                .yml takes its place)
#   LAUNCHER     auto | torchrun | deepspeed | python (default auto: deepspeed when GPUs are
#                present and the deepspeed launcher is installed and NNODES=1, else torchrun;
#                python = one plain process, no launcher)
#   GPUS         GPUs on this node (default: torch.cuda.device_count(), else `nvidia-smi -L`)
#   NPROC        processes on this node (default: GPUS, or 2 on a machine without GPUs)
#   NNODES       nodes in the job (default 1); each node runs this script with its NODE_RANK
#   NODE_RANK    this node's rank, 0..NNODES-1 (default 0)
#   MASTER_ADDR  address of node 0 (default 127.0.0.1)
#   MASTER_PORT  a free TCP port on node 0 (default 29500; single-node torchrun without it uses
#                --standalone, which picks a free port)
#   MAX_RESTARTS torchrun --max-restarts (default 0)
#   PYTHON       interpreter (default .venv/bin/python if present, else python3)
#   OMP_NUM_THREADS  CPU threads per process (default on CPU: cores / NPROC, at least 1)
#   DRY_RUN      1 = print the command line instead of running it
#
# Examples:
#   bash launch/train.sh configs/tiny-cpu.yaml train.max_steps=50
#   LAUNCHER=torchrun NPROC=4 bash launch/train.sh configs/small-1gpu.yaml parallel.ep_size=4
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash launch/train.sh CFG
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/tiny-cpu.yaml}
if [ $# -gt 0 ] && [[ $1 == *.yaml || $1 == *.yml ]]; then
  CONFIG=$1
  shift
fi
LAUNCHER=${LAUNCHER:-auto}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MAX_RESTARTS=${MAX_RESTARTS:-0}

# shellcheck source=launch/common.sh
source launch/common.sh

# The deepspeed launcher installed next to the interpreter (a venv), else on PATH.
ds_bin=$(dirname "$PYTHON")/deepspeed
[ -x "$ds_bin" ] || ds_bin=$(command -v deepspeed || true)

if [ "$LAUNCHER" = auto ]; then
  if [ "$GPUS" -gt 0 ] && [ -n "$ds_bin" ] && [ "$NNODES" = 1 ]; then
    LAUNCHER=deepspeed
  else
    LAUNCHER=torchrun
  fi
fi

case "$LAUNCHER" in
  torchrun)
    cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC"
      --max-restarts "$MAX_RESTARTS")
    if [ "$NNODES" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then
      cmd+=(--standalone)
    else
      cmd+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
        --master-port "${MASTER_PORT:-29500}")
    fi
    cmd+=(-m moetrain train "$CONFIG")
    ;;
  deepspeed)
    if [ -z "$ds_bin" ]; then
      echo "train.sh: LAUNCHER=deepspeed but no deepspeed launcher found" >&2
      exit 2
    fi
    if [ "$NNODES" != 1 ]; then
      echo "train.sh: multi-node deepspeed needs a hostfile: use launch/multinode-deepspeed.sh" >&2
      exit 2
    fi
    cmd=("$ds_bin" --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29500}"
      --module moetrain train "$CONFIG")
    ;;
  python)
    if [ "$NPROC" != 1 ] || [ "$NNODES" != 1 ]; then
      echo "train.sh: LAUNCHER=python runs one process; set NPROC=1 (got NPROC=$NPROC NNODES=$NNODES)" >&2
      exit 2
    fi
    cmd=("$PYTHON" -m moetrain train "$CONFIG")
    ;;
  *)
    echo "train.sh: LAUNCHER must be auto, torchrun, deepspeed or python; got '$LAUNCHER'" >&2
    exit 2
    ;;
esac
cmd+=("$@")

echo "train.sh: GPUS=$GPUS NPROC=$NPROC NNODES=$NNODES NODE_RANK=$NODE_RANK launcher=$LAUNCHER" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
