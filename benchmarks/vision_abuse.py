"""Bad images and image URLs against a served vision model, beside a canary on another key (issue 42: "each bad
image/URL a 400, a canary request on another key answered in <= 2x its idle TTFT").

    python benchmarks/vision_abuse.py [--canaries 20] [--seconds 5] [--concurrency 4] [--output-dir benchmarks/results]

One real `lmserve serve` (tests/server_util.running_server) of the tiny random Idefics3 (tests/vision_models.py,
SmolVLM-shaped) named `vlm`, with a tiny random Llama beside it (`text`, no vision tower: the image-to-a-text-model
case), keys `a` (the abuser) and `b` (the canary). The canary is a text-only streamed completion on `vlm` with key
b; its TTFT is the wall time to its first token. First its idle TTFT (median of --idle canaries); then, for each bad
kind, --concurrency clients send that bad request on key a again and again (a separate process, so the timing
client's event loop never waits on theirs; niced, as clients on other machines take no CPU from the server) while
canaries run one after another on key b (--canaries of them, and for at least --seconds). Reported per kind: the statuses the bad requests got, the
first refusal's message, the canary's TTFT p50 and max, and p50 / idle (target <= 2x). After each kind the server
must be healthy with every KV block free.

A redirect is only seen by a fetch that connects, and every address a local HTTP server can listen on here is
private (refused before any connect): that kind runs on a second server started with the tests' `allow_private`
switch (tests/serve_private_media.py; no flag sets it), with its own idle canary.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEYS = """keys:
  - name: a
    key: sk-a
  - name: b
    key: sk-b
  - name: ops
    key: sk-ops
    role: admin
"""
A, B, OPS = ({"Authorization": f"Bearer sk-{k}", "Content-Type": "application/json"} for k in ("a", "b", "ops"))
MAX_LEN = 512


class _Redirects(BaseHTTPRequestHandler):
    """An allowed host's server: /redirect answers 302 to /ok.png of itself; /ok.png a real PNG."""

    png = b""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)


def serve_images(png: bytes, ports) -> None:
    """In its own process: the allowed host (_Redirects) on 127.0.0.1; puts its port on `ports`, serves forever."""
    _Redirects.png = png
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Redirects)
    httpd.daemon_threads = True
    ports.put(httpd.server_address[1])
    httpd.serve_forever()


def _chat(model: str, *urls: str) -> bytes:
    """A chat request of one user turn: `urls` as image parts, then a word; encoded once (not per send)."""
    return json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": "w1"}]}]}).encode()


def bad_kinds(port: int) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(kinds for the plain server, kinds for the fetching one): name -> a /v1/chat/completions body."""
    from tests.test_media import data_url, png_bomb
    from tests.test_media import image_bytes as solid
    from tests.vision_models import image_bytes

    png, big = image_bytes(90, 50, seed=11), image_bytes(128, 128, seed=5)  # big: 16 tiles and a global view
    plain = {
        "corrupt_image": _chat("vlm", "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode()),
        "decompression_bomb": _chat("vlm", data_url(png_bomb())),  # a PNG header declaring 100000x100000
        "unsupported_format": _chat("vlm", data_url(solid("TIFF"), "image/png")),  # TIFF bytes, labelled PNG
        "images_over_64": _chat("vlm", *[data_url(png)] * 65),
        "images_past_context": _chat("vlm", *[data_url(big)] * 8),  # each decoded and expanded, then too long
        "image_to_text_model": _chat("text", data_url(png)),
        "file_url": _chat("vlm", "file:///etc/passwd"),
        "private_ip": _chat("vlm", "http://10.0.0.1/a.png"),  # 10.0.0.1 is in --allowed-media-domains
        "name_to_loopback": _chat("vlm", f"http://localhost:{port}/ok.png"),  # localhost:PORT is allowed
    }
    fetching = {"redirect": _chat("vlm", f"http://127.0.0.1:{port}/redirect")}
    return plain, fetching


def abuse(url: str, body: bytes, concurrency: int, stop, started, out) -> None:
    """In its own process: `concurrency` clients posting `body` on key a until `stop`; puts (statuses, first
    refusal's message, seconds per request) on `out`."""
    import httpx

    os.nice(10)

    async def main() -> tuple[collections.Counter, str, list[float]]:
        statuses, first, seconds = collections.Counter(), [""], []
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
            async def one() -> None:
                while not stop.is_set():
                    t = time.perf_counter()
                    r = await client.post(url + "/v1/chat/completions", content=body, headers=A)
                    seconds.append(time.perf_counter() - t)
                    statuses[r.status_code] += 1
                    if not first[0]:
                        first[0] = r.text[:2000]  # whole: the report parses it
                    started.set()
            await asyncio.gather(*(one() for _ in range(concurrency)))
        return statuses, first[0], seconds

    statuses, first, seconds = asyncio.run(main())
    out.put((dict(statuses), first, seconds))


def canary_ttft(client, url: str) -> float:
    """Wall seconds to the first token of a short text-only streamed completion on `vlm`, key b."""
    body = {"model": "vlm", "prompt": "w1 w2 w3", "max_tokens": 2, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers=B) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the canary got {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError("the canary got no token")


def idle(client, url: str, n: int) -> list[float]:
    canary_ttft(client, url)  # warm-up: first-call costs out of the way
    return [canary_ttft(client, url) for _ in range(n)]


def run_kind(server, client, name: str, body: bytes, args) -> dict:
    """One bad kind: the burst on key a while the canaries run on key b; then the server checked."""
    ctx = multiprocessing.get_context("spawn")
    stop, started, out = ctx.Event(), ctx.Event(), ctx.Queue()
    load = os.getloadavg()[0]
    proc = ctx.Process(target=abuse, args=(server.url, body, args.concurrency, stop, started, out), daemon=True)
    proc.start()
    if not started.wait(120):
        raise RuntimeError(f"{name}: no bad request was answered")
    start, ttfts = time.perf_counter(), []
    while len(ttfts) < args.canaries or time.perf_counter() - start < args.seconds:  # a burst, not a few requests
        ttfts.append(canary_ttft(client, server.url))
    window = time.perf_counter() - start
    stop.set()
    statuses, first, seconds = out.get(timeout=120)
    proc.join(timeout=60)
    return {"statuses": statuses, "bad_requests": sum(statuses.values()), "refusal": first,
            "bad_per_s": sum(statuses.values()) / window,  # about: the burst ran a little past the canaries
            "bad_seconds_p50": statistics.median(seconds), "bad_seconds_max": max(seconds),
            "canary_ttft_s": ttfts, "canary_p50_s": statistics.median(ttfts), "canary_max_s": max(ttfts),
            "healthy_after": client.get(server.url + "/health").status_code == 200,
            "blocks_free_after": blocks_free(server), "in_flight_after": server.metric("lmserve:num_requests_in_flight"),
            "loadavg_1m": load}


def blocks_free(server, timeout: float = 30) -> bool:
    """Every served model's KV blocks all free within `timeout` s of the burst's end (none leaked)."""
    deadline = time.monotonic() + timeout
    while True:
        free = all(server.metric("lmserve:kv_cache_free_blocks", f'model_name="{m}"') ==
                   server.metric("lmserve:kv_cache_total_blocks", f'model_name="{m}"')
                   for m in server.models)
        if free or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


def phase(server, kinds: dict[str, bytes], args) -> dict:
    """The idle canary, then each kind; the idle canary again at the end (drift)."""
    import httpx

    with httpx.Client(timeout=60) as client:
        before = idle(client, server.url, args.idle)
        base = statistics.median(before)
        rows = {}
        for name, body in kinds.items():
            rows[name] = row = run_kind(server, client, name, body, args)
            row["ratio"] = row["canary_p50_s"] / base
            print(f"{name}: statuses {row['statuses']} ({row['bad_requests']} bad requests), canary p50 "
                  f"{row['canary_p50_s'] * 1e3:.1f} ms max {row['canary_max_s'] * 1e3:.1f} ms, {row['ratio']:.2f}x idle "
                  f"{base * 1e3:.1f} ms", flush=True)
        after = [canary_ttft(client, server.url) for _ in range(args.idle)]
    return {"idle_ttft_s": before, "idle_p50_s": base, "idle_after_p50_s": statistics.median(after), "kinds": rows}


def cpu() -> dict:
    info = {"model": platform.processor() or platform.machine(), "flags": ""}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and info["flags"] == "":
                info["model"] = value.strip()
            if key.strip() == "flags":
                info["flags"] = value.strip()
                break
    except OSError:
        pass
    info["logical_cpus"] = os.cpu_count()
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--idle", type=int, default=20, help="idle canaries (median)")
    p.add_argument("--canaries", type=int, default=20, help="canaries during each bad kind, at least")
    p.add_argument("--seconds", type=float, default=5.0, help="each bad kind's burst lasts at least this long")
    p.add_argument("--concurrency", type=int, default=4, help="bad requests in flight at once")
    p.add_argument("--output-dir", default=str(ROOT / "benchmarks/results"))
    p.add_argument("--lmserve-args", default="", help="extra `lmserve serve` flags for both servers, e.g. "
                   "'--pace-refused-requests 0' (the default server paces a key whose requests keep being refused)")
    p.add_argument("--name", default="vision_abuse", help="the results' file name, without .md/.json")
    args = p.parse_args()

    from tests.conftest import write_tiny_llama
    from tests.server_util import running_server
    from tests.vision_models import build_idefics3, image_bytes

    # the allowed host in its own process: its threads answering hundreds of redirects a second would otherwise
    # take this process's GIL from the canary it times
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    host = ctx.Process(target=serve_images, args=(image_bytes(90, 50, seed=11), ports), daemon=True)
    host.start()
    port = ports.get(timeout=60)
    plain, fetching = bad_kinds(port)
    load = {"start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        vlm, _ = build_idefics3(Path(tmp) / "vlm")
        write_tiny_llama(Path(tmp) / "text")
        (Path(tmp) / "keys.yaml").write_text(KEYS)
        common = ("--api-key-file", str(Path(tmp) / "keys.yaml"), "--dtype", "float32", "--max-model-len",
                  str(MAX_LEN), "--max-num-seqs", "8", *args.lmserve_args.split())
        env = {"PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(ROOT)))}  # this tree's lmserve and tests/
        phases = {}
        with running_server("--model", f"vlm={vlm}", "--model", f"text={Path(tmp) / 'text'}", *common,
                            "--allowed-media-domains", f"10.0.0.1,localhost:{port}", headers=OPS, env=env) as s:
            s.models = ("vlm", "text")
            phases["plain"] = phase(s, plain, args)
        with running_server("--model", f"vlm={vlm}", *common, "--allowed-media-domains", f"127.0.0.1:{port}",
                            headers=OPS, env=env, module="tests.serve_private_media") as s:
            s.models = ("vlm",)
            phases["fetching (allow_private)"] = phase(s, fetching, args)
    host.terminate()
    load["end"] = os.getloadavg()
    write(args, {"cpu": cpu(), "loadavg": load, "clock": "wall (time.perf_counter)", "idle_canaries": args.idle,
                 "canaries_per_kind": args.canaries, "seconds_per_kind": args.seconds, "bad_concurrency": args.concurrency,
                 "server": "lmserve serve, tiny random Idefics3 (tests/vision_models.py) + tiny Llama, float32, "
                           "--num-threads 2", "lmserve_args": args.lmserve_args, "target_ratio": 2.0, "phases": phases})


def write(args, result: dict) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    c, load = result["cpu"], result["loadavg"]
    lines = ["# Bad images and URLs beside a canary on another key (tiny random Idefics3, `lmserve serve`)", "",
             f"CPU: {c['model']}, {c['logical_cpus']} logical CPUs; flags: {c['flags']}", "",
             f"Load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in load['start'])} at the start, "
             f"{', '.join(f'{x:.2f}' for x in load['end'])} at the end (the start's is the machine's before this run; the "
             f"per-kind `load 1m` below counts this benchmark's own server and clients too); wall clock. {result['bad_concurrency']} bad "
             f"requests in flight on key a (a niced client process) for at least {result['seconds_per_kind']:g} s per kind; "
             f"at least {result['canaries_per_kind']} canaries one after another on key b (a text-only streamed completion, 2 tokens), TTFT each. Target: canary p50 <= "
             f"{result['target_ratio']:g}x its idle p50. `python benchmarks/vision_abuse.py"
             f"{' --lmserve-args ' + repr(result['lmserve_args']) if result['lmserve_args'] else ''}` (extra serve flags: "
             f"{result['lmserve_args'] or 'none, the defaults'}).", ""]
    for name, ph in result["phases"].items():
        lines += [f"## Server: {name}", "", f"Idle canary TTFT p50 {ph['idle_p50_s'] * 1e3:.1f} ms (median of "
                  f"{len(ph['idle_ttft_s'])}; {ph['idle_after_p50_s'] * 1e3:.1f} ms again after the last kind).", "",
                  "| bad kind | statuses (count) | bad req/s | canary p50 (ms) | canary max (ms) | p50 / idle | target | "
                  "healthy, blocks free after | load 1m | refusal |", "|---|---|---|---|---|---|---|---|---|---|"]
        for kind, r in ph["kinds"].items():
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
            try:
                message = json.loads(r["refusal"]).get("error", {}).get("message", r["refusal"])
            except (ValueError, AttributeError):
                message = r["refusal"]
            message = message.replace("|", "\\|")[:110]
            lines.append(f"| {kind} | {statuses} | {r['bad_per_s']:.0f} | {r['canary_p50_s'] * 1e3:.1f} | {r['canary_max_s'] * 1e3:.1f} | "
                         f"{r['ratio']:.2f}x | {'met' if r['ratio'] <= result['target_ratio'] else 'MISSED'} | "
                         f"{'yes' if r['healthy_after'] and r['blocks_free_after'] else 'NO'} | "
                         f"{r['loadavg_1m']:.2f} | {message} |")
        lines.append("")
    (out / f"{args.name}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
