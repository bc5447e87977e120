"""The `lmserve bench` subcommands: serve, latency, throughput, startup, roofline."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path


def add_bench_parser(sub, add_engine_args) -> None:
    """Register `lmserve bench <kind>` under the top-level subparsers."""
    bench = sub.add_parser("bench", help="benchmarks: serve, latency, throughput, startup, roofline")
    kinds = bench.add_subparsers(dest="bench", required=True)

    s = kinds.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)")
    s.add_argument("--base-url", required=True)
    s.add_argument("--model", default=None, help="model name (default: the server's first)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--dataset", default="random", help="'random' or a .jsonl file of {prompt, output_len?}")
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--input-len", type=int, default=256)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1 +- r)")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--request-rate", type=float, default=None, help="requests/s, Poisson arrivals (default: all at once)")
    s.add_argument("--goodput", nargs="*", default=[], help="SLOs, e.g. ttft:500 tpot:50 e2el:5000 (ms)")
    s.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,4,16,32")
    s.add_argument("--vocab-size", type=int, default=49152, help="for random token-id prompts")
    s.add_argument("--no-ignore-eos", action="store_true")
    s.add_argument("--api-key", default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--output", default=None, help="write the JSON result here")
    s.add_argument("--plot", default=None, help="with --sweep: PNG of throughput vs TTFT/ITL")
    s.set_defaults(func=cmd_bench_serve)

    for name, helptext in (("latency", "one request at a time: prefill and decode tok/s"),
                           ("throughput", "offline engine throughput"),
                           ("roofline", "this machine's bandwidth/FLOPs and the model's ceilings"),
                           ("startup", "process start to first token, by phase")):
        p = kinds.add_parser(name, help=helptext)
        add_engine_args(p)
        p.add_argument("--output", default=None)
        if name == "throughput":
            p.add_argument("--num-prompts", type=int, default=64)
            p.add_argument("--input-len", type=int, default=256)
            p.add_argument("--output-len", type=int, default=128)
        p.set_defaults(func=globals()[f"cmd_bench_{name}"])


def _write(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    print(text)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import logging

    from lmserve.bench import serve as sb

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report

    model = args.model or _first_model(args.base_url, args.api_key)
    if args.dataset == "random":
        reqs = sb.random_dataset(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                 args.vocab_size, args.seed)
    else:
        reqs = sb.jsonl_dataset(Path(args.dataset), args.num_prompts, args.output_len)
    slos = sb.parse_goodput(args.goodput)
    levels = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.max_concurrency]
    rows = []
    for level in levels:
        cpu = time.process_time()
        results, wall = asyncio.run(sb.run_load(args.base_url, model, args.endpoint, reqs, level, args.request_rate,
                                                args.api_key, not args.no_ignore_eos, args.seed))
        summary = sb.summarize(results, wall, slos, time.process_time() - cpu)
        summary["concurrency"] = level
        print(sb.format_summary(summary))
        rows.append(summary)
    if args.plot and len(rows) > 1:
        sb.plot_sweep(rows, args.plot)
    _write({"model": model, "endpoint": args.endpoint, "runs": rows}, args.output)
    return 0


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _engine(args: argparse.Namespace):
    from lmserve.config import engine_config
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.engine.preflight import check_engine_config

    return LLMEngine(check_engine_config(engine_config(args)).config)


def cmd_bench_roofline(args: argparse.Namespace) -> int:
    from lmserve.bench.offline import roofline_for
    from lmserve.bench.roofline import format_roofline

    engine = _engine(args)
    roof = roofline_for(engine)
    print(format_roofline(roof, engine.loaded.path.name))
    _write(roof.as_dict(), args.output)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from lmserve.bench.offline import latency, roofline_for

    engine = _engine(args)
    _write(latency(engine, roofline_for(engine)), args.output)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from lmserve.bench.offline import roofline_for, throughput
    from lmserve.engine.llm import LLM

    llm = LLM(engine=_engine(args))
    _write(throughput(llm, roofline_for(llm.engine), args.num_prompts, args.input_len, args.output_len), args.output)
    return 0


def cmd_bench_startup(args: argparse.Namespace) -> int:
    from lmserve.bench.offline import startup

    _write(startup(args.model, args.num_threads or 2), args.output)
    return 0
