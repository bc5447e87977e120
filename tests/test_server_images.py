"""Images at the API edge, through each family's official client, against a real `lmserve serve` of the embedded
(text-only) model: OpenAI chat `image_url`, Responses `input_image`, Anthropic `image` blocks, Ollama `images` on
/api/chat and /api/generate.

Each family's image parses; a well-formed image gets the text model's 400 (naming the model) in that family's error
shape; a bad reference (corrupt, a bomb, BMP, file://, a private address, a host not allowed, a redirecting URL's
host) gets its own 400, checked before the text-model refusal, so the message says what was wrong. After each bad
request a canary is answered, and at the end every KV block is free.
"""

from __future__ import annotations

import base64

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.server_util import MODEL, running_server
from tests.test_media import data_url, image_bytes, png_bomb

PNG = image_bytes()
B64 = base64.b64encode(PNG).decode()
TEXT_ONLY = f"model '{MODEL}' does not accept images"
BAD = {  # reference -> what the refusal says
    "corrupt": ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode(), "could not be read"),
    "bomb": (data_url(png_bomb()), "pixels"),
    "bmp": (data_url(image_bytes("BMP"), "image/bmp"), "'image/bmp' is not supported"),
    "tiff": ("data:;base64," + base64.b64encode(image_bytes("TIFF")).decode(), "could not be read"),
    "base64": ("data:image/png;base64,%%%", "base64 is not valid"),
    "file": ("file:///etc/passwd", "file: is not accepted"),
    "metadata-ip": ("http://169.254.169.254/latest/meta-data/", "link-local"),
    "loopback-hex": ("http://0x7f000001/a.png", "loopback"),
    "not-allowed": ("https://evil.example/a.png", "not in --allowed-media-domains"),
    "other-port": ("http://images.example:6379/", "port 6379 of host 'images.example' is not allowed"),
    "unnamed-port": ("https://cdn.example:9443/a.png", "port 9443 of host 'cdn.example' is not allowed"),
}


@pytest.fixture(scope="module")
def server():
    with running_server("--allowed-media-domains", "169.254.169.254,0x7f000001",
                        "--allowed-media-domains", "images.example,cdn.example:8443,[2001:4860::8888]:8443") as s:
        yield s
        s.wait_idle()  # every KV block came back


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def olla(server):
    return ollama.Client(host=server.url, timeout=120)


def canary(oai) -> None:
    r = oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].finish_reason in ("length", "stop")


# Each family's request with one image `ref` (a URL or data: URL), sent with its client; returns its error's message.

def openai_chat(clients, ref: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        clients["oai"].chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": ref, "detail": "low"}}]}])
    return e.value.body["message"]


def responses(clients, ref: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        clients["oai"].responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": ref, "detail": "high"}]}])
    return e.value.body["message"]


def anthropic_messages(clients, ref: str) -> str:
    if ref.startswith("data:") and ";base64," in ref:
        media_type, data = ref[5:].split(";base64,", 1)
        source = {"type": "base64", "media_type": media_type or "image/png", "data": data}
    else:
        source = {"type": "url", "url": ref}
    with pytest.raises(anthropic.BadRequestError) as e:
        clients["claude"].messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "Describe it."}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    return e.value.body["error"]["message"]


def _ollama_b64(ref: str) -> str:
    return ref.split(";base64,", 1)[1] if ref.startswith("data:") else ref


def ollama_chat(clients, ref: str) -> str:
    with pytest.raises(ollama.ResponseError) as e:  # the client passes base64 strings as they are
        clients["olla"].chat(model=MODEL, messages=[{"role": "user", "content": "Describe it.",
                                                      "images": [_ollama_b64(ref)]}])
    assert e.value.status_code == 400
    return e.value.error


def ollama_generate(clients, ref: str) -> str:
    with pytest.raises(ollama.ResponseError) as e:
        clients["olla"].generate(model=MODEL, prompt="Describe it.", images=[_ollama_b64(ref)])
    assert e.value.status_code == 400
    return e.value.error


FAMILIES = [openai_chat, responses, anthropic_messages, ollama_chat, ollama_generate]
URL_FAMILIES = [openai_chat, responses, anthropic_messages]  # Ollama's images are base64 only


@pytest.fixture(scope="module")
def clients(oai, claude, olla):
    return {"oai": oai, "claude": claude, "olla": olla}


@pytest.mark.parametrize("send", FAMILIES, ids=lambda f: f.__name__)
def test_an_image_to_a_text_model_is_a_400_naming_the_model(clients, send):
    for ref in (data_url(PNG), data_url(image_bytes("JPEG"), "image/jpeg"), data_url(image_bytes("WEBP"), "image/webp")):
        message = send(clients, ref)
        assert TEXT_ONLY in message, message
    canary(clients["oai"])


@pytest.mark.parametrize("send", FAMILIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [k for k, (ref, _) in BAD.items() if ref.startswith("data:")])
def test_bad_images_are_400s_in_each_shape(clients, send, bad):
    ref, says = BAD[bad]
    if send in (ollama_chat, ollama_generate) and bad == "bmp":  # bare base64 declares no type: Pillow's check says
        says = "could not be read"
    message = send(clients, ref)
    assert says in message and TEXT_ONLY not in message, message
    canary(clients["oai"])


@pytest.mark.parametrize("send", URL_FAMILIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [k for k, (ref, _) in BAD.items() if not ref.startswith("data:")])
def test_bad_urls_are_400s_in_each_shape(clients, send, bad):
    ref, says = BAD[bad]
    message = send(clients, ref)
    assert says in message and TEXT_ONLY not in message, message
    canary(clients["oai"])


def test_an_allowed_public_url_is_not_fetched_for_a_text_model(clients):
    """images.example is allowed but does not resolve: the text model refuses before any fetch (a fetch would say
    the host does not resolve). So are the ports the flag names (host:port, [IPv6]:port)."""
    for send in URL_FAMILIES:
        for url in ("https://images.example/cat.png", "https://cdn.example:8443/cat.png",
                    "https://[2001:4860::8888]:8443/cat.png"):
            assert TEXT_ONLY in send(clients, url)


def test_image_shapes_each_family_accepts(server):
    """Raw bodies: OpenAI's image_url as a bare string, Anthropic's count_tokens, Ollama's data: URL in images, and
    the shapes each refuses (an image in an assistant turn, a Responses file_id, a bad detail)."""
    url = server.url
    ok_chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": data_url(PNG)}]}]}
    r = httpx.post(url + "/v1/chat/completions", json=ok_chat, timeout=60)
    assert r.status_code == 400 and TEXT_ONLY in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}]}]}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error" and TEXT_ONLY in r.json()["error"]["message"]
    r = httpx.post(url + "/api/chat", json={"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "x", "images": [data_url(PNG)]}]}, timeout=60)
    assert r.status_code == 400 and TEXT_ONLY in r.json()["error"]
    refused = [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": data_url(PNG)}}]}, {"role": "user", "content": "hi"}]},
         "user messages only"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "ultra"}}]}]}, "messages.0.content"),
        ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]}, "input.0.content"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}]},
            {"role": "user", "content": "hi"}]}, "user messages only"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}, "source must be"),
        ("/api/chat", {"model": MODEL, "stream": False, "messages": [{"role": "assistant", "content": "x",
                                                                      "images": [B64]}]}, "user messages only"),
        ("/api/generate", {"model": MODEL, "stream": False, "prompt": "x", "raw": True, "images": [B64]}, TEXT_ONLY),
    ]
    for path, body, says in refused:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and says in r.text, (path, r.text)
