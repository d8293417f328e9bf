# shellcheck shell=bash
# Sourced by the launch scripts (after `cd` to the repository root): the interpreter, the GPUs
# of this node and the processes per node.
#   PYTHON           interpreter (default .venv/bin/python if present, else python3)
#   GPUS             GPUs on this node (default: torch's count, else nvidia-smi's, else 0)
#   NPROC            processes per node (default: GPUS, or 2 without GPUs)
#   OMP_NUM_THREADS  without GPUs: cores / NPROC (at least 1) unless already set
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${GPUS:-}" ]; then
  GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || true)
  if [ -z "$GPUS" ] || [ "$GPUS" = 0 ]; then
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  GPUS=${GPUS:-0}
fi
if [ "$GPUS" -gt 0 ]; then
  NPROC=${NPROC:-$GPUS}
else
  NPROC=${NPROC:-2}
  cores=$(nproc 2>/dev/null || echo 1)
  threads=$((cores / NPROC))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
fi
