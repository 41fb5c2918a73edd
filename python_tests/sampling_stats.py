"""The distribution tests' shared statistics: the exact law of the first three generated tokens under
plain sampling from a (tiny) target, and a pooled chi-square test of samples against it."""
from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats as scipy_stats

import reference

MIN_EXPECTED = 5.0  # chi-square cells with fewer expected counts are pooled


def exact_joint(target, prompt, temperature=1.0, top_p=1.0):
    """P(first three new tokens = (a, b, c)) under plain sampling from the filtered target: [V, V, V].
    One forward over every two-token continuation; V is the target's output vocabulary."""
    V = int(target.get_output_embeddings().weight.shape[0])
    pairs = list(itertools.product(range(V), repeat=2))
    ids = torch.tensor([list(prompt) + [a, b] for a, b in pairs])
    with torch.no_grad():
        logits = target(ids).logits.double().numpy()
    n = len(prompt)
    joint = np.zeros((V, V, V))
    p1 = reference.filtered_probs(logits[0, n - 1], temperature, 0, top_p)
    for row, (a, b) in enumerate(pairs):
        p2 = reference.filtered_probs(logits[row, n], temperature, 0, top_p)
        p3 = reference.filtered_probs(logits[row, n + 1], temperature, 0, top_p)
        joint[a, b] = p1[a] * p2[b] * p3
    return joint


def chi_square_p(samples, joint):
    """p-value of the samples (token triples) against ``joint``, cells below MIN_EXPECTED pooled."""
    counts = np.zeros(joint.size)
    for s in samples:
        counts[np.ravel_multi_index(tuple(s), joint.shape)] += 1
    expected = joint.ravel() * len(samples)
    big = expected >= MIN_EXPECTED
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a sample has zero probability under the filtered target"
    return scipy_stats.chisquare(obs[keep], exp[keep]).pvalue


def prefix_blind(original):
    """A mutation of ``ProcessingState.apply`` (``original``): every column of a verify pass processed with the
    committed counts only, as if it were the first, which is how a verifier that ignores its own drafts would
    process them (the distribution tests must reject it)."""
    def apply(self, logits, draft_tokens, num_draft, temperature, parents=None, counts=None):
        for column in range(logits.shape[1]):
            view = logits[:, column: column + 1].contiguous()
            original(self, view, draft_tokens[:, :0], torch.zeros_like(num_draft), temperature, None, counts)
            logits[:, column: column + 1] = view
    return apply
