"""Repetition, frequency and presence penalties on a batch of logits."""

from __future__ import annotations

import torch

from lmserve.sample.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition as HF/vLLM (divide positive, multiply negative logits of tokens seen in prompt or
    output), then OpenAI's frequency (times the count in the output) and presence (once if in the
    output) subtractions. logits [B, V]; returns a new tensor. Rows at neutral values are unchanged."""
    counts = meta.output_counts  # [B, V]
    in_output = counts > 0  # [B, V]
    if meta.repetition is not None:
        seen = in_output | meta.prompt_seen
        pen = meta.repetition  # [B, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
    if meta.frequency is not None:
        logits = logits - meta.frequency * counts
    if meta.presence is not None:
        logits = logits - meta.presence * in_output
    return logits
