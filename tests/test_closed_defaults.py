"""Closed defaults (issue 47, finding 11) against the real server, probed as the holder of a plain key would:
/metrics is refused to plain keys (a server with plain keys alone has no key that may read it); no model card,
listing or error names a path on the server; and a server told to require keys refuses to start without one.
The labels /metrics gives keys are tests/test_server_tenants.py's (an admin reads them there)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import ollama
import pytest

from tests.conftest import write_tiny_llama
from tests.server_util import BASE_ARGS, MODEL, free_port, running_server

P1, P2 = "plain-closed-one-0123456789", "plain-closed-two-0123456789"
KEY_FINGERPRINT = re.compile(r"key-[0-9a-f]{8}")  # a plain key's name: 8 hex digits of its SHA-256


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def plain_only(tmp_path_factory, smol_path):
    """Two plain keys and keys required; the embedded model, and a tiny one under a private directory whose
    weights go missing after the start (its first load fails)."""
    private = tmp_path_factory.mktemp("closed") / "operator-private-models"
    private.mkdir()
    tiny = private / "tiny"
    write_tiny_llama(tiny)
    with running_server("--require-api-key", "--api-key", P1, "--api-key", P2, "--model", f"{MODEL}={smol_path}",
                        "--model", f"tiny={tiny}", "--max-loaded-models", "1") as s:  # tiny: loaded when asked
        (tiny / "model.safetensors").unlink()
        smol = Path(smol_path).resolve()
        s.paths = [str(p) for p in (smol, smol.parent, Path(smol_path), Path(smol_path).parent, tiny, tiny.parent)]
        yield s


def test_no_plain_key_reads_metrics(plain_only):
    """Plain keys have no role, so none is an admin: 403 on /metrics for each (it lists every key's usage)."""
    for key in (P1, P2):
        r = httpx.get(plain_only.url + "/metrics", headers=bearer(key), timeout=30)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        assert "key_name" not in r.text and not KEY_FINGERPRINT.search(r.text)
    assert httpx.get(plain_only.url + "/metrics", timeout=30).status_code == 401


def test_no_model_card_or_listing_names_a_server_path(plain_only):
    """/api/show returned the model's absolute path (its Modelfile's FROM); every card and listing a key can read
    is checked for the files' paths and their directories."""
    url, h = plain_only.url, bearer(P2)
    bodies = {path: httpx.get(url + path, headers=h, timeout=60).text
              for path in ("/api/tags", "/api/ps", "/v1/models", f"/v1/models/{MODEL}", "/v1/models/tiny",
                           f"/v2/models/{MODEL}")}
    for name in (MODEL, "tiny"):
        r = httpx.post(url + "/api/show", json={"model": name}, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        bodies[f"/api/show {name}"] = r.text
    for where, text in bodies.items():
        leaked = [p for p in plain_only.paths if p in text]
        assert not leaked, f"{where} names {leaked}"
    show = ollama.Client(host=url, headers=h, timeout=60).show(MODEL)  # the official client still reads it
    assert show.modelfile.splitlines()[-1] == f"FROM {MODEL}" and show.modelinfo["general.architecture"] == "llama"


def test_a_failed_load_does_not_name_the_missing_file(plain_only):
    """The reason a model failed to load names its files: it goes to the server's log, not to whichever key asked."""
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 1}
    r = httpx.post(plain_only.url + "/v1/completions", json=body, headers=bearer(P1), timeout=120)
    assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"], r.text
    assert not [p for p in plain_only.paths if p in r.text] and "safetensors" not in r.text, r.text
    ok = httpx.post(plain_only.url + "/v1/completions", json={**body, "model": MODEL}, headers=bearer(P1), timeout=300)
    assert ok.status_code == 200  # the server goes on serving (the embedded model, loaded again)


@pytest.mark.parametrize("key_file", [None, "", "# the Secret's file, with its keys left out\n"])
def test_required_keys_refuse_to_start_without_one(tmp_path, key_file):
    """--require-api-key with no key (none given, or a key file with none in it: a Secret created empty) is one
    line and exit 2, before any model loads."""
    flags = []
    if key_file is not None:
        (tmp_path / "keys").write_text(key_file)
        flags = ["--api-key-file", str(tmp_path / "keys")]
    env = {k: v for k, v in os.environ.items() if k != "LMSERVE_API_KEY"}
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--require-api-key", *flags, *BASE_ARGS,
                        "--log-level", "info"], capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("lmserve: error:")]
    assert errors == ["lmserve: error: --require-api-key: no API key was given (--api-key, $LMSERVE_API_KEY or a "
                      "non-empty --api-key-file); refusing to serve an open API"], out
    assert "loading model" not in out and "Traceback" not in out
