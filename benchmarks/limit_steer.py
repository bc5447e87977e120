"""What the limit steer (structured/limit.py) costs: JSON-schema decode throughput with it and without it.

    python benchmarks/limit_steer.py           # ~8 min on 2 idle cores; writes results/limit_steer.{json,md}

Batch 16, the same 16 chat prompts and seeds, a nested JSON schema at temperature 1, in one process; the two
arms alternate (on, off, off, on, ...) so drift in the machine's load hits both alike. "Off" builds the requests'
grammars with no steer (the engine as it was before the steer). Two workloads:
  roomy:  max_tokens 256, past what the answers need (~100 tokens): the common case, where the steer only looks
          log2(256) times per request; its outputs must equal the unsteered ones token for token (checked).
  binding: max_tokens 48, below every answer: each request looks at every step of its last ~24 tokens and is
          closed by force; the outputs differ (steered ones parse, unsteered ones are cut), so tokens/s compares.
The machine (CPU model, SIMD flags, load average before and after) is written with the result: 2 shared cores
under other people's jobs give noisy numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from compare import _cpu_name, _flags  # noqa: E402  benchmarks/compare.py: the same machine description

import lmserve.engine.front as front  # noqa: E402
import lmserve.structured.limit as limit  # noqa: E402
from lmserve import LLM, SamplingParams  # noqa: E402
from tests.test_server_structured import ORDER  # noqa: E402

WORKLOADS = {"roomy": 256, "binding": 48}


def run(llm: LLM, prompts: list, max_tokens: int, seed: int, steer: bool) -> tuple[float, list]:
    """(seconds, outputs) of one batch, with the steer on or off for the requests it admits."""
    front.limit_steer = _STEER if steer else (lambda compiler, params: None)
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs={"json": ORDER})
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


_STEER = front.limit_steer
_STEER_S = [0.0]  # seconds inside LimitSteer.forced (its looks), summed: the steer's own cost, load or not


def _timed(forced):
    def wrapper(self, matcher, tokens_left):
        t = time.perf_counter()
        try:
            return forced(self, matcher, tokens_left)
        finally:
            _STEER_S[0] += time.perf_counter() - t
    return wrapper


limit.LimitSteer.forced = _timed(limit.LimitSteer.forced)


def workload(llm: LLM, prompts: list, max_tokens: int, repeats: int) -> dict:
    rates: dict[str, list[float]] = {"on": [], "off": []}
    seconds = {"on": 0.0, "off": 0.0}
    parsed = {"on": 0, "off": 0}
    same = True
    _STEER_S[0] = 0.0
    for r in range(repeats):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        outs = {}
        for arm in order:
            dt, outs[arm] = run(llm, prompts, max_tokens, r, arm == "on")
            seconds[arm] += dt
            rates[arm].append(sum(len(o.outputs[0].token_ids) for o in outs[arm]) / dt)
            parsed[arm] += sum(_parses(o.outputs[0].text) for o in outs[arm])
        same &= [o.outputs[0].token_ids for o in outs["on"]] == [o.outputs[0].token_ids for o in outs["off"]]
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"max_tokens": max_tokens, "tok_s": {"on": on, "off": off}, "tok_s_all": rates, "ratio": on / off,
            "ratio_paired": paired_ratio(rates),
            "outputs_equal": same, "parsed": parsed, "outputs": len(prompts) * repeats,
            "steer_s": _STEER_S[0], "steer_share": _STEER_S[0] / seconds["on"]}


def paired_ratio(rates: dict[str, list[float]]) -> float:
    """Median over rounds of on / off within the round: the two arms of a round ran back to back, so the
    machine's load, which drifts between rounds, cancels."""
    return statistics.median(a / b for a, b in zip(rates["on"], rates["off"]))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", default=str(HERE / "results" / "limit_steer"))
    args = ap.parse_args()
    llm = LLM(num_threads=2, kv_cache_memory=256 * 2**20, dtype="float32")
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Write order number {i} as JSON."}])
               for i in range(args.batch)]
    run(llm, prompts[:2], 8, 0, True)  # compile the grammar, build the token table, warm up
    load_before = os.getloadavg()
    results = {name: workload(llm, prompts, n, args.repeats) for name, n in WORKLOADS.items()}
    report = {"machine": {"cpu": _cpu_name(), "flags": _flags(), "python": platform.python_version(),
                          "cores": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "command": "python benchmarks/limit_steer.py " + " ".join(sys.argv[1:]), "batch": args.batch,
              "repeats": args.repeats, "workloads": results}
    assert results["roomy"]["outputs_equal"], "the steer changed an output that never came near its limit"
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    Path(args.out + ".md").write_text(render(report))
    print(render(report))
    return 0


def render(r: dict) -> str:
    m = r["machine"]
    lines = [f"Limit steer (structured/limit.py), {m['cpu']} ({m['flags']}{'' if 'amx' in m['flags'] else '; no amx'}), {m['cores']} cores, float32, "
             f"2 threads, batch {r['batch']}, nested JSON schema at T=1, arms interleaved, median of {r['repeats']}.",
             f"Load average (1, 5, 15 min) before {_load(m['loadavg_before'])}, after {_load(m['loadavg_after'])}: "
             "a shared machine under other jobs, so read the ratios, not the absolute rates. "
             f"Command: `{r['command'].strip()}`", "",
             "| workload | max_tokens | tok/s steer on | tok/s steer off | ratio of medians | median of round ratios "
             "| steer's own time | outputs equal | parse (on / off) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, w in r["workloads"].items():
        lines.append(f"| {name} | {w['max_tokens']} | {w['tok_s']['on']:.1f} | {w['tok_s']['off']:.1f} | "
                     f"{w['ratio']:.3f}x | {w['ratio_paired']:.3f}x | {100 * w['steer_share']:.2f}% | {w['outputs_equal']} | {w['parsed']['on']} / {w['parsed']['off']} "
                     f"of {w['outputs']} |")
    lines += ["", "binding: the steered arm writes fewer tokens (a request ends once its forced completion is out) "
              "and its last rows are forced, so its tok/s is not the same work as the unsteered arm's; read the "
              "steer's own time there.", "", "Steer's own time: seconds inside LimitSteer.forced (all its looks: the shortest-completion searches, "
              "the opener probes) over the steered arm's wall time; it does not depend on the other arm, so it reads "
              "the cost with less noise than the ratio of two loaded runs."]
    return "\n".join(lines) + "\n"


def _load(avg: tuple) -> str:
    return ", ".join(f"{x:.2f}" for x in avg)


if __name__ == "__main__":
    sys.exit(main())
