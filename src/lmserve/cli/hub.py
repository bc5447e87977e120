"""`lmserve pull ORG/NAME` and `lmserve list`: models in the Hugging Face cache, as Ollama users keep theirs.

pull fetches what lmserve serves from a Hub repository (config, tokenizer, safetensors: loader/hf_hub.py) into the
Hugging Face cache (HF_HOME / HF_HUB_CACHE), so a later `lmserve serve ORG/NAME` starts offline. list shows the
cache's models, which of them lmserve can serve and in which format, and the embedded model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parsers(sub) -> None:
    pull = sub.add_parser("pull", help="fetch a Hub model into the Hugging Face cache (then serve it offline)")
    pull.add_argument("repo", metavar="ORG/NAME", help="a Hugging Face Hub model id")
    pull.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    pull.set_defaults(func=cmd_pull)
    listing = sub.add_parser("list", help="models in the Hugging Face cache that lmserve can serve")
    listing.add_argument("--all", action="store_true", help="also repositories lmserve cannot serve")
    listing.set_defaults(func=cmd_list)


def cmd_pull(args: argparse.Namespace) -> int:
    from lmserve.errors import ConfigError
    from lmserve.loader.hf_hub import download_snapshot, looks_like_hub_id

    if not looks_like_hub_id(args.repo):
        raise ConfigError(f"{args.repo}: not a Hub id (ORG/NAME); a local file or directory needs no pull")
    start = time.perf_counter()
    path = download_snapshot(args.repo, args.revision)
    fmt = model_format(path)
    if fmt is None:
        raise ConfigError(f"{args.repo}: the snapshot at {path} has no config.json with safetensors weights, which "
                          "is what lmserve serves from a Hub id")
    print(f"{args.repo} ({fmt}, {_size(path)}) in {path} ({time.perf_counter() - start:.1f} s); "
          f"serve it with: lmserve serve {args.repo}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    rows = [("NAME", "REVISION", "FORMAT", "SIZE", "MODIFIED")]
    rows += [row for row in cached_models() if args.all or row[2] != "-"]
    from lmserve.loader import default_model_path

    embedded = default_model_path()
    rows.append((f"{embedded.stem.split('.')[0]} (embedded)", "-", "gguf", _size(embedded), "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def cached_models() -> list[tuple[str, str, str, str, str]]:
    """(name, revision, format or "-", size, modified) for each cached model revision, newest first."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    rows = []
    for repo in cache.repos:
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            refs = ",".join(sorted(rev.refs)) or rev.commit_hash[:8]
            rows.append((repo.repo_id, refs, model_format(Path(rev.snapshot_path)) or "-", _size(Path(rev.snapshot_path)),
                         time.strftime("%Y-%m-%d %H:%M", time.localtime(rev.last_modified))))
    return rows


def model_format(path: Path) -> str | None:
    """What lmserve serves from a snapshot: "safetensors" (config.json + weights), "gguf", or None."""
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "safetensors"
    return "gguf" if any(path.glob("*.gguf")) else None


def _size(path: Path) -> str:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    return f"{total / 2**20:.1f} MB" if total < 2**30 else f"{total / 2**30:.2f} GB"
