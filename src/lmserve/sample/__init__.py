"""Sampling: per-step metadata built once, and the batched sampler."""

from lmserve.sample.metadata import SamplingMetadata, SamplingRow, build_sampling_metadata
from lmserve.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow", "build_sampling_metadata"]
