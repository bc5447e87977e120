"""server/media.py: image references from data: and http(s) URLs, against a real HTTP server on 127.0.0.1.

The local server is loopback, so every fetch from it is refused unless the test-only `allow_private` is set; the
other checks (redirects, size, time, pinned address) run with it set. Bad images (a declared-size bomb, corrupt bytes,
BMP/TIFF) are refused from the data: URL before any pixel is decoded, or at decode for a body that breaks later.
"""

from __future__ import annotations

import asyncio
import base64
import io
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
    policy = MediaPolicy(allowed_domains=("localhost",))
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


def load(url: str, policy: MediaPolicy) -> ImageData:
    return asyncio.run(load_images([image_source(url, "p", policy)], policy))[0]


def test_the_local_server_is_refused_as_loopback(local):
    policy = MediaPolicy(allowed_domains=("127.0.0.1",))
    assert "loopback" in refused(load, f"{local}/ok.png", policy)


def test_a_fetch_from_an_allowed_host(local):
    img = load(f"{local}/ok.png", OPEN)
    assert img.image.size == (8, 6)


def test_redirects_are_refused_not_followed(local):
    _Handler.hosts.clear()
    assert "redirect (302)" in refused(load, f"{local}/redirect", OPEN)
    assert len(_Handler.hosts) == 1  # the target was never asked


def test_oversize_bodies_are_refused(local):
    assert "larger than" in refused(load, f"{local}/big.png", OPEN)  # by Content-Length
    assert "larger than" in refused(load, f"{local}/big-unsized.png", OPEN)  # while reading


def test_the_whole_fetch_has_a_time_limit(local):
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private=True, timeout=0.5)
    start = time.monotonic()
    message = refused(load, f"{local}/slow.png", policy)
    assert "longer than 0.5s" in message or "timed out" in message
    assert time.monotonic() - start < 10  # the drip would take 50 s


def test_a_fetched_bomb_and_errors_are_refused(local):
    assert f"{100_000 * 100_000} pixels" in refused(load, f"{local}/bomb.png", OPEN)
    assert "HTTP 404" in refused(load, f"{local}/missing.png", OPEN)


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
