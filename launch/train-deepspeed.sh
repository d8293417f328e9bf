#!/usr/bin/env bash
# Train under DeepSpeed's launcher on this node (multi-node: launch/multinode-deepspeed.sh).
#
# Usage: bash launch/train-deepspeed.sh CONFIG.yaml [key=value ...]  (extra arguments = overrides)
#
#   NPROC        processes (default: number of GPUs, or 2 without GPUs; on a CPU-only machine
#                `deepspeed --num_gpus N` starts N CPU processes that use gloo)
#   MASTER_PORT  free TCP port for the rendezvous (default 29500)
#   PYTHON       interpreter (default .venv/bin/python if present, else python3); the
#                `deepspeed` launcher next to it is used, else the one on PATH
#   OMP_NUM_THREADS  threads per process (default on CPU: cores / NPROC, at least 1)
# The DeepSpeed JSON config is generated from the moetrain config (written to
# RUN_DIR/deepspeed_config.json); the launcher needs none.
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
ds_bin=$(dirname "$PYTHON")/deepspeed
[ -x "$ds_bin" ] || ds_bin=$(command -v deepspeed || true)
if [ -z "$ds_bin" ]; then
  echo "train-deepspeed.sh: no deepspeed launcher next to $PYTHON or on PATH" >&2
  exit 2
fi
exec "$ds_bin" --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29500}" \
  --module moetrain train "$CONFIG" "$@"
