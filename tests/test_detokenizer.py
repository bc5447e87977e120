"""Incremental detokenization: streamed pieces join to the one-shot decode, never a broken character."""

from __future__ import annotations

import random

import pytest

from lmserve.engine.detokenizer import IncrementalDetokenizer
from lmserve.tokenizer import Tokenizer

TEXTS = ["日本語のテキストと中文字符が混ざる文章です。", "emoji 🎉🚀👩‍💻 and flags 🇫🇷🇯🇵 in a row",
         "Café déjà vu — naïve façade", "plain ascii words with spaces  and\ttabs\n"]


@pytest.fixture(scope="module")
def tok(smol_path):
    return Tokenizer.from_gguf(smol_path)


def stream(tok, ids, chunks, skip=True):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i = [], 0
    for n in chunks:
        pieces.append(d.add(ids[i:i + n]))
        i += n
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_one_by_one_and_random_chunks_join_exactly(tok, text):
    ids = tok.encode(text)
    split = any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some character spans tokens
    if text.startswith("日本") or text.startswith("emoji"):
        assert split, "the test text should split multi-byte characters across tokens"
    pieces = stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    rng = random.Random(0)
    for _ in range(5):
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        assert "".join(stream(tok, ids, chunks)) == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode_chat([{"role": "user", "content": "hi 👋"}])
    assert "".join(stream(tok, ids, [1] * len(ids))) == tok.decode(ids)
    kept = "".join(stream(tok, ids, [1] * len(ids), skip=False))
    assert kept == tok.decode(ids, skip_special_tokens=False) and "<|im_start|>" in kept


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("Translate: 猫")
    out = tok.encode(" cat 🐱")
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(d.add([i]) for i in out) + d.flush()
    assert text == tok.decode(out)
