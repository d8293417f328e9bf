#!/usr/bin/env bash
# Multi-node training with DeepSpeed's launcher: run this once, on the first host of the
# hostfile. The launcher reaches every host over passwordless ssh with pdsh and starts
# `python -m moetrain train` there in the same directory with the same interpreter, so the
# repository, its .venv and the token shards must sit at the same path on every node (a shared
# filesystem or the Docker image, see docker/README.md).
# Environment variables that must reach the other nodes (NCCL_*, WANDB_*, HF_*) go into a
# `.deepspeed_env` file (KEY=VALUE lines) in the repository root or the home directory;
# DeepSpeed exports NCCL_*, PYTHON* and UCX_* by itself.
#
# Usage: bash launch/multinode-deepspeed.sh [CONFIG.yaml] [key=value ...]
#
#   CONFIG       config file (default configs/tiny-cpu.yaml; a first argument ending in .yaml or
#                .yml takes its place)
#   HOSTFILE     "HOST slots=N" per line (default launch/hostfile; see launch/hostfile.example)
#   MASTER_ADDR  address of the first host as the others reach it (default: its hostfile name)
#   MASTER_PORT  a free TCP port on it (default 29500)
#   NUM_NODES    use only the first NUM_NODES hosts (default: all)
#   NUM_GPUS     use only NUM_GPUS slots per host (default: all)
#   INCLUDE      DeepSpeed --include filter, e.g. "node01:0,1@node02" (default: none)
#   SSH_PORT     ssh port of the hosts (default: ssh's own; the Docker image's sshd uses 2222)
#   LAUNCHER     pdsh (default), openmpi or mvapich: how DeepSpeed fans out
#   PYTHON       interpreter whose deepspeed launcher is used (default .venv/bin/python if
#                present, else python3)
#   DRY_RUN      1 = print the deepspeed command line instead of running it
#
# Example: HOSTFILE=launch/hostfile bash launch/multinode-deepspeed.sh configs/multinode-8x7b-style.yaml
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/tiny-cpu.yaml}
if [ $# -gt 0 ] && [[ $1 == *.yaml || $1 == *.yml ]]; then
  CONFIG=$1
  shift
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
HOSTFILE=${HOSTFILE:-launch/hostfile}
MASTER_PORT=${MASTER_PORT:-29500}
LAUNCHER=${LAUNCHER:-pdsh}
if [ ! -f "$HOSTFILE" ]; then
  echo "multinode-deepspeed.sh: hostfile '$HOSTFILE' not found (see launch/hostfile.example)" >&2
  exit 2
fi
if [ -z "${MASTER_ADDR:-}" ]; then
  MASTER_ADDR=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")
fi
ds_bin=$(dirname "$PYTHON")/deepspeed
[ -x "$ds_bin" ] || ds_bin=deepspeed

cmd=("$ds_bin" --hostfile "$HOSTFILE" --launcher "$LAUNCHER" --master_addr "$MASTER_ADDR"
  --master_port "$MASTER_PORT")
[ -n "${NUM_NODES:-}" ] && cmd+=(--num_nodes "$NUM_NODES")
[ -n "${NUM_GPUS:-}" ] && cmd+=(--num_gpus "$NUM_GPUS")
[ -n "${INCLUDE:-}" ] && cmd+=(--include "$INCLUDE")
[ -n "${SSH_PORT:-}" ] && cmd+=(--ssh_port "$SSH_PORT")
cmd+=(--module moetrain train "$CONFIG" "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
