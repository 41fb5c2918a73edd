"""Float64 NumPy references for every kernel of the sampling family.

These follow the contract of csrc/common/sampling_math.h and csrc/sampling.h literally (sorts and
cumulative sums instead of the kernels' threshold searches), so a kernel that agrees with them
implements the documented semantics.
"""
from __future__ import annotations

import numpy as np

EMPTY = -1
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """Philox4x32-10 on Python ints: counter (4 words), key (2 words) -> 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c3 ^ k1) & MASK32, p0 & MASK32
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, offset: int, position: int) -> float:
    s, o = seed & 0xFFFFFFFFFFFFFFFF, offset & 0xFFFFFFFFFFFFFFFF
    word = philox4x32_10((o & MASK32, o >> 32, position & MASK32, 0), (s & MASK32, s >> 32))[0]
    return (word >> 8) / float(1 << 24)


def philox_uniforms(seeds, offsets, num_draws: int) -> np.ndarray:
    return np.array([[philox_uniform(int(s), int(o), c) for c in range(num_draws)]
                     for s, o in zip(seeds, offsets)], dtype=np.float32)


GREEDY_TEMPERATURE = 1e-5  # csrc/common/sampling_math.h: kGreedyTemperature


def temperature_weights(logits: np.ndarray, temperature: float) -> np.ndarray:
    """exp((logits - max) / T), float64 (so finite logits never overflow apart: each weighs 1 at T = inf, as the
    kernels' weight_exponent keeps them); weight 0 where that is NaN (a -inf logit at T = inf)."""
    logits = np.asarray(logits, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        scaled = (logits - logits.max()) / temperature
    return np.where(np.isnan(scaled), 0.0, np.exp(np.where(np.isnan(scaled), 0.0, scaled)))


def top_k_threshold(logits: np.ndarray, top_k: int) -> float:
    """The k-th largest logit (every logit tied with it kept); -inf when top-k is off (0 or k >= V)."""
    return np.sort(logits)[::-1][top_k - 1] if 0 < top_k < logits.shape[-1] else -np.inf


def filtered_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """softmax(logits / T) filtered by top-k then top-p and renormalised.

    T below GREEDY_TEMPERATURE (0 included) is greedy: one-hot at the argmax, the lowest index on
    ties. T = inf weighs every finite logit 1 and a -inf logit 0 ((-inf - max) / inf is NaN: weight 0).
    Ties: every logit equal to the k-th largest is kept; top-p keeps every logit >= the one at which
    the descending cumulative mass first reaches top_p * (mass after top-k).
    """
    logits = np.asarray(logits, dtype=np.float64)
    vocab = logits.shape[-1]
    if not temperature >= GREEDY_TEMPERATURE:
        p = np.zeros(vocab)
        p[int(np.argmax(logits))] = 1.0
        return p
    weights = temperature_weights(logits, temperature)
    threshold = top_k_threshold(logits, top_k)
    if top_p < 1.0:
        kept = logits >= threshold
        order = np.argsort(-logits, kind="stable")
        order = order[kept[order]]
        cumulative = np.cumsum(weights[order])
        cut = int(np.argmax(cumulative >= top_p * cumulative[-1]))
        threshold = max(threshold, logits[order[cut]])
    weights = np.where(logits >= threshold, weights, 0.0)
    return weights / weights.sum()


def top_p_margin(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> float:
    """How close top_p * M lies to a step of the cumulative mass, relative to M (inf where top-p is off).

    Top-p keeps the levels of equal logits, largest first, until their cumulative mass reaches
    top_p * M; the margin is the distance of that target from the masses before and after the last
    level kept. A kernel summing in fp32 (or in another order) may cut on either side of a level
    whose margin is within its rounding (about 1e-6 of M for a 128k vocabulary).
    """
    if not (top_p < 1.0 and temperature >= GREEDY_TEMPERATURE):
        return float("inf")
    logits = np.asarray(logits, dtype=np.float64)
    weights = temperature_weights(logits, temperature)
    keep = logits >= top_k_threshold(logits, top_k)
    logits, weights = logits[keep], weights[keep]
    levels, inverse = np.unique(-logits, return_inverse=True)  # ascending -logit: largest logit first
    cumulative = np.cumsum(np.bincount(inverse, weights=weights, minlength=len(levels)))
    total = cumulative[-1]
    target = top_p * total
    last = int(np.argmax(cumulative >= target))
    before = cumulative[last - 1] if last > 0 else 0.0
    return float(min(target - before, cumulative[last] - target) / total)


def residual(p, q) -> np.ndarray:
    """normalise(max(0, p - q)); p itself where the residual mass is zero."""
    p = np.asarray(p, dtype=np.float64)
    r = np.maximum(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64), 0.0)
    mass = r.sum(axis=-1, keepdims=True)
    return np.where(mass > 0, r / np.where(mass > 0, mass, 1.0), p)


def sample_inverse_cdf(weights, u: float) -> int:
    """The smallest index whose running sum exceeds u * total mass."""
    weights = np.asarray(weights, dtype=np.float64)
    cumulative = np.cumsum(weights)
    return int(np.argmax(cumulative > u * cumulative[-1]))


def one_hot(token: int, vocab: int) -> np.ndarray:
    q = np.zeros(vocab)
    q[token] = 1.0
    return q


def chain_verify(logits, draft_ids, draft_probs, num_draft, temperature, top_k, top_p, uniforms):
    """Reference of specdec_ext::chain_verify for valid input. Returns (tokens [B, k+1], num_accepted [B])."""
    logits = np.asarray(logits, dtype=np.float64)
    batch, positions, vocab = logits.shape
    k = positions - 1
    tokens = np.full((batch, k + 1), EMPTY, dtype=np.int64)
    num_accepted = np.zeros(batch, dtype=np.int32)
    for b in range(batch):
        n = k if num_draft is None else int(num_draft[b])
        filt = dict(temperature=float(temperature[b]), top_k=int(top_k[b]), top_p=float(top_p[b]))
        final = None
        accepted = 0
        for i in range(n):
            x = int(draft_ids[b, i])
            p = filtered_probs(logits[b, i], **filt)
            q = one_hot(x, vocab) if draft_probs is None else np.asarray(draft_probs[b, i], dtype=np.float64)
            if uniforms[b, i] * q[x] < p[x]:
                tokens[b, i] = x
                accepted += 1
                continue
            final = sample_inverse_cdf(residual(p, q), uniforms[b, n])
            break
        if final is None:
            final = sample_inverse_cdf(filtered_probs(logits[b, n], **filt), uniforms[b, n])
        tokens[b, accepted] = final
        num_accepted[b] = accepted
    return tokens, num_accepted

