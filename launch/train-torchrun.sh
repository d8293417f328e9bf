#!/usr/bin/env bash
# Train under torchrun (one node, or one node of a multi-node job).
#
# Usage: bash launch/train-torchrun.sh CONFIG.yaml [key=value ...]   (extra arguments = overrides)
#
#   NPROC        processes on this node (default: number of GPUs, or 2 without GPUs)
#   NNODES       nodes in the job (default 1)
#   NODE_RANK    this node's rank (default 0)
#   MASTER_ADDR  address of node 0 (default 127.0.0.1)
#   MASTER_PORT  free TCP port on node 0 (default: a free port picked by --standalone when
#                NNODES=1, else 29500)
#   PYTHON       interpreter (default .venv/bin/python if present, else python3)
#   OMP_NUM_THREADS  threads per process (default on CPU: cores / NPROC, at least 1)
# On GPUs the ranks use NCCL, on CPU gloo (chosen by moetrain).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG.yaml [key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
# shellcheck source=launch/common.sh
source launch/common.sh
NNODES=${NNODES:-1}
cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC")
if [ "$NNODES" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then
  cmd+=(--standalone)
else
  cmd+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}"
    --master-port "${MASTER_PORT:-29500}")
fi
exec "${cmd[@]}" -m moetrain train "$CONFIG" "$@"
