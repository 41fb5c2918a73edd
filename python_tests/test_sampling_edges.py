"""Temperature edge cases and seeds of both verifiers (csrc/common/sampling_math.h), on the CPU ops:

- T < GREEDY_TEMPERATURE (1e-5, 0 included) is greedy: one-hot argmax, the lowest index on ties;
- T = inf is uniform over the finite logits (top-k / top-p then keep the largest logits); so is a
  huge finite T in the limit; negative or NaN T is an error naming temperature;
- greedy rows need no randomness; without seed and uniforms the wrappers draw per-row seeds from
  torch's default generator, and the op itself reports sampling rows without draws.
The same cases run on the emulated CUDA kernels in cpp_tests/emulated/test_emulated_edges.cpp.
"""
import math

import numpy as np
import pytest
import torch
from scipy import stats

import reference as ref
import reference_tree as ref_tree
import specdec_ext
from specdec_ext import ops
from specdec_ext._status import raise_for_row_status

INF = float("inf")
VERIFIERS = ["chain", "tree"]


def verify(kind, logits, ids, draft_probs=None, **kwargs):
    """(tokens, num_accepted) of chain_verify, or of tree_verify on the chain-shaped tree (the same
    answer by tree.h's contract)."""
    if kind == "chain":
        return ops.chain_verify(logits, ids, draft_probs, **kwargs)
    nodes = ids.shape[1]
    parents = torch.arange(-1, nodes - 1, dtype=torch.int32).expand(ids.shape[0], nodes).contiguous()
    _, tokens, num_accepted = ops.tree_verify(logits, ids, parents, draft_probs, **kwargs)
    return tokens, num_accepted


def test_greedy_threshold_is_exposed():
    assert ops.GREEDY_TEMPERATURE == 1e-5 == ref.GREEDY_TEMPERATURE


@pytest.mark.parametrize("kind", VERIFIERS)
@pytest.mark.parametrize("temperature", [1e-39, 0.0, 3e-39, 1e-30, 9.99e-6])
def test_tiny_temperatures_are_greedy(kind, temperature):
    # The reported case: at T = 1e-39 1/T overflowed and the argmax draft was rejected.
    tokens, n = verify(kind, torch.tensor([[[0.0, 5.0, 1.0], [0.0, 1.0, 7.0]]]), torch.tensor([[1]]),
                       temperature=torch.tensor([temperature]), seed=torch.tensor([0]))
    assert tokens.tolist() == [[1, 2]] and n.tolist() == [1]


@pytest.mark.parametrize("kind", VERIFIERS)
def test_the_threshold_separates_greedy_from_sampling(kind):
    # Two tied logits: greedy takes the lower index for any draw; at the threshold the weights are
    # equal and a draw of 0.9 takes the upper one.
    logits, ids, u = torch.zeros(1, 1, 2), torch.zeros(1, 0, dtype=torch.int64), torch.tensor([[0.9]])
    below = verify(kind, logits, ids, temperature=ops.GREEDY_TEMPERATURE * 0.99, uniforms=u)[0]
    at = verify(kind, logits, ids, temperature=ops.GREEDY_TEMPERATURE, uniforms=u)[0]
    assert below.tolist() == [[0]] and at.tolist() == [[1]]


@pytest.mark.parametrize("kind", VERIFIERS)
def test_greedy_calls_need_no_seed(kind):
    logits = torch.tensor([[[0.0, 5.0, 1.0], [0.0, 1.0, 7.0]]])
    tokens, n = verify(kind, logits, torch.tensor([[1]]), temperature=torch.zeros(1))
    assert tokens.tolist() == [[1, 2]] and n.tolist() == [1]
    tokens, n = verify(kind, logits, torch.tensor([[0]]), temperature=0.0)
    assert tokens.tolist() == [[1, -1]] and n.tolist() == [0]


@pytest.mark.parametrize("kind", VERIFIERS)
@pytest.mark.parametrize("temperature", [INF, 1e30])
def test_infinite_temperature_is_uniform_over_finite_logits_exactly(kind, temperature):
    logits = torch.tensor([[[0.0, 5.0, -INF]]])
    ids = torch.zeros(1, 0, dtype=torch.int64)
    for u, token in [(0.1, 0), (0.49, 0), (0.51, 1), (0.999, 1)]:
        tokens, _ = verify(kind, logits, ids, temperature=temperature, uniforms=torch.tensor([[u]]))
        assert tokens.tolist() == [[token]], (u, tokens)
    # Filters follow the logits' order: top-k 1 keeps the largest logit; top-p 0.5 of three equal
    # weights keeps the two largest (5 and 3), ties at the boundary kept.
    logits = torch.tensor([[[0.0, 5.0, 3.0, -INF]]])
    assert verify(kind, logits, ids, temperature=temperature, top_k=1, uniforms=torch.tensor([[0.2]]))[0].tolist() == [[1]]
    for u, token in [(0.2, 1), (0.7, 2)]:
        tokens, _ = verify(kind, logits, ids, temperature=temperature, top_p=0.5, uniforms=torch.tensor([[u]]))
        assert tokens.tolist() == [[token]]
    np.testing.assert_array_equal(ref.filtered_probs([0.0, 5.0, 3.0, -INF], temperature, 0, 0.5), [0, 0.5, 0.5, 0])


@pytest.mark.parametrize("kind", VERIFIERS)
def test_infinite_temperature_weighs_logits_further_apart_than_float32_spans(kind):
    """3e38 - (-3e38) overflows to -inf in fp32, and -inf * (1 / T = 0) was NaN: the far logit weighed 0 where
    every finite logit weighs 1 at T = inf (sampling_math.h, weight_exponent)."""
    row = [3e38, -3e38, 0.0, -INF]
    logits = torch.tensor([[row, row]])
    np.testing.assert_allclose(ref.filtered_probs(np.array(row, dtype=np.float32), INF), [1 / 3, 1 / 3, 1 / 3, 0])
    draft = torch.tensor([[1]])  # the far logit, a deterministic draft: accepted with probability p = 1/3
    for u, expected in [((0.3, 0.9), [1, 2]), ((0.34, 0.6), [2, -1]), ((0.34, 0.4), [0, -1])]:
        tokens, _ = verify(kind, logits, draft, temperature=INF, uniforms=torch.tensor([u]))
        assert tokens.tolist() == [expected], u
        want = ref.chain_verify(logits.numpy(), draft.numpy(), None, np.array([1]), np.array([INF]), np.array([0]),
                                np.array([1.0]), np.array([u]))[0]
        assert tokens.tolist() == want.tolist()
    probs, _ = ops.sample_filtered(logits[:, 0], temperature=INF, uniforms=torch.tensor([[0.5]]))
    np.testing.assert_allclose(probs[0].numpy(), [1 / 3, 1 / 3, 1 / 3, 0], rtol=1e-6)


@pytest.mark.parametrize("kind", VERIFIERS)
def test_infinite_temperature_draws_are_uniform_over_seeds(kind):
    draws = 30_000
    logits = torch.tensor([0.0, 5.0, -INF, -2.0, 9.0]).expand(draws, 1, 5).contiguous()
    tokens, _ = verify(kind, logits, torch.zeros(draws, 0, dtype=torch.int64), temperature=INF,
                       seed=torch.arange(draws), offset=5)
    counts = np.bincount(tokens[:, 0].numpy(), minlength=5)
    assert counts[2] == 0  # the -inf logit is never drawn
    assert stats.chisquare(counts[[0, 1, 3, 4]]).pvalue > 1e-4


@pytest.mark.parametrize("kind", VERIFIERS)
@pytest.mark.parametrize("temperature", [INF, 1e30, 1e-39, 1e-5, 3.0])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("filters", [(0, 1.0), (3, 1.0), (0, 0.7), (40, 0.9)], ids=["none", "k3", "p07", "k40_p09"])
def test_edge_temperatures_match_the_reference(rng, kind, temperature, with_probs, filters):
    batch, k, vocab = 24, 3, 50
    logits = rng.standard_normal((batch, k + 1, vocab)) * 2
    logits[rng.random(logits.shape) < 0.2] = -INF  # masked tokens: weight 0 at any temperature
    logits[:, :, 0] = 1.0  # at least one finite logit per position
    q = rng.dirichlet(np.full(vocab, 0.5), size=(batch, k)).astype(np.float32) if with_probs else None
    ids = rng.integers(0, vocab, (batch, k))
    uniforms = rng.random((batch, k + 1)).astype(np.float32)
    full = lambda value: np.full(batch, value)  # noqa: E731
    tokens, n = verify(kind, torch.tensor(logits, dtype=torch.float32), torch.tensor(ids),
                       None if q is None else torch.tensor(q), temperature=temperature, top_k=filters[0],
                       top_p=filters[1], uniforms=torch.tensor(uniforms))
    ref_tokens, ref_n = ref.chain_verify(logits.astype(np.float32), ids, q, None, full(temperature),
                                         full(filters[0]), full(filters[1]), uniforms.astype(np.float64))
    np.testing.assert_array_equal(n.numpy(), ref_n)
    np.testing.assert_array_equal(tokens.numpy(), ref_tokens)


@pytest.mark.parametrize("kind", VERIFIERS)
@pytest.mark.parametrize("temperature", [-1.0, -INF, float("nan"), -1e-39])
def test_negative_or_nan_temperature_names_the_argument(kind, temperature):
    with pytest.raises(ValueError, match="temperature: row 0 is negative or NaN"):
        verify(kind, torch.randn(1, 2, 5), torch.zeros(1, 1, dtype=torch.int64), temperature=temperature, seed=0)


@pytest.mark.parametrize("kind", VERIFIERS)
def test_seeds_come_from_torchs_default_generator(kind):
    g = torch.Generator().manual_seed(3)
    logits, ids = torch.randn(16, 4, 40, generator=g), torch.randint(0, 40, (16, 3), generator=g)
    torch.manual_seed(1234)
    first = verify(kind, logits, ids, temperature=1.0)
    torch.manual_seed(1234)
    again = verify(kind, logits, ids, temperature=1.0)
    torch.manual_seed(1234)
    info = torch.iinfo(torch.int64)
    seeds = torch.randint(info.min, info.max, (16,), dtype=torch.int64)
    explicit = verify(kind, logits, ids, temperature=1.0, seed=seeds)
    for a, b, c in zip(first, again, explicit):
        assert torch.equal(a, b) and torch.equal(a, c)
    # different generator states give different seeds: the rows are not all equal across draws
    different = verify(kind, logits, ids, temperature=1.0)
    assert not torch.equal(first[0], different[0])


@pytest.mark.parametrize("kind", VERIFIERS)
def test_the_op_reports_sampling_rows_without_draws(kind):
    # At the op level (no wrapper to draw seeds): greedy rows run, sampling rows report -11, and
    # the wrappers' status check names seed and uniforms.
    logits = torch.tensor([[[0.0, 5.0, 1.0], [0.0, 1.0, 7.0]]] * 2)
    ids = torch.tensor([[1], [1]])
    temperature = torch.tensor([0.0, 0.8])
    tokens = torch.empty(2, 2, dtype=torch.int64)
    num_accepted = torch.empty(2, dtype=torch.int32)
    if kind == "chain":
        torch.ops.specdec_ext.chain_verify(logits, ids, None, None, temperature, None, None, None, None, None,
                                           tokens, num_accepted)
    else:
        torch.ops.specdec_ext.tree_verify(logits, ids, torch.tensor([[-1], [-1]], dtype=torch.int32), None, None,
                                          temperature, None, None, None, None, None,
                                          torch.empty(2, 1, dtype=torch.int32), tokens, num_accepted)
    assert tokens.tolist() == [[1, 2], [-1, -1]] and num_accepted.tolist() == [1, -11]
    op_name = "chain_verify" if kind == "chain" else "tree_verify"
    with pytest.raises(ValueError, match=f"{op_name}: seed/uniforms: row 1 samples"):
        raise_for_row_status(op_name, num_accepted)


def test_tree_reference_follows_the_same_temperature_rules(rng):
    # reference_tree shares reference.filtered_probs: a two-child tree at T = inf with a masked child.
    logits = np.array([[[0.0, 2.0, -INF], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]])
    ids, parents = np.array([[2, 0]]), np.array([[-1, -1]])
    uniforms = np.array([[0.3, 0.2, 0.9]])
    path, tokens, n = ref_tree.tree_verify(logits, ids, parents, None, None, [INF], [0], [1.0], uniforms)
    # node 0 (token 2) has p = 0: rejected, removed; node 1 (token 0) has p = 1/2 > 0.2: accepted;
    # its leaf bonus at T = inf over three equal logits with u = 0.9 is token 2
    assert path.tolist() == [[1, -1]] and tokens.tolist() == [[0, 2, -1]] and n.tolist() == [1]
    got = ops.tree_verify(torch.tensor(logits, dtype=torch.float32), torch.tensor(ids),
                          torch.tensor(parents, dtype=torch.int32), temperature=INF,
                          uniforms=torch.tensor(uniforms, dtype=torch.float32))
    assert [t.tolist() for t in got] == [path.tolist(), tokens.tolist(), n.tolist()]
    assert math.isclose(ref.filtered_probs([0.0, 2.0, -INF], INF)[1], 0.5)


# ------------------------------------------------------------------------------ through generate()
def test_generate_at_tiny_and_infinite_temperatures():
    """T below GREEDY_TEMPERATURE is greedy end to end (drafter and verifier); T = inf samples uniformly
    over the target's finite logits (a chi-square over the first token), never NaN."""
    from test_generate_utils import noisy_copy, one_thread, tiny_model
    with one_thread():
        target = tiny_model("llama", vocab=8, hidden=32, layers=1, logit_scale=3.0)
        draft = noisy_copy(target, 0.3)
        prompt = [1, 4, 2, 6]
        greedy = specdec_ext.generate([prompt], target, draft, max_new_tokens=8, k=2, eos_token_id=False)
        for temperature in (1e-40, 3e-39, 1e-6):
            tiny = specdec_ext.generate([prompt], target, draft, max_new_tokens=8, k=2, eos_token_id=False,
                                        temperature=temperature, seed=1)
            assert tiny.token_ids == greedy.token_ids, temperature
        hot = specdec_ext.generate([prompt] * 2000, target, draft, max_new_tokens=1, k=2, eos_token_id=False,
                                   temperature=float("inf"), seed=list(range(2000)))
    counts = np.bincount([t[0] for t in hot.token_ids], minlength=8)
    assert stats.chisquare(counts).pvalue > 1e-4  # uniform over the 8 tokens
