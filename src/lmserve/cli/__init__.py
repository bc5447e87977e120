"""The `lmserve` command: serve, generate, chat, run-batch, pull, list, lora merge, monitor, bench.

The flag tables live in cli/flags.py (help groups, defaults shown); this module wires each command to its function.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

# Before anything imports torch: by default `import torch` scans every installed package's entry points for
# out-of-tree device backends (~0.06 s of each start, more with a large environment); the command runs on CPU and
# CUDA only, which need none. A user's own setting wins.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import lmserve  # noqa: E402
from lmserve.cli.flags import (
    LOG_LEVELS,
    Parser,
    add_engine_args,
    add_lora_merge_args,
    add_media_args,
    add_sampling_args,
    add_serve_args,
)
from lmserve.config import engine_config
from lmserve.errors import CheckpointError, ConfigError
from lmserve.multimodal.image_io import load_image_bytes


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
    try:
        images = tuple(load_image_bytes(Path(p).read_bytes()) for p in args.image or ())
    except (OSError, ValueError) as e:  # a missing file, or one Pillow refuses (ImageError says why)
        print(f"lmserve generate: --image: {e}", file=sys.stderr)
        return 2
    _own_sigint()
    engine = _load_engine(args)
    if engine is None:
        return EXIT_INTERRUPTED
    try:
        prompt = _generate_prompt(engine, args.prompt, args.chat_template, len(images))
        reply = _stream(engine, "0", prompt, params, images)
    except ValueError as e:  # e.g. a schema that does not compile, a model that takes no images
        print(f"lmserve generate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in the instant before _stream sets its own handler
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if reply.interrupted else 0


# The shell's convention for a command ended by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
CHAT_HINT = ("/exit quits, /reset clears the conversation, /system TEXT sets the system prompt (and resets), "
             "/image PATH attaches an image to your next message (a vision model); Ctrl-C stops a reply, Ctrl-D exits")
# A turn cut short by Ctrl-C is dropped whole (question and partial reply): a truncated reply fed back
# would condition every later reply on a sentence the model never finished, and a marker such as
# "[interrupted]" is text it never wrote and may imitate. The question stays in readline's history (Up).
INTERRUPTED_NOTE = "[interrupted: this turn is left out of the conversation]"


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat that streams each reply; Ctrl-C stops a reply, Ctrl-D exits."""
    _own_sigint()
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
            chat.command(line.strip(), engine)
        elif line.strip():
            chat.turn(engine, line, sampling_params(args))


class _Chat:
    """The conversation of `lmserve chat`: messages so far, the system prompt they start from, and its images.

    An image attached with /image goes with the next user message, as the model's image token before its text; the
    conversation's images (in prompt order) go with every later request, as its turns do.
    """

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages = self._start()
        self.images: list = []  # the images the kept turns hold, in prompt order
        self.attached: list = []  # /image's, for the next message
        self.turns = 0  # request ids: one per turn, never reused

    def _start(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def command(self, line: str, engine=None) -> None:
        """/reset, /system TEXT (no TEXT: no system prompt) or /image PATH; anything else prints the hint."""
        name, _, rest = line.partition(" ")
        if name == "/image":
            self.attach(engine, rest.strip())
            return
        if name == "/system":
            self.system = rest.strip() or None
        elif name != "/reset":
            print(f"unknown command {name}; {CHAT_HINT}", file=sys.stderr)
            return
        self.messages, self.images, self.attached = self._start(), [], []
        print("[conversation cleared" + ("; system prompt set]" if name == "/system" and self.system else "]"),
              file=sys.stderr)

    def attach(self, engine, path: str) -> None:
        """/image PATH: read and check the image now (a bad file is said at once, the chat goes on)."""
        if engine is not None and engine.front.images is None:
            print("[this model does not accept images]", file=sys.stderr)
            return
        if not path:
            print("[/image needs a file: /image PATH]", file=sys.stderr)
            return
        try:
            image = load_image_bytes(Path(path).expanduser().read_bytes())
        except (OSError, ValueError) as e:  # a missing file, or one Pillow refuses (ImageError says why)
            print(f"[/image: {e}]", file=sys.stderr)
            return
        self.attached.append(image)
        print(f"[image attached: {path}; it goes with your next message]", file=sys.stderr)

    def turn(self, engine, line: str, params) -> None:
        """Ask `line` (with the attached images), stream the reply; keep the turn only if the reply finished."""
        attached, self.attached = self.attached, []  # a turn dropped by Ctrl-C or an error drops its images too
        from lmserve.multimodal.processor import image_text  # numpy: not on `lmserve serve`'s way to the port
        content = image_text(engine.front.images.processor) * len(attached) + line if attached else line
        messages = [*self.messages, {"role": "user", "content": content}]
        images = (*self.images, *attached)
        self.turns += 1
        sys.stdout.write("assistant> ")
        try:
            # with images the rendered conversation is encoded as a raw prompt, so the markers are the image token
            # (as LLM.chat does); without, the messages' text stays plain
            prompt = (engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True) if images
                      else engine.tokenizer.encode_chat(messages))
            reply = _stream(engine, str(self.turns), prompt, params, images)
        except ValueError as e:  # e.g. the conversation no longer fits the context: say so, keep chatting
            print(f"\n[{e}; /reset starts over]", file=sys.stderr)
            return
        except KeyboardInterrupt:  # Ctrl-C just before or after _stream's own handling: no request is left
            reply = Reply("", True)
        if reply.interrupted:
            print(INTERRUPTED_NOTE, file=sys.stderr)
            return
        self.messages = [*messages, {"role": "assistant", "content": reply.text}]
        self.images = list(images)


def checked_engine(args: argparse.Namespace):
    """The engine for the engine flags, after the preflight checks (a bad flag or model fails before loading)."""
    from lmserve.loader.header import check_before_torch  # numpy: not for the commands that do not load a model

    cfg = check_before_torch(engine_config(args))  # a mistyped path is refused before torch is imported
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.preflight import check_engine_config

    return LLMEngine(check_engine_config(cfg).config)


def _own_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt, whatever handling this process inherited.

    A script's background job (`bash .ci/run &`) starts with SIGINT ignored; Python then installs no handler, and
    the terminal's Ctrl-C would do nothing: the chat would wait on.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


def _generate_prompt(engine, prompt: str, chat_template: bool, num_images: int) -> str | list[int]:
    """generate's prompt: with images, their markers (the model's image token) go before the text unless the text
    places them; a chat template wraps the result as one user message (rendered, then encoded as a raw prompt, so
    the markers are the image token; without images the message text stays plain)."""
    if num_images:
        vision = engine.front.images
        if vision is None:
            raise ValueError("this model does not accept images")
        if vision.processor.image_token not in prompt:
            from lmserve.multimodal.processor import image_text  # numpy: not on `lmserve serve`'s way to the port
            prompt = image_text(vision.processor) * num_images + prompt
        if chat_template:
            return engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return prompt
    return engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat_template else prompt


def _stream(engine, request_id: str, prompt, params, images: tuple = ()) -> Reply:
    """Write each delta to stdout as it is generated; Ctrl-C aborts the request (its KV blocks are freed)."""
    text = []
    with _sigint_flag() as stop:
        engine.add_request(request_id, prompt, params, mm_inputs=images)  # inside: a Ctrl-C cannot land half-way through it
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
    from lmserve.loader.header import check_before_torch  # numpy: not for the commands that do not load a model

    src, dst = Path(args.input), Path(args.output)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        if not src.is_file():
            raise ConfigError(f"input file {str(src)!r} does not exist")
        if dst.exists() and dst.resolve() == src.resolve():
            raise ConfigError("the output file must not be the input file")
    except OSError as e:  # e.g. a directory on the way that this user cannot enter
        raise ConfigError(str(e)) from None
    # the flags' numbers and the model's path and header: a typo is one line at once, not after `import torch`
    # (seconds on a small CPU), which the batch modules below pull in through the routes
    cfg = check_before_torch(engine_config(args))
    from lmserve.preflight import check_engine_config
    from lmserve.server.batch import file as batch_file
    from lmserve.server.batch import lines as batch
    from lmserve.server.main import media_policy, served_name

    try:
        lines = batch.read_input(src)  # duplicate custom_ids are refused here, before the model loads
        results = batch.ResultsFile(dst)  # cuts a torn last line; knows the custom_ids already answered
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    todo = batch.pending_lines(lines, results.done)
    checked = check_engine_config(cfg)
    if not todo:
        print(f"run-batch: all {len(lines)} requests already have results in {dst}", file=sys.stderr)
        return 0
    window = args.max_concurrency or 2 * args.max_num_seqs  # the waiting queue stays fed as sequences end
    state = batch_file.offline_state(checked.config, served_name(args, checked.model_path), window, args.strict_fields,
                                     media_policy(args))
    before = dict(results.counts)
    with _BatchProgress(len(lines), len(lines) - len(todo)) as bar:
        summary = batch_file.run_file(state, todo, results, window, bar.update)
    summary.skipped = len(lines) - len(todo)
    batch_file.count_outcomes(summary, before, results)
    print(f"run-batch: {summary.requests} requests ({summary.skipped} already done), {summary.completed} "
          f"completed, {summary.failed} failed; {summary.completion_tokens} output tokens in {summary.seconds:.1f} s "
          f"({summary.output_tok_s:.1f} tok/s)"
          + (f", {summary.images} images ({summary.images_s:.2f} images/s)" if summary.images else "")
          + f"; results in {dst}", file=sys.stderr)
    if args.summary:
        import json

        Path(args.summary).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return 0


class _BatchProgress:
    """run-batch's bar on stderr: lines done of the total (ETA from their rate), output tokens/s so far, and
    images/s once a line with images is answered (an alt-text job's rate)."""

    def __init__(self, total: int, skipped: int) -> None:
        from tqdm import tqdm

        # counted over the whole file: a resumed run starts at the lines already done (its rate from this run's)
        self.bar = tqdm(total=total, initial=skipped, desc="Batch requests" + (f" ({skipped} done before)" if skipped
                        else ""), unit="req", file=sys.stderr, dynamic_ncols=True)
        self.tokens, self.images, self.failed = 0, 0, 0

    def update(self, r) -> None:
        self.tokens += r.completion_tokens
        self.images += r.images
        self.failed += r.result["error"] is not None or r.result["response"]["status_code"] != 200
        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        images = f"{self.images / elapsed:.2f} images/s, " if self.images else ""
        self.bar.set_postfix_str(f"{images}{self.tokens / elapsed:.1f} tok/s, {self.failed} failed", refresh=False)
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
    # until the first models are loaded; server/start._load then freezes them out of every later collection.
    gc.disable()
    from lmserve.server.start import serve  # torch-free: the port listens before torch is imported

    return serve(args)


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
        from lmserve.tokenizer import Tokenizer

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
    parser = Parser(prog="lmserve", description="LLM inference server")
    parser.add_argument("--version", action="version", version=f"lmserve {lmserve.__version__}")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the OpenAI- and TGI-compatible HTTP API",
                           usage="%(prog)s [MODEL] [options]", description="Serve the OpenAI-, TGI- and KServe-"
                           "compatible HTTP API (and the web playground) for one model, or several.")
    serve.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                       help="the model, as vLLM takes it: `lmserve serve ORG/NAME` is `--model ORG/NAME`")
    add_engine_args(serve, several_models=True)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream a completion of one prompt")
    gen.add_argument("prompt", help="raw prompt: special-token strings such as <|im_start|> become control tokens")
    gen.add_argument("--chat-template", action="store_true",
                     help="wrap the prompt as a user chat message (its text then stays plain)")
    gen.add_argument("--image", action="append", metavar="PATH",
                     help="an image for a vision model (repeatable; PNG, JPEG, WebP or GIF); marked in the prompt by "
                          "the model's image token (SmolVLM: <image>), else put before the text")
    add_engine_args(gen)
    add_sampling_args(gen)
    constrain = gen.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this schema")
    constrain.add_argument("--regex", help="the output matches this regular expression")
    constrain.add_argument("--choice", action="append", help="the output is exactly one of these (repeatable)")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (/exit quits)")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
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
    run_batch.add_argument("--strict-fields", action="store_true",
                           help="a line whose body has a field this server does not know gets 400, as `serve "
                           "--strict-fields` answers it (by default the field is ignored)")
    add_media_args(run_batch)
    add_engine_args(run_batch)
    run_batch.set_defaults(func=cmd_run_batch)

    from lmserve.cli import hub

    hub.add_parsers(sub)

    monitor = sub.add_parser("monitor", help="monitoring tools")
    monitor_sub = monitor.add_subparsers(dest="monitor_command", required=True, metavar="COMMAND")
    profile = monitor_sub.add_parser("profile", help="a drift reference profile from a payload log (to stdout)")
    profile.add_argument("payload_log", help="a --payload-log JSONL file")
    profile.set_defaults(func=cmd_monitor_profile)

    lora = sub.add_parser("lora", help="LoRA adapter tools")
    lora_sub = lora.add_subparsers(dest="lora_command", required=True, metavar="COMMAND")
    merge = lora_sub.add_parser(
        "merge", help="merge PEFT LoRA adapters into the base model, written as a Hugging Face safetensors directory")
    add_lora_merge_args(merge)
    merge.set_defaults(func=cmd_lora_merge)

    from lmserve.bench.cli import add_bench_parser
    add_bench_parser(sub, add_engine_args)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed; `serve MODEL` becomes `serve --model MODEL` (given once, one way or the other)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    positional = getattr(args, "model_arg", None)
    if positional is not None:
        if args.model:
            parser.error(f"the model is given twice: as MODEL ({positional}) and as --model; give it once")
        args.model = [positional]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one command; an ordinary mistake (a bad flag value, a file that is not a model) is one line and exit 2."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, CheckpointError) as e:  # as argparse reports a usage error: no traceback, exit 2
        print(f"lmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
