"""Images a request names, from its reference to checked bytes: `data:` URLs, and `http(s)` URLs of allowed hosts.

Two steps, so that the cheap refusals come before any work. `image_source` (on the event loop, no network) reads a
reference: a `data:` URL's base64 is decoded and its header probed (format allow-list, declared size: a bomb is
refused from its header); an `http(s)` URL must name a host in `--allowed-media-domains` (empty: none, so no URL is
ever fetched) on its scheme's default port, or a `host:port` the flag names, and an IP literal must be public;
`file://` and every other scheme are refused. `fetch_images` fetches the URLs (on FETCHES, this module's own
threads) and reads each header's size, so that the caller can count the image's prompt tokens before decoding;
`decode_images` decodes them (off the event loop) into `ImageData`s; `load_images` does both.

A fetch resolves the host once, refuses it unless every address it resolves to is public (not private, loopback,
link-local, multicast, reserved, unspecified, shared, nor one of those inside an IPv4-mapped, 6to4, Teredo or NAT64
address), then connects to that checked address itself (the Host header and TLS name stay the host's), so a DNS
answer that changes between the check and the connect (rebinding) reaches nothing. Redirects are refused, not
followed; the body is cut at `--max-image-bytes` and the whole fetch (waiting for a thread and DNS included) at
`MediaPolicy.timeout` seconds.

Every refusal is an APIError 400 naming the part (`param`); the route's family shapes it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import http.client
import ipaddress
import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

from lmserve.multimodal.image_io import ImageData, ImageError, load_image_bytes, probe_image_bytes
from lmserve.server.errors import APIError

MAX_IMAGE_BYTES = 20 * 2**20  # --max-image-bytes' default: a large phone photo
FETCH_TIMEOUT = 10.0  # seconds for one URL: resolve, connect, headers and body
# URL fetches running at once in this process, on their own threads (FetchPool): a host or resolver that never
# answers holds at most these, never a thread of the default executor that tokenizing and decoding need
MAX_FETCHES = 8
MAX_IMAGES = 64  # per request: each is decoded in memory before the model sees it
# Over all of one request's images, checked from their headers before any is decoded: the pixels decoded at once
# (~192 MB as RGB; without it 64 small PNGs each declaring 64 M pixels decode to ~12 GB) and the bytes fetched.
MAX_REQUEST_PIXELS = 64_000_000
MAX_REQUEST_BYTES = 64 * 2**20
DETAILS = ("auto", "low", "high")
# A data: URL's declared type, when it declares one (Ollama's bare base64 declares none): Pillow's check of the
# bytes themselves (IMAGE_FORMATS) is what decides.
DATA_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large: the serve flags, and a test-only switch."""

    # --allowed-media-domains as server/listen.allowed_entry writes them: "host" (the scheme's default port only) or "host:port",
    # lower case; an IPv6 literal bare ("::1") or, with a port, in brackets ("[::1]:8443")
    allowed_domains: tuple[str, ...] = ()
    max_image_bytes: int = MAX_IMAGE_BYTES  # --max-image-bytes: one image's bytes, decoded from base64 or fetched
    timeout: float = FETCH_TIMEOUT
    allow_private: bool = False  # tests only (a local HTTP server is loopback); no flag sets it
    # tests only (a resolver that never answers cannot be made here without changing the machine's): no flag sets it
    resolve: Callable[..., list] = field(default=socket.getaddrinfo, repr=False)


@dataclass(frozen=True)
class ImageSource:
    """A checked reference to one image: its bytes (a data: URL, already decoded) or an allowed URL to fetch."""

    param: str  # where the request put it, for the 400
    detail: str = "auto"
    data: bytes | None = field(default=None, repr=False)  # up to --max-image-bytes: kept out of logs
    url: str | None = None


def image_source(ref: Any, param: str, policy: MediaPolicy, detail: str | None = None) -> ImageSource:
    """Read an image reference (a data: or http(s) URL) without touching the network; APIError 400 on a bad one."""
    if not isinstance(ref, str) or not ref:
        raise APIError(400, f"{param}: an image must be a data: URL or an http(s) URL", param=param)
    detail = detail or "auto"
    if detail not in DETAILS:
        raise APIError(400, f"{param}: detail must be one of {', '.join(DETAILS)}, got {detail[:20]!r}", param=param)
    scheme = ref.split(":", 1)[0].lower() if ":" in ref else ""
    if scheme == "data":
        return _data_source(ref, param, policy, detail)
    if scheme in ("http", "https"):
        _check_url(ref, param, policy)
        return ImageSource(param, detail, url=ref)
    shown = f"{scheme}:" if scheme and len(scheme) < 20 else "this reference"
    raise APIError(400, f"{param}: {shown} is not accepted; send the image as a data: URL (base64) or an http(s) "
                   "URL of an allowed host", param=param)


def _data_source(ref: str, param: str, policy: MediaPolicy, detail: str) -> ImageSource:
    header, comma, data = ref.partition(",")
    fields = [f.strip().lower() for f in header[len("data:"):].split(";")]
    if not comma or fields[-1] != "base64":
        raise APIError(400, f"{param}: a data: URL must be data:<image type>;base64,<data>", param=param)
    media_type = fields[0]  # empty: none declared (Ollama's bare base64 arrives so)
    if media_type and media_type not in DATA_MEDIA_TYPES:
        raise APIError(400, f"{param}: image type {media_type[:40]!r} is not supported (supported: "
                       f"{', '.join(t for t in DATA_MEDIA_TYPES if t != 'image/jpg')})", param=param)
    return ImageSource(param, detail, data=_checked_bytes(_b64decode(data, param, policy), param, policy))


def _b64decode(text: str, param: str, policy: MediaPolicy) -> bytes:
    if len(text) > (policy.max_image_bytes + 2) // 3 * 4 + 4:  # before decoding it
        raise APIError(400, f"{param}: the image is larger than the {policy.max_image_bytes} bytes allowed",
                       param=param)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: the image's base64 is not valid", param=param) from None


def _checked_bytes(data: bytes, param: str, policy: MediaPolicy) -> bytes:
    if len(data) > policy.max_image_bytes:
        raise APIError(400, f"{param}: the image is larger than the {policy.max_image_bytes} bytes allowed",
                       param=param)
    try:
        probe_image_bytes(data)
    except ImageError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
    return data


# -- URLs ------------------------------------------------------------------------------------------

def _check_url(url: str, param: str, policy: MediaPolicy) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL whose host is allowed at that port (the scheme's default port, unless
    the allow-list names another for the host); an IP literal host must also be public."""
    try:
        parts = urlsplit(url)
        default = 443 if parts.scheme.lower() == "https" else 80
        port = parts.port or default
    except ValueError as e:
        raise APIError(400, f"{param}: the image URL is not valid: {e}", param=param) from None
    host = (parts.hostname or "").rstrip(".").lower()
    if not host:
        raise APIError(400, f"{param}: the image URL names no host", param=param)
    if parts.username is not None or parts.password is not None:
        raise APIError(400, f"{param}: an image URL may not carry credentials", param=param)
    if not policy.allowed_domains:
        raise APIError(400, f"{param}: this server fetches no image URLs (--allowed-media-domains is empty); send "
                       "the image as a data: URL", param=param)
    shown = f"[{host}]" if ":" in host else host
    named = f"{shown}:{port}"
    # a host's other ports are other services (Redis, an admin API): each port but the scheme's must be named
    if named not in policy.allowed_domains and not (port == default and host in policy.allowed_domains):
        entries = [d for d in policy.allowed_domains if d == host or d.startswith(f"{shown}:")]
        if not entries:
            raise APIError(400, f"{param}: host {host[:80]!r} is not in --allowed-media-domains", param=param)
        why = (f"allows a host's default port ({default} for {parts.scheme.lower()}) unless it names the port "
               f"({named[:90]})" if host in entries else f"names {', '.join(entries)[:200]}")
        raise APIError(400, f"{param}: port {port} of host {host[:80]!r} is not allowed: --allowed-media-domains "
                       f"{why}", param=param)
    literal = _ip_literal(host)
    if literal is not None:
        _check_address(literal, param, policy)
    return parts.scheme.lower(), host, port


def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host names by itself, in any form a resolver would read it (0x7f000001, 2130706433, 127.1)."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))  # the legacy forms getaddrinfo also accepts
    except OSError:
        return None


def _why_not_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What makes `ip` unfit to fetch from (None: a public address), looking inside addresses that embed IPv4."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in ipaddress.IPv6Network("64:ff9b::/96"):  # NAT64
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            why = _why_not_public(embedded)
            if why is not None:
                return f"{why} (it embeds {embedded})"
    for kind in ("loopback", "link_local", "unspecified", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if not ip.is_global:  # shared address space (100.64/10) and the like
        return "not globally routable"
    return None


def _check_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, param: str, policy: MediaPolicy) -> None:
    why = None if policy.allow_private else _why_not_public(ip)
    if why is not None:
        raise APIError(400, f"{param}: the image URL's address {ip} is {why}; only public addresses are fetched",
                       param=param)


def _resolve(host: str, port: int, param: str, policy: MediaPolicy) -> str:
    """The address to connect to: every address the host resolves to must be public (one bad answer refuses it)."""
    try:
        infos = policy.resolve(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise APIError(400, f"{param}: the image URL's host {host[:80]!r} does not resolve: {e.strerror or e}",
                       param=param) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses:
        raise APIError(400, f"{param}: the image URL's host {host[:80]!r} does not resolve", param=param)
    for ip in addresses:
        _check_address(ip, param, policy)
    return str(addresses[0])


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to one checked address; the Host header (and TLS SNI and certificate check) say `host`."""

    def __init__(self, host: str, port: int, address: str, timeout: float, tls: bool) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address, self._tls = address, tls
        self.pinned: socket.socket | None = None

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        if self._tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.sock = self.pinned = sock  # kept: http.client drops `sock` once the response owns the stream


def fetch_url(url: str, param: str, policy: MediaPolicy, deadline: float | None = None) -> bytes:
    """GET an allowed image URL (blocking: run it off the event loop); its body, or APIError 400. `deadline`
    (time.monotonic): the request's, set when the fetch was queued (default: `policy.timeout` from now)."""
    scheme, host, port = _check_url(url, param, policy)
    deadline = time.monotonic() + policy.timeout if deadline is None else deadline
    if time.monotonic() >= deadline:  # it waited for a thread past its request's deadline (already answered)
        raise _too_slow(param, policy)
    address = _resolve(host, port, param, policy)
    left = deadline - time.monotonic()
    if left <= 0:  # the resolver took it all (fetch_async answered the request already)
        raise _too_slow(param, policy)
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = _PinnedConnection(host, port, address, left, scheme == "https")  # connect and headers within what is left
    try:
        conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "lmserve"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise APIError(400, f"{param}: the image URL answered a redirect ({resp.status}); redirects are not "
                           "followed", param=param)
        if resp.status != 200:
            raise APIError(400, f"{param}: the image URL answered HTTP {resp.status}", param=param)
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > policy.max_image_bytes:
            raise _too_large(param, policy)
        body = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _too_slow(param, policy)
            if conn.pinned is not None:
                conn.pinned.settimeout(left)
            chunk = resp.read1(65536)
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > policy.max_image_bytes:
                raise _too_large(param, policy)
    except (OSError, http.client.HTTPException) as e:  # socket.timeout and ssl.SSLError are OSErrors
        what = "timed out" if isinstance(e, TimeoutError) else f"failed: {type(e).__name__}"
        raise APIError(400, f"{param}: fetching the image URL {what}", param=param) from None
    finally:
        conn.close()


def _too_slow(param: str, policy: MediaPolicy) -> APIError:
    return APIError(400, f"{param}: the image URL took longer than {policy.timeout:g}s", param=param)


class FetchPool:
    """`size` daemon threads that run URL fetches, and a queue of fetches waiting for one.

    Why not the default executor (asyncio.to_thread) with a semaphore: a fetch blocked where no timeout reaches
    (getaddrinfo waits on the system's resolver as long as it likes) outlives the request that gave up on it, so
    its thread stays taken after the semaphore is released; enough slow names would take every thread the other
    requests tokenize and decode on. Here such a fetch can hold only one of these threads. Daemon threads, unlike
    a ThreadPoolExecutor's (joined at exit), never hold up the server's shutdown on a resolver.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        with self._lock:  # threads start as fetches come: a server that fetches nothing starts none
            if len(self._threads) < self.size:
                thread = threading.Thread(target=self._work, name=f"lmserve-fetch-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():  # its request gave up while it waited: skip it
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request, which raises it
                future.set_exception(e)


FETCHES = FetchPool(MAX_FETCHES)


async def fetch_async(source: ImageSource, policy: MediaPolicy) -> bytes:
    """An allowed URL's body, fetched on FETCHES: the whole of it, time waiting for a thread and DNS included, within
    `policy.timeout` (at the deadline the request gets its 400; a thread blocked in the resolver stays blocked,
    holding one of FETCHES' threads until the resolver returns, then finds its deadline passed)."""
    future = FETCHES.submit(fetch_url, source.url or "", source.param, policy, time.monotonic() + policy.timeout)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), policy.timeout)
    except asyncio.TimeoutError:
        future.cancel()  # still queued: it never runs
        raise _too_slow(source.param, policy) from None


def _too_large(param: str, policy: MediaPolicy) -> APIError:
    return APIError(400, f"{param}: the image is larger than the {policy.max_image_bytes} bytes allowed", param=param)


@dataclass(frozen=True)
class FetchedImage:
    """One image's bytes, fetched or from its data: URL, with the size its header declares (nothing decoded yet):
    enough to count the prompt tokens it will take before any pixel is decoded (EngineFront.count_image_tokens)."""

    source: ImageSource
    data: bytes = field(repr=False)
    width: int
    height: int


def _probe(source: ImageSource, data: bytes) -> FetchedImage:
    """`data` with the size its header declares (APIError 400 for a header that does not read)."""
    try:
        _, width, height = probe_image_bytes(data)
    except ImageError as e:
        raise APIError(400, f"{source.param}: {e}", param=source.param) from None
    return FetchedImage(source, data, width, height)


def _decode_all(raw: list[FetchedImage]) -> list[ImageData]:
    out = []
    for image in raw:
        try:
            out.append(load_image_bytes(image.data, detail=image.source.detail))
        except ImageError as e:
            raise APIError(400, f"{image.source.param}: {e}", param=image.source.param) from None
    return out


async def fetch_images(sources: tuple[ImageSource, ...] | list[ImageSource], policy: MediaPolicy) -> list[FetchedImage]:
    """Each source's bytes (URLs fetched one after another on FETCHES, each within `policy.timeout`), each header
    checked and the request's totals of bytes and declared pixels bounded (MAX_REQUEST_PIXELS, MAX_REQUEST_BYTES).
    APIError 400 on the first bad one. One request's URLs take one fetch thread at a time, so a request with many
    slow URLs does not hold every fetch thread."""
    raw, pixels, size = [], 0, 0
    for source in sources:
        data = source.data if source.data is not None else await fetch_async(source, policy)
        image = _probe(source, data)  # a header: cheap, on the loop
        pixels, size = pixels + image.width * image.height, size + len(data)
        if pixels > MAX_REQUEST_PIXELS or size > MAX_REQUEST_BYTES:
            raise APIError(400, f"{source.param}: the request's images hold {pixels} pixels and {size} bytes up to "
                           f"here, more than the {MAX_REQUEST_PIXELS} pixels or {MAX_REQUEST_BYTES} bytes allowed "
                           "in all", param=source.param)
        raw.append(image)
    return raw


async def decode_images(raw: list[FetchedImage]) -> list[ImageData]:
    """Every image decoded, off the event loop (APIError 400 on the first that does not decode)."""
    return await asyncio.to_thread(_decode_all, raw) if raw else []


async def load_images(sources: tuple[ImageSource, ...] | list[ImageSource], policy: MediaPolicy) -> list[ImageData]:
    """fetch_images, then decode_images: no pixel is decoded before the whole request is known to fit."""
    return await decode_images(await fetch_images(sources, policy)) if sources else []


# -- chat messages ---------------------------------------------------------------------------------

def split_images(messages: list[dict], policy: MediaPolicy) -> tuple[list[dict], list[ImageSource]]:
    """OpenAI-shaped messages with each `image_url` part replaced by `{"type": "image"}` (the part HF chat templates
    of vision models render as the image's placeholder), and the images' sources in prompt order."""
    count = sum(_is_image(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])
    if count > MAX_IMAGES:  # counted before any is decoded
        raise APIError(400, f"the request holds {count} images, more than the {MAX_IMAGES} allowed", param="messages")
    sources: list[ImageSource] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        if message.get("role") != "user":
            raise APIError(400, f"messages.{i}: images are accepted in user messages only, not in a "
                           f"{message.get('role')} message", param=f"messages.{i}.content")
        parts = []
        for j, part in enumerate(content):
            if not _is_image(part):
                parts.append(part)
                continue
            ref = part.get("image_url")
            url, detail = (ref.get("url"), ref.get("detail")) if isinstance(ref, dict) else (ref, None)
            sources.append(image_source(url, f"messages.{i}.content.{j}", policy, detail))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, sources


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def image_url_part(url: str, detail: str | None = None) -> dict:
    """The OpenAI chat part every family's image becomes (Anthropic's and Ollama's base64 as a data: URL)."""
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}

