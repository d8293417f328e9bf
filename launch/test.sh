#!/usr/bin/env bash
# The README's test command: set up .venv, lint, and run the whole test suite.
# Extra arguments go to pytest (e.g. `bash launch/test.sh -k router`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/ruff check moetrain tests benchmarks
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
