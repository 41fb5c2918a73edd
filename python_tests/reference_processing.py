"""Float64 NumPy reference for process_logits (csrc/logits_processing.h), written from the contract:
a column's prefix walked through the parent links, the counts it adds, then the five steps in
vLLM's order on whole columns, min_p as its definition (prob < min_p * max prob after
softmax(l / T)) rearranged to logits.

``count_prefix=False`` is a deliberately wrong variant (the draft prefix not counted as generated),
for the test that shows the kernels' tests can tell the difference.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

GREEDY_TEMPERATURE = np.float32(1e-5)  # csrc/common/sampling_math.h: kGreedyTemperature (fp32)
# |l - threshold| within this fraction of the magnitudes involved: fp32 and float64 may cut differently
BOUNDARY_BAND = 1e-4


def prefix_tokens(draft_row, parents_row, column: int) -> List[int]:
    """The tokens before ``column``: node column - 1 and its ancestors (a chain: drafts 0 .. column-1)."""
    tokens = []
    i = column - 1
    while i >= 0:
        tokens.append(int(draft_row[i]))
        i = i - 1 if parents_row is None else int(parents_row[i])
    return tokens


def allowed_bits(words, vocab: int) -> np.ndarray:
    """A column's bitmask [W] (int32 words read as uint32) -> bool [V]."""
    w = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    return (((w[:, None] >> np.arange(32)) & 1).reshape(-1)[:vocab]).astype(bool)


def _row(value, b: int, default: float) -> float:
    return default if value is None else float(np.asarray(value, dtype=np.float64)[b])


def _min_p_on(min_p: float, temperature: float) -> bool:
    return min_p > 0 and np.isfinite(temperature) and np.float32(temperature) >= GREEDY_TEMPERATURE


def process_column(raw, count, seen, bias, words, r: float, presence: float, frequency: float):
    """Steps 1-4 on one column (float64 arrays [V])."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        logits = raw + bias
        if r != 1.0:
            logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - (frequency * count + presence * (count > 0))
        if words is not None:
            logits = np.where(allowed_bits(words, raw.shape[0]) | np.isnan(logits), logits, -np.inf)
    return logits


def process_logits_reference(logits, draft_tokens, num_draft, *, parents=None, output_counts=None, prompt_mask=None,
                             logit_bias=None, allowed=None, presence_penalty=None, frequency_penalty=None,
                             repetition_penalty=None, min_p=None, temperature=None, count_prefix: bool = True):
    """(processed logits float64 [B, P, V], near_cut bool [B, P, V]): near_cut marks the finite logits
    within BOUNDARY_BAND of a column's min_p threshold, where fp32 kernels may decide either way.
    Stale columns (c > num_draft[b]) are returned as given."""
    x = np.asarray(logits, dtype=np.float64)
    batch, positions, vocab = x.shape
    out, near = x.copy(), np.zeros(x.shape, dtype=bool)
    drafts = np.asarray(draft_tokens)
    for b in range(batch):
        base = np.zeros(vocab, np.int64) if output_counts is None else np.asarray(output_counts[b], np.int64)
        prompt = np.zeros(vocab, bool) if prompt_mask is None else np.asarray(prompt_mask[b], bool)
        bias = 0.0 if logit_bias is None else np.asarray(logit_bias[b], np.float64)
        r = _row(repetition_penalty, b, 1.0)
        keep_ratio, t = _row(min_p, b, 0.0), _row(temperature, b, 1.0)
        for c in range(min(positions, int(num_draft[b]) + 1)):
            count = base.copy()
            if count_prefix:
                for token in prefix_tokens(drafts[b], None if parents is None else np.asarray(parents[b]), c):
                    count[token] += 1
            words = None if allowed is None else np.asarray(allowed[b, c])
            column = process_column(x[b, c], count, prompt | (count > 0), bias, words, r,
                                    _row(presence_penalty, b, 0.0), _row(frequency_penalty, b, 0.0))
            if _min_p_on(keep_ratio, t):
                column, near[b, c] = _min_p_cut(column, keep_ratio, t)
            out[b, c] = column
    return out, near


def _min_p_cut(column, keep_ratio: float, temperature: float):
    finite = np.isfinite(column)
    if not finite.any():
        return column, np.zeros(column.shape, bool)
    top = column[finite].max()
    offset = temperature * np.log(keep_ratio)
    threshold = top + offset
    with np.errstate(invalid="ignore"):
        near = finite & (np.abs(column - threshold) <= BOUNDARY_BAND * (1 + abs(top) + abs(offset)))
        return np.where(column < threshold, -np.inf, column), near


def softmax_min_p_keeps(column, keep_ratio: float, temperature: float) -> np.ndarray:
    """min_p by its definition, for a check of the rearrangement: p = softmax(l / T) over the finite
    logits, keep p >= min_p * max p."""
    finite = np.isfinite(column)
    z = np.where(finite, (column - column[finite].max()) / temperature, -np.inf)
    p = np.exp(z)
    p /= p.sum()
    return finite & (p >= keep_ratio * p.max())


def optional_numpy(value) -> Optional[np.ndarray]:
    """A tensor argument as NumPy (None kept)."""
    if value is None:
        return None
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
