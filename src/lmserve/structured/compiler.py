"""Compile structured-output specs into xgrammar grammars: checked, bounded, cached.

A schema, regex or grammar is user input, and compiling one can take seconds and gigabytes (a few
hundred bounded repetitions in an EBNF grammar took 9 s here). So compilation runs in one child
process: the caller waits at most `compile_timeout_s` and the child may grow by at most
`compile_max_memory_mb`; past either it is killed (a fresh one starts on the next compile) and the
request gets a GrammarError (HTTP 400). The engine thread never compiles: the server compiles at
admission on a worker thread, so the engine keeps stepping meanwhile. Compiled grammars come back
serialised (~100 KB, ~10 ms each way) and are cached here by (kind, canonical spec).
"""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.config import StructuredOutputsConfig
from lmserve.sampling_params import StructuredOutputsParams
from lmserve.structured.schema import unsupported_keywords

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in the child: ~4 s on an idle machine
_POLL_S = 0.02


class GrammarError(ValueError):
    """A spec that cannot be compiled: invalid, unsupported, or too costly. The message names the problem."""


@dataclass(frozen=True)
class VocabInfo:
    """What xgrammar needs of a tokenizer: every token's string as stored in the vocabulary, and how to read it."""

    tokens: list[str]  # id -> token string (byte-level: GPT-2's byte alphabet; byte-fallback: "<0x41>")
    vocab_type: str  # "byte_level" | "byte_fallback" | "raw"
    vocab_size: int  # the model's logits width (may exceed len(tokens): padded embedding rows)
    stop_token_ids: list[int]  # ids that end a finished grammar (EOS)
    add_prefix_space: bool = False


def compile_args(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(xgrammar method, its text argument) for a spec; raises GrammarError on what can be checked here."""
    kind = spec.kind
    if kind == "json":
        return "json_schema", _checked_schema(spec.json)
    if kind == "json_object":
        return "json_object", '{"type": "object"}'
    if kind == "choice":
        # one alternative per choice, each a quoted EBNF literal (JSON string escapes are EBNF's)
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    return {"regex": "regex", "grammar": "grammar", "structural_tag": "structural_tag"}[kind], spec.spec_text


def _checked_schema(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"json schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("json schema must be a JSON object")
    bad = unsupported_keywords(schema)
    if bad:
        raise GrammarError(f"json schema uses keyword(s) structured outputs cannot enforce: {', '.join(bad)}")
    return json.dumps(schema, ensure_ascii=False)


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar (an xgrammar CompiledGrammar) and what obtaining it cost."""

    grammar: Any
    seconds: float
    cached: bool


class GrammarCompiler:
    """Thread-safe: compile(spec) -> Compiled, from the cache or the bounded child process."""

    def __init__(self, vocab: VocabInfo, cfg: StructuredOutputsConfig = StructuredOutputsConfig()) -> None:
        import xgrammar as xgr  # noqa: PLC0415 - only engines that get a structured request pay the import

        self._xgr = xgr
        self.cfg = cfg
        self.info = xgr.TokenizerInfo(vocab.tokens, _VOCAB_TYPES[vocab.vocab_type](xgr), vocab_size=vocab.vocab_size,
                                      stop_token_ids=list(vocab.stop_token_ids),
                                      add_prefix_space=vocab.add_prefix_space)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._table: Any = None
        self._worker = CompileWorker(self.info.serialize_json(), cfg)

    def compile(self, spec: StructuredOutputsParams) -> Compiled:
        """The compiled grammar for `spec`; raises GrammarError naming the problem."""
        start = time.perf_counter()
        key = (spec.kind, spec.spec_text)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return Compiled(self._cache[key], time.perf_counter() - start, cached=True)
        method, text = compile_args(spec)
        compiled = self._xgr.CompiledGrammar.deserialize_json(self._worker.compile(method, text), self.info)
        with self._cache_lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return Compiled(compiled, time.perf_counter() - start, cached=False)

    def token_table(self) -> Any:
        """The vocabulary as limit.py's TokenTable (built on first use, ~0.6 s on 2 cores; shared by every
        request)."""
        from lmserve.structured.limit import TokenTable  # noqa: PLC0415 - a sibling, needed only once

        with self._cache_lock:
            if self._table is None:
                self._table = TokenTable(self.info.decoded_vocab, self.info.stop_token_ids)
            return self._table

    def close(self) -> None:
        self._worker.stop()


_VOCAB_TYPES = {
    "byte_level": lambda xgr: xgr.VocabType.BYTE_LEVEL,
    "byte_fallback": lambda xgr: xgr.VocabType.BYTE_FALLBACK,
    "raw": lambda xgr: xgr.VocabType.RAW,
}


class CompileWorker:
    """The child process that compiles, one spec at a time; killed when over its time or memory bound.

    A plain subprocess (`python -m lmserve.structured.compiler`), not multiprocessing: spawn would
    re-run the caller's main script, which breaks any script that builds an LLM at module level.
    """

    def __init__(self, info_json: str, cfg: StructuredOutputsConfig) -> None:
        self.info_json, self.cfg = info_json, cfg
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._idle_rss = 0

    def compile(self, method: str, text: str) -> str:
        """The serialised compiled grammar; GrammarError when invalid or over a bound."""
        with self._lock:
            if self._proc is None:
                self._start()
            _send(self._proc.stdin, [method, text])
            status, payload = self._wait()
        if status == "error":
            raise GrammarError(payload)
        return payload

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "lmserve.structured.compiler"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": _pythonpath()})
        _send(self._proc.stdin, self.info_json)
        if not _readable(self._proc.stdout, WORKER_START_TIMEOUT_S) or _recv(self._proc.stdout) != "ready":
            self._kill()
            raise GrammarError("the grammar compiler did not start")
        self._idle_rss = _rss(self._proc.pid)

    def _wait(self) -> tuple[str, str]:
        deadline = time.monotonic() + self.cfg.compile_timeout_s
        limit = self._idle_rss + self.cfg.compile_max_memory_mb * 2**20
        while not _readable(self._proc.stdout, _POLL_S):
            if self._proc.poll() is not None:
                self._kill()
                return "error", "the grammar compiler crashed on this spec"
            if time.monotonic() > deadline:
                self._kill()
                return "error", (f"compiling the grammar took longer than {self.cfg.compile_timeout_s:g} s; "
                                 "simplify the schema, regex or grammar")
            if _rss(self._proc.pid) > limit:
                self._kill()
                return "error", (f"compiling the grammar needed more than {self.cfg.compile_max_memory_mb} MiB; "
                                 "simplify the schema, regex or grammar")
        reply = _recv(self._proc.stdout)
        if reply is None:
            self._kill()
            return "error", "the grammar compiler crashed on this spec"
        return reply[0], reply[1]

    def _kill(self) -> None:
        log.warning("grammar compile process stopped (over its time or memory bound, or crashed)")
        self.stop()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None


def _pythonpath() -> str:
    """The child imports this very package, wherever it was imported from (an installed or a source tree)."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def _send(stream: Any, obj: Any) -> None:
    data = json.dumps(obj).encode()
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def _recv(stream: Any) -> Any:
    """One framed JSON message; None at end of stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    data = stream.read(n)
    return json.loads(data) if len(data) == n else None


def _readable(stream: Any, timeout: float) -> bool:
    return bool(select.select([stream], [], [], timeout)[0])


def _rss(pid: int) -> int:
    import psutil  # noqa: PLC0415

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def _serve() -> None:
    """Child process: read the tokenizer info, then compile [method, text] requests until stdin closes."""
    import xgrammar as xgr  # noqa: PLC0415

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    info = xgr.TokenizerInfo.deserialize_json(_recv(stdin))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    _send(stdout, "ready")
    while (request := _recv(stdin)) is not None:
        method, text = request
        try:
            _send(stdout, ["ok", _compile(xgr, compiler, method, text).serialize_json()])
        except Exception as e:  # noqa: BLE001 - xgrammar reports every invalid input as some exception
            _send(stdout, ["error", _clean(e)])


def _compile(xgr: Any, compiler: Any, method: str, text: str) -> Any:
    if method == "json_schema":
        # compact JSON (", " and ": ", no newlines): a sampling model cannot wander off into whitespace
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if method == "json_object":  # any object: other keys allowed (strict mode would forbid every key)
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=False)
    if method == "regex":
        return compiler.compile_regex(text)
    if method == "grammar":
        return compiler.compile_grammar(text)
    return compiler.compile_structural_tag(text)


def _clean(e: Exception) -> str:
    """xgrammar's message without its '[time] /project/cpp/file.cc:line: ' prefix."""
    lines = [line.split(": ", 1)[-1] if ".cc:" in line else line for line in str(e).strip().splitlines()]
    return " ".join(x.strip() for x in lines if x.strip())[:500] or type(e).__name__


if __name__ == "__main__":
    _serve()
