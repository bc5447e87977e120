"""Sampling: the per-step metadata (built by the runner's persistent batch) and the batched sampler."""

from lmserve.sample.metadata import SamplingMetadata
from lmserve.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]
