"""What the engine reports: StepStats after each step (the engine thread hands it to its listeners), and
EngineLoad, read at any time from other threads (the server's /metrics and drain log)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.sched.output import SchedulerOutput
from lmserve.sched.scheduler import Scheduler
from lmserve.spec.stats import SpecDecodeStats


@dataclass
class StepStats:
    """What one engine step did (read by metrics, benchmarks and tests)."""

    num_running: int = 0
    num_waiting: int = 0
    batch_size: int = 0  # requests in the step's batch
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    step_seconds: float = 0.0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    # speculative decoding in this step: verify runs, drafts, accepted drafts, accepted per draft position
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: list[int] | None = None
    grammar_mask_s: float = 0.0  # filling the step's grammar bitmask (structured outputs), seconds
    # LoRA: adapter names of the running and the waiting requests after the step (None: LoRA off)
    running_loras: tuple[str, ...] | None = None
    waiting_loras: tuple[str, ...] | None = None


def step_stats(sched: Scheduler, kv: KVCacheManager, out: SchedulerOutput, num_decodes: int, num_prefill_tokens: int,
               seconds: float, spec: SpecDecodeStats | None, lora: bool) -> StepStats:
    """The stats of a step that ran `out` (spec: its draft counts; lora: LoRA is on)."""
    stats = StepStats(len(sched.running), len(sched.waiting), len(out.requests), num_decodes, num_prefill_tokens,
                      seconds, kv.usage, kv.num_free_blocks,
                      grammar_mask_s=sched.last_mask_s if out.grammar_bitmask is not None else 0.0)
    if lora:
        stats.running_loras, stats.waiting_loras = sched.lora_names()
    if spec is not None:
        stats.num_drafts, stats.num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        stats.num_accepted_tokens, stats.num_accepted_per_pos = spec.num_accepted_tokens, spec.num_accepted_tokens_per_pos
    return stats


@dataclass(frozen=True)
class EngineLoad:
    """The engine's queue and KV pool now: plain ints read without a lock (consistent enough for a gauge)."""

    num_running: int
    num_waiting: int
    num_preemptions: int  # since start
    kv_free_blocks: int
    kv_total_blocks: int
    kv_usage: float
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache since start
    kv_tier: dict[str, dict[str, int]]  # the KV tier's figures by tier, host | disk (KVTier.summary; {}: no tier)
    images_encoded: int = 0  # images run through the vision encoder since start (an encoder-cache hit runs none)
    gate_holds: int = 0  # an encoder's steps that went first on the CPU since start (worker/cpu_gate.py)
    gate_paused_s: float = 0.0  # what a generative model's steps waited for them


def engine_load(sched: Scheduler, kv: KVCacheManager, runner: Any = None) -> EngineLoad:
    """Read the scheduler's, the KV pool's, the encoder cache's and the CPU gate's counters (from any thread)."""
    images = getattr(runner, "images", None)  # a vision model's ImageInputs (worker/mm_encoder.py)
    gate = getattr(runner, "gate", None)  # worker/cpu_gate.py CpuGate
    return EngineLoad(len(sched.running), len(sched.waiting), sched.num_preemptions, kv.num_free_blocks,
                      kv.pool.num_blocks, kv.usage, kv.prefix_hits, kv.tier.summary() if kv.tier is not None else {},
                      images.cache.num_encoded if images is not None else 0,
                      gate.num_holds if gate is not None else 0, gate.paused_s if gate is not None else 0.0)
