"""ModelRunner: owns the KV cache tensors and the persistent batch; one `execute` = apply the step's diffs to the
rows, upload inputs once, one forward, sample (and verify drafts), one download."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from lmserve.layers.attention.backends import attention_factory
from lmserve.layers.attention.context import AttentionContext, ContiguousAttention, GroupedAttention
from lmserve.layers.attention.kv_quant import row_width
from lmserve.layers.kernels.moe_kernels import host_synced_moe_layers
from lmserve.lora.batch import token_slots
from lmserve.models.config import ModelConfig
from lmserve.pooling_params import PoolerConfig
from lmserve.request import TokenLogprobs
from lmserve.sample import Sampler, SamplerOutput
from lmserve.sched.output import SchedulerOutput
from lmserve.worker.cpu_gate import CpuGate
from lmserve.worker.cuda_graphs import DecodeGraphs, ScratchSlot, sampling_rows_only
from lmserve.worker.input_batch import InputBatch
from lmserve.worker.inputs import StepInputs, StepLayout, build_inputs
from lmserve.worker.kv_memory import kv_zeros
from lmserve.worker.kv_transfer import KVTransfer
from lmserve.worker.mm_encoder import ImageInputs
from lmserve.worker.pooler import Pooler
from lmserve.worker.progress import layer_progress
from lmserve.worker.transforms import TransformContext
from lmserve.worker.upload import PinnedStaging, to_device

log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """Per scheduled request (scheduler order): the tokens it keeps and each one's logprobs."""

    sampled_token_ids: list[list[int]]  # accepted drafts then the newly sampled token; [] mid-prefill
    logprobs: list[list[TokenLogprobs]]  # parallel to sampled_token_ids (top empty unless asked)
    num_decodes: int = 0  # tokens in the decode group (plain decodes and verify runs)
    num_prefill_tokens: int = 0
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # pooling requests whose prompt ended


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """K and V for `block_size` tokens in `num_layers` layers (a KV group's; None: every layer); a quantized
    cache's rows carry their scales."""
    layers = cfg.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * cfg.num_kv_heads * row_width(cfg.head_dim, dtype) * dtype.itemsize


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, num_tokens: int, device: torch.device) -> None:
    """One forward of a full step's tokens as a single sequence, LM head on every row: the activation peak
    that --gpu-memory-utilization sizes the KV cache around (no cache exists yet)."""
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), ContiguousAttention([num_tokens]))
    model.compute_logits(hidden)


class ModelRunner:
    """Runs the model over a scheduled batch against the paged KV cache."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, transforms: TransformContext,
                 kv_dtype: torch.dtype | None = None, attention_backend: str = "reference",
                 samples: bool = True, kv_groups: Sequence[Sequence[int]] | None = None,
                 pooler: PoolerConfig = PoolerConfig()) -> None:
        """`model` is finished: the transform pipeline (worker/transforms.py) ran over it, and `transforms` is what
        it handed on (the LoRA slots, the MoE kernels it applied, the decode stack).
        `attention_backend`: a resolved name (layers/attention/backends.py: triton | reference).
        `samples=False`: a tensor-parallel worker rank (forward_only), whose rows keep no sampling state.
        `kv_groups`: the layers of each KV group, all of one size (cache/kv_groups.py; None: one group of every
        layer): a block id is a page in each of `group size` tensors, which the groups share."""
        self.model, self.cfg, self.block_size, self.device = model, cfg, block_size, device
        self.attention = attention_factory(attention_backend)  # one AttentionContext per forward
        self.lora = transforms.lora_slots  # None: LoRA off
        self.moe_layers = transforms.moe_layers  # layers running their experts grouped
        self.decode_stack = transforms.decode_stack  # None: decode steps run the module loop
        groups = [tuple(g) for g in kv_groups] if kv_groups else [tuple(range(cfg.num_layers))]
        # one block past the pool's: the scratch block that padding rows of a fixed-shape decode step write to, and
        # that tables name where a window group released a block (read only under a mask)
        shape = (2, num_blocks + 1, block_size, cfg.num_kv_heads, row_width(cfg.head_dim, kv_dtype or dtype))
        # pages committed as blocks are first written (worker/kv_memory.py), not the whole pool at start
        where = {layer: (g, i) for g, layers in enumerate(groups) for i, layer in enumerate(layers)}
        # a pipeline rank holds the KV of its own layers only: a slot no layer of this rank uses is never allocated
        held = transforms.loaded.stage.layers if transforms.loaded.stage is not None else range(cfg.num_layers)
        used = {where[i][1] for i in held}
        self.kv_tensors = [kv_zeros(shape, kv_dtype or dtype, device) if j in used else None
                           for j in range(len(groups[0]))]
        self.kv_caches = [self.kv_tensors[where[i][1]] for i in range(cfg.num_layers)]  # per layer (shared tensors)
        self.layer_group = [where[i][0] for i in range(cfg.num_layers)]
        self.num_kv_groups = len(groups)
        self.scratch = ScratchSlot(num_blocks, block_size)
        self.graphs: DecodeGraphs | None = None
        self.sampler = Sampler()
        # pooling requests: their prompt's hidden states -> one vector (a classifier's: its head's scores)
        self.pooler = Pooler(pooler, model.score if pooler.num_labels else None)
        self.batch = InputBatch(cfg.vocab_size, device, samples=samples, num_kv_groups=len(groups))
        self.staging = PinnedStaging()  # CUDA: the one pinned buffer every step's inputs travel through
        self.kv_transfer: KVTransfer | None = None  # the KV tier's copies (engine/kv_offload.py sets it)
        self.progress = layer_progress(model)  # the hung-step watchdog's sign of life inside a step
        # on a CPU, an encoder's short steps go first and a generative model's steps pause for them (cpu_gate.py)
        self.gate = CpuGate(model, cfg.encoder, device)
        # a vision model's running images and encoder cache (worker/mm_encoder.py); None: a text-only model
        self.images = ImageInputs(model, device) if hasattr(model, "encode_images") else None

    def kv_block_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor indexed by KV block, with the dimension of that index: what a block's bytes are (the KV
        tier copies all of them; a cache with per-block scales lists those too)."""
        return [(kv, 1) for kv in self.kv_tensors if kv is not None]

    def enable_decode_graphs(self, max_rows: int, max_blocks: int, capture: bool) -> float:
        """Run decode-only steps of up to max_rows tokens at fixed shapes (captured as CUDA graphs when
        `capture`); returns the capture time in seconds. Not with several KV groups: the static buffers hold one
        block table per row (such a model runs its decode steps eagerly). Nor where a mixture-of-experts layer runs
        its module path (it reads run lengths on the host: layers/moe_kernels.host_synced_moe_layers)."""
        if self.num_kv_groups > 1:
            return 0.0
        if host_synced_moe_layers(self.model):
            log.info("CUDA graphs off: %d mixture-of-experts layers have no graph-safe expert path; decode runs eagerly",
                     host_synced_moe_layers(self.model))
            return 0.0
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.scratch, max_rows, max_blocks, capture,
                                  self.attention)
        return self.graphs.capture_seconds

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One forward over the whole batch; only rows that sample or score prompt tokens reach the LM head."""
        # the whole step, inputs to outputs: an encoder's short one holds the gate, a generative one waits while it
        # is held (within its engine step's allowance: LLMEngine.step begins and ends it)
        with self.gate.step(sum(r.num_tokens for r in out.requests)):
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        host, layout = self._inputs(out)
        sample_ids = [out.requests[i].request_id for i in layout.sample_reqs]
        drafts = [out.requests[i].spec_token_ids for i in layout.sample_reqs]
        bans = [out.requests[i].stop_ban_rows for i in layout.sample_reqs]
        meta, gather = self.batch.metadata(sample_ids, drafts, bans) if sample_ids else (None, None)
        if meta is not None and out.grammar_bitmask is not None:
            meta.grammar_bitmask, meta.grammar_rows = _grammar_rows(out, layout)
        lora_meta = self._lora_meta(out, layout) if self.lora is not None else None
        placed = self.images.placements(out.requests, layout.order) if self.images is not None else []
        graph_step = (self.graphs is not None and not layout.pool and not placed
                      and self.graphs.fits(host, layout.num_prefill_tokens))
        upload = sampling_rows_only(host) if graph_step else host
        inputs, meta, gather, pending, lora_meta = to_device(
            (upload, meta, gather, self.batch.take_pending(), lora_meta), self.device, self.staging)
        self.batch.apply_pending(pending)
        if out.kv_transfers is not None:
            self.kv_transfer.before_forward(out.kv_transfers)
        if self.lora is not None:
            self.lora.batch.meta = lora_meta  # has_lora for this step: None leaves every row on the base path
        if graph_step:
            hidden = self.graphs.run(host)
        elif placed:
            embeds = self.images.inputs_embeds(inputs.input_ids, placed)
            hidden = self.model(inputs.input_ids, inputs.positions, self._context(inputs), inputs_embeds=embeds)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self._context(inputs))
        result = RunnerOutput([[] for _ in out.requests], [[] for _ in out.requests],
                              layout.num_decode_tokens, layout.num_prefill_tokens)
        if layout.pool:
            result.embeddings = self.pooler(out, layout.pool, hidden, self.batch.pooling_of)
        if layout.prompt_lp:
            result.prompt_logprobs = self._prompt_logprobs(out, hidden[inputs.prompt_lp_indices], layout)
        if sample_ids:
            self.batch.attach_counts(meta, gather)
            self.gate.pause()  # the LM head is a layer's time or more: an encoder step that began meanwhile goes first
            sampled = self.sampler(self.model.compute_logits(hidden[inputs.logits_indices]), meta)  # [N]
            self._collect(out, layout, sampled, result)
        if out.kv_transfers is not None:
            self.kv_transfer.after_forward(out.kv_transfers)
        return result

    @torch.inference_mode()
    def forward_only(self, out: SchedulerOutput) -> None:
        """A tensor-parallel worker rank's step: the same forward (and collectives) as rank 0, no LM head, no sampling.

        Its rows hold the same tokens and block tables as rank 0's (the same diffs applied), no sampling state.
        """
        host, layout = self._inputs(out)
        inputs = to_device(host, self.device)
        # a vision model's images: each rank runs the whole tower itself (its weights are not split) and places the
        # same embeddings rank 0 does, so the ranks' collectives see the same inputs
        placed = self.images.placements(out.requests, layout.order) if self.images is not None else []
        embeds = self.images.inputs_embeds(inputs.input_ids, placed) if placed else None
        self.model(inputs.input_ids, inputs.positions, self._context(inputs), inputs_embeds=embeds)

    def _context(self, inputs: StepInputs) -> AttentionContext:
        """The step's attention over the paged cache; with several KV groups each layer reads its group's tables."""
        ctx = self.attention(self.kv_caches, inputs.attn)
        if not inputs.group_attn:
            return ctx
        others = [self.attention(self.kv_caches, m) for m in inputs.group_attn]
        return GroupedAttention([ctx, *others], self.layer_group)

    def _inputs(self, out: SchedulerOutput) -> tuple[StepInputs, StepLayout]:
        """Apply the step's changes to the persistent rows, then gather its flat inputs from them (numpy)."""
        b = self.batch
        for rid in out.finished_ids:
            b.remove(rid)
        self.pooler.drop(out.finished_ids)
        if self.images is not None:
            self.images.drop(out.finished_ids)
        for new in out.new_requests:
            b.add(new)
            if self.images is not None:
                self.images.add(new.request_id, new.mm_inputs)
        b.apply(out.requests)
        if self.images is None:
            return build_inputs(out.requests, b.index, b.tokens, b.blocks, self.block_size, b.group_blocks[1:])
        host, layout = build_inputs(out.requests, b.index, b.tokens, b.blocks, self.block_size, b.group_blocks[1:],
                                    self.images.bidirectional_spans())
        # the KV slots and attention lengths above keep the token index; only the rotary reads these positions
        host.positions = self.images.rope_positions(out.requests, layout.order, host.positions)
        return host, layout

    def _lora_meta(self, out: SchedulerOutput, layout: StepLayout):
        """The step's rows grouped by adapter slot, in the flat order build_inputs laid the tokens out."""
        reqs = [out.requests[i] for i in layout.order]
        return self.lora.step_meta(token_slots([r.lora_slot for r in reqs], [r.num_tokens for r in reqs]))

    def _collect(self, out: SchedulerOutput, layout: StepLayout, s: SamplerOutput, result: RunnerOutput) -> None:
        """Download once; per request keep the accepted drafts and the one token after them."""
        ids = s.sampled_token_ids.tolist()
        chosen = s.logprobs.tolist()
        accepted = s.accepted.tolist() if s.accepted is not None else None
        top_ids = s.top_logprob_ids.tolist() if s.top_logprob_ids is not None else None
        top_lp = s.top_logprobs.tolist() if s.top_logprobs is not None else None
        row = 0
        for i, m in zip(layout.sample_reqs, layout.num_logits):
            n_keep = 1 + _leading_true(accepted[row:row + m - 1]) if accepted is not None and m > 1 else 1
            rid = out.requests[i].request_id
            k = self.batch.params[self.batch.index[rid]].logprobs
            rows = range(row, row + n_keep)
            result.sampled_token_ids[i] = [ids[r] for r in rows]
            result.logprobs[i] = [TokenLogprobs(ids[r], chosen[r], _top(top_ids, top_lp, r, k)) for r in rows]
            self.batch.accept(rid, result.sampled_token_ids[i])
            row += m

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, layout: StepLayout
                         ) -> dict[str, list[TokenLogprobs]]:
        """Logprob, rank and top-k of each scored prompt token, from the raw logits of the position before it."""
        logprobs = self.model.compute_logits(hidden).to(torch.float32).log_softmax(dim=-1)  # [P, V]
        targets, ks = [], []
        for i, n in layout.prompt_lp:
            s = out.requests[i]
            a, row = s.prompt_logprob_range[0], self.batch.index[s.request_id]
            targets.extend(self.batch.tokens.array[row, a + 1:a + 1 + n].tolist())  # the row starts with the prompt
            ks.append(self.batch.params[self.batch.index[s.request_id]].prompt_logprobs)
        tgt = torch.as_tensor(targets, device=logprobs.device)
        tok_lp = logprobs.gather(1, tgt[:, None])  # [P, 1]
        ranks = (logprobs > tok_lp).sum(dim=-1) + 1  # [P]
        top, top_ids = logprobs.topk(max(ks), dim=-1)
        tok_lp, ranks, top, top_ids = tok_lp.squeeze(1).tolist(), ranks.tolist(), top.tolist(), top_ids.tolist()
        res, row = {}, 0
        for (i, n), k in zip(layout.prompt_lp, ks):
            res[out.requests[i].request_id] = [
                TokenLogprobs(targets[r], tok_lp[r], list(zip(top_ids[r][:k], top[r][:k])), ranks[r])
                for r in range(row, row + n)]
            row += n
        return res


def _grammar_rows(out: SchedulerOutput, layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """The scheduler's bitmask rows reordered to the logits rows they mask: ([G, W] int32, [G] int64)."""
    mask_rows, logit_rows, row = [], [], 0
    for i, m in zip(layout.sample_reqs, layout.num_logits):
        g = out.requests[i].grammar_row
        if g is not None:
            mask_rows.extend(range(g, g + m))
            logit_rows.extend(range(row, row + m))
        row += m
    return out.grammar_bitmask[mask_rows], np.asarray(logit_rows, dtype=np.int64)


def _leading_true(flags: list[bool]) -> int:
    """How many drafts in a run were accepted: they count only up to the first rejection."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def _top(top_ids: list | None, top_lp: list | None, row: int, k: int | None) -> list[tuple[int, float]]:
    if top_ids is None or not k:
        return []
    return list(zip(top_ids[row][:k], top_lp[row][:k]))
