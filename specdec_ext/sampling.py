"""The sampling filter in Python, the same rule as the verifier kernels (csrc/common/sampling_math.h):
what the tree drafters sample from, and what the tests and the audit compare against (the chain
drafters draw with ops.sample_filtered, the verifiers' own filter).

    SamplingParams        temperature, top-k, top-p (one filter for target and draft alike)
    filtered_probs        softmax(l / T) filtered by top-k then top-p, renormalised, in fp32
    sample_inverse_cdf    the kernels' inverse-CDF draw
    as_float              a numeric argument as a float (a ValueError naming it otherwise)

Edge temperatures, as the kernels treat them: below ``GREEDY_TEMPERATURE`` a row is greedy (one-hot
at the argmax, the lowest index on ties); an infinite temperature is uniform over the finite logits
(then filtered by top-k / top-p in the logits' order).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .ops import GREEDY_TEMPERATURE  # temperatures below this are greedy (as vLLM's sampler does)
from .ops.sampling import saturated_top_k  # the op wrappers' rule for a top_k past int32 (off)

# the kernels hold a row's temperature and top_p in float32 and its top_k in int32 (metadata.py)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # 1.2e-38, the smallest positive normal float32
INT32_MAX = int(torch.iinfo(torch.int32).max)


@dataclass(frozen=True)
class SamplingParams:
    """The filter applied alike to the target and the draft: softmax(l / T), top-k, then top-p."""

    temperature: float = 0.0  # 0 (or < GREEDY_TEMPERATURE) = greedy; inf = uniform over the finite logits
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        # Values the kernels' int32 / float32 (metadata.py) cannot hold, stored as ones they can that mean
        # the same: a top_k beyond int32 is beyond any vocabulary (off, as any top_k >= V is), and a
        # positive top_p that float32 would round to 0 (which the kernels refuse) keeps the top token (ties
        # included), as float32's smallest normal does. (Other values are left for ``validate``.)
        object.__setattr__(self, "top_k", saturated_top_k(self.top_k))
        if isinstance(self.top_p, float) and 0.0 < self.top_p < FLOAT32_TINY:
            object.__setattr__(self, "top_p", FLOAT32_TINY)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        if not (self.temperature >= 0.0 and (self.temperature <= FLOAT32_MAX or self.temperature == math.inf)):
            raise ValueError(f"temperature must be >= 0 (0 is greedy) and at most {FLOAT32_MAX:.4g} (float32's "
                             f"largest) or inf (uniform), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 is off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] (1 is off), got {self.top_p}")


def as_float(name: str, value) -> float:
    """A numeric argument as a float; ValueError naming ``name`` for anything but a real number (float()
    would also take text such as "0.5" and the flags True / False)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def filtered_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) filtered by top-k then top-p and renormalised, in fp32 (one-hot when greedy).

    Every logit tied with the k-th largest is kept; top-p keeps every logit >= the one at which the
    descending cumulative mass first reaches top_p times the mass left after top-k.

    logits [..., V] -> probs [..., V] fp32
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    max_logit = logits.amax(-1, keepdim=True)
    if math.isinf(sampling.temperature):
        weights = torch.isfinite(logits).float()
    else:
        weights = torch.exp((logits - max_logit) / sampling.temperature)
    threshold = torch.full_like(max_logit, -float("inf"))
    if 0 < sampling.top_k < vocab:
        threshold = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        sorted_weights = torch.gather(weights, -1, order) * (sorted_logits >= threshold)
        cumulative = torch.cumsum(sorted_weights, dim=-1)
        reached = cumulative >= sampling.top_p * cumulative[..., -1:]
        cut = reached.int().argmax(-1, keepdim=True)  # first position reaching top_p of the mass
        threshold = torch.maximum(threshold, torch.gather(sorted_logits, -1, cut))
    weights = torch.where(logits >= threshold, weights, torch.zeros_like(weights))
    return weights / weights.sum(-1, keepdim=True)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The smallest index whose running sum of ``probs`` exceeds u times the total (the kernels' rule).

    probs [B, V] fp32, uniforms [B] fp32 in [0, 1) -> tokens [B] int64
    """
    cumulative = torch.cumsum(probs, dim=-1)
    target = (uniforms.to(cumulative.dtype) * cumulative[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(tokens, last_positive)
