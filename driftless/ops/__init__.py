"""Numerics: memory-bounded log-prob extraction, (later) quantization and batch-invariant ops."""

from driftless.ops.logprobs import TokenLogprobs, extract_logprobs, naive_logprobs

__all__ = ["TokenLogprobs", "extract_logprobs", "naive_logprobs"]
