"""The ops under autograd (csrc/autograd_guard.cpp): they have no derivative and write their outputs in place,
so a written tensor that requires grad is refused with grad mode on, every written tensor's version is bumped
(autograd then refuses a backward through a tensor it saved and an op overwrote), and under torch.no_grad() the
calls run as before. Without it the in-place write went unseen: a backward ran on the overwritten value,
silently wrong. Then the wrappers' own checks of what the ops would take wrongly."""
from __future__ import annotations

import pytest
import torch

from specdec_ext import ops


def test_a_written_tensor_that_requires_grad_is_refused_with_grad_mode_on():
    base = torch.randn(1, 2, 8, requires_grad=True)
    bias = dict(num_draft=1, logit_bias=torch.full((1, 8), 3.0))
    logits = base.exp()  # requires grad (exp saves it for the backward), not a leaf
    with pytest.raises(RuntimeError, match="process_logits: logits requires grad, and the op writes it in place"):
        ops.process_logits(logits, torch.zeros(1, 1, dtype=torch.int64), **bias)
    with torch.no_grad():
        plain = base.exp()
        ops.process_logits(plain, torch.zeros(1, 1, dtype=torch.int64), **bias)
    torch.testing.assert_close(plain, base.detach().exp() + 3.0)


def test_an_op_s_write_bumps_the_version_autograd_checks():
    weight = torch.randn(2, 2, 4, 1, 2, requires_grad=True)
    cache = torch.zeros(2, 2, 4, 1, 2)
    loss = (weight * cache).sum()  # autograd saves cache for weight's gradient
    version = cache._version
    ops.kv_write(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), torch.zeros(1, 1, dtype=torch.int64), cache)
    assert cache._version > version and cache.abs().sum() > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inputs_that_require_grad_are_read_as_they_are():
    x, weight = torch.randn(2, 8), torch.randn(4, 8, requires_grad=True)
    out = torch.empty(2, 4)
    ops.fused_linear(x, [weight], [out])
    torch.testing.assert_close(out, x @ weight.detach().T, rtol=1e-5, atol=1e-5)
    assert not out.requires_grad


# ---------------------------------------------------------------------------------- the wrappers' own checks
def test_the_wrappers_name_what_the_ops_would_take_wrongly():
    """A 0-d target_logits reaches the op's message (the wrapper raised an IndexError), a fractional count is
    refused (it was truncated), a negative number of draws is named, and out=target_probs is refused (the
    residual's mass is summed before its row is written: it returned zeros)."""
    with pytest.raises(RuntimeError, match=r"target_logits must be a 3-D tensor \[B, k\+1, V\], got shape \[\]"):
        ops.chain_verify(torch.tensor(1.0), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_draft must be a whole number for the op's int32 rows, got 2.5"):
        ops.chain_verify(torch.randn(1, 4, 5), torch.zeros(1, 3, dtype=torch.int64), num_draft=2.5, temperature=0.0)
    with pytest.raises(ValueError, match="num_draws must be an int >= 0, got -1"):
        ops.philox_uniforms(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64), -1)
    p = torch.tensor([[0.25, 0.75]])
    with pytest.raises(RuntimeError, match=r"out \(written\) must not share memory with target_probs"):
        ops.residual_probs(p, p.clone(), out=p)
    assert ops.chain_verify(torch.randn(1, 4, 5), torch.zeros(1, 3, dtype=torch.int64), num_draft=2.0,
                            temperature=0.0)[1].tolist()[0] <= 2  # (a whole float is taken)
