"""What `lmserve serve` checks and binds before anything heavy is imported: the HTTP-side flags and the listening
socket (torch-free, so the port is open within the interpreter's first few hundred milliseconds)."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import socket
from pathlib import Path

from lmserve.errors import ConfigError


def check_serve_args(args: argparse.Namespace) -> None:
    """The HTTP-side flags that can never work; ConfigError naming the flag."""
    if not 1 <= args.port <= 65535:  # here, not at bind: a Ray deploy checks these flags once, before any replica
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    for flag, value, low in (("--max-queued-requests", args.max_queued_requests, 0),
                             ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--max-rerank-documents", getattr(args, "max_rerank_documents", 1), 1),
                             ("--max-upload-bytes", args.max_upload_bytes, 1),
                             ("--max-image-bytes", args.max_image_bytes, 1),
                             ("--default-max-tokens", args.default_max_tokens, 1),
                             ("--max-tokens-limit", args.max_tokens_limit, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--drain-timeout", args.drain_timeout), ("--engine-step-timeout", args.engine_step_timeout)):
        if not value >= 0:
            raise ConfigError(f"{flag} must be >= 0 seconds, got {value}")
    for flag, value in (("--request-read-timeout", args.request_read_timeout),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0 seconds, got {value}")
    default, limit = args.default_max_tokens, args.max_tokens_limit
    if default is not None and limit is not None and default > limit:
        raise ConfigError(f"--default-max-tokens {default} is above --max-tokens-limit {limit}")
    if args.allow_runtime_lora_updating and not (args.enable_lora and args.lora_dir):
        raise ConfigError("--allow-runtime-lora-updating needs --enable-lora and at least one --lora-dir")
    for host in (h.strip() for flag in args.allowed_media_domains for h in flag.split(",")):
        try:
            if host:
                allowed_entry(host)  # host, host:port, an IP literal, [IPv6] or [IPv6]:port
        except ValueError as e:
            raise ConfigError(f"--allowed-media-domains {host[:80]!r}: {e}") from None
    for d in args.lora_dir:
        if not Path(d).is_dir():
            raise ConfigError(f"--lora-dir {d}: not a directory")


def allowed_entry(text: str) -> str:
    """One --allowed-media-domains entry as MediaPolicy keeps it: "host", or "host:port" where the flag names the
    port (an IPv6 literal bare, or in brackets with a port); ValueError saying what is wrong with it."""
    text = text.strip()
    if any(c in text for c in "/*@ ?#"):
        raise ValueError("give host names or IP literals, optionally with :port (exact), not URLs or patterns")
    port = None
    if text.startswith("["):  # [v6] or [v6]:port
        host, close, rest = text[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 literal is [address] or [address]:port")
        port = rest[1:] if rest else None
        _ipv6(host)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host = text
        if ":" in host:  # a bare IPv6 literal: no port can follow it (it would read as part of the address)
            _ipv6(host)
    host = host.rstrip(".").lower()
    if not host:
        raise ValueError("the entry names no host")
    if port is not None:
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"port {port[:10]!r} is not a number from 1 to 65535")
        return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"
    return host


def _ipv6(text: str) -> None:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        raise ValueError(f"{text[:60]!r} is not an IPv6 address") from None


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a port in use or a host that is not this machine's is a ConfigError before
    the model loads (uvicorn would find out only after it, and exit with a traceback). The port's range was
    checked with the other flags (check_serve_args, from prepare)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} is in use ({host}:{port}: {e.strerror}); stop what holds it or choose "
                              "another with --port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host}: not an address of this machine ({e.strerror})") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
