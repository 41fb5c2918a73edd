"""Float64 NumPy references for the tree family (csrc/tree.h): build_tree_mask and tree_verify.

They follow the contract literally, one row and one node at a time, on top of the sampling
helpers of reference.py (filtering, residual, inverse-CDF sampling), so chains and trees share
one reference implementation of each piece.
"""
from __future__ import annotations

import numpy as np

import reference as ref

EMPTY = ref.EMPTY
STATUS_INVALID_TREE = -9
STATUS_NUM_NODES_OUT_OF_RANGE = -10


def tree_status(parents_row, n: int) -> int:
    """0, or the status of an invalid row: num_nodes outside [0, N], or a parent not in [-1, i)."""
    nodes = len(parents_row)
    if n < 0 or n > nodes:
        return STATUS_NUM_NODES_OUT_OF_RANGE
    for i in range(n):
        if not -1 <= int(parents_row[i]) < i:
            return STATUS_INVALID_TREE
    return 0


def build_tree_mask(parents, num_nodes=None):
    """Reference of specdec_ext::build_tree_mask: (mask [B, N, N] bool, depth [B, N] int32).

    Ancestors are found by walking parent links (not by copying the parent's row as the kernel does).
    """
    parents = np.asarray(parents)
    batch, nodes = parents.shape
    mask = np.zeros((batch, nodes, nodes), dtype=bool)
    depth = np.zeros((batch, nodes), dtype=np.int32)
    for b in range(batch):
        n = nodes if num_nodes is None else int(num_nodes[b])
        status = tree_status(parents[b], n)
        if status:
            depth[b] = status
            continue
        for i in range(nodes):
            if i >= n:
                mask[b, i, i] = True
                continue
            j, d = i, 0
            while j >= 0:
                mask[b, i, j] = True
                j, d = int(parents[b, j]), d + 1
            depth[b, i] = d
    return mask, depth


def children(parents_row, n: int, node: int):
    """The children of `node` (-1: the root) among the first n nodes, in increasing index order."""
    return [c for c in range(n) if int(parents_row[c]) == node]


class _Margin:
    """Smallest relative distance of any decision from its boundary (a float64 reference and an fp32
    kernel may only disagree on rows where this is tiny)."""

    def __init__(self):
        self.value = np.inf

    def accept(self, u, p, q):
        self.value = min(self.value, abs(u * q - p))

    def sample(self, weights, u):
        cumulative = np.cumsum(weights) / weights.sum()
        j = int(np.argmax(cumulative > u))  # the sampled index: u lies in [cumulative[j-1], cumulative[j])
        below = cumulative[j - 1] if j > 0 else 0.0
        self.value = min(self.value, u - below, cumulative[j] - u)


def tree_verify_row(logits, ids, parents_row, q_rows, n, filt, uniforms, skip_residual=False, margin=None):
    """One valid row: (path [N], tokens [N+1], num_accepted). skip_residual=True is a deliberately
    wrong variant (p is not updated after a rejection) used to show the distribution tests' power."""
    nodes = len(parents_row)
    vocab = logits.shape[-1]
    path = np.full(nodes, EMPTY, dtype=np.int32)
    tokens = np.full(nodes + 1, EMPTY, dtype=np.int64)
    current, depth = -1, 0
    while True:
        p = ref.filtered_probs(logits[current + 1], **filt)
        accepted = None
        for c in children(parents_row, n, current):
            x = int(ids[c])
            q = ref.one_hot(x, vocab) if q_rows is None else np.asarray(q_rows[c], dtype=np.float64)
            if margin is not None:
                margin.accept(uniforms[c], p[x], q[x])
            if uniforms[c] * q[x] < p[x]:
                accepted = c
                break
            if not skip_residual:
                p = ref.residual(p, q)
        if accepted is None:
            if margin is not None:
                margin.sample(p, uniforms[n])
            tokens[depth] = ref.sample_inverse_cdf(p, uniforms[n])
            return path, tokens, depth
        path[depth] = accepted
        tokens[depth] = int(ids[accepted])
        depth += 1
        current = accepted


def tree_verify(logits, ids, parents, draft_probs, num_nodes, temperature, top_k, top_p, uniforms,
                skip_residual=False, with_margin=False):
    """Reference of specdec_ext::tree_verify for rows with a valid filter, tree and ids.

    Returns (path [B, N] int32, tokens [B, N+1] int64, num_accepted [B] int32), and with
    with_margin=True also margin [B]: the smallest distance of a decision from its boundary.
    """
    logits = np.asarray(logits, dtype=np.float64)
    batch, positions, _ = logits.shape
    nodes = positions - 1
    path = np.full((batch, nodes), EMPTY, dtype=np.int32)
    tokens = np.full((batch, nodes + 1), EMPTY, dtype=np.int64)
    num_accepted = np.zeros(batch, dtype=np.int32)
    margins = np.full(batch, np.inf)
    for b in range(batch):
        n = nodes if num_nodes is None else int(num_nodes[b])
        status = tree_status(parents[b], n)
        if status:
            num_accepted[b] = status
            continue
        filt = dict(temperature=float(temperature[b]), top_k=int(top_k[b]), top_p=float(top_p[b]))
        margin = _Margin() if with_margin else None
        path[b], tokens[b], num_accepted[b] = tree_verify_row(
            logits[b], ids[b], parents[b], None if draft_probs is None else draft_probs[b], n, filt,
            np.asarray(uniforms[b], dtype=np.float64), skip_residual=skip_residual, margin=margin)
        if margin is not None:
            margins[b] = margin.value
    if with_margin:
        return path, tokens, num_accepted, margins
    return path, tokens, num_accepted
