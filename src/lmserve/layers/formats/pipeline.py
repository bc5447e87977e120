"""Pipeline parallelism as a cut of a model and a replacement layer loop (the model file never knows it is split).

Rank r of N holds a contiguous run of decoder layers (`PPStage.layers`: the first ranks take one more where they do
not divide evenly). The scheduler's rank 0 also keeps the embedding, the final norm and the LM head; the other ranks
hold stand-ins without parameters in their place (`cut_to_stage`, run on the empty model before any weight is read,
so a rank never allocates, reads or dequantizes another rank's weights) and so their KV cache holds their layers only.

A step is a ring over point-to-point sends (gloo on CPU, NCCL on CUDA): rank 0 embeds and runs its layers, sends the
hidden states and the residual stream to rank 1, each rank runs its layers and sends on, and the last rank sends them
back to rank 0, which applies the final norm and the LM head and samples as with one rank. Keeping the head with the
sampler means logits, sampling state and sampled ids never cross a process; every rank sees the same SchedulerOutput
(the executor pipes it to each), so each knows the step's token count and the receive buffers' shape. A peer that died
makes its neighbour's send or receive raise (or time out: ParallelConfig.rank_timeout_s), which fails the step as a
tensor-parallel collective does (worker/executor.py). Combined with tensor parallelism, each stage is a tensor-parallel
group of its own (`stage_tp_group`) and each of its processes exchanges with the same tensor rank of the next stage.

Micro-batches (`PPStage.micro_batches`, --pipeline-micro-batches): a step's rows are cut into parts of whole sequences
(at most that many, balanced by tokens) that travel the ring one after another, so rank 0 runs part 1 while rank 1
runs part 0. Every rank cuts the same step the same way (the cut depends only on the attention context's rows, which
each rank builds from the same SchedulerOutput). The paged attention cuts between decode rows and between prefill
chunks; a chunk, one sequence's rows, is never cut.

The sends and receives are posted in one order on every backend (`ring_posts`), made for NCCL, which ignores tags:
it matches a pair's sends and receives in the order they were posted and runs a process's point-to-point ops on one
stream, one group after another. Posting every receive ahead of the sends (enough over gloo, which matches by tag)
would leave two ranks of two each waiting in a receive for a send queued behind the other's receive. So each post
is a group (`batch_isend_irecv`: NCCL runs its ops together) of one part's send and the neighbouring part's receive,
and the groups of two neighbours pair up one for one (tests/test_pp.py replays the order under NCCL's rules; with
two GPUs or more, not run here: a lent machine had one, and NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ENDS = ("model.embed_tokens.", "model.norm.", "lm_head.")  # rank 0's alone


@dataclass(frozen=True)
class PPStage:
    """This process's place among the pipeline stages, and the model's layer count. With tensor parallelism too, each
    stage is `tp_size` processes, global rank `rank * tp_size + tp_rank`: tensor rank t of a stage exchanges with
    tensor rank t of the next (each holds the whole hidden state after its all-reduces)."""

    rank: int  # the stage
    world_size: int  # stages
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1
    micro_batches: int = 2  # at most this many parts per step (1: the whole step at once)

    def global_rank(self, stage: int) -> int:
        """The process of `stage` that this one exchanges with."""
        return stage * self.tp_size + self.tp_rank

    @property
    def layers(self) -> range:
        """This rank's decoder layers: contiguous, the first `num_layers % world_size` ranks one more."""
        base, extra = divmod(self.num_layers, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def holds(self, name: str) -> bool:
        """Whether a checkpoint tensor (the family's name) is this rank's to load."""
        m = _LAYER.match(name)
        if m is not None:
            return int(m.group(1)) in self.layers
        return self.rank == 0 or not name.startswith(_ENDS)


class AbsentLayer(nn.Module):
    """Another rank's decoder layer: no parameters; the pipeline loop never calls it."""

    absent = True

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank ran a layer it does not hold")


class AbsentEmbedding(nn.Module):
    """Rank > 0's embedding: an uninitialised [T, hidden] of the model's dtype, overwritten by what rank r-1 sends."""

    absent = True

    def __init__(self, hidden_size: int, like: torch.Tensor) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        # carries the model's dtype and device through empty_model's materialisation and .to(dtype)
        self.register_buffer("probe", torch.empty(0, dtype=like.dtype, device=like.device), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.probe.dtype, device=input_ids.device)


class AbsentNorm(nn.Module):
    """Rank > 0's final norm: the forward's result there is discarded (rank 0 norms what comes back)."""

    absent = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return x, residual


class AbsentHead(nn.Module):
    """Rank > 0's LM head: never called (such a rank runs forward_only)."""

    absent = True


def cut_to_stage(net: nn.Module, stage: PPStage) -> None:
    """Replace what this rank does not hold by stand-ins without parameters (net may still be on the meta device)."""
    keep = stage.layers
    for i in range(len(net.model.layers)):
        if i not in keep:
            net.model.layers[i] = AbsentLayer()
    if stage.rank > 0:
        like = net.model.embed_tokens.weight
        net.model.embed_tokens = AbsentEmbedding(net.config.hidden_size, like)
        net.model.norm = AbsentNorm()
        net.lm_head = AbsentHead()


class PipelineLoop(nn.Module):
    """This rank's layers, between a receive from the previous rank and a send to the next, once per micro-batch
    (models/decoder.LayerLoop's contract: (last layer's output, residual stream)); on rank 0 the result is what the
    last rank sent back, the parts in their rows' order. `split_steps` counts the steps that ran in several parts."""

    def __init__(self, stage: PPStage) -> None:
        super().__init__()
        self.stage = stage
        self.split_steps = 0

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, rope, attn) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.stage
        parts = micro_batches(attn, x.shape[0], s.micro_batches)
        self.split_steps += len(parts) > 1
        first = s.rank == 0
        prev = s.global_rank((s.rank - 1) % s.world_size)  # rank 0: the last rank, sending the results back
        nxt = s.global_rank((s.rank + 1) % s.world_size)
        # a message is [2, rows, hidden]: the two streams stacked (a tensor after any layer); kept until sent
        inbox = [torch.empty((2, hi - lo, *x.shape[1:]), dtype=x.dtype, device=x.device) for lo, hi in parts]
        outbox: list[torch.Tensor] = []
        received, sent = {}, []
        posts = ring_posts(first, len(parts))

        def post(j: int) -> None:
            send, recv = posts[j]
            ops = ([dist.P2POp(dist.isend, outbox[send], nxt, tag=send)] if send is not None else []) + \
                  ([dist.P2POp(dist.irecv, inbox[recv], prev, tag=recv)] if recv is not None else [])
            works = dist.batch_isend_irecv(ops)
            if send is not None:
                sent.append(works[0])
            if recv is not None:
                received[recv] = works[-1]

        if not first:
            post(0)
        for i, (lo, hi) in enumerate(parts):
            if first:
                h, residual = x[lo:hi], None
            else:  # a dead or hung peer makes the wait raise, or time out (ParallelConfig.rank_timeout_s)
                received[i].wait()
                h, residual = inbox[i][0], inbox[i][1]
            part_rope, part_attn = (rope, attn) if len(parts) == 1 else (_rows(rope, lo, hi), attn.rows(lo, hi))
            for j in s.layers:
                h, residual = layers[j](h, residual, part_rope, part_attn)
            outbox.append(torch.stack((h, residual)))
            post(i if first else i + 1)
        if first:
            post(len(parts))
            for work in received.values():
                work.wait()
            # one part: its buffers as they are, no copy
            h, residual = (inbox[0][0], inbox[0][1]) if len(parts) == 1 else torch.cat(inbox, dim=1)
        for work in sent:
            work.wait()
        return h, residual  # on a rank > 0: its last part's, discarded (AbsentNorm, forward_only)


def ring_posts(first: bool, parts: int) -> list[tuple[int | None, int | None]]:
    """The (part sent on, part received) of each of a rank's posts in one step, in order: rank 0 posts after running
    each part (its send, and the return of the part before) and once more for the last return; a later rank posts
    the first receive before anything, then after running each part (its send, and the next part's receive). Post j
    of rank 0 and post j of rank 1 are each other's match, so NCCL's in-order pairing never waits in a circle."""
    if first:
        return [(j if j < parts else None, j - 1 if j > 0 else None) for j in range(parts + 1)]
    return [(j - 1 if j > 0 else None, j if j < parts else None) for j in range(parts + 1)]


def micro_batches(attn, num_tokens: int, most: int) -> list[tuple[int, int]]:
    """The step's rows [lo, hi) per micro-batch: at most `most`, cut where the attention context allows (`cuts`:
    between whole sequences), each cut the allowed one nearest an equal share of the tokens; empty parts dropped."""
    if most <= 1 or not hasattr(attn, "rows"):
        return [(0, num_tokens)]
    allowed = attn.cuts()
    inner = {min(allowed, key=lambda c: abs(c * most - i * num_tokens)) for i in range(1, most)}
    bounds = [0, *sorted(inner - {0, num_tokens}), num_tokens]
    return list(zip(bounds, bounds[1:]))


def _rows(rope: dict[str, tuple[torch.Tensor, torch.Tensor]], lo: int, hi: int):
    """The rotary tables of rows [lo, hi) (each (cos, sin) [T, 1, rotary_dim])."""
    return {kind: (cos[lo:hi], sin[lo:hi]) for kind, (cos, sin) in rope.items()}


def stage_tp_group(stage: PPStage) -> dist.ProcessGroup:
    """The tensor-parallel group of this process's stage. Every process creates every stage's group, in the same
    order (torch.distributed requires it), when its tensor_parallel transform runs: once per process."""
    mine = None
    for s in range(stage.world_size):
        group = dist.new_group([s * stage.tp_size + t for t in range(stage.tp_size)])
        if s == stage.rank:
            mine = group
    return mine


def apply_pipeline_parallel(model: nn.Module, stage: PPStage) -> nn.Module:
    """The model's layer loop replaced by this rank's part of the ring."""
    model.layer_loop = PipelineLoop(stage)
    return model
