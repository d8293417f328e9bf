#!/usr/bin/env bash
# Train under `accelerate launch` with DeepSpeed (launch/accelerate_deepspeed.yaml).
#
# Usage: bash launch/train-accelerate.sh CONFIG.yaml [key=value ...] (extra arguments = overrides)
#
#   NPROC        processes on this node (default: number of GPUs, or 2 without GPUs)
#   NNODES       machines (default 1); MACHINE_RANK this machine's rank (default 0)
#   MASTER_ADDR  address of machine 0 (default 127.0.0.1)
#   MASTER_PORT  free TCP port on machine 0 (default 29500)
#   ACCELERATE_CONFIG  accelerate config file (default launch/accelerate_deepspeed.yaml)
#   PYTHON       interpreter (default .venv/bin/python if present, else python3)
#   OMP_NUM_THREADS  threads per process (default on CPU: cores / NPROC, at least 1)
# moetrain builds the DeepSpeed engine itself from the moetrain config (ZeRO stage, batch,
# accumulation, clipping, precision); accelerate only starts the processes. Do not pass --cpu:
# accelerate refuses it together with DeepSpeed, and moetrain picks gloo on CPU by itself.
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
exec "$PYTHON" -m accelerate.commands.launch \
  --config_file "${ACCELERATE_CONFIG:-launch/accelerate_deepspeed.yaml}" \
  --num_processes $((NPROC * NNODES)) --num_machines "$NNODES" \
  --machine_rank "${MACHINE_RANK:-0}" --main_process_ip "${MASTER_ADDR:-127.0.0.1}" \
  --main_process_port "${MASTER_PORT:-29500}" \
  -m moetrain train "$CONFIG" "$@"
