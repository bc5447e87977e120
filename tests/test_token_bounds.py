"""tokenizer/bounds.py: a text's token count lies between the bounds read from its UTF-8 length, for the embedded
model's byte-level BPE and a SentencePiece vocabulary; no lower bound where one token can cover more than its
spelling; and long texts encode without holding the GIL (the server's event loop runs meanwhile)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from lmserve.loader import default_model_path
from lmserve.tokenizer.bounds import TokenBounds, text_bytes
from lmserve.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def texts(seed: int) -> list[str]:
    """Texts that stress both bounds: long whitespace and punctuation runs (the longest tokens), multi-byte
    characters, control-token spellings, a lone surrogate-free mix."""
    rng = random.Random(seed)
    alphabet = [" ", "\n", "\t", "a", "Z", "7", "é", "語", "🙂", "-", "=", "<|im_start|>", "    ", "\u0301"]
    made = ["", "x", " " * 5000, "\n" * 300 + " " * 300, "-" * 2000, "🙂" * 500, "<|im_end|>" * 50]
    made += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(30)]
    return made


def test_the_embedded_vocabulary_holds_its_bounds(smol):
    b = smol.bounds
    assert b.max_token_bytes == 81 and b.tokens_per_byte == 1  # SmolLM2: "\n" + 80 spaces is its longest token
    for text in texts(0):
        n = text_bytes(text)
        for ids in (smol.encode_prompt(text), smol.encode(text), smol.encode(text, add_special_tokens=False)):
            assert b.lower(n) <= len(ids) <= b.upper(n), (text[:40], n, len(ids))


def sentencepiece() -> HFTokenizer:
    """A small SentencePiece-style BPE with byte fallback and a prefix space (as Llama 2's tokenizer.json)."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "ab": 5, "▁ab": 6}
    vocab.update({f"<0x{i:02X}>": 7 + i for i in range(256)})
    hf = HFTokenizer(models.BPE(vocab, [("a", "b"), ("▁", "a"), ("▁", "ab")], unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf


def test_a_sentencepiece_vocabulary_holds_its_bounds():
    hf = sentencepiece()
    b = TokenBounds.of(hf, "byte_fallback")
    assert b.max_token_bytes == len("<0x00>") and b.tokens_per_byte == 2
    for text in texts(1):
        n = text_bytes(text)
        assert b.lower(n) <= len(hf.encode(text).ids) <= b.upper(n), (text[:40], n)


@pytest.mark.parametrize("change", ["nfc", "strip", "whitespace", "lstrip"])
def test_no_lower_bound_where_one_token_can_cover_more_than_its_spelling(change):
    """NFC composes "e" + U+0301 (3 bytes) into "é" (2); Strip and Whitespace drop input; an lstrip added token
    swallows the spaces before it: none may refuse a request by its bytes."""
    hf = sentencepiece()
    if change == "nfc":
        hf.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(" ", "▁")])
    elif change == "strip":
        hf.normalizer = normalizers.Strip()
    elif change == "whitespace":
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:
        hf.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    assert TokenBounds.of(hf, "byte_fallback").max_token_bytes is None
    assert TokenBounds.of(hf, "byte_fallback").lower(10**6) == 0


def test_a_long_text_encodes_without_holding_the_gil(smol):
    """A ticker thread keeps running while a 2 MiB prompt encodes (Tokenizer.encode held the GIL for all of it)."""
    text = "hello world " * (2 * 2**20 // 12)
    gaps, done = [], threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    try:
        ids = smol.encode_prompt(text)
    finally:
        took = time.monotonic() - start
        done.set()
        ticker.join()
    assert len(ids) > 300_000 and ids == smol._hf.encode(text).ids
    assert max(gaps) < took / 3, (max(gaps), took)
