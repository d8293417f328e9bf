#!/usr/bin/env bash
# The README's main command: set up, prepare the embedded default corpus, train the tiny config,
# convert the final checkpoint to a Hugging Face model and print a generated sample.
# On a machine with GPUs it trains on all of them; without, on 2 CPU processes (EP=2, ZeRO-2).
#   CONFIG   config file (default: configs/tiny-cpu.yaml)
#   NPROC    processes to start (default: number of GPUs, or 2 on CPU)
#   PROMPT   prompt for the sample at the end (default: "def ")
# Extra arguments are config overrides, e.g. `bash launch/quickstart.sh train.max_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/tiny-cpu.yaml}
PROMPT=${PROMPT:-"def "}
bash launch/setup.sh
PYTHON=.venv/bin/python
# shellcheck source=launch/common.sh
source launch/common.sh
py=$PYTHON
run_dir=$($py -m moetrain print-config "$CONFIG" "$@" | sed -n 's/^run_dir: //p')
$py -m moetrain prepare "$CONFIG" "$@"
.venv/bin/torchrun --standalone --nproc_per_node "$NPROC" -m moetrain train "$CONFIG" "$@"
$py -m moetrain convert "$run_dir" "$run_dir/hf" --overwrite
echo "--- sample from $run_dir/hf (transformers-loadable) ---"
$py -m moetrain generate "$run_dir/hf" --prompt "$PROMPT" --max-new-tokens 64 --temperature 0.8 --top-k 50
