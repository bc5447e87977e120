"""The `lmserve bench` subcommands: serve, latency, throughput, startup, roofline."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
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
    s.add_argument("--output", default=None, help="also write the JSON result here")
    s.add_argument("--json", action="store_true", help="print JSON instead of the summaries")
    s.add_argument("--plot", default=None, help="with --sweep: PNG of throughput vs TTFT/ITL")
    s.set_defaults(func=cmd_bench_serve)

    for name, helptext in (("roofline", "this machine's bandwidth/FLOPs and the model's ceilings"),
                           ("startup", "process start to first token, by phase")):
        p = kinds.add_parser(name, help=helptext)
        add_engine_args(p)
        p.add_argument("--json", action="store_true", help="print JSON instead of the table")
        p.add_argument("--output", default=None, help="also write the JSON result to this file")
        p.set_defaults(func=globals()[f"cmd_bench_{name}"])
    _add_sized(kinds, add_engine_args, "latency", "batches run alone: TTFT, TPOT, prefill and decode tok/s",
               input_len=256, output_len=64, batch_sizes="1,8")
    _add_sized(kinds, add_engine_args, "throughput", "offline engine throughput with continuous batching",
               input_len=256, output_len=128, batch_sizes=None)


def _add_sized(kinds, add_engine_args, name: str, helptext: str, input_len: int, output_len: int,
               batch_sizes: str | None) -> None:
    """latency and throughput: the engine flags, the sizes, and where the result goes."""
    p = kinds.add_parser(name, help=helptext)
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=output_len, help="generated tokens per sequence")
    meaning = "sequences run together" if name == "latency" else "most sequences per step"
    p.add_argument("--batch-sizes", type=_int_list, default=batch_sizes and _int_list(batch_sizes),
                   help=f"comma-separated, one table row each: {meaning} (default: {batch_sizes or '--max-num-seqs'})")
    if name == "latency":
        p.add_argument("--num-iters", type=int, default=3, help="timed runs per batch size, after one warm-up")
    else:
        p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=globals()[f"cmd_bench_{name}"])


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _write(result: dict, args: argparse.Namespace) -> None:
    """JSON to --output, and to stdout with --json (the readable form is printed by each command)."""
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    if args.json:
        print(text)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import logging

    from lmserve.bench import serve as sb

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report

    if args.plot:  # before minutes of load, not after: matplotlib is in the `bench` extra, not the base install
        _require("matplotlib", "--plot", "bench")
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
        if not args.json:
            print(sb.format_summary(summary))
        rows.append(summary)
    if args.plot and len(rows) > 1:
        sb.plot_sweep(rows, args.plot)
    _write({"model": model, "endpoint": args.endpoint, "runs": rows}, args)
    return 0


def _require(module: str, flag: str, extra: str) -> None:
    """A flag whose package is an optional extra: without it, one line naming the install, exit 2."""
    import importlib.util

    from lmserve.errors import ConfigError

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{flag} needs {module}, which the serve-only install leaves out: "
                          f"pip install 'lmserve[{extra}]' (or pip install {module})")


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _checked(args: argparse.Namespace):
    """The engine flags' config after the checks that need no torch (their numbers, the model's path and header):
    a typo is one line at once, not after `import torch` (seconds on a small CPU) that every bench kind pulls in."""
    from lmserve.config import engine_config
    from lmserve.loader.header import check_before_torch

    return check_before_torch(engine_config(args))


def _engine(cfg):
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.preflight import check_engine_config

    return LLMEngine(check_engine_config(cfg).config)


def cmd_bench_roofline(args: argparse.Namespace) -> int:
    cfg = _checked(args)
    from lmserve.bench.offline import roofline_for
    from lmserve.bench.roofline import format_roofline

    engine = _engine(cfg)
    _status("measuring this machine's bandwidth and matmul ceilings")
    roof = roofline_for(engine)
    if not args.json:
        print(format_roofline(roof, engine.loaded.path.name))
    _write(roof.as_dict(), args)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    cfg = _checked(args)
    from lmserve.bench.offline import latency_case

    engine, roof, before = _prepare(cfg, max(args.batch_sizes))
    iters = args.num_iters + 1  # and the warm-up
    total = sum(b * args.output_len * iters for b in args.batch_sizes)
    with _progress(total, "latency") as bar:
        rows = []
        for b in args.batch_sizes:
            bar.set_postfix_str(f"batch {b}")
            rows.append(latency_case(engine, roof, b, args.input_len, args.output_len, args.num_iters, bar))
    _report("latency", rows, engine, roof, before, args)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from dataclasses import replace

    cfg = _checked(args)
    from lmserve.bench.offline import throughput_case
    from lmserve.engine.llm_engine import LLMEngine

    sizes = args.batch_sizes or [args.max_num_seqs]
    engine, roof, before = _prepare(cfg, sizes[0])
    rows = []
    with _progress(len(sizes) * args.num_prompts * args.output_len, "throughput") as bar:
        for b in sizes:
            bar.set_postfix_str(f"max batch {b}")
            # One engine per batch size, sharing the loaded weights: max_num_seqs is fixed at build.
            cfg = replace(engine.cfg, scheduler=replace(engine.cfg.scheduler, max_num_seqs=b))
            engine = LLMEngine(cfg, loaded=engine.loaded, tokenizer=engine.tokenizer)
            rows.append(throughput_case(engine, roof, args.num_prompts, args.input_len, args.output_len, bar))
    _report("throughput", rows, engine, roof, before, args)
    return 0


def _prepare(cfg, max_batch: int):
    """Load the engine of `cfg` (_checked's; room for `max_batch` sequences) and measure the roofline, saying so
    on stderr."""
    from dataclasses import replace

    from lmserve.bench.offline import roofline_for
    from lmserve.bench.report import cpu_sample
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.preflight import check_engine_config

    before = cpu_sample()
    _status("loading the model")
    cfg = check_engine_config(cfg).config
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, max_num_seqs=max(max_batch, cfg.scheduler.max_num_seqs)))
    engine = LLMEngine(cfg)
    _status("measuring this machine's bandwidth and matmul ceilings")
    return engine, roofline_for(engine), before


def _progress(total: int, desc: str):
    """A bar of generated tokens on stderr (stdout keeps only the result)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, dynamic_ncols=True)


def _status(text: str) -> None:
    print(f"[lmserve bench] {text} ...", file=sys.stderr, flush=True)


def _report(kind: str, rows: list[dict], engine, roof, before, args: argparse.Namespace) -> None:
    """The table (or JSON with --json) on stdout; JSON to --output; a note when the machine was busy."""
    import torch

    from lmserve.bench import report
    from lmserve.bench.report import cpu_sample, load_note, others_load

    load = others_load(before, cpu_sample())
    result = {"kind": kind, "model": str(engine.loaded.path), "dtype": str(engine.dtype).removeprefix("torch."),
              "num_threads": torch.get_num_threads(), "machine_load": load, "roofline": roof.as_dict(), "runs": rows}
    _write(result, args)
    note = load_note(load)
    if args.json:
        if note:
            print(note, file=sys.stderr)
        return
    columns = report.LATENCY_COLUMNS if kind == "latency" else report.THROUGHPUT_COLUMNS
    legend = report.LATENCY_LEGEND if kind == "latency" else report.THROUGHPUT_LEGEND
    print(f"{kind}: {engine.loaded.path.name}, {result['dtype']}, {result['num_threads']} threads")
    print(report.format_table(rows, columns))
    print(legend + (f"\n{note}" if note else ""))


def cmd_bench_startup(args: argparse.Namespace) -> int:
    # the child starts from the checked local path (a Hub id resolved here, at --revision), as `serve` loads once
    # its first checks have resolved the flag
    cfg = _checked(args)
    from lmserve.bench.offline import startup

    _status("starting a fresh process up to its first token")
    phases = startup(cfg.model, args.num_threads or 2)
    if not args.json:
        print("startup phases (seconds):")
        for name, value in phases.items():
            print(f"  {name.removesuffix('_s'):<24} {value:8.2f}" if isinstance(value, float) else f"  {name:<24} {value}")
    _write(phases, args)
    return 0
