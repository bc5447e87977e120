#!/usr/bin/env bash
# Install everything into .venv (torch 2.13.0 CPU, lmserve with its test extras, the embedded model)
# and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
. .venv/bin/activate
python -m pytest -q -rs --durations=25 "$@"  # the slowest 25 listed: the suite must stay under 30 min
