"""The seeds' workload (issue 42): a day's queue of images captioned as one batch. `lmserve run-batch` on a tiny
random Idefics3 (SmolVLM-shaped, made by transformers here) turns a JSONL of 200 generated images with an alt-text
prompt into 200 answers; killed part-way (SIGKILL) and rerun, it redoes no finished line and ends with exactly one
result per image; progress shows lines done of the total and images/s; a bad image is that line's 400, never the
job's failure."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.test_batch_cli import kill_after_lines, results, write_jsonl
from tests.test_cli_errors import SRC
from tests.vision_models import build_idefics3

pytest.importorskip("transformers")
N = 200
PROMPT = "w1 w2 w3"  # the word-level tokenizer's words stand in for "Write alt text for this image."
SMALL = ["--dtype", "float32", "--mm-encoder-dtype", "float32", "--device", "cpu", "--num-threads", "1", "--max-num-seqs", "8",
         "--served-model-name", "vlm"]


def png(i: int) -> bytes:
    """The i-th image of the queue: its own size (aspect ratios from 1:3 to 3:1) and colours."""
    from PIL import Image

    rng = np.random.default_rng(i)
    w, h = int(rng.integers(16, 97)), int(rng.integers(16, 97))
    colour = rng.integers(0, 256, 3)
    pixels = np.clip(colour + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def alt_text_line(cid: str, url: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "vlm", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("vlm"))[0]


def cmd(model: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lmserve.cli", "--log-level", "warning", "run-batch", "-i", str(src), "-o", str(out), "--model", str(model),
            *SMALL, *extra]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # 200 image requests, twice a model load, on 2 shared cores
def test_200_images_become_200_alt_texts_resumed_after_a_kill(model, tmp_path):
    ids = [f"img-{i:03d}" for i in range(N)]
    src = write_jsonl(tmp_path / "queue.jsonl", [
        alt_text_line(cid, "data:image/png;base64," + base64.b64encode(png(i)).decode()) for i, cid in enumerate(ids)])
    out = tmp_path / "alt.jsonl"
    kill_after_lines(cmd(model, src, out), out, 20, timeout=600, env=env())
    first = results(out)  # every line whole (a torn tail is cut by the rerun; here none is read)
    assert 20 <= len(first) < N

    p = subprocess.run(cmd(model, src, out, "--summary", str(tmp_path / "s.json")), capture_output=True, text=True,
                       timeout=900, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    final = results(out)
    assert len(final) == N and Counter(r["custom_id"] for r in final) == Counter(ids)  # none redone, none missing
    assert final[:len(first)] == first  # the finished lines kept as they were
    for r in final:
        assert r["error"] is None and r["response"]["status_code"] == 200, r
        body = r["response"]["body"]
        # random weights: 8 tokens each (ignore_eos), whatever words they are (special ones are not shown)
        assert isinstance(body["choices"][0]["message"]["content"], str) and body["usage"]["completion_tokens"] == 8
        assert body["usage"]["prompt_tokens"] > 10  # the image's placeholder tokens are in the prompt
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["skipped"], summary["completed"], summary["images"]) == (len(first), N - len(first), N - len(first))
    assert summary["images_s"] > 0
    # progress: lines done of the whole file (the rerun starts at those already done), and images/s
    assert f"{len(first)} done before" in p.stderr and f"{N}/{N}" in p.stderr and "images/s" in p.stderr
    assert f"{N - len(first)} images (" in p.stderr


def test_a_bad_image_is_its_lines_400_and_the_job_goes_on(model, tmp_path):
    good = "data:image/png;base64," + base64.b64encode(png(1)).decode()
    src = write_jsonl(tmp_path / "in.jsonl", [
        alt_text_line("good", good),
        alt_text_line("corrupt", "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnope").decode()),
        alt_text_line("file", "file:///etc/passwd"),
        alt_text_line("not-allowed", "https://evil.example/a.png"),
        alt_text_line("private", "http://10.0.0.1/a.png"),  # allowed by name, refused by address
        alt_text_line("good-2", good),
    ])
    out = tmp_path / "out.jsonl"
    p = subprocess.run(cmd(model, src, out, "--allowed-media-domains", "10.0.0.1"), capture_output=True, text=True,
                       timeout=600, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    by_id = {r["custom_id"]: r for r in results(out)}
    assert len(by_id) == 6
    for cid in ("good", "good-2"):
        assert by_id[cid]["response"]["status_code"] == 200
    assert by_id["good"]["response"]["body"]["choices"] == by_id["good-2"]["response"]["body"]["choices"]
    for cid, words in {"corrupt": "could not be read", "file": "file: is not accepted",
                       "not-allowed": "not in --allowed-media-domains", "private": "private"}.items():
        response = by_id[cid]["response"]
        assert response["status_code"] == 400, by_id[cid]
        error = response["body"]["error"]  # OpenAI's error body, as the HTTP route answers it
        assert words in error["message"] and error["param"] == "messages.0.content.0"
        assert error["type"] == "invalid_request_error"
    assert "2 completed, 4 failed" in p.stderr and "2 images" in p.stderr


def test_batches_api_with_image_lines(model, tmp_path):
    """The same lines through /v1/files and /v1/batches with the official client: the answered image lines in the
    output file, each equal to the chat route's own answer; the bad image in the error file as its 400."""
    import openai

    from tests.server_util import running_server

    n = 12
    urls = ["data:image/png;base64," + base64.b64encode(png(i)).decode() for i in range(n)]
    rows = [alt_text_line(f"img-{i}", u) for i, u in enumerate(urls)]
    rows.append(alt_text_line("corrupt", "data:image/png;base64," + base64.b64encode(b"GIF89a-not").decode()))
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    with running_server("--model", str(model), "--served-model-name", "vlm", "--dtype", "float32", "--mm-encoder-dtype", "float32", "--device", "cpu",
                        "--batch-dir", str(tmp_path / "batches")) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        uploaded = client.files.create(file=("images.jsonl", body), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.time() + 300
        while batch.status not in ("completed", "failed") and time.time() < deadline:
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": n + 1, "completed": n, "failed": 1}
        out = client.files.content(batch.output_file_id).text.splitlines()
        ok = {r["custom_id"]: r for r in map(json.loads, out)}
        assert set(ok) == {f"img-{i}" for i in range(n)}
        for i in (0, n - 1):  # as the chat route answers the same body
            line = dict(rows[i]["body"])
            extra = {"ignore_eos": line.pop("ignore_eos")}  # not a parameter of the client's signature
            alone = client.chat.completions.create(**line, extra_body=extra)
            answer = ok[f"img-{i}"]["response"]["body"]["choices"][0]["message"]["content"]
            assert answer == alone.choices[0].message.content
        failed = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        assert [r["custom_id"] for r in failed] == ["corrupt"]
        error = failed[0]["response"]["body"]["error"]
        assert failed[0]["response"]["status_code"] == 400 and error["param"] == "messages.0.content.0"
        s.wait_idle()  # every KV block came back
