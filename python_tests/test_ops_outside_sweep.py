"""An outside sweep of the public ops (specdec_ext.ops), written the way tests of the same algorithms are written
elsewhere (vLLM's rejection sampler, FlashInfer's chain speculative sampling and top-k / top-p sampling, SGLang's
tree speculative sampling), probing what the project's own op tests do not:

- rejection-sampling edges against the float64 references: p == q exactly (never rejected, even at the largest
  uniform), p(x) = 0 (always rejected, even at u = 0), vocabularies of 1-3 tokens with ties, -inf masks and one-hot
  rows, k = 0 and k = 256, ragged rows, uniforms at exactly 0 and 1 - 2^-24, stars, chains and binary trees;
- the joint law of the first two emitted tokens of a chain, and the depth-1 law of a star, under adversarial draft
  distributions (most of q's mass where the filtered p has none), with the power to catch a verifier that
  resamples from p instead of the residual;
- 16-bit logits give exactly what their fp32 upcast gives; batch permutation and thread count change nothing;
- sampling filters at extremes (top_k >= V, ties at top_k = 1, T = 1e-6 / 1e6, min_p = 1 among ties);
- tree masks of degenerate trees (a 600-node chain, a star), KV compaction with nothing and everything accepted;
- opcheck on shapes the other tests do not use;
- inputs that share memory with what an op writes, and invalid values the ops pass on silently (each such test
  asserts the correct behaviour: an error naming the argument, or torch's read-then-write answer).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import reference as ref
import reference_token_buffer as ref_tb
import reference_tree as rt
from specdec_ext import ops

LAST_UNIFORM = 1.0 - 2.0 ** -24  # the largest draw philox_uniforms gives
I32, I64 = torch.int32, torch.int64
OPS = torch.ops.specdec_ext


def chain_parents(batch: int, k: int) -> torch.Tensor:
    return torch.arange(-1, k - 1, dtype=I32).expand(batch, k).contiguous()


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """counts over cells against probs; no count may fall where probs is 0; small cells pooled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token (pair) of probability 0 under the filtered target was emitted"
    expected = probs[support] / probs[support].sum() * counts.sum()
    observed = counts[support]
    small = expected < min_expected
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(observed, expected).pvalue


# =============================================================================================================
# Rejection sampling at its edges (exact, explicit uniforms)
# =============================================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=5), dict(top_p=0.9), dict(temperature=0.7, top_k=3, top_p=0.8),
                                     dict(temperature=1e6), dict(temperature=float("inf"), top_k=4)],
                         ids=["plain", "k5", "p09", "t07_k3_p08", "t1e6", "tinf_k4"])
def test_a_draft_distributed_exactly_as_the_target_is_never_rejected(dtype, filters):
    """q = the verifier's own filtered p (sample_filtered on the same logits, the drafters' path): min(1, p/q) = 1,
    so even the largest draw 1 - 2^-24 accepts every draft, on chains and on chain-shaped trees."""
    g = torch.Generator().manual_seed(11)
    batch, k = 48, 3
    for vocab in (2, 33, 4099):
        logits = (torch.randn(batch, k + 1, vocab, generator=g) * 3).to(dtype)
        q = torch.empty(batch, k, vocab)
        ids = torch.empty(batch, k, dtype=I64)
        for i in range(k):
            q[:, i], ids[:, i] = ops.sample_filtered(logits[:, i].contiguous(), seed=torch.arange(batch) + 100 * i,
                                                     **filters)
        uniforms = torch.full((batch, k + 1), LAST_UNIFORM)
        _, n = ops.chain_verify(logits, ids, q, uniforms=uniforms, **filters)
        assert n.tolist() == [k] * batch, f"V={vocab}: p == q rejected a draft"
        _, _, n_tree = ops.tree_verify(logits, ids, chain_parents(batch, k), q, uniforms=uniforms, **filters)
        assert n_tree.tolist() == [k] * batch


@pytest.mark.parametrize("with_probs", [True, False])
def test_a_draft_the_filtered_target_excludes_is_rejected_even_at_u_zero(with_probs):
    """p(x) = 0 (x below top-k, or a -inf logit): rejected whatever the draw (u = 0: 0 * q < 0 is false), and the
    recovered token is never x; on a tree every such sibling is rejected and the row emits one token."""
    g = torch.Generator().manual_seed(3)
    batch, vocab = 64, 9
    logits = torch.randn(batch, 2, vocab, generator=g)
    logits[:, 0, 7] = float("-inf")
    excluded = logits[:, 0].argsort(-1)[:, :4]  # the 3 smallest finite logits and the -inf one: out of top-5
    ids = excluded.gather(1, (torch.arange(batch) % 4)[:, None]).contiguous()  # each excluded token in turn
    q = None
    if with_probs:
        q = torch.full((batch, 1, vocab), 0.05)
        q.scatter_(2, ids[:, :, None], 0.6)
    u0 = torch.zeros(batch, 2)
    tokens, n = ops.chain_verify(logits, ids, q, top_k=5, uniforms=u0)
    assert n.tolist() == [0] * batch
    p = np.stack([ref.filtered_probs(logits[b, 0].numpy(), 1.0, 5) for b in range(batch)])
    assert (p[np.arange(batch), tokens[:, 0].numpy()] > 0).all() and not bool((tokens[:, 0] == ids[:, 0]).any())
    # a star of the four excluded tokens: all rejected, the recovered token from what is left
    star_ids = excluded.contiguous()
    star_logits = torch.cat([logits[:, :1], torch.zeros(batch, 4, vocab)], dim=1)
    star_q = None
    if with_probs:
        star_q = torch.full((batch, 4, vocab), 0.4 / (vocab - 4))
        star_q.scatter_(2, star_ids[:, None, :].expand(batch, 4, 4), 0.15)
    path, tree_tokens, tree_n = ops.tree_verify(star_logits, star_ids, torch.full((4,), -1, dtype=I32), star_q,
                                                top_k=5, uniforms=torch.zeros(batch, 5))
    assert tree_n.tolist() == [0] * batch and bool((path == -1).all())
    assert (p[np.arange(batch), tree_tokens[:, 0].numpy()] > 0).all()


def _edge_case(rng):
    """One random chain case from a regime of edges: tied small-integer logits, -inf masks, one-hot rows; q absent,
    one-hot, Dirichlet or two-point; uniforms exactly 0, exactly 1 - 2^-24, or random."""
    batch, k, vocab = int(rng.integers(1, 6)), int(rng.integers(0, 9)), int(rng.choice([1, 2, 3, 5, 16]))
    regime = rng.choice(["ties", "masked", "one_hot"])
    if regime == "ties":
        logits = rng.integers(-2, 2, (batch, k + 1, vocab)).astype(np.float32)
    elif regime == "masked":
        logits = (rng.standard_normal((batch, k + 1, vocab)) * 2).astype(np.float32)
        logits[rng.random(logits.shape) < 0.5] = -np.inf
        logits[:, :, rng.integers(0, vocab)] = 0.0
    else:
        logits = np.full((batch, k + 1, vocab), -np.inf, np.float32)
        np.put_along_axis(logits, rng.integers(0, vocab, (batch, k + 1, 1)), 0.0, axis=2)
    ids = rng.integers(0, vocab, (batch, k))
    kind = rng.choice(["none", "one_hot", "dirichlet", "two_point"])
    q = None
    if kind != "none":
        q = np.zeros((batch, k, vocab), np.float32)
        for b in range(batch):
            for i in range(k):
                if kind == "one_hot":
                    row = ref.one_hot(int(ids[b, i]), vocab)
                elif kind == "dirichlet":
                    row = rng.dirichlet(np.full(vocab, 0.3))
                    row[ids[b, i]] = max(row[ids[b, i]], 1e-3)
                else:
                    row = np.zeros(vocab)
                    row[ids[b, i]] += 0.5
                    row[rng.integers(0, vocab)] += 0.5
                q[b, i] = row / row.sum()
    draws = rng.random((batch, k + 1))
    pick = rng.random((batch, k + 1))
    uniforms = np.where(pick < 0.3, 0.0, np.where(pick < 0.6, LAST_UNIFORM, draws)).astype(np.float32)
    filters = (float(rng.choice([0.0, 0.5, 1.0, 2.0, np.inf])), int(rng.choice([0, 1, 2, vocab, vocab + 3])),
               float(rng.choice([1.0, 0.5, 0.01])))
    num_draft = rng.integers(0, k + 1, batch).astype(np.int32)
    return logits, ids, q, num_draft, filters, uniforms


def test_chain_and_tree_match_the_references_over_a_sweep_of_edge_regimes():
    rng = np.random.default_rng(2024)
    for trial in range(250):
        logits, ids, q, num_draft, (t, top_k, top_p), uniforms = _edge_case(rng)
        batch, k = ids.shape
        kwargs = dict(num_draft=torch.from_numpy(num_draft), temperature=t, top_k=top_k, top_p=top_p,
                      uniforms=torch.from_numpy(uniforms))
        q_t = None if q is None else torch.from_numpy(q)
        tokens, n = ops.chain_verify(torch.from_numpy(logits), torch.from_numpy(ids), q_t, **kwargs)
        want_tokens, want_n = ref.chain_verify(logits, ids, q, num_draft, np.full(batch, t), np.full(batch, top_k),
                                               np.full(batch, top_p), uniforms.astype(np.float64))
        assert n.tolist() == want_n.tolist() and tokens.tolist() == want_tokens.tolist(), f"trial {trial}"
        kwargs["num_nodes"] = kwargs.pop("num_draft")
        _, tree_tokens, tree_n = ops.tree_verify(torch.from_numpy(logits), torch.from_numpy(ids),
                                                 chain_parents(batch, k), q_t, **kwargs)
        assert torch.equal(tree_tokens, tokens) and torch.equal(tree_n, n), f"trial {trial}: chain tree != chain"


@pytest.mark.parametrize("shape", ["star", "binary", "chain", "random"])
def test_tree_verify_matches_the_reference_on_degenerate_shapes(shape):
    rng = np.random.default_rng({"star": 1, "binary": 2, "chain": 3, "random": 4}[shape])
    compared = 0
    for _ in range(60):
        batch, nodes, vocab = int(rng.integers(1, 5)), int(rng.integers(1, 10)), int(rng.choice([1, 2, 3, 6]))
        if shape == "star":
            parents = np.full(nodes, -1)
        elif shape == "binary":
            parents = np.array([(i - 1) // 2 for i in range(nodes)])
        elif shape == "chain":
            parents = np.arange(-1, nodes - 1)
        else:
            parents = np.array([rng.integers(-1, i) if i else -1 for i in range(nodes)])
        parents = np.broadcast_to(parents.astype(np.int32), (batch, nodes)).copy()
        logits = (rng.standard_normal((batch, nodes + 1, vocab)) * 2).astype(np.float32)
        logits[rng.random(logits.shape) < 0.3] = -np.inf
        logits[:, :, 0] = 0.0
        ids = rng.integers(0, vocab, (batch, nodes))
        q = None
        if rng.random() < 0.5:
            q = rng.dirichlet(np.full(vocab, 0.4), size=(batch, nodes)).astype(np.float32)
            np.put_along_axis(q, ids[..., None], np.maximum(np.take_along_axis(q, ids[..., None], 2), 1e-3), 2)
            q /= q.sum(-1, keepdims=True)
        t = float(rng.choice([0.0, 0.7, np.inf]))
        top_k, top_p = int(rng.choice([0, 1, 2])), float(rng.choice([1.0, 0.6]))
        num_nodes = rng.integers(0, nodes + 1, batch).astype(np.int32)
        uniforms = rng.random((batch, nodes + 1)).astype(np.float32)
        path, tokens, n = ops.tree_verify(torch.from_numpy(logits), torch.from_numpy(ids), torch.from_numpy(parents),
                                          None if q is None else torch.from_numpy(q),
                                          num_nodes=torch.from_numpy(num_nodes), temperature=t, top_k=top_k,
                                          top_p=top_p, uniforms=torch.from_numpy(uniforms))
        want_path, want_tokens, want_n, margin = rt.tree_verify(
            logits, ids, parents, q, num_nodes, np.full(batch, t), np.full(batch, top_k), np.full(batch, top_p),
            uniforms.astype(np.float64), with_margin=True)
        for b in np.flatnonzero(margin > 1e-5):
            assert path[b].tolist() == want_path[b].tolist() and tokens[b].tolist() == want_tokens[b].tolist()
            assert int(n[b]) == int(want_n[b])
            compared += 1
    assert compared > 100


def test_largest_chains_and_single_token_vocabularies():
    """k = 256 over V = 3 against the reference (ragged, with and without q), and over V = 1 every draft of every row
    is accepted and the bonus is token 0; a 64-deep chain tree over V = 1 accepts its whole path."""
    rng = np.random.default_rng(5)
    batch, k, vocab = 3, 256, 3
    logits = (rng.standard_normal((batch, k + 1, vocab)) * 0.3).astype(np.float32)
    target = np.stack([[ref.filtered_probs(logits[b, i], 1.0) for i in range(k)] for b in range(batch)])
    ids = np.array([[rng.choice(vocab, p=target[b, i]) for i in range(k)] for b in range(batch)])
    q = np.clip(target + rng.normal(0, 0.01, target.shape), 1e-3, None).astype(np.float32)
    q /= q.sum(-1, keepdims=True)
    num_draft = np.array([k, 0, 131], dtype=np.int32)
    uniforms = rng.random((batch, k + 1)).astype(np.float32)
    longest = 0
    for draft_probs in (q, None):
        tokens, n = ops.chain_verify(torch.from_numpy(logits), torch.from_numpy(ids),
                                     None if draft_probs is None else torch.from_numpy(draft_probs),
                                     num_draft=torch.from_numpy(num_draft), uniforms=torch.from_numpy(uniforms))
        want_tokens, want_n = ref.chain_verify(logits, ids, draft_probs, num_draft, np.ones(batch), np.zeros(batch),
                                               np.ones(batch), uniforms.astype(np.float64))
        assert n.tolist() == want_n.tolist() and tokens.tolist() == want_tokens.tolist()
        longest = max(longest, int(n.max()))
    assert longest > 5  # q near p: accepted runs were compared, not only first rejections
    tokens, n = ops.chain_verify(torch.zeros(4, k + 1, 1), torch.zeros(4, k, dtype=I64), seed=torch.arange(4))
    assert n.tolist() == [k] * 4 and tokens.tolist() == [[0] * (k + 1)] * 4
    path, tokens, n = ops.tree_verify(torch.zeros(2, 65, 1), torch.zeros(2, 64, dtype=I64), chain_parents(2, 64),
                                      seed=torch.arange(2))
    assert n.tolist() == [64, 64] and path.tolist() == [list(range(64))] * 2


def test_a_star_over_the_whole_vocabulary_always_accepts_one_child():
    """Deterministic candidates: accept x with p(x), else remove x from p. A star holding every token accepts one
    child in every row (the last remaining candidate has p = 1), even at u = 1 - 2^-24."""
    vocab, batch = 6, 32
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(batch, vocab + 1, vocab, generator=g) * 2
    ids = torch.stack([torch.randperm(vocab, generator=g) for _ in range(batch)])
    path, tokens, n = ops.tree_verify(logits, ids, torch.full((vocab,), -1, dtype=I32),
                                      uniforms=torch.full((batch, vocab + 1), LAST_UNIFORM))
    assert n.tolist() == [1] * batch
    assert tokens[:, 0].tolist() == ids.gather(1, path[:, :1].long())[:, 0].tolist()


# =============================================================================================================
# Distribution under adversarial drafts
# =============================================================================================================
DRAWS = 60_000
V_SMALL = 5
TOP_K = 3  # the filtered targets have 2 zeros each: adversarial q puts most of its mass there


def _adversarial_model(seed=17):
    rng = np.random.default_rng(seed)
    L0 = rng.standard_normal(V_SMALL) * 1.2
    L1 = rng.standard_normal((V_SMALL, V_SMALL)) * 1.2
    p0 = ref.filtered_probs(L0, 1.0, TOP_K)
    p1 = np.stack([ref.filtered_probs(L1[x], 1.0, TOP_K) for x in range(V_SMALL)])

    def adversarial(p):
        q = rng.dirichlet(np.ones(V_SMALL)) * 0.3
        q[np.flatnonzero(p == 0)[0]] += 0.7  # mass where p has none
        return q / q.sum()

    q0 = adversarial(p0)
    q1 = np.stack([adversarial(p1[x]) for x in range(V_SMALL)])
    return rng, L0, L1, p0, p1, q0, q1


def _sample_rows(rng, probs):
    """One token per row of probs [n, V] (inverse CDF, vectorised)."""
    cdf = np.cumsum(probs, axis=1)
    return np.minimum((rng.random((len(probs), 1)) * cdf[:, -1:] >= cdf).sum(1), probs.shape[1] - 1)


@pytest.mark.parametrize("with_probs", [True, False], ids=["q_adversarial", "deterministic_adversarial"])
def test_chain_joint_law_of_two_tokens_under_adversarial_drafts(with_probs):
    """The first two emitted tokens (y0, y1) of a k = 2 chain whose target at position 1 depends on the drafted x0
    follow p0(y0) p1(y1 | y0) exactly (where only y0 is emitted, y1 is drawn from p1[y0] as the next step would);
    q puts 70% of its mass on tokens the top-k filter removed from p."""
    rng, L0, L1, p0, p1, q0, q1 = _adversarial_model()
    if with_probs:
        x0 = _sample_rows(rng, np.broadcast_to(q0, (DRAWS, V_SMALL)))
        x1 = _sample_rows(rng, q1[x0])
        q = np.stack([np.broadcast_to(q0, (DRAWS, V_SMALL)), q1[x0]], axis=1).astype(np.float32)
    else:  # x0: the most likely draft token (p0 = 0 there), or p0's second token; x1: q1's argmax (p1 = 0)
        x0 = np.where(rng.random(DRAWS) < 0.5, int(np.argmax(q0)), int(np.argsort(-p0)[1]))
        x1 = np.argmax(q1, axis=1)[x0]
        q = None
    logits = np.stack([np.broadcast_to(L0, (DRAWS, V_SMALL)), L1[x0], np.zeros((DRAWS, V_SMALL))], axis=1)
    tokens, n = ops.chain_verify(torch.from_numpy(logits.astype(np.float32)), torch.from_numpy(np.stack([x0, x1], 1)),
                                 None if q is None else torch.from_numpy(q), top_k=TOP_K,
                                 seed=torch.arange(DRAWS), offset=77)
    tokens, n = tokens.numpy(), n.numpy()
    assert 0.05 < (n >= 1).mean() < 0.95  # both branches were exercised
    y0 = tokens[:, 0]
    y1 = np.where(n >= 1, tokens[:, 1], _sample_rows(rng, p1[y0]))
    joint = p0[:, None] * p1
    counts = np.bincount(y0 * V_SMALL + y1, minlength=V_SMALL * V_SMALL)
    assert chi_square_pvalue(counts, joint) > 1e-4
    assert chi_square_pvalue(np.bincount(y0, minlength=V_SMALL), p0) > 1e-4


def test_the_adversarial_chain_test_catches_a_verifier_that_resamples_from_p():
    """The same statistic, applied to the exact law of a verifier that draws the recovered token from p instead of
    normalise(max(0, p - q)), rejects it (the adversarial q makes the difference large)."""
    rng, _, _, p0, _, q0, _ = _adversarial_model()
    accept = np.minimum(p0, q0)  # P(draft x and accept it) = q0(x) min(1, p0/q0)
    wrong = accept + (1 - accept.sum()) * p0
    samples = _sample_rows(rng, np.broadcast_to(wrong, (DRAWS, V_SMALL)))
    assert chi_square_pvalue(np.bincount(samples, minlength=V_SMALL), p0) < 1e-6


@pytest.mark.parametrize("with_probs", [True, False], ids=["iid_children", "deterministic_with_duplicates"])
def test_star_depth_one_law_under_adversarial_siblings(with_probs):
    """A star of 3 children: drawn i.i.d. from an adversarial q (SpecInfer's rule), or deterministic candidates
    [a token p excludes, a, a (a duplicate), b]: the depth-1 token follows p0 whatever the siblings."""
    rng, L0, _, p0, _, q0, _ = _adversarial_model(seed=23)
    if with_probs:
        ids = _sample_rows(rng, np.broadcast_to(q0, (DRAWS * 3, V_SMALL))).reshape(DRAWS, 3)
        q = torch.from_numpy(np.broadcast_to(q0, (DRAWS, 3, V_SMALL)).astype(np.float32).copy())
    else:
        order = np.argsort(-p0)
        ids = np.broadcast_to(np.array([order[-1], order[1], order[1], order[0]]), (DRAWS, 4)).copy()
        q = None
    nodes = ids.shape[1]
    logits = np.zeros((DRAWS, nodes + 1, V_SMALL), dtype=np.float32)
    logits[:, 0] = L0
    _, tokens, n = ops.tree_verify(torch.from_numpy(logits), torch.from_numpy(ids),
                                   torch.full((nodes,), -1, dtype=I32), q, top_k=TOP_K,
                                   seed=torch.arange(DRAWS), offset=5)
    tokens, n = tokens.numpy(), n.numpy()
    assert 0.05 < (n == 1).mean() < 0.99
    assert chi_square_pvalue(np.bincount(tokens[:, 0], minlength=V_SMALL), p0) > 1e-4


# =============================================================================================================
# dtypes, batch and thread invariance
# =============================================================================================================
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_logits_give_exactly_what_their_fp32_upcast_gives(dtype):
    """fp32 maths whatever the input dtype: a bf16/fp16 call equals the call on logits.float(), bit for bit."""
    g = torch.Generator().manual_seed(4)
    batch, k, vocab = 64, 3, 3001
    logits = (torch.randn(batch, k + 1, vocab, generator=g) * 4).to(dtype)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    ids = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(batch, k)
    parents = torch.tensor([-1, -1, 0], dtype=I32)
    for filters in (dict(), dict(temperature=0.7, top_k=50, top_p=0.9)):
        seed = dict(seed=torch.arange(batch), offset=3)
        half = ops.chain_verify(logits, ids, q, **filters, **seed)
        full = ops.chain_verify(logits.float(), ids, q, **filters, **seed)
        assert all(torch.equal(a, b) for a, b in zip(half, full))
        half = ops.tree_verify(logits, ids, parents, q, **filters, **seed)
        full = ops.tree_verify(logits.float(), ids, parents, q, **filters, **seed)
        assert all(torch.equal(a, b) for a, b in zip(half, full))
        half = ops.sample_filtered(logits[:, 0].contiguous(), **filters, **seed)
        full = ops.sample_filtered(logits[:, 0].float().contiguous(), **filters, **seed)
        assert all(torch.equal(a, b) for a, b in zip(half, full))


def test_results_do_not_depend_on_row_order_or_thread_count():
    g = torch.Generator().manual_seed(9)
    batch, k, vocab = 120, 4, 700
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    ids = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(batch, k)
    parents = torch.tensor([[-1, -1, 0, 1]] * batch, dtype=I32)
    seed, offset = torch.arange(batch) * 31 + 7, torch.arange(batch) % 3
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.7])[torch.arange(batch) % 4]
    top_p = torch.tensor([1.0, 0.8, 0.95])[torch.arange(batch) % 3]

    def run(perm):
        rows = dict(seed=seed[perm].contiguous(), offset=offset[perm].contiguous(),
                    temperature=temperature[perm].contiguous(), top_p=top_p[perm].contiguous())
        chain = ops.chain_verify(logits[perm].contiguous(), ids[perm].contiguous(), q[perm].contiguous(), **rows)
        tree = ops.tree_verify(logits[perm].contiguous(), ids[perm].contiguous(), parents[perm].contiguous(),
                               q[perm].contiguous(), **rows)
        drawn = ops.sample_filtered(logits[perm, 0].contiguous(), **rows)
        return chain + tree + drawn

    identity = torch.arange(batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        base = run(identity)
        torch.set_num_threads(1)
        single = run(identity)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(base, single))
    perm = torch.randperm(batch, generator=g)
    permuted = run(perm)
    assert all(torch.equal(a, b[perm]) for a, b in zip(permuted, base))


# =============================================================================================================
# Sampling filters at extremes
# =============================================================================================================
def test_sample_filtered_at_extreme_filters():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 10, generator=g) * 3
    softmax = torch.softmax(logits, -1)
    for top_k in (10, 11, 2 ** 31 - 1, 10 ** 15):  # top_k >= V keeps every token
        probs, _ = ops.sample_filtered(logits, top_k=top_k, seed=1)
        torch.testing.assert_close(probs, softmax, rtol=1e-5, atol=1e-7)
    probs, tokens = ops.sample_filtered(logits, temperature=1e-6, seed=1)  # greedy: one-hot argmax
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(probs, torch.nn.functional.one_hot(tokens, 10).float())
    probs, _ = ops.sample_filtered(logits, temperature=1e6, seed=1)  # almost uniform
    torch.testing.assert_close(probs, torch.full((5, 10), 0.1), rtol=1e-4, atol=1e-5)
    # ties at the top: top_k = 1 and a tiny top_p keep every tied maximum; u = 0 draws the first kept token and the
    # largest draw the last
    tied = torch.tensor([[1.0, 5.0, -2.0, 5.0, 5.0, float("-inf")]])
    for kw in (dict(top_k=1), dict(top_p=1e-7), dict(top_k=1, temperature=float("inf"))):
        probs, first = ops.sample_filtered(tied, uniforms=torch.zeros(1, 1), **kw)
        _, last = ops.sample_filtered(tied, uniforms=torch.full((1, 1), LAST_UNIFORM), **kw)
        torch.testing.assert_close(probs, torch.tensor([[0.0, 1 / 3, 0.0, 1 / 3, 1 / 3, 0.0]]))
        assert first.tolist() == [1] and last.tolist() == [4]
    probs, token = ops.sample_filtered(torch.tensor([[0.0, float("-inf"), float("-inf")]]), seed=3)
    assert probs.tolist() == [[1.0, 0.0, 0.0]] and token.tolist() == [0]


def test_min_p_at_extremes():
    """min_p = 1 keeps exactly the tied maxima; T below the greedy threshold cuts nothing; a huge T keeps only
    logits within T * log(1 / min_p) of the top (which, at 1e6, is all but an outlier)."""
    none = torch.zeros(1, 0, dtype=I64)
    row = torch.tensor([[[1.0, 3.0, 3.0, 2.0, float("-inf")]]])
    out = ops.process_logits(row.clone(), none, num_draft=0, min_p=1.0)
    assert out.tolist() == [[[float("-inf"), 3.0, 3.0, float("-inf"), float("-inf")]]]
    out = ops.process_logits(row.clone(), none, num_draft=0, min_p=0.9, temperature=1e-6)
    assert torch.equal(out, row)
    far = torch.tensor([[[1.0, 3.0, 3.0, -1e7]]])
    out = ops.process_logits(far.clone(), none, num_draft=0, min_p=0.5, temperature=1e6)
    assert out.tolist() == [[[1.0, 3.0, 3.0, float("-inf")]]]


# =============================================================================================================
# Trees and the KV cache: degenerate shapes
# =============================================================================================================
def test_tree_masks_of_a_long_chain_and_a_wide_star():
    nodes = 600
    mask, depth = ops.build_tree_mask(torch.arange(-1, nodes - 1, dtype=I32)[None])
    assert depth[0].tolist() == list(range(1, nodes + 1))
    assert torch.equal(mask[0], torch.ones(nodes, nodes, dtype=torch.bool).tril())
    mask, depth = ops.build_tree_mask(torch.full((2, nodes), -1, dtype=I32), torch.tensor([nodes, 1], dtype=I32))
    assert bool((depth[0] == 1).all()) and depth[1, 0] == 1 and bool((depth[1, 1:] == 0).all())
    assert torch.equal(mask[0], torch.eye(nodes, dtype=torch.bool)) and torch.equal(mask[1], mask[0])


def test_kv_compact_with_nothing_and_everything_accepted():
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(4, 6, 4, 2, 3, generator=g)
    tables = torch.tensor([[2, 0, 5], [1, 3, 4]], dtype=I32)
    before = pool.clone()
    ops.kv_compact(pool, tables, torch.full((2, 5), -1, dtype=I64), torch.tensor([3, 7]))  # nothing accepted
    assert torch.equal(pool, before)
    # everything accepted along a chain: the sources are already where they belong
    ops.kv_compact(pool, tables, torch.tensor([[4, 5, 6, 7, 8], [8, 9, 10, 11, -1]]), torch.tensor([4, 8]))
    assert torch.equal(pool, before)
    # entirely out of the table (and negative destinations): skipped
    ops.kv_compact(pool, tables, torch.tensor([[12, 13, 40, 2 ** 40, -1]] * 2), torch.tensor([0, -(2 ** 62)]))
    assert torch.equal(pool, before)


def test_commit_tokens_full_and_empty_verdicts_and_width_one():
    tokens = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    buffer = torch.zeros(3, 6, dtype=I64)
    lengths = torch.tensor([1, 3, 6])
    kept, following = torch.empty(3, dtype=I64), torch.full((3, 2), -7)
    accepted = torch.tensor([2, 0, 2], dtype=I32)
    want = ref_tb.commit_tokens(tokens.numpy(), accepted.numpy(), np.ones(3, bool), buffer.numpy(), lengths.numpy(),
                                following.numpy())
    ops.commit_tokens(tokens, accepted, torch.ones(3, dtype=torch.bool), buffer, lengths, kept, following)
    for got, expected in zip((buffer, lengths, kept, following), want):
        assert got.tolist() == expected.tolist()
    assert kept.tolist() == [3, 1, 3] and lengths.tolist() == [4, 4, 9]
    ops.commit_tokens(tokens[:, :1], torch.tensor([5, 0, -3], dtype=I32), torch.ones(3, dtype=torch.bool), buffer,
                      lengths, kept, following)  # w = 1 caps what is kept; a failed row keeps nothing
    assert kept.tolist() == [1, 1, 0] and buffer[0, 4] == 10 and buffer[1, 4] == 20


# =============================================================================================================
# Argument errors an outside caller meets
# =============================================================================================================
@pytest.mark.parametrize("call, message", [
    (lambda: ops.chain_verify(torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=I64),
                              temperature=torch.tensor([0.5]).expand(2), seed=0), "temperature must be contiguous"),
    (lambda: ops.chain_verify(torch.randn(1, 3, 5).expand(2, 3, 5), torch.zeros(2, 2, dtype=I64), seed=0),
     "target_logits must be contiguous"),
    (lambda: ops.chain_verify(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=I64)[:, ::2], seed=0),
     "draft_token_ids must be contiguous"),
    (lambda: ops.tree_verify(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=I64),
                             torch.full((2, 6), -1, dtype=I32)[:, ::2], seed=0), "parents must be contiguous"),
    (lambda: ops.tree_verify(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=I64), torch.full((2, 3), -1, dtype=I32),
                             seed=torch.zeros(2, dtype=I64, device="meta")), "seed must be on the same device"),
    (lambda: ops.sample_filtered(torch.randn(2, 5), seed=torch.tensor(3)), r"seed must be a 1-D tensor \[B\]"),
    (lambda: ops.philox_uniforms(torch.zeros(2, dtype=I64), torch.zeros(3, dtype=I64), 2),
     "offset dimension 0 must be B"),
    (lambda: ops.kv_write(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, dtype=I64, device="meta"),
                          torch.zeros(2, 3, 4, 1, 4)), "slot_mapping must be on the same device"),
    (lambda: ops.chain_verify(torch.randn(2, 3, 5), torch.full((2, 2), 2 ** 40), seed=0),
     r"draft_token_ids: row 0 has a token id outside \[0, V\)"),
    (lambda: ops.chain_verify(torch.randn(2, 3, 5), torch.full((2, 2), -2 ** 63), seed=0),
     r"draft_token_ids: row 0 has a token id outside \[0, V\)"),
])
def test_strided_misplaced_and_out_of_range_inputs_are_named(call, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        call()


# =============================================================================================================
# opcheck on shapes the other tests do not use
# =============================================================================================================
def _opcheck_cases():
    column = torch.zeros(3, 4, 9)
    return {
        "chain_k0_v1": (OPS.chain_verify.default, (torch.randn(3, 1, 1), torch.zeros(3, 0, dtype=I64), None, None, None,
                                                   None, None, torch.arange(3), None, None,
                                                   torch.empty(3, 1, dtype=I64), torch.empty(3, dtype=I32))),
        "chain_b0": (OPS.chain_verify.default, (torch.randn(0, 3, 5), torch.zeros(0, 2, dtype=I64), torch.zeros(0, 2, 5),
                                                None, None, None, None, torch.zeros(0, dtype=I64), None, None,
                                                torch.empty(0, 3, dtype=I64), torch.empty(0, dtype=I32))),
        "chain_fp16_ragged_greedy": (OPS.chain_verify.default, (
            torch.randn(4, 3, 7).half(), torch.zeros(4, 2, dtype=I64), None, torch.tensor([0, 1, 2, 1], dtype=I32),
            torch.zeros(4), None, None, None, None, None, torch.empty(4, 3, dtype=I64), torch.empty(4, dtype=I32))),
        "tree_n0": (OPS.tree_verify.default, (torch.randn(2, 1, 5), torch.zeros(2, 0, dtype=I64),
                                              torch.zeros(2, 0, dtype=I32), None, None, None, None, None,
                                              torch.arange(2), None, None, torch.empty(2, 0, dtype=I32),
                                              torch.empty(2, 1, dtype=I64), torch.empty(2, dtype=I32))),
        "tree_star_bf16_q": (OPS.tree_verify.default, (
            torch.randn(2, 5, 6).bfloat16(), torch.randint(0, 6, (2, 4)), torch.full((2, 4), -1, dtype=I32),
            torch.full((2, 4, 6), 1 / 6), None, None, torch.tensor([2, 0], dtype=I32), torch.tensor([0.9, 1.0]),
            torch.arange(2), torch.tensor([3, 4]), None, torch.empty(2, 4, dtype=I32), torch.empty(2, 5, dtype=I64),
            torch.empty(2, dtype=I32))),
        "mask_n0": (OPS.build_tree_mask.default, (torch.zeros(2, 0, dtype=I32), None,
                                                  torch.empty(2, 0, 0, dtype=torch.bool), torch.empty(2, 0, dtype=I32))),
        "mask_b0": (OPS.build_tree_mask.default, (torch.zeros(0, 3, dtype=I32), None,
                                                  torch.empty(0, 3, 3, dtype=torch.bool), torch.empty(0, 3, dtype=I32))),
        "sample_into_a_column": (OPS.sample_filtered.default, (torch.randn(3, 9), None, None, None, torch.arange(3), None,
                                                               None, column[:, 1], torch.empty(3, dtype=I64))),
        "sample_v1_fp16": (OPS.sample_filtered.default, (torch.randn(2, 1).half(), torch.zeros(2), None, None, None, None,
                                                         None, torch.empty(2, 1), torch.empty(2, dtype=I64))),
        "residual_3d_bf16": (OPS.residual_probs.default, (torch.rand(2, 3, 5).softmax(-1).bfloat16(),
                                                          torch.rand(2, 3, 5).softmax(-1).bfloat16(), torch.empty(2, 3, 5))),
        "residual_1d": (OPS.residual_probs.default, (torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1]), torch.empty(2))),
        "philox_b0": (OPS.philox_uniforms.default, (torch.zeros(0, dtype=I64), torch.zeros(0, dtype=I64),
                                                    torch.empty(0, 4))),
        "philox_c0": (OPS.philox_uniforms.default, (torch.zeros(2, dtype=I64), torch.zeros(2, dtype=I64),
                                                    torch.empty(2, 0))),
        "kv_write_fp16_transposed": (OPS.kv_write.default, (
            torch.randn(2, 3, 4, 5).half().transpose(1, 2), torch.randn(2, 3, 4, 5).half().transpose(1, 2),
            torch.tensor([[0, 1, -1, 7], [2, 3, 4, 5]]), torch.zeros(2, 3, 4, 3, 5).half())),
        "kv_compact_4_planes_fp16": (OPS.kv_compact.default, (
            torch.randn(4, 5, 2, 1, 3).half(), torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=I32),
            torch.tensor([[3, 4], [1, -1]]), torch.tensor([1, 0]))),
        "commit_b0": (OPS.commit_tokens.default, (
            torch.zeros(0, 3, dtype=I64), torch.zeros(0, dtype=I32), torch.zeros(0, dtype=torch.bool),
            torch.zeros(0, 5, dtype=I64), torch.zeros(0, dtype=I64), torch.zeros(0, dtype=I64), torch.zeros(0, 1, dtype=I64))),
        "commit_w0": (OPS.commit_tokens.default, (
            torch.zeros(2, 0, dtype=I64), torch.zeros(2, dtype=I32), torch.ones(2, dtype=torch.bool),
            torch.zeros(2, 5, dtype=I64), torch.tensor([1, 2]), torch.zeros(2, dtype=I64), torch.zeros(2, 3, dtype=I64))),
        "process_tree_fp16_min_p": (OPS.process_logits.default, (
            torch.randn(2, 4, 40).half(), torch.randint(0, 40, (2, 3)), torch.tensor([[-1, 0, 0], [-1, -1, 1]], dtype=I32),
            torch.tensor([3, 2], dtype=I32), None, None, None, None, torch.ones(2), None, torch.full((2,), 1.3),
            torch.full((2,), 0.1), torch.full((2,), 0.7))),
        "process_no_drafts": (OPS.process_logits.default, (
            torch.randn(2, 1, 40), torch.zeros(2, 0, dtype=I64), None, torch.zeros(2, dtype=I32), None, None,
            torch.zeros(2, 40), None, None, None, None, None, None)),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck_on_unusual_shapes(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


# =============================================================================================================
# Defects found: each test asserts the correct behaviour (it failed on the library as found; fixed since)
# =============================================================================================================
def test_kv_write_from_a_view_of_the_pool_is_refused_or_reads_before_writing():
    """key/value that are views of kv_cache (moving K/V between slots): torch's index_put_ refuses such a source
    ("some elements of the input tensor and the written-to tensor refer to a single memory location"), and the
    verifiers refuse outputs that share memory with inputs. kv_write did neither: it wrote slot 3 from slot 0, then
    read slot 3 as the source of slot 0 (a silently wrong pool)."""
    pool = torch.arange(2 * 2 * 4 * 1 * 2, dtype=torch.float32).reshape(2, 2, 4, 1, 2)
    key = pool[0].view(-1, 1, 2)[0:4].unsqueeze(0)
    value = pool[1].view(-1, 1, 2)[0:4].unsqueeze(0)
    slots = torch.tensor([[3, 2, 1, 0]])
    expected = pool.clone()
    for plane in range(2):  # read every source first, then write
        flat = expected[plane].view(-1, 1, 2)
        flat[[3, 2, 1, 0]] = flat[0:4].clone()
    try:
        ops.kv_write(key, value, slots, pool)
    except RuntimeError as error:
        assert "kv_cache" in str(error) and "memory" in str(error)
        return
    assert torch.equal(pool, expected), "kv_write from a view of its own pool gave a silently wrong pool"


def _commit_case():
    return dict(tokens=torch.tensor([[5, 6, 7]]), num_accepted=torch.tensor([2], dtype=I32),
                active=torch.tensor([True]), token_buffer=torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0]]),
                seq_lens=torch.tensor([3]), num_kept=torch.zeros(1, dtype=I64), next_input=torch.zeros(1, 1, dtype=I64))


COMMIT_ORDER = ("tokens", "num_accepted", "active", "token_buffer", "seq_lens", "num_kept", "next_input")


@pytest.mark.parametrize("alias", ["tokens_view_of_token_buffer", "num_kept_is_seq_lens", "next_input_view_of_token_buffer"])
def test_commit_tokens_arguments_sharing_memory_are_refused_or_read_before_writing(alias):
    """commit_tokens checks only that next_input and token_buffer do not overlap themselves. Written tensors that
    share memory with another argument were silently wrong: tokens a view of token_buffer wrote [.., 2, 3, 2] where
    the tokens read first give [.., 2, 3, 0]; num_kept = seq_lens left seq_lens 2 (not 4 or 5); next_input a view of
    token_buffer overwrote committed position 0."""
    case = _commit_case()
    if alias == "tokens_view_of_token_buffer":
        case["tokens"] = case["token_buffer"][:, 1:4]
    elif alias == "num_kept_is_seq_lens":
        case["num_kept"] = case["seq_lens"]
    else:
        case["next_input"] = case["token_buffer"][:, :1]
    snapshot = {name: t.clone() for name, t in case.items()}
    try:
        ops.commit_tokens(*(case[name] for name in COMMIT_ORDER))
    except RuntimeError as error:
        assert "share memory" in str(error) or "overlap" in str(error)
        return
    buffer, lengths, kept, following = ref_tb.commit_tokens(*(snapshot[name].numpy() for name in (
        "tokens", "num_accepted", "active", "token_buffer", "seq_lens", "next_input")))
    if alias == "tokens_view_of_token_buffer":
        assert case["token_buffer"].tolist() == buffer.tolist() and case["seq_lens"].tolist() == lengths.tolist()
    elif alias == "num_kept_is_seq_lens":  # two outputs in one tensor: no result is right, only a refusal is
        pytest.fail(f"num_kept and seq_lens were one tensor and the call went through: it holds "
                    f"{case['seq_lens'].tolist()}, seq_lens should be {lengths.tolist()} and num_kept {kept.tolist()}")
    else:  # writing next_input is writing a committed position of token_buffer: only a refusal is right
        pytest.fail(f"next_input was a view of token_buffer and the call went through: committed position 0 now "
                    f"holds {case['token_buffer'][0, 0].item()} (was {snapshot['token_buffer'][0, 0].item()})")


def test_residual_probs_into_a_view_of_target_probs_is_refused_or_correct():
    """The wrapper refuses out=target_probs by identity only ("a row's residual mass is summed before it is
    written"); out=target_probs[:] (the same memory, another tensor object) returned zeros for p == q, where the
    documented result is p itself, and wiped p."""
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    expected = p.clone()
    try:
        out = ops.residual_probs(p, p.clone(), out=p[:])
    except (ValueError, RuntimeError) as error:
        assert "out" in str(error)
        return
    assert torch.equal(out, expected), f"residual_probs(p, p, out=p[:]) gave {out.tolist()}, not p"


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("bad", [float("nan"), -0.2], ids=["nan", "negative"])
def test_an_invalid_draft_probability_is_reported_where_the_walk_reads_it(kind, bad):
    """Status -2 reports an invalid q where the walk reads it: q(x) at the verified draft x, whether the draft is
    accepted or not, and the whole row where a rejection resamples from it; an accepted position's other entries
    are never read (one pass over V per position saved), and the documentation says so. (Its message said "at a
    verified position", which an accepted row with a NaN elsewhere contradicted.)"""
    logits = torch.zeros(1, 2, 4)
    ids = torch.tensor([[1]])

    def verify(q, u):
        """(tokens, num_accepted)"""
        q, u = torch.tensor([[q]]), torch.tensor([[u, 0.5]])
        if kind == "chain":
            return ops.chain_verify(logits, ids, q, uniforms=u)
        return ops.tree_verify(logits, ids, torch.tensor([-1], dtype=I32), q, uniforms=u)[1:]  # (after the path)

    with pytest.raises(ValueError, match="draft_probs: row 0 has an invalid probability where the walk reads it"):
        verify([0.25, bad, 0.25, 0.5], 0.1)  # at q(x), accepted (u q(x) < p(x) = 0.25 whatever the value)
    with pytest.raises(ValueError, match="draft_probs: row 0"):
        verify([bad, 0.9, 0.05, 0.05], 0.9)  # elsewhere, rejected (u q(x) = 0.81 > 0.25): the residual reads the row
    tokens, accepted = verify([bad, 0.5, 0.25, 0.25], 0.1)  # elsewhere, accepted: not read
    assert tokens.tolist()[0][0] == 1 and int(accepted) == 1


@pytest.mark.parametrize("bias", [float("nan"), float("inf")], ids=["nan", "plus_inf"])
def test_a_non_finite_logit_bias_is_refused_naming_logit_bias(bias):
    """process_logits checks every penalty for finiteness but not logit_bias (documented: "-inf bans a token"): a
    NaN or +inf bias went into the logits silently, and the verifier then blamed target_logits ("row 0 has a NaN
    or +inf logit"), an argument the caller never set."""
    logit_bias = torch.zeros(1, 4)
    logit_bias[0, 1] = bias
    logits = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="process_logits: logit_bias"):
        ops.process_logits(logits, torch.zeros(1, 1, dtype=I64), num_draft=1, logit_bias=logit_bias)


def test_numpy_scalars_are_taken_as_numbers():
    """The wrappers took Python numbers and tensors but refused NumPy scalars with "top_k must be a number or a [B]
    tensor, got int64" (an np.int64 is a number; np.float64 passed only because it subclasses float)."""
    logits, ids = torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=I64)
    plain = ops.chain_verify(logits, ids, top_k=2, temperature=0.5, seed=5, num_draft=1)
    numpy = ops.chain_verify(logits, ids, top_k=np.int64(2), temperature=np.float32(0.5), seed=np.int64(5),
                             num_draft=np.int32(1))
    assert all(torch.equal(a, b) for a, b in zip(plain, numpy))
