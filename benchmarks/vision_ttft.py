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
    args = ap.parse_args()
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
