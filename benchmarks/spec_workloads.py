"""The engine side of benchmarks/spec_decode.py: one engine per process, driven by JSON lines on stdin.

    PYTHONPATH=<tree>/src python benchmarks/spec_workloads.py      (started by spec_decode.py, not by hand)

lmserve is imported from PYTHONPATH only (checked at load), so the same file measures an old and a new
tree side by side. Ops: {"op": "load", "tree", "kwargs", "needs_spec"} first, then "single", "offline" and
"streams" (Bench methods of those names); each reply is one JSON line on the process's original stdout
(whatever else is printed goes to stderr), {"error": traceback} when the op raised. The prompts are
plain functions of an index, so every engine and every repeat builds the same ones.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
WARMUP_FIRST = 10_000  # prompt numbers of the warm-ups: never used by a measurement

# -- prompts ------------------------------------------------------------------------------------------------

TEXT_WORDS = ("the old harbor town wakes slowly while fishing boats return with their nets and gulls circle "
              "above the market where traders call out prices for bread cheese apples and warm wool "
              "children run along the stone wall as the tide comes in and the bell of the chapel rings "
              "twice before noon a baker carries trays of rolls past the library and the clock tower "
              "shows a quarter past ten while rain clouds gather over the hills beyond the river").split()
CODE_TEMPLATES = (
    "def {name}(items):\n    total = 0\n    for item in items:\n        total += item.{attr}\n    return total\n",
    "def {name}(values, limit):\n    result = []\n    for value in values:\n        if value > limit:\n"
    "            break\n        result.append(value * {k})\n    return result\n",
    "class {cls}:\n    def __init__(self, {attr}):\n        self.{attr} = {attr}\n\n"
    "    def {name}(self):\n        return self.{attr} * {k}\n",
    "def {name}(path):\n    with open(path) as handle:\n        lines = [line.strip() for line in handle]\n"
    "    return [line for line in lines if line and not line.startswith('#')]\n",
    "def {name}(mapping, key, default=None):\n    if key in mapping:\n        return mapping[key]\n"
    "    return default\n",
)
NAMES = ("load_rows", "sum_prices", "scale_values", "read_config", "count_words", "merge_orders", "find_user",
         "parse_line", "clean_names", "total_weight")
ATTRS = ("price", "weight", "count", "name", "size", "level")
CLASSES = ("Order", "Basket", "Sensor", "Account", "Shelf", "Ticket")
TYPOS = {"return": "retrun", "self": "slef", "append": "apend", "result": "reslut", "value": "valeu"}
CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Give me three ideas for a rainy weekend.",
    "Write a poem about autumn in a big city.",
    "What are the pros and cons of working from home?",
    "Describe the perfect breakfast.",
    "Write a letter to a friend who moved abroad.",
    "How do bees make honey?",
    "Invent a new board game and explain its rules.",
    "Tell me about the history of the bicycle.",
)


def prose(i: int, approx_tokens: int) -> str:
    """Paragraphs of sentences drawn from TEXT_WORDS by a generator seeded with i (~1.3 tokens per word)."""
    rng, sentences, words = random.Random(i), [], 0
    while words * 1.3 < approx_tokens:
        s = [rng.choice(TEXT_WORDS) for _ in range(rng.randint(8, 14))]
        sentences.append(" ".join(s).capitalize() + ".")
        words += len(s)
    return "\n\n".join(" ".join(sentences[j:j + 5]) for j in range(0, len(sentences), 5))


def code_with_typo(i: int, approx_tokens: int) -> str:
    """A Python listing built from CODE_TEMPLATES (seeded with i) with one typo from TYPOS (~3.3 chars per token)."""
    rng, blocks = random.Random(i), []
    names = rng.sample(NAMES, len(NAMES))  # no function defined twice (up to len(NAMES) blocks)
    while sum(map(len, blocks)) / 3.3 < approx_tokens:
        t = rng.choice(CODE_TEMPLATES)
        blocks.append(t.format(name=names[len(blocks) % len(names)], attr=rng.choice(ATTRS),
                               cls=rng.choice(CLASSES), k=rng.randint(2, 9)))
    code = "\n\n".join(blocks)
    word = rng.choice([w for w in TYPOS if w in code])
    at = rng.choice([j for j in range(len(code)) if code.startswith(word, j)])
    return code[:at] + TYPOS[word] + code[at + len(word):]


def grounded_message(i: int, approx_tokens: int) -> str:
    """Prompt i of the input-grounded set: even i repeat a text, odd i fix a typo in code."""
    if i % 2 == 0:
        return "Repeat the following text exactly:\n" + prose(i, approx_tokens)
    return "Fix the typo in this code:\n" + code_with_typo(i, approx_tokens)


def chat_message(i: int) -> str:
    return CHAT_PROMPTS[i % len(CHAT_PROMPTS)]


# -- the engine -------------------------------------------------------------------------------------------


class ForwardTimer:
    """Adds up the wall time of the model's forward and LM head (compute_logits) since the last reset."""

    def __init__(self, model) -> None:
        self.forward = self.logits = 0.0
        model.forward = self._wrap(model.forward, "forward")
        if hasattr(model, "compute_logits"):
            model.compute_logits = self._wrap(model.compute_logits, "logits")

    def _wrap(self, fn, slot: str):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                setattr(self, slot, getattr(self, slot) + time.perf_counter() - start)
        return timed

    def reset(self) -> None:
        self.forward = self.logits = 0.0


@dataclass
class Trace:
    """One request run alone: its tokens, when the first and last arrived, and each decode step's timings."""

    tokens: list[int] = field(default_factory=list)
    first: float = 0.0
    last: float = 0.0
    steps: list[tuple[float, float, float]] = field(default_factory=list)  # (step, forward, logits) seconds

    @property
    def decode_seconds(self) -> float:
        return self.last - self.first


def spec_counters(engine) -> dict | None:
    """The engine's cumulative speculative-decoding counters, or None where it has none."""
    s = getattr(engine, "spec_stats", None)
    if s is None:
        return None
    return {**{k: int(getattr(s, k)) for k in SPEC_COUNTERS},
            "num_accepted_tokens_per_pos": [int(x) for x in s.num_accepted_tokens_per_pos]}


def counters_delta(after: dict | None, before: dict | None) -> dict | None:
    """after - before, the per-position list padded to the longer one."""
    if after is None or before is None:
        return None
    a, b = after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"]
    b = b + [0] * (len(a) - len(b))
    return {**{k: after[k] - before[k] for k in SPEC_COUNTERS},
            "num_accepted_tokens_per_pos": [x - y for x, y in zip(a, b)]}


class Bench:
    """The worker's engine: loaded once, warmed up, then runs the measurements the parent sends."""

    def __init__(self, tree: str, kwargs: dict, needs_spec: bool) -> None:
        start = time.perf_counter()
        import torch

        import lmserve
        from lmserve import LLM, SamplingParams

        src = (Path(tree) / "src").resolve()
        if not Path(lmserve.__file__).resolve().is_relative_to(src):
            raise RuntimeError(f"imported {lmserve.__file__}, not the tree under test {src}")
        self.SamplingParams = SamplingParams
        self.llm = LLM(**kwargs)
        self.engine = self.llm.engine
        if needs_spec and spec_counters(self.engine) is None:
            raise RuntimeError("llm.engine.spec_stats is missing: this engine does not count drafts and "
                               "accepted tokens yet, so acceptance cannot be measured")
        self.timer = ForwardTimer(self.engine.runner.model)
        self.info = {"lmserve": lmserve.__file__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "load_s": time.perf_counter() - start}
        self._next_id = 0
        self.warm_up()

    def params(self, max_tokens: int, temperature: float = 0.0, seed: int | None = None, ignore_eos: bool = False):
        return self.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos)

    def numbered(self, first: int, n: int, length: int) -> list[list[int]]:
        from engine_vs_transformers import make_prompts  # benchmarks/: distinct in their first KV block

        return make_prompts(n, self.llm.tokenizer, length, first=first)

    def chat_ids(self, text: str) -> list[int]:
        return self.llm.tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)

    def warm_up(self) -> None:
        """Allocator, thread pools and every code path a measurement takes (speculation included), discarded."""
        self.llm.generate(self.numbered(WARMUP_FIRST, 4, 32), self.params(8, ignore_eos=True), use_tqdm=False)
        self.decode_one(self.chat_ids(grounded_message(WARMUP_FIRST, 200)), self.params(16))

    def decode_one(self, ids: list[int], params) -> Trace:
        """Run one request alone, step by step; the steps after its first token are its decode steps."""
        eng, trace = self.engine, Trace()
        eng.add_request(f"bench-{self._next_id}", ids, params)
        self._next_id += 1
        while eng.has_unfinished():
            self.timer.reset()
            start = time.perf_counter()
            deltas = eng.step()
            end = time.perf_counter()
            if trace.tokens:
                trace.steps.append((end - start, self.timer.forward, self.timer.logits))
            trace.tokens += [t for d in deltas for t in d.token_ids]
            if trace.tokens and not trace.first:
                trace.first = end
        trace.last = end
        return trace

    def single(self, first: int, prompt_len: int, max_tokens: int) -> dict:
        """Single-stream decode tok/s and the mean step / forward / LM-head time of its decode steps (ms)."""
        trace = self.decode_one(self.numbered(first, 1, prompt_len)[0], self.params(max_tokens, ignore_eos=True))
        step, fwd, logits = (1e3 * statistics.fmean(col) for col in zip(*trace.steps))
        return {"tok_s": (len(trace.tokens) - 1) / trace.decode_seconds, "step_ms": step, "forward_ms": fwd,
                "logits_ms": logits, "overhead_ms": step - fwd, "overhead_excl_logits_ms": step - fwd - logits,
                "decode_steps": len(trace.steps), "tokens": [trace.tokens]}

    def offline(self, first: int, n: int, prompt_len: int, max_tokens: int) -> dict:
        """Output tok/s of n distinct prompts through `generate` at once (prefill included)."""
        prompts = self.numbered(first, n, prompt_len)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, self.params(max_tokens, ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == max_tokens for t in tokens)
        return {"tok_s": n * max_tokens / seconds, "tokens": tokens}

    def streams(self, kind: str, n: int, max_tokens: int, temperature: float, seed: int | None,
                grounded_tokens: int) -> dict:
        """n chat prompts of `kind`, one request at a time; decode tok/s over all, and the spec counters' delta."""
        texts = [grounded_message(i, grounded_tokens) if kind == "grounded" else chat_message(i) for i in range(n)]
        prompts = [self.chat_ids(t) for t in texts]
        before = spec_counters(self.engine)
        traces = [self.decode_one(ids, self.params(max_tokens, temperature, None if seed is None else seed + i))
                  for i, ids in enumerate(prompts)]
        decoded = sum(len(t.tokens) - 1 for t in traces)
        return {"tok_s": decoded / sum(t.decode_seconds for t in traces), "output_tokens": decoded + n,
                "mean_prompt_tokens": statistics.fmean(map(len, prompts)), "tokens": [t.tokens for t in traces],
                "spec": counters_delta(spec_counters(self.engine), before)}


def worker_main() -> None:
    """Serve {"op": ...} lines from stdin; replies on the original stdout, everything else printed goes to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    bench: Bench | None = None
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.pop("op")
        try:
            if op == "load":
                bench = Bench(**msg)
                out = bench.info
            else:
                out = getattr(bench, op)(**msg)
        except Exception:
            out = {"error": traceback.format_exc()}
        reply.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    worker_main()
