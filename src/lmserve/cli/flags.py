"""The flag tables of `lmserve` commands, in help groups, each flag with its help and its default shown.

`Parser` answers a bad value with two lines (a short usage and the error), not the whole flag list; the
formatter appends "(default: X)" to a flag whose help does not already say what its default is.
"""

from __future__ import annotations

import argparse

from lmserve.config import DEFAULT_KV_OFFLOAD_DISK_BYTES, DEFAULT_KV_SHARED_TTL_S, ENV_API_KEY, LORA_DTYPES
from lmserve.parsers.reasoning import REASONING_PARSERS
from lmserve.parsers.tool_formats import TOOL_FORMATS as TOOL_CALL_PARSERS

LOG_LEVELS = ["debug", "info", "warning", "error"]


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, unless the help already names it or there is none to show (an off switch)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=110)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == [] \
                or action.default == argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with a two-line answer to a mistake: `usage: PROG [options] ARGS` and the error itself."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"usage: {self.short_usage()} (see {self.prog} --help)\n{self.prog}: error: {message}\n")

    def short_usage(self) -> str:
        if self.usage:
            return self.usage % {"prog": self.prog}
        names = [a.metavar if isinstance(a.metavar, str) else a.dest.upper() for a in self._get_positional_actions()]
        return " ".join([self.prog, "[options]", *names])


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Flags that build an EngineConfig (shared by every command that loads a model), in groups; `several_models`:
    serve's repeatable --model NAME=PATH."""
    _add_model_args(p.add_argument_group("model"), several_models)
    _add_runtime_args(p.add_argument_group("engine"))
    _add_kv_tier_args(p.add_argument_group("KV tier (prefix-cache blocks below the pool)"))
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                      help='as vLLM writes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                      '"model": PATH, "num_speculative_tokens": 4}\' (default: none)')
    lora = p.add_argument_group("LoRA")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters on the base model (a request names one as its model)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="PEFT adapter directories to serve from the start, each as name=path (default: none)")
    lora.add_argument("--max-loras", type=int, default=4, help="adapters active in one engine step (device slots)")
    lora.add_argument("--max-cpu-loras", type=int, default=16,
                      help="adapters kept read in host memory (least recently used dropped, re-read when used)")
    lora.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted; slots are sized for it")
    lora.add_argument("--lora-dtype", default="auto", metavar="{" + ",".join(LORA_DTYPES) + "}",
                      help="the adapters' weights in their device slots (default auto: float16 over a base kept in "
                      "quantized blocks on a CPU, e.g. a GGUF file's, where reading every adapter's float32 weights "
                      "each step was most of their cost; else the model's dtype)")
    scale = p.add_argument_group("scale-out")
    scale.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="split each layer across N ranks, one process each (torch.distributed: gloo on CPU, NCCL "
                       "on CUDA, one GPU per rank); the model's heads and KV heads must be divisible by N")
    scale.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                       help="split the decoder layers across N ranks, one process each, each holding its layers' "
                       "weights and KV cache (torch.distributed: gloo on CPU, NCCL on CUDA, one GPU per rank); "
                       "1 <= N <= the model's layers; with --tensor-parallel-size T, N x T ranks")
    scale.add_argument("--pipeline-micro-batches", type=int, default=None, metavar="K",
                       help="with --pipeline-parallel-size > 1: cut each step's sequences into up to K parts that follow "
                       "each other through the stages, so one rank runs a part while the next runs the one before "
                       "(cut between sequences: a prefill chunk is never cut); 1: each step travels whole (default: 2 "
                       "on CPU, 1 on CUDA, where cut steps over NCCL have not run on two GPUs yet)")


def _add_model_args(g, several_models: bool) -> None:
    what = ("a .gguf file, a Hugging Face directory, or a Hub id (org/name: from the local Hugging Face cache, else "
            "downloaded; HF_TOKEN, HF_HUB_OFFLINE apply) (default: the embedded SmolLM2-135M-Instruct)")
    if several_models:
        g.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                       help=what + "; repeatable as NAME=PATH to serve several models, routed by the request's "
                       "`model` (the first is the default); every engine flag applies to each model alone, "
                       "--kv-cache-memory included")
    else:
        g.add_argument("--model", default=None, help=what)
    g.add_argument("--revision", default=None, help="Hub branch, tag or commit when --model is a Hub id "
                   "(default: main)")
    g.add_argument("--mmproj", default=None, metavar="PATH",
                   help="a vision-language model as llama.cpp converts it: --model is the text .gguf, this its "
                   "multimodal projector .gguf (convert_hf_to_gguf.py --mmproj; projector types: idefics3, gemma3, "
                   "qwen2.5vl_merger, mlp) (default: none, "
                   "a text model or a Hugging Face directory with its own vision tower)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA; on a CPU float32, unless a measurement made once on the machine "
                   "of an AMX CPU finds bfloat16 batch invariant and clearly faster")
    g.add_argument("--mm-encoder-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="a vision model's image tower and projector (the text model keeps --dtype); auto: bfloat16 on "
                   "CUDA, and on a CPU with AVX512_BF16 or AMX where a tower-shaped matmul, timed once on the "
                   "machine, runs >= 1.5x float32's; float32 elsewhere. Embeddings reach the text model in its dtype")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                   help="how linear weights are held: gguf (CPU): a GGUF file's own blocks through native int8-dot "
                   "kernels; none: float weights (a GGUF dequantized; transformers parity); int8, int4: weight-only "
                   "quantized at load; auto: gguf for a quantized GGUF on CPU with float32 and one rank, else none")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--pooling", choices=("last", "mean", "cls"), default=None,
                   help="how embedding requests (/v1/embeddings, /api/embed, LLM.embed) pool the final hidden states; "
                   "default: the checkpoint's sentence-transformers 1_Pooling/config.json, else last (the last token, "
                   "vLLM's default for decoder LMs)")
    g.add_argument("--classifier-from-token", default=None, metavar="FALSE,TRUE",
                   help="serve a decoder as a reranker scored by a token pair (Qwen3-Reranker: no,yes): a pair's score "
                   "is the softmax over the two tokens' last-token logits, taken at TRUE; the model then answers "
                   "/v1/rerank, /rerank, /v1/score and /classify (vLLM's hf_overrides classifier_from_token); default: none, "
                   "a decoder generates and embeds")


def _add_runtime_args(g) -> None:
    g.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: 1024, lowered at start to what this host "
                   "prefills in about a second)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="schedule whole prompts only (on by default)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="never reuse KV blocks of a prompt prefix seen before (reused by default)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="sliding-window layers keep every KV block, as full-attention layers do (by default they "
                   "release the blocks their window left: Gemma 2/3, Mistral)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "int8", "fp8_e4m3"), default="auto",
                   help="KV cache element type; auto: float16 for a GGUF file's kept blocks on CPU (as llama.cpp), "
                   "else the model's dtype; int8 / fp8_e4m3 (CPU): one-byte codes with a float16 scale per 32 values, "
                   "0.53x the bytes of float16")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size: bytes if > 1, else a fraction of available memory (default: 0.15); a size "
                   "given here may be smaller than one --max-model-len request (longer ones then get 400)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="CUDA: fraction of the GPU's memory for weights, activations and the KV cache, which gets "
                   "what a profiled full step leaves (used when --kv-cache-memory and --num-kv-blocks are not given)")
    g.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV cache size in blocks of --block-size tokens, overriding --kv-cache-memory (default: "
                   "from --kv-cache-memory)")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (default: one per core; idle OpenMP threads sleep, OMP_WAIT_POLICY=PASSIVE, "
                   "unless you set it or GOMP_SPINCOUNT)")
    g.add_argument("--seed", type=int, default=0, help="the engine's random seed (requests without a seed of their "
                   "own draw from it)")
    g.add_argument("--cuda-graphs", action="store_true", default=True,
                   help="CUDA: replay decode steps from CUDA graphs captured per batch size at start-up (the default: "
                   "5-10x eager decode on an H100; ignored on CPU; kept so older command lines still parse)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: never replay CUDA graphs (decode runs eagerly; start-up skips the capture)")
    g.add_argument("--attention-backend", choices=("auto", "triton", "reference"), default="auto",
                   help="attention over the paged KV cache: triton (CUDA: kernels reading K/V in place through the "
                   "block tables), reference (gather + SDPA; the native kernel on CPU); auto: triton on CUDA where "
                   "Triton runs, else reference")
    g.add_argument("--grammar-compile-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="structured outputs: a schema, regex or grammar that takes longer to compile gets a 400")


def _add_kv_tier_args(g) -> None:
    g.add_argument("--kv-offload-memory", type=size_arg, default=0, metavar="SIZE",
                   help="host memory for prefix-cache blocks the KV pool evicts (an LRU, e.g. 2GiB); a later prompt "
                   "with that prefix copies them back instead of recomputing them (default: 0, off)")
    g.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="a directory for every full prefix-cache block (written off the engine thread, checked on "
                   "read, kept across restarts): a repeated long prompt is answered from it after a restart; keyed "
                   "by the model's weights, tokenizer, KV layout and block size, and by each API key's prefix salt; "
                   "files signed with a secret kept there, 0600 in 0700 directories (one every user may write is "
                   "refused) (default: none, off)")
    g.add_argument("--kv-offload-disk-size", type=size_arg, default=DEFAULT_KV_OFFLOAD_DISK_BYTES, metavar="SIZE",
                   help="most bytes --kv-offload-dir holds for this model; the least recently used blocks are "
                   "deleted beyond it (default: 8GiB)")
    g.add_argument("--kv-shared", default=None, metavar="URL|DIR",
                   help="a KV tier every replica shares: redis://HOST:PORT/DB (a password or ACL user in the URL), or "
                   "a directory on a shared filesystem; each full prefix block is written there (off the engine "
                   "thread) and any replica of the same model, tokenizer and KV layout loads it instead of computing "
                   "it, checked on read and keyed by each API key's prefix salt; Redis down or slow: blocks are "
                   "computed, never a failed request (default: none, off)")
    g.add_argument("--kv-shared-ttl", type=float, default=DEFAULT_KV_SHARED_TTL_S, metavar="SECONDS",
                   help="Redis only: a block expires this long after its last write or read (default: 3600)")
    g.add_argument("--kv-shared-size", type=size_arg, default=DEFAULT_KV_OFFLOAD_DISK_BYTES, metavar="SIZE",
                   help="a shared directory only: most bytes this replica keeps there; the least recently used "
                   "blocks are deleted beyond it (default: 8GiB)")


def size_arg(text: str) -> int:
    """A size flag (2GiB, 512MiB, bytes) -> bytes (argparse reports a ValueError as a usage error)."""
    from lmserve.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def speculative_config(text: str):
    """--speculative-config JSON -> SpeculativeConfig (argparse reports a ValueError as a usage error)."""
    import json

    from lmserve.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens generated per reply")
    g.add_argument("--temperature", type=float, default=0.7, help="0: greedy (the same answer every time)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens this likely")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min_p times the likeliest")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")
    g.add_argument("--sample-seed", dest="sample_seed", type=int, default=None,
                   help="per-request sampling seed: the same seed, the same text (default: none)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`lmserve serve`'s own flags, in the groups that add_engine_args started."""
    groups = {g.title: g for g in p._action_groups}
    _add_server_args(p.add_argument_group("server"))
    _add_security_args(p.add_argument_group("security"))
    lora = groups["LoRA"]
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (paths under --lora-dir only; "
                      "a key manages the adapters it loaded, an admin key every one)")
    lora.add_argument("--lora-dir", action="append", default=[], metavar="DIR",
                      help="a directory whose subdirectories the load route may read adapters from (repeatable; "
                      "default: none)")
    scale = groups["scale-out"]
    scale.add_argument("--max-loaded-models", type=int, default=None, metavar="K",
                       help="with several --model: at most K loaded at once; loading another unloads the least "
                       "recently used idle one (default: all loaded at start)")
    scale.add_argument("--model-load-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="a request waits this long for its model to load, then gets 503 with Retry-After")
    scale.add_argument("--keep-alive", default=None, metavar="DURATION",
                       help="unload a model once idle this long, to load it again on its next request (scale to zero): "
                       "5m, 30s, 1h30m or seconds; 0 unloads after every request; negative never. An Ollama "
                       "request's keep_alive overrides it for its model, within --keep-alive-max (default: never; "
                       "Ollama's own is 5m)")
    scale.add_argument("--keep-alive-max", default=None, metavar="DURATION",
                       help="the longest keep-alive an Ollama request may set (longer, or negative, is cut to it); "
                       "negative lets requests keep a model loaded forever (default: --keep-alive's value)")
    scale.add_argument("--allow-unload", action="store_true",
                       help="let every key's requests shorten the keep-alive below --keep-alive and unload a model "
                       "(keep_alive 0); without it only admin keys may (everyone, on a server without keys)")
    scale.add_argument("--route", action="append", default=[], metavar="NAME=MODEL:WEIGHT,...",
                       help="weighted traffic split (canaries): a request for model NAME goes to one of the models by "
                       "weight, the same one for the same `user` (repeatable; default: none)")
    from lmserve.ops.hub import add_ops_args

    observability = p.add_argument_group("observability (all off by default but the access log)")
    observability.add_argument("--no-access-log", action="store_true",
                               help="no log line per request (method, route, status, latency, tokens, request id)")
    add_ops_args(observability)


def _add_server_args(g) -> None:
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: from the file)")
    g.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help="log level (default: info)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a thinking model's <think>...</think> from its answer: chat replies get "
                   "reasoning_content (streamed as delta.reasoning_content), and response_format / forced tools "
                   "apply only after the reasoning ends (deepseek_r1: all text before </think>; qwen3: only what "
                   "follows <think>; gpt_oss: harmony's analysis channel; none with chat_template_kwargs "
                   "enable_thinking false) (default: none)")
    g.add_argument("--chat-template", dest="chat_template_file", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template text) replacing the model's own for every "
                   "chat route (default: the model's)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the tool-call format a model writes, reads back and is constrained to (tool_choice "
                   "required / named): hermes <tool_call>{json}</tool_call>, llama3_json {\"name\", \"parameters\"}, "
                   "mistral [TOOL_CALLS][...], pythonic [f(a=1)], qwen3_xml <function=f><parameter=a>..., phi4_mini "
                   "<|tool_call|>[...]<|/tool_call|>, gemma3 [f(a=1)] or ```tool_code, harmony (gpt-oss) "
                   "to=functions.f<|message|>{...}<|call|> "
                   "(default: from the chat template's markers; hermes when it has none)")
    g.add_argument("--strict-fields", action="store_true",
                   help="answer a request field this server does not know with 400 (by default it is ignored, "
                   "logged and named in the X-Ignored-Fields header, as vLLM does)")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting beyond the running batch before new ones get 503")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body accepted")
    g.add_argument("--pace-refused-requests", type=float, default=10.0, metavar="PER_SECOND",
                   help="refused requests (4xx) a second an API key may send, in bursts of twice that, while other "
                   "keys are served; past it the key's next requests wait before their body is read, so that bad "
                   "requests sent back to back cannot take the server from other keys (0: off)")
    g.add_argument("--max-rerank-documents", type=int, default=1000,
                   help="most documents (or text pairs) one rerank or score request may send; more is a 400")
    g.add_argument("--max-upload-bytes", type=int, default=64 * 2**20,
                   help="largest file accepted by POST /v1/files (a batch job's input)")
    add_media_args(g)
    g.add_argument("--storage-quota", action="append", default=[], metavar="NAME=VALUE",
                   help="what each API key may store (repeatable; a key file entry's storage_quota wins): files=1000, "
                   "file_bytes=4GiB, shares=1000, share_bytes=100MiB, responses=10000 (then its oldest are dropped), "
                   "response_bytes=1GiB, response_chain=1000 (turns of previous_response_id), cache_entries=N "
                   "(default: the response cache's size split equally among the keys); none: unlimited")
    g.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="where uploaded files and batch jobs are kept, so they survive a restart "
                   "(default: ~/.local/share/lmserve/batches)")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish "
                   "after SIGTERM")
    g.add_argument("--request-read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a client must send a request's headers and body within this many seconds of starting it, "
                   "or its connection is closed (slow-loris clients)")
    g.add_argument("--timeout-keep-alive", type=float, default=30.0, metavar="SECONDS",
                   help="an idle kept-alive connection is closed after this many seconds (longer than the clients' "
                   "own idle expiry, e.g. httpx's 5 s, so that a client never sends into a connection the server is "
                   "closing)")
    g.add_argument("--engine-step-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="an engine step running longer than this means a hung engine: /health turns 503 and the "
                   "process exits 1 for its supervisor to restart it (0: no watchdog)")
    g.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="max_tokens of a request that names none (default: the API's own: 16 for completions, "
                   "100 for TGI, the rest of the context for chat)")
    g.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="a request asking for more max_tokens gets 400; one naming none is held to it too "
                   "(default: no limit)")
    g.add_argument("--response-cache", default=None, metavar="URL",
                   help="cache the answers of deterministic requests (greedy or seeded): 'sqlite' (a file under "
                   "~/.cache/lmserve), 'sqlite:PATH' or 'redis://HOST:PORT/DB'; per API key (default: off)")
    g.add_argument("--response-cache-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="how long a cached answer is served")
    g.add_argument("--response-cache-max-entries", type=int, default=10_000, metavar="N",
                   help="the oldest answers are dropped past this many")
    g.add_argument("--playground-db", default=None, metavar="PATH",
                   help="the SQLite file of the web playground's shared permalinks (default: "
                   "$XDG_DATA_HOME/lmserve/playground.sqlite3, i.e. ~/.local/share/lmserve/... when unset)")
    g.add_argument("--responses-db", default=None, metavar="PATH",
                   help="the SQLite file of stored /v1/responses answers (store: true), per API key, for "
                   "previous_response_id and GET /v1/responses/ID (default: $XDG_DATA_HOME/lmserve/"
                   "responses.sqlite3, i.e. ~/.local/share/lmserve/... when unset)")
    g.add_argument("--no-playground", action="store_true",
                   help="no web playground: /, /playground, /p/<id> and /playground/api/... answer 404")


def add_media_args(g) -> None:
    """Where images may come from: `serve` and `run-batch` (whose lines may hold image parts)."""
    g.add_argument("--allowed-media-domains", action="append", default=[], metavar="HOST[:PORT][,...]",
                   help="hosts whose http(s) image URLs requests may name (repeatable or comma-separated; exact "
                   "names or IP literals, on the scheme's default port 80/443 unless given as HOST:PORT or "
                   "[IPv6]:PORT; only public addresses are fetched, no redirects; default: none, so images come only "
                   "as data: URLs or base64)")
    g.add_argument("--max-image-bytes", type=size_arg, default=20 * 2**20, metavar="SIZE",
                   help="largest image accepted, sent as base64 or fetched from a URL (default: 20MiB)")


def _add_security_args(g) -> None:
    g.add_argument("--api-key", action="append", default=[],
                   help=f"accepted API key (repeatable; also ${ENV_API_KEY}, comma-separated; default: none, the "
                   "server is open); each is its own tenant, named key-<first 8 hex digits of its SHA-256>")
    g.add_argument("--api-key-file", default=None,
                   help="accepted API keys: a YAML/JSON file of named keys with limits (keys: [{name, key or sha256, "
                   "requests_per_minute, tokens_per_minute, max_concurrent_requests, models (names or patterns of "
                   "models and adapters), role (user|admin), prefix_cache (isolated|shared)}]), or one key per line "
                   "(default: none)")
    g.add_argument("--require-api-key", action="store_true",
                   help="refuse to start without at least one API key (a deployment whose key Secret went "
                   "missing must not serve an open API)")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without an API key (by default, with keys set, it needs an admin key from "
                   "--api-key-file; plain keys never read it)")
    g.add_argument("--cors-allowed-origins", action="append", default=[],
                   help="origin allowed by CORS (repeatable; default: none, no CORS headers)")


def add_lora_merge_args(p: argparse.ArgumentParser) -> None:
    """`lmserve lora merge`: flags follow PEFT's add_weighted_adapter (weights, combination type, density)."""
    p.add_argument("--base", default=None, help="the base model: a .gguf file, a Hugging Face directory or a Hub id "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit when --base is a Hub id (default: main)")
    p.add_argument("--adapter", action="append", default=[], metavar="DIR", help="a PEFT adapter directory (repeatable)")
    p.add_argument("--weights", default=None, metavar="W1,W2,...",
                   help="one weight per adapter, comma-separated (default: 1 each)")
    p.add_argument("--method", default="linear", metavar="METHOD",
                   help="how several adapters combine, as PEFT defines it: linear, cat, ties, dare_linear, dare_ties")
    p.add_argument("--density", type=float, default=None,
                   help="ties/dare: the fraction of each adapter's entries kept, in (0, 1] (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seeds DARE's random drop (the same seed, the same merge)")
    p.add_argument("--dtype", default="auto", metavar="DTYPE",
                   help="float32, bfloat16 or float16 (default auto: a Hugging Face base's own dtype; bfloat16 for GGUF)")
    p.add_argument("--quantization", default=None, metavar="int4|int8",
                   help="QLoRA: merge onto the projection weights as lmserve's int4/int8 quantizer stores them "
                   "(dequantized); a GGUF base is always merged onto its dequantized weights (default: none)")
    p.add_argument("--out", required=True, metavar="DIR", help="the new model directory (must not exist, or be empty)")
