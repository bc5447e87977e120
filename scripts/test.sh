#!/usr/bin/env bash
# Install everything into .venv (torch 2.13.0 CPU, lmserve with its test extras, the embedded model)
# and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
. .venv/bin/activate
# The suite must stay under 30 min on 2 cores. Two phases: every test not marked `serial` in two worker processes
# (xdist; whole files per worker, so a module's server fixture is started once), then the `serial` ones alone
# (timing- or load-sensitive: the abuse canaries, the thread pool's wake-up counts). Exit 5 is "none selected".
status=0
python -m pytest -q -rs --durations=40 -n 2 --dist loadfile -m "not serial" "$@" || status=$?
[ "$status" = 5 ] && status=0
serial=0
python -m pytest -q -rs --durations=10 -m serial "$@" || serial=$?
[ "$serial" = 5 ] && serial=0
[ "$status" != 0 ] && exit "$status"
exit "$serial"
