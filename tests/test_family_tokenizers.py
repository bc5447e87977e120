"""Tokenizers and chat templates of the new families, compared with transformers reading the same GGUF file:
Qwen3's byte-level BPE (pre-tokenizer "qwen2", <think> tags as user-defined tokens) and its `enable_thinking`
template variable; Gemma's SentencePiece-style vocabulary (merges in file order, byte fallback, spaces stored as
spaces, no prefix space); a template that refuses a system role; the Gemma turn format for files without one."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from lmserve.tokenizer import Tokenizer

TEXTS = ["def f(x):\n    return x ** 2  # square\n\n\tprint(f'{x}')",
         "emoji 🎉🚀👩‍💻 and 🇫🇷 flags", "Привет, мир! Ελληνικά עברית العربية हिन्दी 日本語のテキスト 中文 한국어",
         "   leading and    multiple   spaces\r\nline", "12345 3.14159 don't I'll", "<think>plan</think> done", ""]
CORPUS = ["def f(x):\n    return x * 2\n", "The quick brown fox jumps over the lazy dog.", "Hello world! How are you?",
          "numbers 12345 and 3.14", "the theory of the thing that thinks", "Привет мир", "日本語 中文"]
# A template of our own that reads `enable_thinking` as Qwen3's does: off, it writes an empty think block.
QWEN_TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
                 "{%- endif %}{%- endif %}")
# Gemma 2's rule: no system role at all.
NO_SYSTEM_TEMPLATE = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                      "supported') }}{%- endif %}{%- for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + "
                      "m['content'] + '<end_of_turn>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                      "{{ '<start_of_turn>model\\n' }}{%- endif %}")


def _writer(path, arch: str, tokens: list[str], types: list[int]) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128), w.add_embedding_length(16), w.add_block_count(1), w.add_feed_forward_length(32)
    w.add_head_count(2), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(len(tokens))
    w.add_token_list(tokens), w.add_token_types(types)
    return w


def _close(w: gguf.GGUFWriter, vocab: int) -> None:
    w.add_tensor("token_embd.weight", np.zeros((vocab, 16), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def write_qwen_vocab(path) -> None:
    """A byte-level BPE trained with Qwen2's split, written as llama.cpp writes Qwen3's vocabulary."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from lmserve.tokenizer.gguf_vocab import _QWEN2

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    specials, user = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"]
    tokens += specials + user
    w = _writer(path, "qwen3", tokens, [1] * (len(tokens) - 5) + [3, 3, 3, 4, 4])
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2")
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    w.add_eos_token_id(tokens.index("<|im_end|>")), w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False), w.add_chat_template(QWEN_TEMPLATE)
    _close(w, len(tokens))


def write_gemma_vocab(path) -> None:
    """A SentencePiece-BPE vocabulary laid out as Gemma's GGUF files are: control tokens, turn markers, 256 byte
    pieces, runs of spaces stored as spaces (user-defined), then pieces in merge order with scores that ignore it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, trainers

    bpe = HFTokenizer(models.BPE(byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    bpe.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    chars = sorted(t for t in model["vocab"] if len(t) == 1)
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3, 3]
    tokens += [f"<0x{i:02X}>" for i in range(256)] + ["  ", "   ", "    "]
    types += [6] * 256 + [4, 4, 4]
    normal = list(dict.fromkeys(t for t in chars + merged if t not in tokens))
    tokens += normal
    types += [1] * len(normal)
    w = _writer(path, "gemma3", tokens, types)
    w.add_tokenizer_model("llama"), w.add_tokenizer_pre("default")
    w.add_token_scores([-1000.0] * len(tokens))  # flat: only the order can rank merges
    w.add_bos_token_id(2), w.add_eos_token_id(1), w.add_unk_token_id(3), w.add_pad_token_id(0)
    w.add_add_bos_token(True), w.add_add_space_prefix(False)
    _close(w, len(tokens))


@pytest.mark.parametrize("writer,name", [(write_qwen_vocab, "qwen3.gguf"), (write_gemma_vocab, "gemma3.gguf")])
def test_gguf_vocabulary_matches_transformers(tmp_path, writer, name):
    """Ids, and decoding back, equal transformers' on code, emoji, several scripts and runs of spaces."""
    from transformers import AutoTokenizer

    writer(tmp_path / name)
    ours = Tokenizer.from_gguf(tmp_path / name)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=name)
    for text in TEXTS:
        ids = ours.encode_prompt(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    if name.startswith("gemma"):
        spaces = ours.encode("a    b", add_special_tokens=False)
        assert ours.vocab_tokens()[spaces[1]] == "\u2581" * 4  # stored as "    ", matched as "▁▁▁▁"
        assert ours.encode_prompt("hi")[0] == ours.bos_token_id == 2
        assert ours.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) \
            == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"  # the built-in format


def test_enable_thinking_reaches_the_template(tmp_path):
    """chat_template_kwargs: {"enable_thinking": false} renders as transformers renders it."""
    from transformers import AutoTokenizer

    write_qwen_vocab(tmp_path / "qwen3.gguf")
    ours = Tokenizer.from_gguf(tmp_path / "qwen3.gguf")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="qwen3.gguf")
    chat = [{"role": "user", "content": "Hi"}]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        text = ours.apply_chat_template(chat, **kwargs)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.encode_chat(chat, **kwargs) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.apply_chat_template(chat, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_a_template_without_a_system_role_refuses_it_as_transformers_does(tmp_path):
    """Gemma 2's template raises on a system message: transformers raises its message, and so do we (the server
    turns it into a 400); conversations without one render identically."""
    import jinja2
    from transformers import AutoTokenizer

    write_gemma_vocab(tmp_path / "gemma3.gguf")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma3.gguf")
    theirs.chat_template = NO_SYSTEM_TEMPLATE
    ours = Tokenizer(Tokenizer.from_gguf(tmp_path / "gemma3.gguf")._hf, {"bos_token": "<bos>", "eos_token": "<eos>"},
                     chat_template=NO_SYSTEM_TEMPLATE)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    system = [{"role": "system", "content": "Be brief."}] + chat
    with pytest.raises(jinja2.TemplateError, match="System role not supported"):
        theirs.apply_chat_template(system, tokenize=False)
    with pytest.raises(ValueError, match="System role not supported"):
        ours.encode_chat(system)


def test_chat_template_kwargs_pass_through_the_chat_route(tmp_path):
    """The server hands `chat_template_kwargs` to the template (vLLM's extension; the official client sends it in
    extra_body): enable_thinking false adds the empty think block to the prompt; the request's own fields are not
    overridable (400)."""
    import openai
    from openai import OpenAI

    from tests.server_util import running_server
    from tests.tiny_models import build_hf

    path, _ = build_hf("qwen3", tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text()) | {"chat_template": QWEN_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with running_server("--model", str(path)) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused")
        ask = dict(model=path.name, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=2, temperature=0)
        plain = client.chat.completions.create(**ask)
        off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.usage.prompt_tokens > plain.usage.prompt_tokens  # the think block's pieces (a word-level vocabulary)
        on = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert on.usage.prompt_tokens == plain.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
            client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
