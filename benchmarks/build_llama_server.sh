#!/usr/bin/env bash
# Build llama.cpp's llama-server (benchmarks/compare) and llama-perplexity (benchmarks/perplexity.py) from the
# sources inside PyPI's llama-cpp-python sdist. Nothing built here is committed (benchmarks/.cache is git-ignored).
# Prints llama-server's path last (compare.py reads it); llama-perplexity lies beside it.
# CPU build: GGML_NATIVE=OFF with AVX2/FMA/F16C, plus AVX-512 where this CPU has it, AMX off
# (a native build crashes on multi-token batches on the CPUs this project was planned for).
# LLAMA_LEVEL=avx2: AVX-512 off whatever this CPU has (the peer of lmserve's x86-64-v3 build, which
# LMSERVE_NATIVE_LEVEL=x86-64-v3 runs on any newer CPU), in its own build directory.
set -euo pipefail
cd "$(dirname "$0")"
level=${LLAMA_LEVEL:-host}
cache=.cache/llama.cpp
[ "$level" = avx2 ] && cache=.cache/llama.cpp-avx2
bin="$cache/build/bin/llama-server"
if [ -x "$bin" ] && [ -x "$cache/build/bin/llama-perplexity" ]; then echo "$bin"; exit 0; fi
mkdir -p "$cache" .cache/sdist
if ! ls .cache/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  python3 -m pip download --no-binary :all: --no-deps -d .cache/sdist llama-cpp-python >&2
fi
sdist=$(ls .cache/sdist/llama_cpp_python-*.tar.gz | head -n 1)
[ -d "$(ls -d .cache/sdist/llama_cpp_python-*/ 2>/dev/null | head -n 1)" ] || tar -xzf "$sdist" -C .cache/sdist
src=$(ls -d .cache/sdist/llama_cpp_python-*/vendor/llama.cpp | head -n 1)
# each AVX-512 extension only where this CPU has it (a Xeon may have AVX-512 F/BW/VNNI without VBMI or BF16)
has() { [ "$level" != avx2 ] && grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
cmake -S "$src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)" \
  -DGGML_AVX512_BF16="$(has avx512_bf16)" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
cmake --build "$cache/build" --target llama-server llama-perplexity -j "$(nproc)" >&2
echo "$bin"
