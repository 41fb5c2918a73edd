"""Draft trees from a draft model (generate(..., draft_tree=(b, d, N))): greedy equality with HF generate,
the exact target distribution at T = 1 (chi-square, with a verifier that skips the removal of rejected
candidates as the negative control), and tokens per target pass against the chain at equal verify budget."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

import reference
from specdec_ext import generate, ops
from specdec_ext.drafters.tree_drafter import beam_widths, tree_num_nodes
from specdec_ext.metadata import filtered_probs
from test_generate_utils import hf_greedy, noisy_copy, one_thread, tiny_model

NEW = 24
PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30], [7, 7, 81, 13, 40]]  # ragged
TREES = [(2, 4, 16), (3, 3, 8)]

TINY_VOCAB = 8
POSITIONS = 3  # the prefill token, then the first tree step (root level and depth 2)
SAMPLES = 3000
MIN_EXPECTED = 5.0
PROMPT = [1, 4, 2, 6]
PASS_P = 1e-4
FAIL_P = 1e-8


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=96, hidden=64, layers=2, seed=0, logit_scale=3.0)
    return target, noisy_copy(target, noise=0.3)


@pytest.fixture(scope="module")
def references(pair):
    return [hf_greedy(pair[0], p, NEW) for p in PROMPTS]


def test_beam_widths_and_node_counts():
    assert beam_widths(2, 4, 16) == [2, 4, 8, 16] and tree_num_nodes(2, 4, 16) == 16
    assert beam_widths(3, 3, 8) == [3, 8, 8] and tree_num_nodes(3, 3, 8) == 8
    assert beam_widths(1, 4, 6) == [1, 1, 1, 1] and tree_num_nodes(1, 4, 6) == 4  # b = 1: a chain
    assert beam_widths(2, 1, 4) == [2] and tree_num_nodes(2, 1, 4) == 2
    for bad in [(0, 2, 4), (2, 0, 4), (2, 2, True)]:
        with pytest.raises(ValueError):
            beam_widths(*bad)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("runner", ["paged", "recompute"])
def test_greedy_tree_matches_hf_generate_batch1_and_batch3(pair, references, tree, runner):
    target, draft = pair
    one = generate([PROMPTS[0]], target, draft, max_new_tokens=NEW, draft_tree=tree, runner=runner)
    assert one.token_ids == [references[0]]
    batch = generate(PROMPTS, target, draft, max_new_tokens=NEW, draft_tree=tree, runner=runner)
    assert batch.token_ids == references
    assert batch.stats.tokens_per_pass > 1.0  # the tree was used, not only bonus tokens
    # an unrelated draft and the target as its own draft give the same tokens
    other = tiny_model("llama", vocab=96, hidden=32, layers=1, seed=7)
    assert generate(PROMPTS, target, other, max_new_tokens=NEW, draft_tree=tree).token_ids == references
    self_draft = generate(PROMPTS, target, target, max_new_tokens=NEW, draft_tree=tree)
    assert self_draft.token_ids == references
    assert self_draft.stats.tokens_per_pass > 2.0
    # the draft's cache is right: its top-1 at the root is the target's argmax at every step
    assert self_draft.stats.accepted[0] == self_draft.stats.reached[0]


def test_eos_and_max_new_tokens_with_a_tree(pair, references):
    target, draft = pair
    eos = references[1][5]
    out = generate(PROMPTS, target, draft, max_new_tokens=NEW, draft_tree=(2, 4, 16), eos_token_id=eos)
    for ref, got, reason in zip(references, out.token_ids, out.finish_reasons):
        if eos in ref:
            assert got == ref[: ref.index(eos) + 1] and reason == "eos"
        else:
            assert got == ref and reason == "length"
    for max_new in (1, 2, 7):
        assert generate(PROMPTS, target, draft, max_new_tokens=max_new,
                        draft_tree=(2, 4, 16)).token_ids == [r[:max_new] for r in references]


def test_draft_tree_argument_is_validated(pair):
    target, draft = pair
    for bad in [(2, 4), (0, 4, 16), (2, 4, 16.0), "2,4,16"]:
        with pytest.raises(ValueError, match="draft_tree"):
            generate([PROMPTS[0]], target, draft, max_new_tokens=4, draft_tree=bad)


# --------------------------------------------------------------------------- distribution at T = 1
@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0)
    draft = tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0)
    return target, draft


def exact_joint(target, prompt, temperature=1.0):
    """P(first three tokens = (a, b, c)) under plain sampling from the target: [V, V, V]."""
    V = TINY_VOCAB
    pairs = list(itertools.product(range(V), repeat=2))
    ids = torch.tensor([prompt + [a, b] for a, b in pairs])
    with torch.no_grad():
        logits = target(ids).logits.double().numpy()
    n = len(prompt)
    joint = np.zeros((V, V, V))
    p1 = reference.filtered_probs(logits[0, n - 1], temperature, 0, 1.0)
    for row, (a, b) in enumerate(pairs):
        p2 = reference.filtered_probs(logits[row, n], temperature, 0, 1.0)
        p3 = reference.filtered_probs(logits[row, n + 1], temperature, 0, 1.0)
        joint[a, b] = p1[a] * p2[b] * p3
    return joint


def chi_square_p(samples, joint):
    counts = np.zeros(joint.size)
    for s in samples:
        counts[np.ravel_multi_index(tuple(s), joint.shape)] += 1
    expected = joint.ravel() * len(samples)
    big = expected >= MIN_EXPECTED
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a sample has zero probability under the target"
    return scipy_stats.chisquare(obs[keep], exp[keep]).pvalue


def python_tree_verifier(remove_rejected: bool):
    """The deterministic-candidate rule in Python (row by row). With remove_rejected=False it is the
    bug the test must catch: a rejected candidate stays in p (acceptance and the final draw use the
    unreduced p)."""

    def verifier(meta, target_logits):
        B, positions, _ = target_logits.shape
        N = positions - 1
        probs = filtered_probs(target_logits, meta.sampling).double()  # [B, N+1, V]
        u = ops.philox_uniforms(meta.seed, meta.verify_offset, N + 1).double()  # [B, N+1]
        parents, tokens = meta.tree_parents.tolist(), meta.draft_token_ids.tolist()
        meta.tree_path.fill_(-1)
        meta.output_tokens.fill_(-1)
        for b in range(B):
            cur, depth = -1, 0
            while True:
                p = probs[b, cur + 1].clone()
                moved = False
                for c in (i for i in range(N) if parents[b][i] == cur):
                    x = tokens[b][c]
                    if u[b, c] * p.sum() < p[x]:
                        meta.tree_path[b, depth] = c
                        meta.output_tokens[b, depth] = x
                        depth, cur, moved = depth + 1, c, True
                        break
                    if remove_rejected:
                        p[x] = 0.0
                if not moved:
                    cumulative = torch.cumsum(p, 0)
                    token = int(torch.searchsorted(cumulative, u[b, N] * cumulative[-1], right=True))
                    meta.output_tokens[b, depth] = min(token, p.shape[0] - 1)
                    meta.num_accepted[b] = depth
                    break

    return verifier


def sample_first_tokens(target, draft, tree, **kw):
    out = generate([PROMPT] * SAMPLES, target, draft, max_new_tokens=POSITIONS, draft_tree=tree,
                   seed=list(range(SAMPLES)), temperature=1.0, cost_probe=False, **kw)
    assert all(len(t) == POSITIONS for t in out.token_ids)
    return out


@pytest.mark.parametrize("tree", [(2, 2, 4), (3, 2, 5)])
def test_first_tokens_follow_plain_target_sampling_at_t1(tiny_pair, tree):
    target, draft = tiny_pair
    joint = exact_joint(target, PROMPT)
    out = sample_first_tokens(target, draft, tree)
    reached, accepted = out.stats.reached, out.stats.accepted
    assert 0.05 < accepted[0] / reached[0] < 0.95  # accepts and rejections at the root
    assert accepted[1] > 0  # some rows accept a depth-2 node
    p_value = chi_square_p(out.token_ids, joint)
    print(f"\ntree {tree}: chi-square p = {p_value:.3g}, acceptance by depth {out.stats.acceptance_by_position[:2]}")
    assert p_value > PASS_P


def test_chi_square_catches_a_verifier_that_keeps_rejected_candidates(tiny_pair):
    target, draft = tiny_pair
    joint = exact_joint(target, PROMPT)
    right = sample_first_tokens(target, draft, (2, 2, 4), verifier=python_tree_verifier(True))
    wrong = sample_first_tokens(target, draft, (2, 2, 4), verifier=python_tree_verifier(False))
    p_right, p_wrong = chi_square_p(right.token_ids, joint), chi_square_p(wrong.token_ids, joint)
    print(f"\npython verifier with removal p = {p_right:.3g}, without removal p = {p_wrong:.3g}")
    assert p_right > PASS_P  # the Python rule is the kernel's rule: only the removal differs below
    assert p_wrong < FAIL_P


# --------------------------------------------------------------------------- tokens per target pass
def test_tree_tokens_per_pass_at_least_the_chains_at_equal_verify_budget(capsys):
    """Greedy, near-self draft (a noisy copy of the target): with N + 1 = k + 1 tokens per target pass,
    the tree's second candidates recover many of the chain's early rejections."""
    target = tiny_model("llama", vocab=64, hidden=32, layers=1, seed=0, logit_scale=3.0)
    prompts = [[1 + i, 2, 3 + i, 4, 5] for i in range(8)]
    rows = []
    for noise in (0.0, 0.3, 0.4):
        draft = target if noise == 0.0 else noisy_copy(target, noise)
        for k, tree in ((4, (2, 4, 4)), (6, (2, 6, 6))):
            assert tree_num_nodes(*tree) == k
            chain = generate(prompts, target, draft, max_new_tokens=40, k=k, cost_probe=False)
            treed = generate(prompts, target, draft, max_new_tokens=40, draft_tree=tree, cost_probe=False)
            assert treed.token_ids == chain.token_ids
            rows.append((noise, k, tree, chain.stats.tokens_per_pass, treed.stats.tokens_per_pass))
    with capsys.disabled():
        print("\nnoise  k  tree        chain tok/pass  tree tok/pass")
        for noise, k, tree, c, t in rows:
            print(f"{noise:5.1f}  {k}  {str(tree):10s}  {c:14.2f}  {t:13.2f}")
    for noise, k, tree, c, t in rows:
        if noise == 0.4:
            assert t >= c, (noise, k, tree, c, t)
