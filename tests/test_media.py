"""server/media.py: image references from data: and http(s) URLs, against a real HTTP server on 127.0.0.1.

The local server is loopback, so every fetch from it is refused unless the test-only `allow_private` is set; the
other checks (redirects, size, time, pinned address) run with it set. Bad images (a declared-size bomb, corrupt bytes,
BMP/TIFF) are refused from the data: URL before any pixel is decoded, or at decode for a body that breaks later.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from lmserve.multimodal.image_io import ImageData
from lmserve.server.errors import APIError
from lmserve.server.media import (
    MediaPolicy,
    _PinnedConnection,
    fetch_url,
    image_source,
    image_url_part,
    load_images,
    split_images,
)


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), color=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A tiny PNG whose IHDR declares width x height (its CRC fixed, so only the size gives it away)."""
    png = bytearray(image_bytes())
    ihdr = png.index(b"IHDR")
    png[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    png[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(png[ihdr:ihdr + 17])))
    return bytes(png)


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(APIError) as e:
        fn(*args, **kwargs)
    assert e.value.status == 400
    return e.value.message


PNG = image_bytes()
OPEN = MediaPolicy(allowed_domains=("127.0.0.1", "localhost", "images.example"), allow_private=True, timeout=2.0,
                   max_image_bytes=64 * 1024)


# -- data: URLs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                            ("GIF", "image/gif")])
def test_data_urls_of_each_format_load(fmt, media_type):
    data = image_bytes(fmt, (5, 7))
    src = image_source(data_url(data, media_type), "p", MediaPolicy(), "low")
    [img] = asyncio.run(load_images([src], MediaPolicy()))
    assert isinstance(img, ImageData) and img.image.size == (5, 7) and img.image.mode == "RGB"
    assert img.detail == "low" and img.digest == __import__("hashlib").sha256(data).hexdigest()


def test_a_data_url_without_a_type_is_read_from_its_bytes():  # Ollama's bare base64 arrives so
    src = image_source(f"data:;base64,{base64.b64encode(PNG).decode()}", "p", MediaPolicy())
    assert src.data == PNG


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,!!!notbase64", "base64 is not valid"),
    ("data:image/png,rawbytes", "data:<image type>;base64"),
    ("data:text/plain;base64,aGVsbG8=", "'text/plain' is not supported"),
    ("data:image/bmp;base64," + base64.b64encode(image_bytes("BMP")).decode(), "'image/bmp' is not supported"),
    ("data:;base64," + base64.b64encode(image_bytes("BMP")).decode(), "could not be read"),
    ("data:;base64," + base64.b64encode(image_bytes("TIFF")).decode(), "could not be read"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode(), "could not be read"),
    ("data:image/png;base64,", "empty"),
])
def test_bad_data_urls_are_refused_before_decoding(url, words):
    assert words in refused(image_source, url, "messages.0.content.1", MediaPolicy())


@pytest.mark.parametrize("width,height", [(100_000, 100_000), (9_000, 9_000)])
def test_a_decompression_bomb_is_refused_from_its_header_fast(width, height):
    start = time.process_time()
    message = refused(image_source, data_url(png_bomb(width, height)), "p", MediaPolicy())
    # Pillow's own bomb check names the pixel count; below it, image_io's names the dimensions
    assert f"{width * height} pixels" in message or f"{width}x{height}" in message
    assert time.process_time() - start < 0.5  # nothing decoded


def test_an_image_past_max_image_bytes_is_refused_before_decoding():
    policy = MediaPolicy(max_image_bytes=100)
    noise = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(noise, format="PNG")
    assert len(noise.getvalue()) > 100
    assert "larger than the 100 bytes" in refused(image_source, data_url(noise.getvalue()), "p", policy)


def test_corrupt_pixel_data_is_refused_at_decode():
    png = bytearray(image_bytes(size=(32, 32)))
    idat = png.index(b"IDAT")
    png[idat + 8:idat + 20] = b"\xff" * 12  # the header reads, the compressed pixels do not
    src = image_source(data_url(bytes(png)), "p", MediaPolicy())
    with pytest.raises(APIError, match="could not be decoded"):
        asyncio.run(load_images([src], MediaPolicy()))


def test_a_request_s_images_are_bounded_in_all_before_any_is_decoded():
    """Each image below the per-image limit (64 M pixels), two together above the request's: refused from their
    headers, so a few kilobytes of PNG cannot make the server decode gigabytes (64 such images: ~12 GB as RGB)."""
    from lmserve.server.media import MAX_REQUEST_PIXELS

    big = png_bomb(8000, 5000)  # 40 M pixels declared, a few hundred bytes sent
    sources = [image_source(data_url(big), f"messages.0.content.{i}", MediaPolicy()) for i in range(2)]
    with pytest.raises(APIError) as e:
        asyncio.run(load_images(sources, MediaPolicy()))
    assert e.value.status == 400 and e.value.param == "messages.0.content.1"
    assert f"more than the {MAX_REQUEST_PIXELS} pixels" in e.value.message


@pytest.mark.parametrize("ref", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://x", "/etc/passwd",
                                 "javascript:alert(1)", "C:\\\\x.png", ""])
def test_other_schemes_are_refused(ref):
    message = refused(image_source, ref, "p", OPEN)
    assert "data: URL" in message


def test_bad_detail_is_refused():
    assert "detail must be one of" in refused(image_source, data_url(PNG), "p", MediaPolicy(), "ultra")


# -- URLs: the allow-list and addresses -----------------------------------------------------------

def test_no_url_is_fetched_by_default():
    assert "--allowed-media-domains is empty" in refused(image_source, "https://example.com/a.png", "p", MediaPolicy())


def test_a_host_outside_the_allow_list_is_refused():
    policy = MediaPolicy(allowed_domains=("images.example",))
    assert "'evil.example' is not in --allowed-media-domains" in refused(
        image_source, "https://evil.example/a.png", "p", policy)
    assert "credentials" in refused(image_source, "https://u:p@images.example/a.png", "p", policy)


@pytest.mark.parametrize("entry,url,ok", [
    ("images.example", "http://images.example/a.png", True), ("images.example", "https://images.example/a.png", True),
    ("images.example", "http://images.example:80/a.png", True), ("images.example", "https://images.example:443/", True),
    ("images.example", "http://images.example:6379/", False), ("images.example", "http://images.example:443/", False),
    ("images.example", "https://images.example:80/", False), ("images.example", "https://images.example:8443/", False),
    ("images.example:8443", "https://images.example:8443/a.png", True),
    ("images.example:8443", "https://images.example/a.png", False),  # a named port is that port only
    ("images.example:8443", "http://images.example:6379/", False),
    ("images.example:80", "http://images.example/a.png", True),
    ("8.8.8.8", "http://8.8.8.8/a.png", True), ("8.8.8.8", "http://8.8.8.8:8080/a.png", False),
    ("8.8.8.8:8080", "http://8.8.8.8:8080/a.png", True),
    ("2001:4860::8888", "http://[2001:4860::8888]/a.png", True), ("2001:4860::8888", "http://[2001:4860::8888]:8080/", False),
    ("[2001:4860::8888]:8080", "http://[2001:4860::8888]:8080/a.png", True),
    ("[2001:4860::8888]:8080", "http://[2001:4860::8888]/a.png", False),
])
def test_only_the_scheme_s_default_port_unless_the_entry_names_one(entry, url, ok):
    """`--allowed-media-domains example.com` is not every service on that host (`http://example.com:6379/` is
    Redis): a bare entry allows the scheme's default port (80 for http, 443 for https), `host:port` that port."""
    from lmserve.server.listen import allowed_entry

    policy = MediaPolicy(allowed_domains=(allowed_entry(entry),))
    if ok:
        assert image_source(url, "p", policy).url == url
    else:
        message = refused(image_source, url, "p", policy)
        assert "is not allowed" in message or "is not in --allowed-media-domains" in message


def test_a_refused_port_says_how_to_allow_it():
    message = refused(image_source, "http://images.example:6379/", "p", MediaPolicy(allowed_domains=("images.example",)))
    assert "port 6379 of host 'images.example' is not allowed" in message
    assert "default port (80 for http) unless it names the port (images.example:6379)" in message
    policy = MediaPolicy(allowed_domains=("images.example:8443", "[2001:4860::8888]:8443"))
    message = refused(image_source, "https://images.example:9443/", "p", policy)
    assert "port 9443 of host 'images.example' is not allowed: --allowed-media-domains names images.example:8443" \
        in message
    assert "names [2001:4860::8888]:8443" in refused(image_source, "https://[2001:4860::8888]/", "p", policy)


@pytest.mark.parametrize("entry,normal", [
    ("Images.Example.", "images.example"), ("images.example:8443", "images.example:8443"), ("10.0.0.1", "10.0.0.1"),
    ("10.0.0.1:80", "10.0.0.1:80"), ("[2001:DB8::1]", "2001:db8::1"), ("2001:db8::1", "2001:db8::1"),
    ("[2001:db8::1]:8443", "[2001:db8::1]:8443"), ("0x7f000001", "0x7f000001"),
])
def test_allow_list_entries_are_read_as_host_or_host_port(entry, normal):
    from lmserve.server.listen import allowed_entry

    assert allowed_entry(entry) == normal


@pytest.mark.parametrize("entry,words", [
    ("https://cdn.example/x", "not URLs"), ("*.example", "patterns"), ("images.example:0", "port '0'"),
    ("images.example:http", "port 'http'"), ("images.example:70000", "port '70000'"), (":443", "names no host"),
    ("[2001:db8::1]x", "[address]:port"), ("[not-v6]:80", "not an IPv6 address"), ("a:b:c", "not an IPv6 address"),
])
def test_bad_allow_list_entries_are_refused(entry, words):
    from lmserve.server.listen import allowed_entry

    with pytest.raises(ValueError, match=re.escape(words)):
        allowed_entry(entry)


@pytest.mark.parametrize("host,shown,why", [
    ("10.1.2.3", "10.1.2.3", "private"), ("192.168.0.1", "192.168.0.1", "private"),
    ("169.254.169.254", "169.254.169.254", "link-local"), ("127.0.0.1", "127.0.0.1", "loopback"),
    ("[::1]", "::1", "loopback"), ("0x7f000001", "127.0.0.1", "loopback"), ("2130706433", "127.0.0.1", "loopback"),
    ("127.1", "127.0.0.1", "loopback"), ("0177.0.0.1", "127.0.0.1", "loopback"),
    ("[::ffff:127.0.0.1]", "127.0.0.1", "loopback"), ("[::ffff:a9fe:a9fe]", "169.254.169.254", "link-local"),
    ("[2002:7f00:1::]", "127.0.0.1", "loopback"), ("[64:ff9b::a00:1]", "10.0.0.1", "private"),
    ("[fe80::1]", "fe80::1", "link-local"), ("[fd00::1]", "fd00::1", "private"), ("0.0.0.0", "0.0.0.0", "unspecified"),
    ("224.0.0.1", "224.0.0.1", "multicast"), ("100.64.0.1", "100.64.0.1", "not globally routable"),
])
def test_private_ip_literals_are_refused_even_when_allowed(host, shown, why):
    name = host.strip("[]")
    policy = MediaPolicy(allowed_domains=(name,))
    message = refused(image_source, f"http://{host}/latest/meta-data/", "p", policy)
    assert why in message and shown in message


def test_a_name_that_resolves_to_loopback_is_refused_at_fetch():
    policy = MediaPolicy(allowed_domains=("localhost:9",))
    src = image_source("http://localhost:9/a.png", "p", policy)  # no network yet: a name is resolved at fetch
    assert src.url is not None
    assert "loopback" in refused(fetch_url, src.url, "p", policy)


# -- URLs: a real server ---------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        _Handler.hosts.append(self.headers.get("Host", ""))
        if self.path == "/ok.png":
            self._send(200, PNG)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/big.png":
            self._send(200, b"\x89PNG" + b"\0" * 100_000)
        elif self.path == "/big-unsized.png":  # no Content-Length: cut while reading
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"\0" * 10_000)
        elif self.path == "/slow.png":  # a drip: each byte in time, the whole too late
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):
                try:
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.05)
        elif self.path == "/bomb.png":
            self._send(200, png_bomb())
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def local():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def opened(local: str, **kw) -> MediaPolicy:
    """OPEN, with the local server's host:port allowed (a host's other ports than 80/443 must be named)."""
    return MediaPolicy(**{"allowed_domains": (local.split("//")[1],), "allow_private": True, "timeout": 2.0,
                          "max_image_bytes": 64 * 1024, **kw})


def load(url: str, policy: MediaPolicy) -> ImageData:
    return asyncio.run(load_images([image_source(url, "p", policy)], policy))[0]


def test_the_local_server_is_refused_as_loopback(local):
    policy = MediaPolicy(allowed_domains=(local.split("//")[1],))
    assert "loopback" in refused(load, f"{local}/ok.png", policy)


def test_a_fetch_from_an_allowed_host(local):
    img = load(f"{local}/ok.png", opened(local))
    assert img.image.size == (8, 6)


def test_redirects_are_refused_not_followed(local):
    _Handler.hosts.clear()
    assert "redirect (302)" in refused(load, f"{local}/redirect", opened(local))
    assert len(_Handler.hosts) == 1  # the target was never asked


def test_oversize_bodies_are_refused(local):
    assert "larger than" in refused(load, f"{local}/big.png", opened(local))  # by Content-Length
    assert "larger than" in refused(load, f"{local}/big-unsized.png", opened(local))  # while reading


def test_the_whole_fetch_has_a_time_limit(local):
    policy = opened(local, timeout=0.5)
    start = time.monotonic()
    message = refused(load, f"{local}/slow.png", policy)
    assert "longer than 0.5s" in message or "timed out" in message
    assert time.monotonic() - start < 10  # the drip would take 50 s


def test_a_fetched_bomb_and_errors_are_refused(local):
    assert f"{100_000 * 100_000} pixels" in refused(load, f"{local}/bomb.png", opened(local))
    assert "HTTP 404" in refused(load, f"{local}/missing.png", opened(local))


def test_the_connection_goes_to_the_checked_address(local):
    """A pinned connection reaches the address that was checked, whatever the name now resolves to; the Host header
    still names the host (so a DNS answer changed after the check, rebinding, reaches nothing else)."""
    port = int(local.rsplit(":", 1)[1])
    _Handler.hosts.clear()
    conn = _PinnedConnection("images.example", port, "127.0.0.1", 2.0, tls=False)  # the name does not resolve
    conn.request("GET", "/ok.png")
    assert conn.getresponse().read() == PNG
    conn.close()
    assert _Handler.hosts == [f"images.example:{port}"]


# -- chat messages ---------------------------------------------------------------------------------

def test_split_images_keeps_order_and_leaves_placeholders():
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, image_url_part(data_url(PNG), "high"),
                                             {"type": "image_url", "image_url": data_url(image_bytes("GIF"), "image/gif")}]}]
    out, sources = split_images(messages, MediaPolicy())
    assert out[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]
    assert [s.param for s in sources] == ["messages.1.content.1", "messages.1.content.2"]
    assert [s.detail for s in sources] == ["high", "auto"] and out[0] is messages[0]


def test_images_outside_user_messages_are_refused():
    messages = [{"role": "assistant", "content": [image_url_part(data_url(PNG))]}]
    assert "user messages only" in refused(split_images, messages, MediaPolicy())


def test_too_many_images_are_refused_before_any_is_read():
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}  # each would be its own 400
    assert "65 images, more than the 64 allowed" in refused(
        split_images, [{"role": "user", "content": [bad] * 65}], MediaPolicy())


# -- slow hosts and resolvers: each fetch ends at its deadline, and fetches never take the default executor -------

@pytest.fixture
def hung():
    """A TCP server on 127.0.0.1 that accepts every connection, reads what comes and never answers (a host that
    hangs): its port, and [connections open now, the most ever open at once], counted at each accept."""
    import select
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    live, conns = [0, 0], []

    def drain(conn) -> None:
        try:
            while conn.recv(4096):  # b"": the client closed it
                pass
        except OSError:
            pass

    def open_now() -> int:
        """Connections whose client has not closed them, as the kernel has it now (POLLRDHUP: the client's FIN, even
        behind unread bytes). A reading thread may see a close only after the same fetch thread's next connect."""
        poll = select.poll()
        for c in conns:
            poll.register(c, select.POLLRDHUP)
        gone = {fd for fd, ev in poll.poll(0) if ev & (select.POLLRDHUP | select.POLLHUP)}
        return sum(c.fileno() not in gone for c in conns)

    def serve() -> None:
        while True:
            try:
                conn = server.accept()[0]
            except OSError:
                return
            conns.append(conn)
            live[0] = open_now()
            live[1] = max(live[1], live[0])
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], live
    server.close()
    for conn in conns:
        conn.close()


def _flood(urls: list[str], policy: MediaPolicy) -> tuple[list, float, list[float]]:
    """Load each URL as its own request, all at once, while a canary runs as many short jobs on the default executor
    as it has threads (tokenizing and decoding run there): (each request's outcome, when the canary ended, when each
    request ended), times from the start."""

    async def main():
        start = time.monotonic()
        ended: list[float] = []

        async def one(url: str):
            try:
                return await load_images([image_source(url, "p", policy)], policy)
            except APIError as e:
                return e
            finally:
                ended.append(time.monotonic() - start)

        async def canary() -> float:
            n = min(32, (os.cpu_count() or 1) + 4)  # the default executor's threads (ThreadPoolExecutor's default)
            await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.05) for _ in range(n)))
            return time.monotonic() - start

        results = asyncio.gather(*(one(u) for u in urls))
        await asyncio.sleep(0.2)  # every fetch has started or queued
        done = await canary()
        return await results, done, ended

    return asyncio.run(main())


def test_a_resolver_that_never_answers_holds_only_the_fetch_threads():
    """3x MAX_FETCHES requests for a name whose resolver never answers (the policy's resolver: a stand-in, since the
    machine's resolver cannot be made to hang from a test): each request is a 400 at its deadline, DNS included;
    no more than MAX_FETCHES fetches are ever inside the resolver; and meanwhile the default executor runs a full
    burst of other work (with the fetches on it, they would hold every one of its threads)."""
    from lmserve.server.media import FETCHES, MAX_FETCHES

    release, lock = threading.Event(), threading.Lock()
    inside, peak = [0], [0]

    def resolver(host, port, **kw):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        try:
            release.wait(60)
            raise OSError("no answer")
        finally:
            with lock:
                inside[0] -= 1

    policy = MediaPolicy(allowed_domains=("slow-dns.example",), timeout=1.5, resolve=resolver)
    try:
        results, canary_done, ended = _flood(["http://slow-dns.example/a.png"] * (3 * MAX_FETCHES), policy)
    finally:
        release.set()
    assert all(isinstance(r, APIError) and "took longer than 1.5s" in r.message for r in results), results
    assert canary_done < 1.5 <= min(ended)  # the canary ran while every fetch still hung
    assert max(ended) < 1.5 + 3  # queued fetches end at their deadline too, not after the ones ahead of them
    assert peak[0] == MAX_FETCHES and len(FETCHES._threads) <= MAX_FETCHES
    deadline = time.monotonic() + 10
    while inside[0] and time.monotonic() < deadline:  # released: the threads come back
        time.sleep(0.01)
    assert inside[0] == 0


def test_a_host_that_never_answers_holds_only_the_fetch_threads(hung):
    """The same against a real socket that accepts and never answers (no DNS: an IP literal): each request a 400 at
    its deadline, never more than MAX_FETCHES connections open at once, and the default executor free meanwhile."""
    from lmserve.server.media import MAX_FETCHES

    port, live = hung
    policy = MediaPolicy(allowed_domains=(f"127.0.0.1:{port}",), allow_private=True, timeout=1.5)
    results, canary_done, ended = _flood([f"http://127.0.0.1:{port}/a.png"] * (3 * MAX_FETCHES), policy)
    assert all(isinstance(r, APIError) and ("took longer than 1.5s" in r.message or "timed out" in r.message)
               for r in results), results
    assert canary_done < 1.5 <= min(ended) and max(ended) < 1.5 + 3
    assert live[1] == MAX_FETCHES
