"""Inputs an outside sweep of the ops found silently mishandled: a NaN or infinite key in attention, draft
distributions that do not sum to 1, written tensors that overlap themselves or the inputs, output counts out of
range. Each now gives torch's answer (NaN) or an error naming the argument, on every CPU path."""
import pytest
import torch

from lean_forward_cases import isa  # noqa: F401 (the fixture: every CPU path this machine runs)
from specdec_ext import ops


def _sdpa(q, k_cache, v_cache, start, scale):
    """torch's attention for cache_attention's layout: q [1, T, H, D] after start[0] cached positions."""
    B, T, H, D = q.shape
    Hk, S = k_cache.shape[1], int(start[0]) + T
    k = k_cache[0, :, :S].repeat_interleave(H // Hk, 0)
    v = v_cache[0, :, :S].repeat_interleave(H // Hk, 0)
    mask = torch.ones(T, S, dtype=torch.bool)
    mask[:, S - T:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    out = torch.nn.functional.scaled_dot_product_attention(q[0].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)[None]


@pytest.mark.parametrize("value, slot", [(float("nan"), 1), (float("nan"), 3), (float("inf"), 1)])
def test_attention_over_a_non_finite_key_is_nan_as_torchs(isa, value, slot):
    """A NaN or +inf key made its score's weight 0 (the max skips NaN, exp took it to 0): the outputs stayed
    finite where torch's attention is NaN, and the verifiers' logits checks never saw the broken cache."""
    torch.manual_seed(0)
    q, k_cache, v_cache = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8)
    start = torch.tensor([3])
    k_cache[0, 0, slot] = value
    out = ops.cache_attention(q, k_cache, v_cache, start, 8 ** -0.5)
    expected = _sdpa(q, k_cache, v_cache, start, 8 ** -0.5)
    assert torch.equal(torch.isnan(out), torch.isnan(expected)) and bool(torch.isnan(out).any())
    clean = torch.randn(1, 1, 8, 8)
    finite = ops.cache_attention(q, clean, v_cache, start, 8 ** -0.5)
    torch.testing.assert_close(finite, _sdpa(q, clean, v_cache, start, 8 ** -0.5), rtol=1e-4, atol=1e-5)


def _rejecting_case(scale):
    """One row whose draft is rejected at position 0 (u = 0.99 against a draft q(x) far above p(x)), its q row
    scaled by ``scale``."""
    logits = torch.zeros(1, 3, 10)
    logits[0, :, 0] = 5.0  # p is nearly one-hot at token 0
    q = torch.full((1, 2, 10), 0.02)
    q[0, :, 7] = 0.82  # sums to 1; the draft is token 7
    return logits, torch.tensor([[7, 7]]), q * scale


@pytest.mark.parametrize("scale", [0.5, 0.9, 2.0])
def test_a_draft_distribution_that_does_not_sum_to_one_is_refused(scale):
    """q scaled by 0.5 / 0.9 / 2 was accepted, and the output was no longer distributed as the target (a
    sweep measured total variation 0.08-0.47 against p): a rejection reads the row whole and checks its sum."""
    logits, draft, q = _rejecting_case(scale)
    uniforms = torch.full((1, 3), 0.99)
    with pytest.raises(ValueError, match="draft_probs: row 0 .* a sum off 1 by more than 1e-3"):
        ops.chain_verify(logits, draft, q, temperature=torch.ones(1), uniforms=uniforms)
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="draft_probs: row 0 .* a sum off 1 by more than 1e-3"):
        ops.tree_verify(logits, draft, parents, q, temperature=torch.ones(1), uniforms=uniforms)
    with pytest.raises(ValueError, match="draft_probs: row 0"):  # greedy rows check q on a rejection too
        ops.chain_verify(logits, draft, q, temperature=torch.zeros(1), seed=torch.zeros(1, dtype=torch.int64))
    tokens, accepted = ops.chain_verify(logits, draft, q / scale, temperature=torch.ones(1), uniforms=uniforms)
    assert accepted.item() == 0 and tokens[0, 0].item() == 0  # the same row, normalised: rejected, resampled


def test_outputs_that_share_memory_with_an_input_are_refused():
    """draft_token_ids a view of the tokens output was reported as 'token id outside [0, V)' (the op had
    written -1 over the ids before reading them)."""
    logits = torch.randn(1, 5, 6)
    tokens = torch.empty(1, 5, dtype=torch.int64)
    tokens[0, :4] = logits[0, :4].argmax(-1)
    ids = tokens[:, :4]
    with pytest.raises(RuntimeError, match="tokens \\(written\\) must not share memory with draft_token_ids"):
        ops.chain_verify(logits, ids, temperature=0.0, out=(tokens, torch.empty(1, dtype=torch.int32)))
    parents = torch.tensor([[-1, 0, 1, 2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="must not share memory with tree_token_ids"):
        ops.tree_verify(logits, ids, parents, temperature=0.0,
                        out=(torch.empty(1, 4, dtype=torch.int32), tokens, torch.empty(1, dtype=torch.int32)))
    path = torch.empty(1, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="path \\(written\\) must not share memory with parents"):
        ops.tree_verify(logits, logits[0, :4].argmax(-1)[None], path, temperature=0.0,
                        out=(path, torch.empty(1, 5, dtype=torch.int64), torch.empty(1, dtype=torch.int32)))


def test_written_tensors_that_overlap_themselves_are_refused():
    """An expanded q (rotated in place) was rotated once per alias; an expanded next_input kept the last
    row's token for every row: torch's own in-place ops refuse such views, and so do these."""
    M, H, D = 4, 2, 8
    q = torch.randn(1, H, D).expand(M, H, D)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = torch.arange(16, dtype=torch.float32)[:, None] * inv
    with pytest.raises(RuntimeError, match="q is written, so no two of its elements may share memory"):
        ops.rope_cache_write(q, torch.randn(M, 1, D), torch.randn(M, 1, D), angles.cos().contiguous(),
                             angles.sin().contiguous(), torch.full((M,), 5), torch.zeros(M, dtype=torch.long),
                             torch.arange(M), torch.zeros(1, 1, 8, D), torch.zeros(1, 1, 8, D))
    next_input = torch.zeros(1, 1, dtype=torch.long).expand(2, 1)
    with pytest.raises(RuntimeError, match="next_input is written, so no two of its elements may share memory"):
        ops.commit_tokens(torch.tensor([[10, 11], [20, 21]]), torch.tensor([1, 0], dtype=torch.int32),
                          torch.ones(2, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.long),
                          torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), next_input)


@pytest.mark.parametrize("count", [-5, 2 ** 31 - 1])
def test_output_counts_out_of_range_are_refused(count):
    """A count of -5 with frequency penalty 1 turned the penalty into a bonus of 5; INT32_MAX plus the drafts
    overflowed an int32."""
    logits = torch.zeros(1, 2, 6)
    counts = torch.zeros(1, 6, dtype=torch.int32)
    counts[0, 3] = count
    with pytest.raises(RuntimeError, match="output_counts must lie in \\[0, 1073741824\\]"):
        ops.process_logits(logits, torch.tensor([[3]]), num_draft=torch.ones(1, dtype=torch.int32), output_counts=counts,
                           frequency_penalty=torch.ones(1))
    counts[0, 3] = 2
    ops.process_logits(logits, torch.tensor([[3]]), num_draft=torch.ones(1, dtype=torch.int32), output_counts=counts,
                       frequency_penalty=torch.ones(1))
    assert logits[0, 0, 3].item() == -2.0 and logits[0, 1, 3].item() == -3.0  # the draft counts at column 1


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.5])
def test_an_attention_scale_that_is_not_finite_and_positive_is_refused(scale):
    q, cache = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 8, 8)
    with pytest.raises(RuntimeError, match="cache_attention: scale must be finite and > 0"):
        ops.cache_attention(q, cache, cache, torch.tensor([2]), scale)


@pytest.mark.parametrize("eps", [float("nan"), -1e-6, float("inf")])
def test_a_norm_epsilon_that_is_not_finite_and_non_negative_is_refused(eps):
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="fused_linear: norm_eps must be finite and >= 0"):
        ops.fused_linear(x, [w], [torch.empty(2, 4)], norm_weight=torch.ones(8), norm_eps=eps)
    ops.fused_linear(x, [w], [torch.empty(2, 4)], norm_eps=eps)  # (no norm: the epsilon is not read)
