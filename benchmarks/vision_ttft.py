"""Time to first token of an image request, first sight of the image against a repeat (issue 42): the encoder
cache (worker/mm_encoder.py) keeps an image's embeddings, so a repeated image runs no vision tower.

    python benchmarks/vision_ttft.py [--rounds 2] [--split] [--output-dir benchmarks/results]

The model is SmolVLM-256M-Instruct's shape with random weights (its config written below; nothing downloaded):
a SigLIP-base/16 tower at 512 px, pixel shuffle by 4 (64 tokens a tile), SmolLM2-135M's text model. Each round
asks the offline engine (engine/llm.py) for one token of three requests, each timed in CPU seconds of this process
(time.process_time, one torch thread: the machine may be shared, so no wall clock):
- first: a new image after new text (the tower runs, nothing cached);
- repeat: the same image after other text (the prefix cache cannot help: the text before the image differs;
  its embeddings come from the encoder cache);
- same: the first request again (prefix cache and encoder cache).
The target: repeat / first <= 0.3x. Without --split an image is one 512 px tile (64 tokens); with it, SmolVLM's
default splitting: the 640x480 image is 4x3 tiles and the global view (859 tokens), where the tower's share is
larger still.

    python benchmarks/vision_ttft.py --vs-llama-server [--llama-server PATH] [--threads 2]

lmserve against llama-server on the same two files: the same random model converted by llama.cpp's own
convert_hf_to_gguf.py (tests/llama_convert.py) to a text GGUF and an mmproj GGUF (float32), served by
`lmserve serve --mmproj` and `llama-server --mmproj`, one after the other in the same run, the same threads. Alt
text: a 512x512 image and a short text, 32 tokens out (ignore_eos, greedy), streamed; every request a new image
(no encoder or prefix cache helps). Measured: TTFT of one image alone (the wall time of
that request cut to one token, median of 3) and images/s of 8
concurrent requests. The preprocessor is SmolVLM-256M's own (`--longest-edge 2048`): both servers scale a 512 px
image to 2048 px, 16 tiles of 512 and a global view, 17 tower passes and 1,088 image tokens each. `--longest-edge
512` is the light variant an earlier run used: lmserve then frames one tile, as transformers does, while llama.cpp's
mtmd still adds an overview, so the two do different work. lmserve's text model is float32 and its tower runs as
`--mm-encoder-dtype` says (default auto: bf16 on a CPU where a bf16 tower matmul measures >= 1.5x float32's;
llama-server computes a float32 mmproj in float32); `--name` writes the results under another file name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# HuggingFaceTB/SmolVLM-256M-Instruct's config.json (the fields that set its shape)
SMOLVLM_256M = {
    "scale_factor": 4,
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                      "image_size": 512, "patch_size": 16, "layer_norm_eps": 1e-6},
    "text_config": {"model_type": "llama", "vocab_size": 49280, "hidden_size": 576, "intermediate_size": 1536,
                    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                    "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": False},
}
# its preprocessor_config.json / processor_config.json
PREPROCESSOR = {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 2048},
                "max_image_size": {"longest_edge": 512}, "resample": 1, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}


def build(root: Path, split: bool) -> Path:
    """The random-weight model directory (the tiny test tokenizer: its words and SmolVLM's image tokens)."""
    import torch
    import transformers

    from tests.vision_models import IMAGE_TOKEN_ID, write_tokenizer

    torch.manual_seed(0)
    cfg = transformers.Idefics3Config(**SMOLVLM_256M, image_token_id=IMAGE_TOKEN_ID)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    path = root / "smolvlm-256m-random"
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "do_image_splitting": split}))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    write_tokenizer(path)
    return path


def cpu_seconds(llm, prompt: str, img) -> tuple[float, int]:
    """CPU seconds of one request for one token (its TTFT's work), and the prompt tokens it found cached."""
    from lmserve.sampling_params import SamplingParams

    start = time.process_time()
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [img]}}],
                       SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    return time.process_time() - start, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--split", action="store_true", help="SmolVLM's default image splitting (tiles and the global view)")
    ap.add_argument("--output-dir", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--vs-llama-server", action="store_true", help="lmserve against llama-server on GGUF + mmproj")
    ap.add_argument("--llama-server", default=str(ROOT / "benchmarks/.cache/llama.cpp/build/bin/llama-server"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mm-encoder-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="--vs-llama-server: lmserve's tower dtype (the text model stays float32)")
    ap.add_argument("--name", default=None, help="--vs-llama-server: the results' file name, without .md/.json "
                    "(default vision_mmproj, or vision_mmproj_edgeN)")
    ap.add_argument("--longest-edge", type=int, default=2048,
                    help="--vs-llama-server: the processor's longest edge (SmolVLM-256M's own 2048: 16 tiles + global)")
    args = ap.parse_args()
    if args.vs_llama_server:
        vs_llama_server(args)
        return
    import torch

    torch.set_num_threads(1)
    from lmserve.engine.llm import LLM
    from tests.vision_models import image

    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args.split)
        llm = LLM(str(path), dtype="float32", device="cpu", num_threads=1, enable_prefix_caching=True,
                  max_model_len=4096, max_num_batched_tokens=4096)
        cpu_seconds(llm, "w1 w2 <image> w3", image(64, 64, seed=1))  # warm-up: first-call costs out of the way
        rows = []
        for r in range(args.rounds):
            img = image(640, 480, seed=100 + r)
            first, hit_first = cpu_seconds(llm, f"w{10 + r} w20 <image> w21", img)
            repeat, hit_repeat = cpu_seconds(llm, f"w{40 + r} w41 <image> w21", img)
            same, hit_same = cpu_seconds(llm, f"w{10 + r} w20 <image> w21", img)
            rows.append({"first_s": first, "repeat_s": repeat, "same_s": same, "cached_tokens": {
                "first": hit_first, "repeat": hit_repeat, "same": hit_same}})
            print(f"round {r}: first {first:.2f} s, repeat {repeat:.2f} s ({repeat / first:.3f}x), "
                  f"same {same:.2f} s ({same / first:.3f}x)", flush=True)
        encoded = llm.engine.runner.images.cache.num_encoded
        tokens = len(llm.engine.front.images.expand(llm.engine.front.tokenize_prompt("<image>"), [img])[0])
    load.append(os.getloadavg()[0])
    ratio = statistics.median(r["repeat_s"] / r["first_s"] for r in rows)
    same = statistics.median(r["same_s"] / r["first_s"] for r in rows)
    result = {"cpu": _cpu_name(), "torch_threads": 1, "split": args.split, "image_tokens": tokens,
              "images_encoded": encoded, "rounds": rows, "repeat_over_first": ratio, "same_over_first": same,
              "target": 0.3, "loadavg_before_after": load, "clock": "time.process_time (CPU seconds)"}
    out = Path(args.output_dir)
    name = "vision_ttft_split" if args.split else "vision_ttft"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Vision TTFT: a repeated image (encoder cache), SmolVLM-256M shape, random weights", "",
             f"CPU: {result['cpu']}; 1 torch thread; CPU seconds (time.process_time), load average "
             f"{load[0]:.1f} -> {load[1]:.1f}; image 640x480, {'split: 512 px tiles and the global view' if args.split else 'one 512 px tile'}, "
             f"{tokens} prompt tokens for it.", "",
             "| round | first (s) | repeat, other text (s) | ratio | same request (s) | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {i} | {r['first_s']:.2f} | {r['repeat_s']:.2f} | {r['repeat_s'] / r['first_s']:.3f} | "
              f"{r['same_s']:.2f} | {r['same_s'] / r['first_s']:.3f} |" for i, r in enumerate(rows)]
    lines += ["", f"Median repeat / first: **{ratio:.3f}x** (target <= 0.3x); images encoded: {encoded} "
              f"(one per round and the warm-up).", ""]
    (out / f"{name}.md").write_text("\n".join(lines))
    print(f"repeat/first {ratio:.3f}x (target 0.3x); same/first {same:.3f}x; {encoded} images encoded")


def mmproj_files(root: Path, longest_edge: int) -> tuple[Path, Path]:
    """The random SmolVLM-256M-shaped model as llama.cpp's converter writes it: (text GGUF, mmproj GGUF), its
    processor scaling an image's longest edge to `longest_edge` (SmolVLM-256M's own: 2048)."""
    from tests.llama_convert import convert

    path = build(root, split=True)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**pre, "size": {"longest_edge": longest_edge}}))
    return convert(path, root, sentencepiece=True, newlines=True)


def _chat_body(png: bytes, stream: bool) -> dict:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w5 w6 w7 w8"}]}],
        "max_tokens": 32, "temperature": 0.0, "ignore_eos": True, "stream": stream}


def _ttft(client, url: str, png: bytes) -> float:
    """Wall seconds of the request cut to one token: the image's preprocessing, tower and prefill, and the first
    token. Not the first streamed content: a random model's tokens may be special ones, which llama-server streams
    no content for (every warm-up stream ended without one)."""
    body = {**_chat_body(png, False), "max_tokens": 1}
    start = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:  # the server's own words, not only the status
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:1000]}")
    if r.json()["usage"]["completion_tokens"] != 1:
        raise RuntimeError(f"{url}: not one token: {r.text[:1000]}")
    return time.perf_counter() - start


def _concurrent(client, url: str, pngs: list[bytes]) -> tuple[float, list[int], list[int]]:
    """(wall seconds, completion tokens of each, prompt tokens of each) of the requests sent at once. The prompt
    tokens say how each server framed the image (llama.cpp's Idefics3 framing adds newline tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(png: bytes) -> tuple[int, int]:
        r = client.post(url + "/v1/chat/completions", json=_chat_body(png, False), timeout=1200)
        r.raise_for_status()
        usage = r.json()["usage"]
        return int(usage["completion_tokens"]), int(usage["prompt_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(len(pngs)) as pool:
        counts = list(pool.map(one, pngs))
    return time.perf_counter() - start, [c for c, _ in counts], [p for _, p in counts]


def vs_llama_server(args) -> None:
    """lmserve and llama-server on the same GGUF + mmproj (module docstring)."""
    import subprocess

    import httpx

    from tests.server_util import free_port
    from tests.vision_models import image_bytes

    peer_env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    binary = Path(args.llama_server)
    n, rounds = 8, 3
    ctx = 4096 if args.longest_edge > 512 else 1024  # 17 views of 64 tokens and llama.cpp's framing fit 4096
    with tempfile.TemporaryDirectory() as tmp:
        text, mmproj = mmproj_files(Path(tmp), args.longest_edge)
        systems = {"lmserve": lambda port: ([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port),
                                             "--model", str(text), "--mmproj", str(mmproj), "--served-model-name", "m",
                                             "--dtype", "float32", "--mm-encoder-dtype", args.mm_encoder_dtype,
                                             "--quantization", "none", "--num-threads", str(args.threads),
                                             "--max-num-seqs", str(n), "--kv-cache-memory", str(2**30),
                                             "--max-model-len", str(ctx), "--log-level", "warning"],
                                            {"PYTHONPATH": str(ROOT / "src")}),
                   "llama-server": lambda port: ([str(binary), "-m", str(text), "--mmproj", str(mmproj), "--host",
                                                  "127.0.0.1", "--port", str(port), "-t", str(args.threads), "-tb",
                                                  str(args.threads), "-np", str(n), "-c", str(n * ctx),
                                                  "--alias", "m", "--no-webui"], {"LD_LIBRARY_PATH": str(binary.parent)})}
        if not binary.is_file():
            systems.pop("llama-server")
            print(f"{binary} not built: lmserve alone", flush=True)
        rows, seed = {}, 1000
        load = [os.getloadavg()[0]]
        for name, cmd_of in systems.items():
            port = free_port()
            cmd, env = cmd_of(port)
            proc = subprocess.Popen(cmd, env={**peer_env, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{port}"
            try:
                with httpx.Client(timeout=5) as client:
                    for _ in range(3000):
                        try:
                            if client.get(url + "/health").status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        if proc.poll() is not None:
                            raise RuntimeError(f"{name} exited during start")
                        time.sleep(0.1)
                    _ttft(client, url, image_bytes(512, 512, seed=1))  # warm-up: first-call costs out of the way
                    ttfts = []
                    for _ in range(rounds):
                        seed += 1
                        ttfts.append(_ttft(client, url, image_bytes(512, 512, seed=seed)))
                    pngs = [image_bytes(512, 512, seed=seed + 1 + i) for i in range(n)]
                    seed += n
                    wall, tokens, prompt_tokens = _concurrent(client, url, pngs)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            rows[name] = {"ttft_s": ttfts, "ttft_median_s": statistics.median(ttfts), "concurrent": n,
                          "concurrent_wall_s": wall, "images_per_s": n / wall, "completion_tokens": tokens,
                          "prompt_tokens": prompt_tokens}
            print(f"{name}: TTFT {statistics.median(ttfts):.2f} s (median of {rounds}), {n} concurrent: "
                  f"{n / wall:.4g} images/s ({wall:.1f} s)", flush=True)
        load.append(os.getloadavg()[0])
    views = (-(-args.longest_edge // 512)) ** 2 + (args.longest_edge > 512)
    image = f"512x512 PNG scaled to {args.longest_edge} px: {views} view{'s' * (views > 1)} of 512 px (64 tokens each)"
    result = {"cpu": _cpu_name(), "cpu_flags": _flags(), "threads": args.threads, "image": image,
              "longest_edge": args.longest_edge,
              "max_tokens": 32, "weights": "float32 GGUF + float32 mmproj (convert_hf_to_gguf.py)",
              "lmserve_mm_encoder_dtype": args.mm_encoder_dtype,
              "systems": rows, "loadavg_before_after": load, "clock": "wall (time.perf_counter)"}
    if "llama-server" in rows:
        lm, ll = rows["lmserve"], rows["llama-server"]
        result |= {"images_per_s_ratio": lm["images_per_s"] / ll["images_per_s"],
                   "ttft_ratio": lm["ttft_median_s"] / ll["ttft_median_s"]}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)  # a half-hour run's results must not be lost to a missing folder
    name = args.name or ("vision_mmproj" if args.longest_edge == 2048 else f"vision_mmproj_edge{args.longest_edge}")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Alt text from GGUF + mmproj: lmserve against llama-server, SmolVLM-256M shape, random weights", "",
             f"CPU: {result['cpu']} ({result['cpu_flags']}); {args.threads} threads each; wall clock; load average {load[0]:.1f} -> "
             f"{load[1]:.1f}; {result['image']}, 32 tokens out; the same two files (llama.cpp's converter); lmserve "
             f"--dtype float32 --mm-encoder-dtype {args.mm_encoder_dtype}.", "",
             "| system | TTFT, one image (s, median of 3) | 8 concurrent: wall (s) | images/s | prompt tokens |",
             "|---|---|---|---|---|"]
    lines += [f"| {k} | {r['ttft_median_s']:.2f} | {r['concurrent_wall_s']:.1f} | {r['images_per_s']:.3f} | "
              f"{r['prompt_tokens'][0]} |" for k, r in rows.items()]
    if "llama-server" in rows:
        lines += ["", f"lmserve / llama-server: images/s **{result['images_per_s_ratio']:.2f}x** (target >= 1.5x), "
                  f"TTFT **{result['ttft_ratio']:.2f}x** (target <= 1.0x)."]
        if lm["prompt_tokens"][0] != ll["prompt_tokens"][0]:
            lines += ["", "The prompt tokens differ: lmserve frames the image as transformers' Idefics3 processor does, "
                      "llama.cpp's mtmd its own way (newline tokens between tiles; with one tile, an overview as well: "
                      "a second tower pass). Compare the views above before the ratios."]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def _flags() -> str:
    """The CPU's vector flags (the instruction-set level both servers pick from)."""
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "").split()
    return ",".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
