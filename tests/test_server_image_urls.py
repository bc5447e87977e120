"""Image URLs through a real `lmserve serve` of a vision model (the tiny random Idefics3, tests/vision_models.py),
fetched from a real HTTP server on this machine: a URL whose allowed host name resolves to a loopback address, and
a redirect from an allowed host, are each a 400 in every image API's own error shape (OpenAI chat `image_url`,
Responses `input_image`, Anthropic `image` with a `url` source); Ollama's `images` take base64 only, so a URL there
is a 400 and never fetched. After each the server is healthy and answers a canary; at the end every KV block is free.

A text model refuses an image before any fetch (tests/test_server_images.py), so these need a vision model. The
redirect needs a fetch that connects: every address a local server can listen on here is private, so that server is
`lmserve serve` with the tests' `allow_private` switch (tests/serve_private_media.py); the resolver case runs the
plain `lmserve serve`.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest

from tests.server_util import running_server
from tests.test_media import data_url
from tests.vision_models import image_bytes

pytest.importorskip("transformers")
PNG = image_bytes(90, 50, seed=11)
SERVED: list[str] = []  # the paths the local HTTP server was asked for, in order


class _Images(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        SERVED.append(self.path)
        if self.path == "/redirect":  # to a path of the same allowed host: only the redirect itself is wrong
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = PNG if self.path == "/ok.png" else b"no"
        self.send_response(200 if self.path == "/ok.png" else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def images_port():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.vision_models import build_idefics3

    return build_idefics3(tmp_path_factory.mktemp("vlm"))[0]


def _serve(model_dir, allowed: str, **kw):
    return running_server("--model", str(model_dir), "--served-model-name", "vlm", "--dtype", "float32", "--mm-encoder-dtype", "float32",
                          "--max-model-len", "512", "--allowed-media-domains", allowed, **kw)


@pytest.fixture(scope="module")
def guarded(model_dir, images_port):
    """The plain server, `localhost:PORT` allowed: a name that resolves to loopback."""
    with _serve(model_dir, f"localhost:{images_port}") as s:
        yield s
        s.wait_idle()  # every KV block came back


@pytest.fixture(scope="module")
def fetching(model_dir, images_port):
    """The server that fetches from private addresses (tests/serve_private_media.py), `127.0.0.1:PORT` allowed."""
    with _serve(model_dir, f"127.0.0.1:{images_port}", module="tests.serve_private_media") as s:
        yield s
        s.wait_idle()


def chat(server, url: str) -> str:
    """The OpenAI chat 400's message."""
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w1"}]}])
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == "messages.0.content.0"
    return e.value.body["message"]


def responses(server, url: str) -> str:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="vlm", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "w1"}]}])
    assert e.value.body["type"] == "invalid_request_error", e.value.body
    return e.value.body["message"]


def anthropic_url(server, url: str) -> str:
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": "w1"}]}])
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


URL_FAMILIES = [chat, responses, anthropic_url]


def healthy(server) -> None:
    """/health is 200 and a request with an image is answered."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(model="vlm", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(PNG)}}, {"type": "text", "text": "w1"}]}])
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("send", URL_FAMILIES, ids=lambda f: f.__name__)
def test_an_allowed_name_that_resolves_to_loopback_is_a_400_and_never_fetched(guarded, images_port, send):
    SERVED.clear()
    message = send(guarded, f"http://localhost:{images_port}/ok.png")
    assert "loopback" in message and "only public addresses are fetched" in message, message
    assert SERVED == []  # refused after DNS, before any connection
    healthy(guarded)
    guarded.wait_idle()


def test_ollama_images_take_no_url(guarded, images_port):
    """Ollama's `images` are base64: a URL there is bad base64, a 400 in Ollama's shape, and nothing is fetched.
    Raw bodies: the ollama client would read the string as a file path and never send it."""
    SERVED.clear()
    url = f"http://localhost:{images_port}/ok.png"
    for path, body in (("/api/chat", {"model": "vlm", "stream": False, "messages": [
            {"role": "user", "content": "w1", "images": [url]}]}),
            ("/api/generate", {"model": "vlm", "stream": False, "prompt": "w1", "images": [url]})):
        r = httpx.post(guarded.url + path, json=body, timeout=60)
        assert r.status_code == 400 and "base64 is not valid" in r.json()["error"], r.text
    assert SERVED == []
    healthy(guarded)
    guarded.wait_idle()


def test_an_allowed_url_is_fetched_and_answered_as_its_data_url(fetching, images_port):
    """The control for the redirect: through this server a URL of the allowed host is fetched and answered as the
    same bytes in a data: URL are, so the redirect's 400 below is the redirect's."""
    oai = openai.OpenAI(base_url=fetching.url + "/v1", api_key="x", max_retries=0)

    def answer(url: str) -> str:
        return oai.chat.completions.create(model="vlm", max_tokens=8, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w3 w4"}]}]).choices[0].message.content

    SERVED.clear()
    assert answer(f"http://127.0.0.1:{images_port}/ok.png") == answer(data_url(PNG))
    assert SERVED == ["/ok.png"]


@pytest.mark.parametrize("send", URL_FAMILIES, ids=lambda f: f.__name__)
def test_a_redirect_from_an_allowed_host_is_a_400_not_followed(fetching, images_port, send):
    SERVED.clear()
    message = send(fetching, f"http://127.0.0.1:{images_port}/redirect")
    assert "redirect (302)" in message and "not followed" in message, message
    assert SERVED == ["/redirect"]  # its target was never asked for
    healthy(fetching)
    fetching.wait_idle()

