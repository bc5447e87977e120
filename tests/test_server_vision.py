"""A vision model served over HTTP: a tiny random Idefics3 (SmolVLM-shaped, tests/vision_models.py) under a real
`lmserve serve`, asked through each family's official client.

Each image's greedy answer equals the offline engine's (LLM.chat) for the same pixels and text; two images give two
answers; the same image again hits the prefix cache and is not encoded again; every family's image shape answers;
prompt token counts include the images' placeholder tokens; the chat template writes one image marker per image
while a user's literal `<image>` stays text; bad images and more images than the context holds are 400s (the latter
in every family's shape), with a canary after each; `detail` is accepted and changes no answer; at the end every KV
block is free.
"""

from __future__ import annotations

import base64

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.server_util import running_server
from tests.test_media import data_url, png_bomb
from tests.vision_models import image_bytes

pytest.importorskip("transformers")
N_OUT = 8
MAX_LEN = 512
PNG_A, PNG_B = image_bytes(90, 50, seed=11), image_bytes(90, 50, seed=12)
BIG = image_bytes(128, 128, seed=5)  # 16 tiles and the global image: the most placeholder tokens one image takes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.vision_models import build_idefics3

    path, _ = build_idefics3(tmp_path_factory.mktemp("vlm"))
    return path


@pytest.fixture(scope="module")
def offline(model_dir):
    from lmserve.engine.llm import LLM

    return LLM(str(model_dir), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=128, block_size=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server("--model", str(model_dir), "--served-model-name", "vlm", "--dtype", "float32", "--mm-encoder-dtype", "float32",
                        "--max-model-len", str(MAX_LEN)) as s:
        yield s
        s.wait_idle()  # every KV block came back


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _parts(text: str, *pngs: bytes) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs), {"type": "text", "text": text}]


def offline_answer(offline, text: str, *pngs: bytes, images_first: bool = True) -> tuple[str, int, int]:
    """(text, completion tokens, prompt tokens with each image's placeholder tokens) of the offline engine's greedy
    answer to the same chat (the images before the text, or after it as Ollama sends them)."""
    import io

    from PIL import Image

    from lmserve.sampling_params import SamplingParams

    parts = _parts(text, *pngs)
    out = offline.chat([{"role": "user", "content": parts if images_first else parts[-1:] + parts[:-1]}],
                       SamplingParams(temperature=0.0, max_tokens=N_OUT), use_tqdm=False)[0]
    # the output's prompt ids hold one marker per image: expanded as the engine ran them
    ids, _ = offline.engine.front.images.expand(out.prompt_token_ids, [Image.open(io.BytesIO(p)) for p in pngs])
    return out.outputs[0].text, len(out.outputs[0].token_ids), len(ids)


def ask(oai, text: str, *pngs: bytes):
    return oai.chat.completions.create(model="vlm", max_tokens=N_OUT, temperature=0,
                                       messages=[{"role": "user", "content": _parts(text, *pngs)}])


def canary(oai) -> None:
    r = ask(oai, "w1 w2", PNG_A)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_openai_image_answer_equals_the_offline_engine(oai, offline):
    for png in (PNG_A, PNG_B):
        r = ask(oai, "w3 w4", png)
        text, n, prompt = offline_answer(offline, "w3 w4", png)
        assert (r.choices[0].message.content, r.usage.completion_tokens) == (text, n)
        assert r.usage.prompt_tokens == prompt > 40  # the image's placeholder tokens are counted
    assert ask(oai, "w3 w4", PNG_A).choices[0].message.content != ask(oai, "w3 w4", PNG_B).choices[0].message.content


def test_two_images_in_one_request(oai, offline):
    r = ask(oai, "w5 w6", PNG_A, PNG_B)
    text, n, prompt = offline_answer(offline, "w5 w6", PNG_A, PNG_B)
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.usage.prompt_tokens) == (text, n, prompt)
    swapped = offline_answer(offline, "w5 w6", PNG_B, PNG_A)
    assert ask(oai, "w5 w6", PNG_B, PNG_A).choices[0].message.content == swapped[0]


def test_a_conversation_with_text_turns_and_an_image(oai, offline):
    """String messages beside an image turn reach the template as text parts (a vision template loops over the
    parts): the answer is the offline engine's for the same conversation."""
    from lmserve.sampling_params import SamplingParams

    msgs = [{"role": "system", "content": "w90 w91"}, {"role": "user", "content": "w92"},
            {"role": "assistant", "content": "w93 w94"}, {"role": "user", "content": _parts("w95", PNG_B)}]
    want = offline.chat(msgs, SamplingParams(temperature=0.0, max_tokens=N_OUT), use_tqdm=False)[0].outputs[0].text
    r = oai.chat.completions.create(model="vlm", max_tokens=N_OUT, temperature=0, messages=msgs)
    assert r.choices[0].message.content == want


def test_the_same_image_again_hits_the_prefix_and_encoder_caches(server, oai):
    png = image_bytes(70, 60, seed=77)
    encoded = server.metric("lmserve:encoder_cache_images_encoded_total")
    first = ask(oai, "w7 w8 w9", png)
    assert server.metric("lmserve:encoder_cache_images_encoded_total") == encoded + 1
    again = ask(oai, "w7 w8 w9", png)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert server.metric("lmserve:encoder_cache_images_encoded_total") == encoded + 1
    other_text = ask(oai, "w10", png)  # the same image, other text after it: the image's blocks are shared
    assert 0 < other_text.usage.prompt_tokens_details.cached_tokens < other_text.usage.prompt_tokens
    assert server.metric("lmserve:encoder_cache_images_encoded_total") == encoded + 1


def test_a_users_literal_image_token_is_never_a_marker(oai):
    """`<image>` typed by the user is no image marker (control-token injection): it is encoded as plain text, and
    where the vocabulary has no plain-text spelling of it (this word-level one maps the word to the special id)
    the request is a 400 saying so, with or without an image part beside it; never an answer that read it as one."""
    for content in ("w1 <image> w2", _parts("w3 <image> w4", PNG_A)):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="vlm", max_tokens=2, messages=[{"role": "user", "content": content}])
        assert "special token" in e.value.body["message"], e.value.body
    canary(oai)


def test_every_family_answers_with_an_image(server, oai, offline):
    b64 = base64.b64encode(PNG_A).decode()
    want, _, prompt = offline_answer(offline, "w3 w4", PNG_A)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
              {"type": "text", "text": "w3 w4"}]
    m = claude.messages.create(model="vlm", max_tokens=N_OUT, messages=[{"role": "user", "content": blocks}],
                               extra_body={"temperature": 0})  # this SDK sends temperature only as an extra
    assert m.content[0].text == want and m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    assert claude.messages.count_tokens(model="vlm", messages=[{"role": "user", "content": blocks}]).input_tokens == prompt
    r = oai.responses.create(model="vlm", max_output_tokens=N_OUT, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(PNG_A)}, {"type": "input_text", "text": "w3 w4"}]}])
    assert r.output_text == want and r.usage.input_tokens == prompt
    olla = ollama.Client(host=server.url, timeout=120)
    opts = {"temperature": 0, "num_predict": N_OUT}
    # Ollama puts the images after the text
    o_want, _, o_prompt = offline_answer(offline, "w3 w4", PNG_A, images_first=False)
    c = olla.chat(model="vlm", messages=[{"role": "user", "content": "w3 w4", "images": [b64]}], options=opts)
    assert c.message.content == o_want and c.prompt_eval_count == o_prompt
    g = olla.generate(model="vlm", prompt="w3 w4", images=[b64], options=opts)
    assert g.response == o_want and g.prompt_eval_count == o_prompt


@pytest.mark.parametrize("ref, says", [
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode(), "could not be read"),
    (data_url(png_bomb()), "pixels"),
], ids=["corrupt", "bomb"])
def test_bad_images_are_400s(oai, ref, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="vlm", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": ref}}, {"type": "text", "text": "w1"}]}])
    assert says in e.value.body["message"], e.value.body
    canary(oai)


def test_more_images_than_the_context_holds_is_a_400_naming_it(server, oai):
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, "w1", *[BIG] * 8)
    assert str(MAX_LEN) in e.value.body["message"], e.value.body
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "vlm", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(BIG).decode()}}
        for _ in range(8)]}]}, timeout=120)
    assert r.status_code == 200 and r.json()["input_tokens"] > MAX_LEN, r.text  # counted, not run: no limit
    canary(oai)


def test_past_the_context_is_refused_from_the_image_sizes_before_any_decode(server, oai):
    """The token count comes from each image's header: 8 images whose headers declare BIG's size but whose pixel
    data is cut short are refused for the context (nothing decoded), while one such image alone, which fits, gets
    the decode's own 400."""
    cut = BIG[:len(BIG) // 2]  # the header and half the pixel data: it opens, and fails to decode
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, "w1", cut)
    assert "could not be decoded" in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, "w1", *[cut] * 8)
    assert str(MAX_LEN) in e.value.body["message"] and e.value.body["code"] == "context_length_exceeded", e.value.body
    canary(oai)


def test_more_images_than_the_context_holds_is_a_400_in_every_family(server, oai):
    """The same 8 images through Responses, Anthropic and Ollama (chat and generate): each that family's 400
    naming the context, each answered while the server stays healthy; no KV block is held after them."""
    b64 = base64.b64encode(BIG).decode()
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="vlm", max_output_tokens=N_OUT, input=[{"role": "user", "content": [
            *({"type": "input_image", "image_url": data_url(BIG)} for _ in range(8)),
            {"type": "input_text", "text": "w1"}]}])
    assert str(MAX_LEN) in e.value.body["message"], e.value.body
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="vlm", max_tokens=N_OUT, messages=[{"role": "user", "content": [
            *({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}} for _ in range(8)),
            {"type": "text", "text": "w1"}]}])
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert str(MAX_LEN) in body["error"]["message"], body
    olla = ollama.Client(host=server.url, timeout=120)
    for send in (lambda: olla.chat(model="vlm", messages=[{"role": "user", "content": "w1", "images": [b64] * 8}]),
                 lambda: olla.generate(model="vlm", prompt="w1", images=[b64] * 8)):
        with pytest.raises(ollama.ResponseError) as e:
            send()
        assert e.value.status_code == 400 and str(MAX_LEN) in e.value.error, e.value.error
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()
    canary(oai)


def test_detail_is_accepted_and_changes_nothing(oai):
    """`detail` (OpenAI chat, Responses) is read and checked, and no family reads it: the processor sets the
    resolution, so low, high and auto give the answer of no detail (vLLM also accepts and ignores it). Any other
    value is a 400 in each."""
    want = ask(oai, "w21 w22", PNG_A).choices[0].message.content
    for detail in ("low", "high", "auto"):
        r = oai.chat.completions.create(model="vlm", max_tokens=N_OUT, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(PNG_A), "detail": detail}},
            {"type": "text", "text": "w21 w22"}]}])
        assert r.choices[0].message.content == want, detail
        r = oai.responses.create(model="vlm", max_output_tokens=N_OUT, temperature=0, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(PNG_A), "detail": detail},
            {"type": "input_text", "text": "w21 w22"}]}])
        assert r.output_text == want, detail
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="vlm", max_tokens=N_OUT, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(PNG_A), "detail": "ultra"}}]}])
    assert e.value.body["param"] == "messages.0.content", e.value.body  # the part's schema (a Literal) refuses it
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="vlm", max_output_tokens=N_OUT, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(PNG_A), "detail": "ultra"}]}])
    assert e.value.body["param"] == "input.0.content", e.value.body


# -- streams with images: each family's stream joins to its non-streamed answer and ends as that API ends one ----

def test_openai_chat_stream_with_an_image(oai):
    want = ask(oai, "w11 w12", PNG_B)
    stream = oai.chat.completions.create(model="vlm", max_tokens=N_OUT, temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         messages=[{"role": "user", "content": _parts("w11 w12", PNG_B)}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == want.choices[0].message.content and finish == [want.choices[0].finish_reason]
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens  # the images' tokens counted in the stream too
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def test_anthropic_messages_stream_with_an_image(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(PNG_B).decode()}},
              {"type": "text", "text": "w13 w14"}]
    kw = dict(model="vlm", max_tokens=N_OUT, messages=[{"role": "user", "content": blocks}],
              extra_body={"temperature": 0})
    want = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.content[0].text == final.content[0].text
    assert final.stop_reason == want.stop_reason and final.stop_reason in ("max_tokens", "end_turn")
    assert final.usage.output_tokens == want.usage.output_tokens


def test_responses_stream_with_an_input_image(oai):
    kw = dict(model="vlm", max_output_tokens=N_OUT, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(PNG_B)}, {"type": "input_text", "text": "w15 w16"}]}])
    want = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    ends = [e for e in events if e.type in ("response.completed", "response.incomplete", "response.failed")]
    assert text == want.output_text
    assert [e.type for e in ends] == [events[-1].type] and ends[0].response.status == want.status
    assert ends[0].response.output_text == want.output_text
    assert ends[0].response.usage.input_tokens == want.usage.input_tokens


def test_ollama_chat_stream_with_images(server):
    olla = ollama.Client(host=server.url, timeout=120)
    b64 = base64.b64encode(PNG_B).decode()
    kw = dict(model="vlm", messages=[{"role": "user", "content": "w17 w18", "images": [b64]}],
              options={"temperature": 0, "num_predict": N_OUT})
    want = olla.chat(**kw)
    chunks = list(olla.chat(stream=True, **kw))
    assert "".join(c.message.content for c in chunks) == want.message.content
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done
    assert chunks[-1].done_reason == want.done_reason and chunks[-1].prompt_eval_count == want.prompt_eval_count
    assert chunks[-1].eval_count == want.eval_count
