"""`lmserve serve | generate | chat | run-batch | lora merge`: one argparse table per command, engine flags shared."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple

from lmserve.config import ENV_API_KEY, engine_config
from lmserve.errors import CheckpointError, ConfigError


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Flags that build an EngineConfig (shared by every command that loads a model); `several_models`: serve's
    repeatable --model NAME=PATH."""
    help = ("path to a .gguf file or a Hugging Face directory, or a Hub id (org/name: from the local Hugging Face "
            "cache, else downloaded; HF_TOKEN, HF_HUB_OFFLINE apply) (default: the embedded SmolLM2-135M-Instruct)")
    if several_models:
        p.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                       help=help + "; repeatable as NAME=PATH to serve several models, routed by the request's "
                       "`model` (the first is the default); every engine flag applies to each model alone, "
                       "--kv-cache-memory included")
    else:
        p.add_argument("--model", default=None, help=help)
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit when --model is a Hub id")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA and on CPUs with AMX, float32 elsewhere")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                   help="how linear weights are held: gguf (CPU): a GGUF file's own blocks (Q4_0/1, Q5_0/1, Q8_0, Q4_K, "
                   "Q5_K, Q6_K; the embedding too, rows dequantized on lookup) through native int8-dot kernels; none: "
                   "float weights (a GGUF dequantized; transformers parity); int8, int4 (CPU, CUDA): weight-only "
                   "quantized at load (a Q4_1 GGUF keeps its own 4-bit codes under int4); auto (default): gguf for a "
                   "quantized GGUF on CPU with float32 and one rank, else none")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget of one engine step")
    p.add_argument("--no-chunked-prefill", action="store_true", help="schedule whole prompts only")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "int8", "fp8_e4m3"), default="auto",
                   help="KV cache element type; auto: float16 for a GGUF file's kept blocks on CPU (as llama.cpp), "
                   "else the model's dtype; int8 / fp8_e4m3 (CPU): one-byte codes with a float16 scale per 32 values, "
                   "0.53x the bytes of float16")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size: bytes if > 1, else a fraction of available memory (default: 0.15); "
                   "a size given here may be smaller than one --max-model-len request (longer ones then get 400)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="CUDA: fraction of the GPU's memory for weights, activations and the KV cache, which gets "
                   "what a profiled full step leaves (used when --kv-cache-memory and --num-kv-blocks are not given)")
    p.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV cache size in blocks of --block-size tokens (overrides --kv-cache-memory)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split each layer across N ranks, one process each (torch.distributed: gloo on CPU, NCCL on "
                   "CUDA, one GPU per rank); the model's heads and KV heads must be divisible by N")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (default: one per core; idle OpenMP threads sleep, OMP_WAIT_POLICY=PASSIVE, "
                   "unless you set it or GOMP_SPINCOUNT)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: replay decode steps from CUDA graphs captured per batch size at start-up "
                   "(experimental: not yet measured on a GPU; ignored on CPU)")
    p.add_argument("--grammar-compile-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="structured outputs: a schema, regex or grammar that takes longer to compile gets a 400")
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM writes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                   '"model": PATH, "num_speculative_tokens": 4}\'')
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters on the base model (a request names one as its model)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT adapter directories to serve from the start, each as name=path")
    p.add_argument("--max-loras", type=int, default=4, help="adapters active in one engine step (device slots)")
    p.add_argument("--max-cpu-loras", type=int, default=16,
                   help="adapters kept read in host memory (least recently used dropped, re-read when used)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted; slots are sized for it")


def speculative_config(text: str):
    """--speculative-config JSON -> SpeculativeConfig (argparse reports a ValueError as a usage error)."""
    import json

    from lmserve.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sample-seed", dest="sample_seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from lmserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sample_seed, stop=args.stop, structured_outputs=structured_outputs(args))


def structured_outputs(args: argparse.Namespace) -> dict | None:
    """--json-schema FILE / --regex / --choice -> a structured_outputs dict (at most one; argparse enforces it)."""
    import json

    if getattr(args, "json_schema", None):
        with open(args.json_schema, encoding="utf-8") as f:
            return {"json": json.load(f)}
    if getattr(args, "regex", None):
        return {"regex": args.regex}
    if getattr(args, "choice", None):
        return {"choice": args.choice}
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion of a prompt to stdout (logs go to stderr, so `> out.txt` holds the text alone)."""
    try:
        params = sampling_params(args)
    except (OSError, ValueError) as e:  # an unreadable schema file or a bad spec: one line, not a traceback
        print(f"lmserve generate: {e}", file=sys.stderr)
        return 2
    engine = _load_engine(args)
    if engine is None:
        return EXIT_INTERRUPTED
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat_template \
        else args.prompt
    try:
        reply = _stream(engine, "0", prompt, params)
    except ValueError as e:  # e.g. a schema that does not compile
        print(f"lmserve generate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in the instant before _stream sets its own handler
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if reply.interrupted else 0


# The shell's convention for a command ended by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
CHAT_HINT = ("/exit quits, /reset clears the conversation, /system TEXT sets the system prompt (and resets); "
             "Ctrl-C stops a reply, Ctrl-D exits")
# A turn cut short by Ctrl-C is dropped whole (question and partial reply): a truncated reply fed back
# would condition every later reply on a sentence the model never finished, and a marker such as
# "[interrupted]" is text it never wrote and may imitate. The question stays in readline's history (Up).
INTERRUPTED_NOTE = "[interrupted: this turn is left out of the conversation]"


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat that streams each reply; Ctrl-C stops a reply, Ctrl-D exits."""
    _enable_line_editing()
    engine = _load_engine(args)
    if engine is None:
        return EXIT_INTERRUPTED
    chat = _Chat(args.system)
    print(CHAT_HINT, file=sys.stderr)
    while True:
        line = _read_line("you> ")
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip().startswith("/"):
            chat.command(line.strip())
        elif line.strip():
            chat.turn(engine, line, sampling_params(args))


class _Chat:
    """The conversation of `lmserve chat`: messages so far and the system prompt they start from."""

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages = self._start()
        self.turns = 0  # request ids: one per turn, never reused

    def _start(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def command(self, line: str) -> None:
        """/reset or /system TEXT (no TEXT: no system prompt); anything else prints the hint."""
        name, _, rest = line.partition(" ")
        if name == "/system":
            self.system = rest.strip() or None
        elif name != "/reset":
            print(f"unknown command {name}; {CHAT_HINT}", file=sys.stderr)
            return
        self.messages = self._start()
        print("[conversation cleared" + ("; system prompt set]" if name == "/system" and self.system else "]"),
              file=sys.stderr)

    def turn(self, engine, line: str, params) -> None:
        """Ask `line`, stream the reply; keep the turn only if the reply finished."""
        messages = [*self.messages, {"role": "user", "content": line}]
        self.turns += 1
        sys.stdout.write("assistant> ")
        try:
            reply = _stream(engine, str(self.turns), engine.tokenizer.encode_chat(messages), params)
        except ValueError as e:  # e.g. the conversation no longer fits the context: say so, keep chatting
            print(f"\n[{e}; /reset starts over]", file=sys.stderr)
            return
        except KeyboardInterrupt:  # Ctrl-C just before or after _stream's own handling: no request is left
            reply = Reply("", True)
        if reply.interrupted:
            print(INTERRUPTED_NOTE, file=sys.stderr)
            return
        self.messages = [*messages, {"role": "assistant", "content": reply.text}]


def checked_engine(args: argparse.Namespace):
    """The engine for the engine flags, after the preflight checks (a bad flag or model fails before loading)."""
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.engine.preflight import check_engine_config

    return LLMEngine(check_engine_config(engine_config(args)).config)


def _enable_line_editing() -> None:
    """Arrow keys and history for input(): importing readline is enough (not available everywhere)."""
    try:
        import readline  # noqa: F401
    except ImportError:
        pass


def _read_line(prompt: str) -> str | None:
    """One line typed at the prompt; None on Ctrl-D, or Ctrl-C at an empty prompt (the user wants to leave).

    Ctrl-C over typed text discards that text, as shells do ("" asks for a new prompt).
    """
    try:
        return input(prompt)
    except EOFError:
        print()
        return None
    except KeyboardInterrupt:
        print()
        return "" if _typed_text() else None


def _typed_text() -> str:
    """What was on the input line when Ctrl-C came (readline keeps it); "" without readline."""
    try:
        import readline
    except ImportError:
        return ""
    return readline.get_line_buffer()


def _load_engine(args: argparse.Namespace):
    """The checked engine for `args`, or None when Ctrl-C stopped the load (no traceback for that)."""
    try:
        return checked_engine(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return None


class Reply(NamedTuple):
    """What _stream wrote: the text, and whether Ctrl-C cut it short."""

    text: str
    interrupted: bool


def _stream(engine, request_id: str, prompt, params) -> Reply:
    """Write each delta to stdout as it is generated; Ctrl-C aborts the request (its KV blocks are freed)."""
    text = []
    with _sigint_flag() as stop:
        engine.add_request(request_id, prompt, params)  # inside: a Ctrl-C cannot land half-way through it
        while engine.has_unfinished() and not stop.is_set():
            for d in engine.step():
                sys.stdout.write(d.text)
                sys.stdout.flush()
                text.append(d.text)
        interrupted = stop.is_set() and engine.has_unfinished()  # Ctrl-C after the last step: it finished
        if interrupted:
            engine.abort(request_id)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return Reply("".join(text), interrupted)


@contextmanager
def _sigint_flag() -> Iterator[threading.Event]:
    """While streaming, Ctrl-C sets a flag checked between engine steps instead of raising inside one.

    A KeyboardInterrupt in the middle of a step would leave the scheduler's and the runner's state
    half-updated; between steps the request can be aborted cleanly. (Signal handlers can only be set
    from the main thread; elsewhere Ctrl-C keeps its default.)
    """
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_run_batch(args: argparse.Namespace) -> int:
    """Run an OpenAI Batch API input file into a results file; a rerun resumes where a killed run stopped."""
    from pathlib import Path

    from lmserve.engine.preflight import check_engine_config
    from lmserve.server import batch, batch_file
    from lmserve.server.main import served_name

    src, dst = Path(args.input), Path(args.output)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        batch_file.check_paths(src, dst)
        lines = batch.read_input(src)  # duplicate custom_ids are refused here, before the model loads
        results = batch.ResultsFile(dst)  # cuts a torn last line; knows the custom_ids already answered
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    todo = batch.pending_lines(lines, results.done)
    checked = check_engine_config(engine_config(args))
    if not todo:
        print(f"run-batch: all {len(lines)} requests already have results in {dst}", file=sys.stderr)
        return 0
    window = args.max_concurrency or 2 * args.max_num_seqs  # the waiting queue stays fed as sequences end
    state = batch_file.offline_state(checked.config, served_name(args, checked.model_path), window)
    before = dict(results.counts)
    with _BatchProgress(len(todo), len(lines) - len(todo)) as bar:
        summary = batch_file.run_file(state, todo, results, window, bar.update)
    summary.skipped = len(lines) - len(todo)
    batch_file.count_outcomes(summary, before, results)
    print(f"run-batch: {summary.requests} requests ({summary.skipped} already done), {summary.completed} "
          f"completed, {summary.failed} failed; {summary.completion_tokens} output tokens in {summary.seconds:.1f} s "
          f"({summary.output_tok_s:.1f} tok/s); results in {dst}", file=sys.stderr)
    if args.summary:
        import json

        Path(args.summary).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return 0


class _BatchProgress:
    """run-batch's bar on stderr: requests done (ETA from their rate) and output tokens/s so far."""

    def __init__(self, total: int, skipped: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="Batch requests" + (f" ({skipped} done before)" if skipped else ""),
                        unit="req", file=sys.stderr, dynamic_ncols=True)
        self.tokens, self.failed = 0, 0

    def update(self, r) -> None:
        self.tokens += r.completion_tokens
        self.failed += r.result["error"] is not None or r.result["response"]["status_code"] != 200
        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s, {self.failed} failed", refresh=False)
        self.bar.update(1)

    def __enter__(self) -> "_BatchProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def cmd_monitor_profile(args: argparse.Namespace) -> int:
    from lmserve.ops.drift import profile_command

    return profile_command(args.payload_log, sys.stdout)


def cmd_serve(args: argparse.Namespace) -> int:
    # A start makes millions of objects that live as long as the process (modules, the vocabulary, the model),
    # and the cyclic collector traversed them again and again: ~0.3 s of a ~2.8 s start to first token. It is off
    # until the first models are loaded; server/main._load then freezes them out of every later collection.
    gc.disable()
    from lmserve.server.main import serve

    return serve(args)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: from the file)")
    p.add_argument("--api-key", action="append", default=[],
                   help=f"accepted API key (repeatable; also ${ENV_API_KEY}, comma-separated)")
    p.add_argument("--api-key-file", default=None,
                   help="accepted API keys: a YAML/JSON file of named keys with limits (keys: [{name, key or sha256, "
                   "requests_per_minute, tokens_per_minute, max_concurrent_requests, models}]), or one key per line")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without an API key (by default, with keys set, it needs one like every "
                   "route but /health)")
    p.add_argument("--cors-allowed-origins", action="append", default=[], help="origin allowed by CORS (repeatable)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting beyond the running batch before new ones get 503")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body accepted")
    p.add_argument("--max-upload-bytes", type=int, default=64 * 2**20,
                   help="largest file accepted by POST /v1/files (a batch job's input)")
    p.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="where uploaded files and batch jobs are kept, so they survive a restart "
                   "(default: ~/.local/share/lmserve/batches)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--request-read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a client must send a request's headers and body within this many seconds of starting it, "
                   "or its connection is closed (slow-loris clients)")
    p.add_argument("--engine-step-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="an engine step running longer than this means a hung engine: /health turns 503 and the "
                   "process exits 1 for its supervisor to restart it (0: no watchdog)")
    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="max_tokens of a request that names none (default: the API's own: 16 for completions, "
                   "100 for TGI, the rest of the context for chat)")
    p.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="a request asking for more max_tokens gets 400 (one naming none is held to it too)")
    p.add_argument("--response-cache", default=None, metavar="URL",
                   help="cache the answers of deterministic requests (greedy or seeded): 'sqlite' (a file under "
                   "~/.cache/lmserve), 'sqlite:PATH' or 'redis://HOST:PORT/DB'; per API key, never shared")
    p.add_argument("--response-cache-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="how long a cached answer is served")
    p.add_argument("--response-cache-max-entries", type=int, default=10_000, metavar="N",
                   help="the oldest answers are dropped past this many")
    p.add_argument("--playground-db", default=None, metavar="PATH",
                   help="the SQLite file of the web playground's shared permalinks (default: "
                   "$XDG_DATA_HOME/lmserve/playground.sqlite3, i.e. ~/.local/share/lmserve/... when unset)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (paths under --lora-dir only)")
    p.add_argument("--lora-dir", action="append", default=[], metavar="DIR",
                   help="a directory whose subdirectories the load route may read adapters from (repeatable)")
    p.add_argument("--no-playground", action="store_true",
                   help="no web playground: /, /playground, /p/<id> and /playground/api/... answer 404")
    p.add_argument("--max-loaded-models", type=int, default=None, metavar="K",
                   help="with several --model: at most K loaded at once; loading another unloads the least recently "
                   "used idle one (default: all loaded at start)")
    p.add_argument("--model-load-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request waits this long for its model to load, then gets 503 with Retry-After")
    p.add_argument("--route", action="append", default=[], metavar="NAME=MODEL:WEIGHT,...",
                   help="weighted traffic split (canaries): a request for model NAME goes to one of the models by "
                   "weight, the same one for the same `user` (repeatable)")
    from lmserve.ops.hub import add_ops_args
    add_ops_args(p)


def add_lora_merge_args(p: argparse.ArgumentParser) -> None:
    """`lmserve lora merge`: flags follow PEFT's add_weighted_adapter (weights, combination type, density)."""
    p.add_argument("--base", default=None, help="the base model: a .gguf file, a Hugging Face directory or a Hub id "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit when --base is a Hub id")
    p.add_argument("--adapter", action="append", default=[], metavar="DIR", help="a PEFT adapter directory (repeatable)")
    p.add_argument("--weights", default=None, metavar="W1,W2,...",
                   help="one weight per adapter, comma-separated (default: 1 each)")
    p.add_argument("--method", default="linear", metavar="METHOD",
                   help="how several adapters combine, as PEFT defines it: linear, cat, ties, dare_linear, dare_ties")
    p.add_argument("--density", type=float, default=None,
                   help="ties/dare: the fraction of each adapter's entries kept, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seeds DARE's random drop (the same seed, the same merge)")
    p.add_argument("--dtype", default="auto", metavar="DTYPE",
                   help="float32, bfloat16 or float16 (default auto: a Hugging Face base's own dtype; bfloat16 for GGUF)")
    p.add_argument("--quantization", default=None, metavar="int4|int8",
                   help="QLoRA: merge onto the projection weights as lmserve's int4/int8 quantizer stores them "
                   "(dequantized); a GGUF base is always merged onto its dequantized weights")
    p.add_argument("--out", required=True, metavar="DIR", help="the new model directory (must not exist, or be empty)")
    p.set_defaults(func=cmd_lora_merge)


def cmd_lora_merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmserve.loader import read_model_config, resolve_model_path
    from lmserve.lora.merge import MergeSpec, merge_to_directory

    try:
        base = resolve_model_path(args.base, args.revision)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    spec = MergeSpec(_weights(args.weights, len(args.adapter)), args.method, args.density, args.seed)
    result = merge_to_directory(base, read_model_config(base), [Path(a) for a in args.adapter], spec, Path(args.out),
                                args.dtype, args.quantization)
    if not base.is_dir():  # a GGUF carries its tokenizer in its metadata: written out as tokenizer.json
        from lmserve.engine.tokenizer import Tokenizer

        Tokenizer.from_gguf(base).save_pretrained(args.out)
    how = spec.method if len(result.adapters) > 1 else "one adapter"
    print(f"merged {', '.join(result.adapters)} into {base.name} ({how}, {result.export.merged_modules} projections, "
          f"{str(result.dtype).removeprefix('torch.')}, {result.export.nbytes / 2**20:.0f} MiB) -> {args.out}")
    return 0


def _weights(text: str | None, count: int) -> tuple[float, ...]:
    """--weights "0.5,0.5" -> (0.5, 0.5); none given: 1 per adapter."""
    if text is None:
        return (1.0,) * count
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise ConfigError(f"--weights must be comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserve", description="LLM inference server")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI- and TGI-compatible HTTP API")
    add_engine_args(serve, several_models=True)
    add_serve_args(serve)
    serve.add_argument("--log-level", default=argparse.SUPPRESS, choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream a completion of one prompt")
    gen.add_argument("prompt", help="raw prompt: special-token strings such as <|im_start|> become control tokens")
    gen.add_argument("--chat-template", action="store_true",
                     help="wrap the prompt as a user chat message (its text then stays plain)")
    add_engine_args(gen)
    add_sampling_args(gen)
    constrain = gen.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this schema")
    constrain.add_argument("--regex", help="the output matches this regular expression")
    constrain.add_argument("--choice", action="append", help="the output is exactly one of these (repeatable)")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    run_batch = sub.add_parser("run-batch", help="run an OpenAI Batch API input file (JSONL) into a results file")
    run_batch.add_argument("-i", "--input", required=True, help="requests: one {custom_id, method, url, body} a line")
    run_batch.add_argument("-o", "--output", required=True,
                           help="results, one line per request as it finishes; rerun with the same file to resume")
    run_batch.add_argument("--served-model-name", default=None,
                           help="the model name the lines' bodies use (default: from the model file)")
    run_batch.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                           help="lines in flight at once (default: twice --max-num-seqs, so the batch stays full)")
    run_batch.add_argument("--summary", default=None, metavar="FILE", help="also write the run's summary as JSON")
    add_engine_args(run_batch)
    run_batch.set_defaults(func=cmd_run_batch)

    monitor = sub.add_parser("monitor", help="monitoring tools")
    monitor_sub = monitor.add_subparsers(dest="monitor_command", required=True)
    profile = monitor_sub.add_parser("profile", help="a drift reference profile from a payload log (to stdout)")
    profile.add_argument("payload_log", help="a --payload-log JSONL file")
    profile.set_defaults(func=cmd_monitor_profile)

    lora = sub.add_parser("lora", help="LoRA adapter tools")
    lora_sub = lora.add_subparsers(dest="lora_command", required=True)
    add_lora_merge_args(lora_sub.add_parser(
        "merge", help="merge PEFT LoRA adapters into the base model, written as a Hugging Face safetensors directory"))

    from lmserve.bench.cli import add_bench_parser
    add_bench_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; an ordinary mistake (a bad flag value, a file that is not a model) is one line and exit 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, CheckpointError) as e:  # as argparse reports a usage error: no traceback, exit 2
        print(f"lmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
