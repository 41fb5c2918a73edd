"""chain_verify against the float64 NumPy reference: exact (given uniforms), invariants,
distribution, greedy, opcheck, odd sizes and every bad-input path."""
import numpy as np
import pytest
import torch
from scipy import stats

import reference as ref
from specdec_ext import ops

DTYPE_CASES = [torch.float32, torch.bfloat16, torch.float16]
FILTER_CASES = {
    "t1": (1.0, 0, 1.0),
    "t07_top_p09": (0.7, 0, 0.9),
    "t13_top_k5": (1.3, 5, 1.0),
    "top_k3_top_p08": (1.0, 3, 0.8),
    "greedy": (0.0, 0, 1.0),
}


def make_case(rng, batch, k, vocab, dtype, with_probs, filters, ragged=True, scale=3.0):
    logits = torch.from_numpy(rng.standard_normal((batch, k + 1, vocab)).astype(np.float32) * scale).to(dtype)
    q = None
    if with_probs:
        q_np = rng.dirichlet(np.full(vocab, 0.5), size=(batch, k)).astype(np.float32)
        q = torch.from_numpy(q_np)
        draft = torch.from_numpy(np.array([[rng.choice(vocab, p=q_np[b, i] / q_np[b, i].sum())
                                            for i in range(k)] for b in range(batch)], dtype=np.int64))
    else:
        # deterministic drafts: half the time the target's argmax, so that runs get accepted
        argmax = logits[:, :k].float().argmax(-1)
        noise = torch.from_numpy(rng.integers(0, vocab, (batch, k)))
        draft = torch.where(torch.from_numpy(rng.random((batch, k)) < 0.6), argmax, noise)
    num_draft = torch.from_numpy(rng.integers(0, k + 1, batch).astype(np.int32)) if ragged else None
    temperature = torch.full((batch,), filters[0], dtype=torch.float32)
    top_k = torch.full((batch,), filters[1], dtype=torch.int32)
    top_p = torch.full((batch,), filters[2], dtype=torch.float32)
    uniforms = torch.from_numpy(rng.random((batch, k + 1)).astype(np.float32))
    return dict(logits=logits, draft=draft, q=q, num_draft=num_draft, temperature=temperature,
                top_k=top_k, top_p=top_p, uniforms=uniforms)


def run_op(c, **kw):
    return ops.chain_verify(c["logits"], c["draft"], c["q"], num_draft=c["num_draft"],
                            temperature=c["temperature"], top_k=c["top_k"], top_p=c["top_p"],
                            uniforms=c.get("uniforms"), **kw)


def run_reference(c):
    return ref.chain_verify(c["logits"].float().numpy(), c["draft"].numpy(),
                            None if c["q"] is None else c["q"].numpy(),
                            None if c["num_draft"] is None else c["num_draft"].numpy(),
                            c["temperature"].numpy(), c["top_k"].numpy(), c["top_p"].numpy(),
                            c["uniforms"].numpy().astype(np.float64))


def assert_matches_reference(c):
    tokens, num_accepted = run_op(c)
    ref_tokens, ref_accepted = run_reference(c)
    np.testing.assert_array_equal(num_accepted.numpy(), ref_accepted)
    np.testing.assert_array_equal(tokens.numpy(), ref_tokens)
    return tokens, num_accepted


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("filter_name", list(FILTER_CASES))
def test_exact_against_reference(rng, dtype, with_probs, filter_name):
    c = make_case(rng, batch=24, k=4, vocab=50, dtype=dtype, with_probs=with_probs,
                  filters=FILTER_CASES[filter_name])
    assert_matches_reference(c)


@pytest.mark.parametrize("vocab", [1, 7, 32001])
@pytest.mark.parametrize("with_probs", [True, False])
def test_odd_vocab_sizes(rng, vocab, with_probs):
    c = make_case(rng, batch=5, k=3, vocab=vocab, dtype=torch.float32, with_probs=with_probs,
                  filters=(0.9, 0, 0.95))
    tokens, num_accepted = assert_matches_reference(c)
    if vocab == 1:  # a single token: every draft is accepted and the bonus is token 0
        assert (num_accepted == c["num_draft"]).all()


def test_mixed_rows_each_with_own_filter(rng):
    batch = 40
    c = make_case(rng, batch=batch, k=5, vocab=64, dtype=torch.float32, with_probs=True, filters=(1.0, 0, 1.0))
    c["temperature"] = torch.from_numpy(rng.choice([0.0, 0.5, 1.0, 1.5], batch).astype(np.float32))
    c["top_k"] = torch.from_numpy(rng.choice([0, 1, 4, 63, 64, 100], batch).astype(np.int32))
    c["top_p"] = torch.from_numpy(rng.choice([1.0, 0.9, 0.5, 0.01], batch).astype(np.float32))
    assert_matches_reference(c)


def test_ties_keep_every_tied_logit_and_greedy_takes_lowest_index():
    logits = torch.tensor([[[0.0, 2.0, 2.0, 2.0, -1.0]] * 2])
    draft = torch.tensor([[2]])
    # top_k = 1 with three tied maxima keeps all three, each with probability 1/3 (no draft: column 0 draws the
    # bonus token)
    for u, expected in [(0.2, 1), (0.5, 2), (0.9, 3)]:
        tokens, n = ops.chain_verify(logits, draft, num_draft=0, top_k=1, uniforms=torch.tensor([[u, 0.0]]))
        assert tokens.tolist() == [[expected, -1]] and n.item() == 0
    # greedy: argmax is the lowest tied index, so draft 2 is rejected and 1 emitted
    tokens, n = ops.chain_verify(logits, draft, temperature=0.0, seed=0)
    assert tokens.tolist() == [[1, -1]] and n.item() == 0


def test_degenerate_one_hot_target_and_draft():
    vocab = 6
    logits = torch.full((1, 3, vocab), float("-inf"))
    logits[0, 0, 2] = 0.0
    logits[0, 1, 4] = 0.0
    logits[0, 2, 1] = 0.0
    q = torch.zeros(1, 2, vocab)
    q[0, 0, 2] = 1.0
    q[0, 1, 3] = 1.0
    tokens, n = ops.chain_verify(logits, torch.tensor([[2, 3]]), q, seed=7)
    # draft 2 has p = 1: accepted; draft 3 has p = 0: rejected, the residual is one-hot at 4
    assert tokens.tolist() == [[2, 4, -1]] and n.item() == 1
    tokens, n = ops.chain_verify(logits, torch.tensor([[2, 4]]), seed=7)
    assert tokens.tolist() == [[2, 4, 1]] and n.item() == 2


@pytest.mark.parametrize("with_probs", [True, False])
def test_invariants_on_many_rows(rng, with_probs):
    c = make_case(rng, batch=300, k=6, vocab=20, dtype=torch.float32, with_probs=with_probs, filters=(1.0, 0, 1.0))
    tokens, num_accepted = run_op(c)
    tokens, n = tokens.numpy(), num_accepted.numpy()
    nd = c["num_draft"].numpy()
    assert (n >= 0).all() and (n <= nd).all()
    for b in range(len(n)):
        np.testing.assert_array_equal(tokens[b, : n[b]], c["draft"].numpy()[b, : n[b]])
        assert 0 <= tokens[b, n[b]] < 20
        assert (tokens[b, n[b] + 1:] == -1).all()


def test_philox_known_answer_and_reference():
    # Random123 known-answer vector: counter 0, key 0 -> first word 0x6627e8d5
    u = ops.philox_uniforms(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1)
    assert u.item() == (0x6627E8D5 >> 8) / 2.0**24
    seeds = torch.tensor([0, 1, -5, 2**40 + 3, 2**63 - 1], dtype=torch.int64)
    offsets = torch.tensor([0, 7, 2**33, 1, 12345], dtype=torch.int64)
    got = ops.philox_uniforms(seeds, offsets, 9).numpy()
    np.testing.assert_array_equal(got, ref.philox_uniforms(seeds.tolist(), offsets.tolist(), 9))
    assert got.min() >= 0.0 and got.max() < 1.0


def test_seeded_draws_are_philox_and_independent_of_batch_position(rng):
    c = make_case(rng, batch=12, k=3, vocab=30, dtype=torch.float32, with_probs=True, filters=(1.0, 0, 1.0))
    seeds = torch.arange(100, 112, dtype=torch.int64)
    offsets = torch.arange(12, dtype=torch.int64) * 5
    c_seeded = dict(c, uniforms=None)
    tokens, n = run_op(c_seeded, seed=seeds, offset=offsets)
    c["uniforms"] = ops.philox_uniforms(seeds, offsets, 4)
    tokens_u, n_u = run_op(c)
    assert torch.equal(tokens, tokens_u) and torch.equal(n, n_u)
    # the same request alone in a batch of one gives the same answer
    for b in (0, 7):
        one = {key: (v[b : b + 1] if isinstance(v, torch.Tensor) else v) for key, v in c_seeded.items()}
        t1, n1 = run_op(one, seed=seeds[b : b + 1], offset=offsets[b : b + 1])
        assert torch.equal(t1[0], tokens[b]) and n1.item() == n[b].item()


@pytest.mark.parametrize("with_probs", [True, False])
def test_a_rows_draws_do_not_depend_on_the_buffer_width(rng, with_probs):
    """Rows drafting 3 tokens in k = 8 buffers emit exactly what the same rows give in k = 3 buffers, seeded:
    column num_draft (not k) draws the recovered or bonus token (a server's k-by-load buffers hold a seeded
    row pinned to 4 drafts, which must give generate()'s k = 4 tokens)."""
    c = make_case(rng, batch=16, k=8, vocab=30, dtype=torch.float32, with_probs=with_probs, filters=(1.0, 0, 1.0))
    c["num_draft"] = torch.full((16,), 3, dtype=torch.int32)
    if with_probs:  # rows 0..7 draft from the target's own distribution: accepted whole, a bonus token
        c["q"][:8] = torch.softmax(c["logits"][:8, :8].float(), dim=-1)
    seeds, offsets = torch.arange(16, dtype=torch.int64) + 40, torch.full((16,), 6, dtype=torch.int64)
    wide_tokens, wide_accepted = run_op(dict(c, uniforms=None), seed=seeds, offset=offsets)
    narrow = dict(c, logits=c["logits"][:, :4].contiguous(), draft=c["draft"][:, :3].contiguous(),
                  q=None if c["q"] is None else c["q"][:, :3].contiguous(), uniforms=None)
    narrow_tokens, narrow_accepted = run_op(narrow, seed=seeds, offset=offsets)
    assert torch.equal(wide_accepted, narrow_accepted)
    assert torch.equal(wide_tokens[:, :4], narrow_tokens) and bool((wide_tokens[:, 4:] == -1).all())
    assert 0 < int((wide_accepted < 3).sum()) < 16  # both a recovered token and a bonus token were drawn


# ---------------------------------------------------------------------------------------------
# Distribution: the emitted tokens must follow the filtered target distribution.
DRAWS = 100_000
VOCAB_SMALL = 8


def chi_square_pvalue(samples, probs):
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the filtered support was emitted"
    expected = probs[support] * len(samples)
    return stats.chisquare(counts[support], expected).pvalue


def distribution_case(filters, with_probs, seed=5):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((2, VOCAB_SMALL)) * 1.5
    q = rng.dirichlet(np.full(VOCAB_SMALL, 0.7), size=1)[0]
    p0 = ref.filtered_probs(logits[0], *filters)
    p1 = ref.filtered_probs(logits[1], *filters)
    if with_probs:
        draft = rng.choice(VOCAB_SMALL, size=DRAWS, p=q)
        q_rows = np.broadcast_to(q, (DRAWS, 1, VOCAB_SMALL))
    else:  # a deterministic drafter always proposes the target's second most likely token
        draft = np.full(DRAWS, int(np.argsort(-p0)[1]))
        q_rows = None
    return logits, q, q_rows, draft, p0, p1


@pytest.mark.parametrize("filters", [(1.0, 0, 1.0), (0.7, 0, 0.9)], ids=["t1", "t07_top_p09"])
@pytest.mark.parametrize("with_probs", [True, False])
def test_emitted_token_follows_filtered_target(filters, with_probs):
    logits, q, q_rows, draft, p0, p1 = distribution_case(filters, with_probs)
    target_logits = torch.from_numpy(np.broadcast_to(logits, (DRAWS, 2, VOCAB_SMALL)).astype(np.float32).copy())
    tokens, n = ops.chain_verify(
        target_logits, torch.from_numpy(draft.reshape(DRAWS, 1)),
        None if q_rows is None else torch.from_numpy(q_rows.astype(np.float32).copy()),
        temperature=filters[0], top_k=filters[1], top_p=filters[2],
        seed=torch.arange(DRAWS, dtype=torch.int64), offset=3)
    tokens, n = tokens.numpy(), n.numpy()
    assert chi_square_pvalue(tokens[:, 0], p0) > 1e-4
    # after an accepted draft, the bonus token follows p at the next position
    assert (n == 1).sum() > DRAWS // 20
    assert chi_square_pvalue(tokens[n == 1, 1], p1) > 1e-4


@pytest.mark.parametrize("with_probs", [True, False])
def test_distribution_test_detects_a_verifier_that_skips_the_residual(with_probs):
    """The chi-square test above has the power to catch resampling from p instead of max(0, p - q)."""
    filters = (1.0, 0, 1.0)
    logits, q, q_rows, draft, p0, _ = distribution_case(filters, with_probs)
    rng = np.random.default_rng(11)
    q_draft = q if with_probs else ref.one_hot(int(draft[0]), VOCAB_SMALL)
    accept = rng.random(DRAWS) * q_draft[draft] < p0[draft]
    broken = np.where(accept, draft, rng.choice(VOCAB_SMALL, size=DRAWS, p=p0))
    assert chi_square_pvalue(broken, p0) < 1e-6


# ---------------------------------------------------------------------------------------------
def test_opcheck():
    rng = np.random.default_rng(3)
    c = make_case(rng, batch=3, k=2, vocab=11, dtype=torch.float32, with_probs=True, filters=(0.8, 3, 0.9))
    tokens = torch.empty(3, 3, dtype=torch.int64)
    num_accepted = torch.empty(3, dtype=torch.int32)
    args = (c["logits"], c["draft"], c["q"], c["num_draft"], c["temperature"], c["top_k"], c["top_p"],
            torch.arange(3, dtype=torch.int64), None, None, tokens, num_accepted)
    torch.library.opcheck(torch.ops.specdec_ext.chain_verify.default, args)
    args = (c["logits"].bfloat16(), c["draft"], None, None, None, None, None, None, None, c["uniforms"],
            tokens, num_accepted)
    torch.library.opcheck(torch.ops.specdec_ext.chain_verify.default, args)
    torch.library.opcheck(torch.ops.specdec_ext.philox_uniforms.default,
                          (torch.arange(2), torch.zeros(2, dtype=torch.int64), torch.empty(2, 5)))


def test_the_wrappers_take_meta_tensors_and_return_shapes():
    """On the meta device the ops give outputs of the right shapes (their fake kernels), and the wrappers'
    status check has nothing to read (it raised "Tensor.item() cannot be called on meta tensors")."""
    logits, ids = torch.randn(2, 3, 5, device="meta"), torch.zeros(2, 2, dtype=torch.int64, device="meta")
    tokens, num_accepted = ops.chain_verify(logits, ids, None, temperature=0.0)
    assert tokens.is_meta and tokens.shape == (2, 3) and num_accepted.shape == (2,)
    parents = torch.tensor([[-1, 0]] * 2, dtype=torch.int32, device="meta")
    path, tree_tokens, tree_accepted = ops.tree_verify(logits, ids, parents, None, temperature=0.0)
    assert path.is_meta and path.shape == (2, 2) and tree_tokens.shape == (2, 3) and tree_accepted.shape == (2,)


# ---------------------------------------------------------------------------------------------
def good_args():
    return dict(target_logits=torch.randn(2, 3, 5), draft_token_ids=torch.zeros(2, 2, dtype=torch.int64),
                draft_probs=torch.full((2, 2, 5), 0.2), seed=torch.arange(2, dtype=torch.int64))


def call(**overrides):
    a = good_args()
    a.update(overrides)
    return ops.chain_verify(a.pop("target_logits"), a.pop("draft_token_ids"), a.pop("draft_probs"), **a)


@pytest.mark.parametrize("overrides, message", [
    (dict(target_logits=torch.randn(3, 5)), r"target_logits must be a 3-D tensor \[B, k\+1, V\]"),
    (dict(target_logits=torch.randn(2, 3, 5, dtype=torch.float64)), "target_logits must have dtype"),
    (dict(target_logits=torch.randn(2, 0, 5)), "k\\+1 >= 1"),
    (dict(draft_token_ids=torch.zeros(2, 3, dtype=torch.int64)), "draft_token_ids dimension 1 must be k"),
    (dict(draft_token_ids=torch.zeros(2, 2, dtype=torch.int32)), "draft_token_ids must have dtype Long"),
    (dict(draft_token_ids=torch.zeros(2, 2, dtype=torch.int64, device="meta")), "draft_token_ids must be on the same device"),
    (dict(draft_probs=torch.full((2, 2, 4), 0.25)), "draft_probs dimension 2 must be V"),
    (dict(draft_probs=torch.full((2, 2, 5), 0.2, dtype=torch.float16)), "draft_probs must have dtype Float"),
    (dict(num_draft=torch.tensor([1, 2, 2], dtype=torch.int32)), "num_draft dimension 0 must be B"),
    (dict(temperature=torch.ones(2, dtype=torch.float64)), "temperature must have dtype Float"),
    (dict(uniforms=torch.rand(2, 2)), "uniforms dimension 1 must be the number of draws"),
    (dict(num_draft=torch.tensor([1, 3], dtype=torch.int32)), r"num_draft: row 1 is outside \[0, k\]"),
    (dict(num_draft=torch.tensor([-1, 0], dtype=torch.int32)), r"num_draft: row 0 is outside \[0, k\]"),
    (dict(draft_token_ids=torch.tensor([[0, 0], [5, 0]])), r"draft_token_ids: row 1 has a token id outside \[0, V\)"),
    (dict(draft_token_ids=torch.tensor([[0, -2], [0, 0]])), r"draft_token_ids: row 0"),
    (dict(target_logits=torch.tensor([[[float("nan")] * 5] * 3] * 2)), "target_logits: row 0 has a NaN"),
    (dict(target_logits=torch.full((2, 3, 5), float("-inf"))), "every logit is -inf"),
    (dict(draft_probs=torch.full((2, 2, 5), -0.2)), "draft_probs: row 0 has an invalid probability where the walk"),
    (dict(draft_probs=torch.full((2, 2, 5), float("nan"))), "draft_probs: row 0 has an invalid probability"),
    # q(x) = 0 at the drafted token 0: x cannot have been drawn from q (min(1, p / 0) accepted it)
    (dict(draft_probs=torch.tensor([0.0, 0.25, 0.25, 0.25, 0.25]).expand(2, 2, 5).contiguous()),
     r"draft_probs: row 0 .* > 1 or 0 \(x cannot have been drawn from it\)"),
    (dict(temperature=-1.0), "temperature: row 0 is negative or NaN"),
    (dict(temperature=float("nan")), "temperature: row 0 is negative or NaN"),
    (dict(top_p=0.0), r"top_p: row 0 is outside \(0, 1\]"),
    (dict(top_p=1.5), r"top_p: row 0 is outside \(0, 1\]"),
    (dict(top_k=-1), "top_k: row 0 is negative"),
    (dict(uniforms=torch.ones(2, 3), seed=None), r"uniforms: row 0 has a value outside \[0, 1\)"),
    # numbers past the rows' dtypes (torch's own overflow error named none of them)
    (dict(num_draft=2 ** 33), r"num_draft=8589934592 does not fit the op's int32 rows"),
    (dict(temperature=1e39), r"temperature=1e\+39 does not fit the op's float32 rows"),
    (dict(top_p=-1e39), r"top_p=-1e\+39 does not fit"),
    (dict(seed=2 ** 63, uniforms=None), r"seed=9223372036854775808 does not fit the op's int64 rows"),
    (dict(offset=-2 ** 64), r"offset=-18446744073709551616 does not fit"),
])
def test_bad_input_names_the_argument(overrides, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(**overrides)


def test_a_top_k_past_int32_is_off():
    """top_k >= V keeps every token; one past int32 (2**31, 10**12) is that too, not an overflow error."""
    logits = torch.randn(2, 3, 5)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    off = call(target_logits=logits, draft_token_ids=ids, top_k=0, uniforms=torch.rand(2, 3, generator=torch.Generator().manual_seed(1)))
    for top_k in (2 ** 31, 10 ** 12):
        tokens = call(target_logits=logits, draft_token_ids=ids, top_k=top_k,
                      uniforms=torch.rand(2, 3, generator=torch.Generator().manual_seed(1)))
        assert torch.equal(tokens[0], off[0]) and torch.equal(tokens[1], off[1])


def test_nan_logit_in_a_later_row_names_that_row():
    logits = torch.randn(3, 2, 4)
    logits[2, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="target_logits: row 2"):
        ops.chain_verify(logits, torch.zeros(3, 1, dtype=torch.int64), seed=0)
    tokens, n = ops.chain_verify(logits, torch.zeros(3, 1, dtype=torch.int64), seed=0, check_status=False)
    assert n[2].item() == -1 and (tokens[2] == -1).all() and (n[:2] >= 0).all()


def test_empty_batch():
    tokens, n = ops.chain_verify(torch.randn(0, 3, 5), torch.zeros(0, 2, dtype=torch.int64), seed=0)
    assert tokens.shape == (0, 3) and n.shape == (0,)
