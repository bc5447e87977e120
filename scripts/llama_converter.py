"""Fetch llama.cpp's converter (convert_hf_to_gguf.py, conversion/, gguf-py/) from the pinned llama-cpp-python sdist on
PyPI into ~/.cache/lmserve/llama_cpp_src, where tests/llama_convert.py finds it. `scripts/install.sh test` runs it.

The tests write GGUF and mmproj files of tiny models with llama.cpp's own converter, as llama.cpp's users make them.
`pip download` of the sdist would first prepare its metadata (a scikit-build-core build environment: about 2 CPU
minutes, 15 on a loaded 2-core machine); the file itself is read from the package index here, checked against its
pinned digest, and only the converter's files are extracted.

    python scripts/llama_converter.py [--index https://pypi.org/simple]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# the converter, and the legacy LLaVA-1.5 scripts (llava_surgery_v2.py, convert_image_encoder_to_gguf.py): its
# convert_hf_to_gguf.py --mmproj refuses a CLIP tower (docs/models.md)
WANTED = ("/vendor/llama.cpp/convert_hf_to_gguf.py", "/vendor/llama.cpp/conversion/", "/vendor/llama.cpp/gguf-py/",
          "/vendor/llama.cpp/tools/mtmd/legacy-models/")
CACHE = Path.home() / ".cache/lmserve/llama_cpp_src"


def sdist_url(index: str) -> str:
    """The sdist's URL on the index's simple page for llama-cpp-python."""
    page = urllib.request.urlopen(f"{index.rstrip('/')}/llama-cpp-python/", timeout=60).read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        if href.split("#")[0].endswith(f"llama_cpp_python-{VERSION}.tar.gz"):
            return urllib.parse.urljoin(f"{index.rstrip('/')}/llama-cpp-python/", href.split("#")[0])
    raise SystemExit(f"llama_converter: llama-cpp-python {VERSION}'s sdist is not on {index}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", default="https://pypi.org/simple")
    args = ap.parse_args(argv)
    if list(CACHE.glob(f"llama_cpp_python-{VERSION}/vendor/llama.cpp/tools/mtmd/legacy-models")):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sdist.tar.gz"
        with urllib.request.urlopen(sdist_url(args.index), timeout=300) as r, path.open("wb") as f:
            digest = hashlib.sha256()
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != SHA256:
            raise SystemExit(f"llama_converter: the sdist's sha256 is {digest.hexdigest()}, not the pinned {SHA256}")
        with tarfile.open(path) as tar:
            members = [m for m in tar.getmembers() if any(w in m.name for w in WANTED)]
            tar.extractall(CACHE, members=members, filter="data")
    print(f"llama_converter: {len(members)} files under {CACHE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
