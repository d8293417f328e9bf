#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install moetrain with its dependencies.
#   PYTHON       interpreter to build the venv with (default: python3)
#   VENV         venv directory (default: .venv at the repository root)
#   TORCH_SPEC   the torch requirement (default: torch==2.13.0, the version CI pins; on Linux
#                x86_64 PyPI's build of it is the CUDA one)
#   EXTRAS       pip extras to install (default: dev)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# torch first, pinned, so that no dependency pulls another build.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$TORCH_SPEC"
"${pip[@]}" -e ".[${EXTRAS}]"
echo "moetrain installed in $VENV"
