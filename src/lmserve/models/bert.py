"""Encoder families: BERT (MiniLM, bge, e5, gte) and XLM-RoBERTa, bare or with a sequence-classification head.

A post-norm transformer with bidirectional attention and learned absolute positions, no KV cache. It runs in the
engine's steps like a decoder's prompt (padding-free: the step's prompts concatenated, [T] ids and positions), on
one condition the engine keeps (engine/build.py: no chunked prefill, no prefix reuse): every prompt runs whole in
one step, so a sequence starts where its position is 0. Attention is per sequence over its own tokens (padded, in
groups of near lengths, inside attention alone, `bidirectional`; `bidirectional_ref` is the per-sequence reference); the
AttentionContext (the paged cache) is not used. Token types follow BERT's pair layout: type 1 after a sequence's
first [SEP] (a cross-encoder's second text), 0 before. XLM-R's positions start at padding_idx + 1 (fairseq's).
A classification head (BertForSequenceClassification: pooler dense + tanh, classifier; XLM-R's
`classifier.dense` + tanh, `classifier.out_proj`) is the same two linears, applied by `score` to the CLS vector.
A GGUF file as llama.cpp's converter writes BERT (`general.architecture` bert) loads through `_GGUF_NAMES` onto the
same HF names; its vocabulary is tokenizer/gguf_vocab.py's WordPiece, its pooling loader/pooling.py's `gguf_pooler`.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.layers.blocks.fused_linear import linear_act, linear_add
from lmserve.layers.blocks.norm import LayerNorm
from lmserve.layers.kernels.fused import encoder_attention
from lmserve.models.config import ModelConfig
from lmserve.models.family import Family, Fields, GGUFMeta

_BERT_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")  # of fused_linear's ACTS, those BERT checkpoints name
# the base model's prefix in a task checkpoint (BertForSequenceClassification: `bert.`); a bare model has none
_PREFIXES = ("bert.", "roberta.", "model.")


class EncoderLayer(nn.Module):
    """Self-attention and MLP, each followed by residual + LayerNorm (post-norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(h, 3 * cfg.num_heads * cfg.head_dim)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h)
        self.attn_norm = LayerNorm(h, eps=eps)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
        self.mlp_norm = LayerNorm(h, eps=eps)
        self.act = cfg.hidden_act  # a name in fused_linear's ACTS

    def forward(self, x: torch.Tensor, seqs: StepSequences) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x).view(t, 3, self.num_heads, self.head_dim)
        x = self.attn_norm(linear_add(self.o_proj, bidirectional(qkv, seqs), x))  # norm(x + o_proj(attn))
        return self.mlp_norm(linear_add(self.down, linear_act(self.up, x, self.act), x))  # norm(x + down(act(up x)))


class PaddedGroup(NamedTuple):
    """Sequences of similar length laid out padded to their longest: `tokens` [Tg] (their flat token indices; None:
    every token of the step, in order), each token's row in the [Bg * Lg] layout (`rows`, [Tg]) and the real keys
    of each sequence (`keys`, [Bg, 1, 1, Lg] bool)."""

    tokens: torch.Tensor | None
    rows: torch.Tensor
    keys: torch.Tensor


class StepSequences:
    """Where the step's sequences lie: `lens` and `starts` ([B + 1] int64: 0, each sequence's end; both on the
    host), and the padded groups the PyTorch attention runs them in, made only if it asks (`groups`): the native
    attention reads `starts` alone, and building the groups' index tensors was host work each encoder step."""

    def __init__(self, lens: list[int], starts: torch.Tensor, positions: torch.Tensor) -> None:
        self.lens, self.starts, self._positions = lens, starts, positions

    @functools.cached_property
    def groups(self) -> list[PaddedGroup]:
        return _groups(self.lens, self.starts, self._positions)


# a group's longest sequence is at most this many times its shortest: padding the step's sequences to one longest
# (16..128 tokens) spent about 2.7x the attention's work on padding; groups of near lengths spend little more
# than an index copy
GROUP_SPREAD = 1.5


def step_sequences(positions: torch.Tensor, num_tokens: int) -> StepSequences:
    """Every prompt runs whole in its step, so a sequence starts where its position is 0; the step's one host
    read is the sequences' lengths."""
    begin = (positions == 0).nonzero().flatten()
    lens = torch.diff(begin, append=begin.new_tensor([num_tokens])).tolist()  # [B]
    bounds = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)  # [B + 1], for the native attention
    return StepSequences(lens, bounds, positions)


def _groups(lens: list[int], bounds: torch.Tensor, positions: torch.Tensor) -> list[PaddedGroup]:
    """The sequences grouped by length (sorted, a new group where a length passes GROUP_SPREAD x the group's
    shortest), each laid out padded."""
    device = positions.device
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if not groups or lens[i] > GROUP_SPREAD * lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    if len(groups) == 1:
        return [_group(list(range(len(lens))), lens, None, positions)]
    starts = bounds.tolist()  # each sequence's first token
    out = []
    for g in groups:
        tokens = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in g]).to(device)
        out.append(_group(g, lens, tokens, positions[tokens]))
    return out


def _group(members: list[int], lens: list[int], tokens: torch.Tensor | None, positions: torch.Tensor) -> PaddedGroup:
    device = positions.device
    glens = torch.tensor([lens[i] for i in members], device=device)
    longest = max(lens[i] for i in members)
    seq = torch.repeat_interleave(torch.arange(len(members), device=device), glens)  # [Tg]
    keys = torch.arange(longest, device=device)[None, :] < glens[:, None]  # [Bg, Lg]
    return PaddedGroup(tokens, seq * longest + positions, keys[:, None, None, :])


def bidirectional(qkv: torch.Tensor, seqs: StepSequences, window: int | None = None) -> torch.Tensor:
    """Each sequence attends over all of its own tokens: qkv [T, 3, H, D] -> [T, H * D]. The linears stay
    padding-free; only here are the sequences laid out padded, group by group (one attention call per group, the
    padding keys masked, the padding queries' rows never read). `window`: a token sees only the keys at most that
    many positions away (ModernBERT's local layers). On CPU in float32 one native call does it all, with neither
    padding nor copies (layers/kernels/fused.py `encoder_attention`)."""
    native = encoder_attention(qkv, seqs.starts, window)
    if native is not None:
        return native
    return bidirectional_padded(qkv, seqs, window)


def bidirectional_padded(qkv: torch.Tensor, seqs: StepSequences, window: int | None = None) -> torch.Tensor:
    """`bidirectional` in PyTorch: the step's sequences padded group by group, one attention call per group."""
    t, _, h, d = qkv.shape
    if len(seqs.lens) == 1:
        return bidirectional_ref(qkv, seqs.lens, window)
    if len(seqs.groups) == 1:
        return _padded(qkv, seqs.groups[0], window)
    out = qkv.new_empty(t, h * d)
    for g in seqs.groups:
        out[g.tokens] = _padded(qkv[g.tokens], g, window)
    return out


def _padded(qkv: torch.Tensor, g: PaddedGroup, window: int | None) -> torch.Tensor:
    """One group's attention: its tokens' qkv [Tg, 3, H, D] -> [Tg, H * D]."""
    _, _, h, d = qkv.shape
    b, longest = g.keys.shape[0], g.keys.shape[-1]
    padded = qkv.new_zeros(b * longest, 3, h, d)
    padded[g.rows] = qkv
    q, k, v = padded.view(b, longest, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, Lmax, D] each
    mask = g.keys if window is None else g.keys & _near(longest, window, qkv.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, Lmax, D]
    return out.transpose(1, 2).reshape(b * longest, h * d)[g.rows]


def _near(n: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool: query i may read key j, |i - j| <= window."""
    i = torch.arange(n, device=device)
    return (i[:, None] - i[None, :]).abs() <= window


def bidirectional_ref(qkv: torch.Tensor, seq_lens: list[int], window: int | None = None) -> torch.Tensor:
    """The reference: one attention call per sequence over its own rows, no padding at all."""
    q, k, v = qkv.transpose(0, 1).unbind(0)  # [T, H, D] each
    outs, start = [], 0
    for n in seq_lens:
        s = slice(start, start + n)
        mask = None if window is None or window >= n else _near(n, window, qkv.device)
        o = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                           attn_mask=mask)
        outs.append(o.transpose(0, 1).reshape(n, -1))  # [n, H * D]
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class Encoder(nn.Module):
    """What every encoder shares (BERT and XLM-R here, ModernBERT and NomicBERT in rotary_encoder.py): pair token
    types from the first [SEP], no logits (it pools), and an exact weight load. A subclass sets `config`,
    `sep_token_id` and its parameters."""

    config: ModelConfig
    sep_token_id: int | None

    def _token_types(self, input_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """[T]: 1 for the tokens after their sequence's first [SEP] (a pair's second text), else 0."""
        sep = self.sep_token_id
        if self.config.type_vocab_size < 2 or sep is None:
            return torch.zeros_like(input_ids)
        is_sep = (input_ids == sep).long()
        before = is_sep.cumsum(0) - is_sep  # [SEP]s before each token, counted over the whole step
        seq = starts.long().cumsum(0) - 1  # each token's sequence
        return (before - before[starts][seq] > 0).long()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.config.architecture} is an encoder: it pools, it does not generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        """Copy (name, tensor, source) as `checkpoint_tensors` renamed them; every parameter filled exactly once."""
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor, source in weights:
            if name not in params:
                raise CheckpointError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
            if params[name].shape != tensor.shape:
                raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)}, "
                                      f"expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise CheckpointError(f"checkpoint: missing {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")


class EncoderModel(Encoder):
    """BERT / XLM-R over a padding-free step: forward(ids [T], positions [T], ctx) -> final hidden states [T, H]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.sep_token_id = cfg.sep_token_id  # engine/build.py sets the tokenizer's where config.json has none
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        # the table's rows: the served window after XLM-R's offset rows
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings + cfg.position_offset, h)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.embed_norm = LayerNorm(h, eps=cfg.rms_norm_eps)
        self.blocks = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))  # not `layers`: no decoder stack
        if cfg.num_labels:  # the classification head: dense + tanh on the CLS vector, then the label logits
            self.head_dense = nn.Linear(h, h)
            self.head_out = nn.Linear(h, cfg.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        starts = positions == 0  # every prompt runs whole in its step: its first token is at position 0
        seqs = step_sequences(positions, input_ids.shape[0])
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.config.position_offset)
             + self.token_type_embeddings(self._token_types(input_ids, starts)))
        x = self.embed_norm(x)  # [T, H]
        for layer in self.blocks:
            x = layer(x, seqs)
        return x

    def score(self, cls: torch.Tensor) -> torch.Tensor:
        """The classification head's logits: CLS vectors [N, H] (any float dtype) -> [N, num_labels]."""
        return self.head_out(torch.tanh(self.head_dense(cls.to(self.word_embeddings.weight.dtype))))

# HF name (prefix stripped, {i}: layer) -> ours; q/k/v are fused into `qkv` by `_checkpoint_stream`
_NAMES = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight", "embeddings.LayerNorm.bias": "embed_norm.bias",
    "pooler.dense.weight": "head_dense.weight", "pooler.dense.bias": "head_dense.bias",  # BERT's classifier input
    "classifier.weight": "head_out.weight", "classifier.bias": "head_out.bias",
    "classifier.dense.weight": "head_dense.weight", "classifier.dense.bias": "head_dense.bias",  # XLM-R's
    "classifier.out_proj.weight": "head_out.weight", "classifier.out_proj.bias": "head_out.bias",
}
_LAYER_NAMES = {
    "attention.output.dense": "o_proj", "attention.output.LayerNorm": "attn_norm", "intermediate.dense": "up",
    "output.dense": "down", "output.LayerNorm": "mlp_norm",
}
_QKV = ("attention.self.query.", "attention.self.key.", "attention.self.value.")


def _checkpoint_stream(weights: Iterator[tuple[str, torch.Tensor, str]],
                       cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
    """HF BERT / XLM-R tensors -> ours: the task prefix stripped; a layer's q, k and v (any order) held back and
    yielded as one `qkv` once all three have come; an unused pooler and saved position-id buffers dropped."""
    pending: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    for name, tensor, source in weights:
        name = _bare(name)
        if name.startswith("encoder.layer."):
            i, rest = name.removeprefix("encoder.layer.").split(".", 1)
            j = next((j for j, frag in enumerate(_QKV) if rest.startswith(frag)), None)
            if j is None:
                module, kind = rest.rsplit(".", 1)
                yield f"blocks.{i}.{_LAYER_NAMES.get(module, module)}.{kind}", tensor, source
                continue
            kind = rest.removeprefix(_QKV[j])  # weight | bias
            parts = pending.setdefault((i, kind), [None, None, None])
            parts[j] = tensor
            if all(p is not None for p in parts):
                yield f"blocks.{i}.qkv.{kind}", torch.cat(pending.pop((i, kind))), source
        elif name.startswith("pooler.") and not cfg.num_labels or name.endswith("position_ids"):
            continue  # BertModel's pooler (sentence-transformers never reads it); a saved buffer
        else:
            yield _NAMES.get(name, name), tensor, source  # an unknown name: load_weights says it is unexpected


def _bare(name: str) -> str:
    """The base model's name: a task checkpoint's prefix (`bert.`, `roberta.`) stripped, TF-era gamma/beta renamed."""
    for p in _PREFIXES:
        if name.startswith(p):
            name = name.removeprefix(p)
            break
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def _bert_hf(cfg: Mapping[str, Any]) -> Fields:
    return _encoder_fields(cfg, position_offset=0)


def _roberta_hf(cfg: Mapping[str, Any]) -> Fields:
    """fairseq's positions: the first token is at padding_idx + 1 (the table's first rows are never read)."""
    return _encoder_fields(cfg, position_offset=int(cfg.get("pad_token_id", 1)) + 1)


def _encoder_fields(cfg: Mapping[str, Any], position_offset: int) -> Fields:
    archs = cfg.get("architectures") or []
    classifier = any(str(a).endswith("ForSequenceClassification") for a in archs)
    labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2)) if classifier else 0
    act = str(cfg.get("hidden_act", "gelu"))
    if act not in _BERT_ACTS:
        raise CheckpointError(f"config.json: hidden_act {act!r} is not supported ({', '.join(_BERT_ACTS)})")
    return {"encoder": True, "type_vocab_size": int(cfg.get("type_vocab_size", 2)), "position_offset": position_offset,
            "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)), "hidden_act": act, "num_labels": labels,
            "qkv_bias": True, "o_bias": True, "mlp_bias": True, "num_kv_heads": int(cfg["num_attention_heads"]),
            # the window a prompt may fill (XLM-R's table has padding_idx + 1 rows before its first position)
            "max_position_embeddings": int(cfg.get("max_position_embeddings", 512)) - position_offset,
            "sep_token_id": cfg.get("sep_token_id")}


# llama.cpp's BERT tensor names -> HF's (bare, as a BertModel saves them; `{i}`: layer); weights and biases alike
_GGUF_NAMES = {f"{g}.{kind}": f"{h}.{kind}" for kind in ("weight", "bias") for g, h in {
    "token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm",
    "blk.{i}.attn_q": "encoder.layer.{i}.attention.self.query", "blk.{i}.attn_k": "encoder.layer.{i}.attention.self.key",
    "blk.{i}.attn_v": "encoder.layer.{i}.attention.self.value",
    "blk.{i}.attn_output": "encoder.layer.{i}.attention.output.dense",
    "blk.{i}.attn_output_norm": "encoder.layer.{i}.attention.output.LayerNorm",
    "blk.{i}.ffn_up": "encoder.layer.{i}.intermediate.dense", "blk.{i}.ffn_down": "encoder.layer.{i}.output.dense",
    "blk.{i}.layer_output_norm": "encoder.layer.{i}.output.LayerNorm",
    "cls": "classifier.dense", "cls.output": "classifier.out_proj",  # a reranker's head (RoBERTa-style names)
}.items()}


def _bert_gguf(m: GGUFMeta) -> Fields:
    """llama.cpp's BERT keys. Its converter drops BertForSequenceClassification's pooler (`bert.pooler.dense`) and
    keeps only the classifier, so such a file cannot give the model's scores: refused, not served wrong."""
    if "cls.output.weight" in m.names and "cls.weight" not in m.names:
        raise CheckpointError("a BERT classifier GGUF without its pooler layer (llama.cpp's converter drops "
                              "bert.pooler.dense, which the head reads): its scores would not be the model's; "
                              "serve the Hugging Face directory instead")
    labels = m.get("classifier.output_labels")
    num_labels = (len(labels) if labels else 1) if "cls.output.weight" in m.names else 0
    sep = m.meta.get("tokenizer.ggml.seperator_token_id")  # llama.cpp's spelling of the key
    types = int(m.meta.get("tokenizer.ggml.token_type_count", 2))
    if not 0 <= types <= 1024:  # the table is built before token_types.weight is read: never a huge allocation
        raise CheckpointError(f"GGUF metadata: tokenizer.ggml.token_type_count {types} is not a BERT's (0..1024)")
    return {"encoder": True, "type_vocab_size": types,
            "position_offset": 0, "rms_norm_eps": float(m.get("attention.layer_norm_epsilon", 1e-12)),
            "hidden_act": "gelu", "num_labels": num_labels, "qkv_bias": True, "o_bias": True, "mlp_bias": True,
            "sep_token_id": int(sep) if sep is not None else None}


BERT = Family("bert", hf_fields=_bert_hf, checkpoint_stream=_checkpoint_stream, model=EncoderModel,
              gguf_fields=_bert_gguf, gguf_names=_GGUF_NAMES)
XLM_ROBERTA = Family("xlm-roberta", hf_fields=_roberta_hf, checkpoint_stream=_checkpoint_stream, model=EncoderModel)
