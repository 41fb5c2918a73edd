"""residual_probs against the float64 NumPy reference, opcheck and bad input."""
import numpy as np
import pytest
import torch

import reference as ref
from specdec_ext import ops

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7,), (3, 1), (2, 3, 7), (2, 32001)])
def test_matches_reference(rng, dtype, shape):
    p = torch.from_numpy(rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]).astype(np.float32)).to(dtype)
    q = torch.from_numpy(rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]).astype(np.float32)).to(dtype)
    out = ops.residual_probs(p, q)
    assert out.dtype == torch.float32 and out.shape == p.shape
    expected = ref.residual(p.float().numpy(), q.float().numpy())
    np.testing.assert_allclose(out.numpy(), expected, rtol=TOLERANCE[dtype], atol=1e-6)
    np.testing.assert_allclose(out.sum(-1).numpy(), 1.0, rtol=1e-5)


def test_equal_distributions_return_p(rng):
    p = torch.from_numpy(rng.dirichlet(np.ones(9), size=4).astype(np.float32))
    assert torch.equal(ops.residual_probs(p, p), p)


def test_disjoint_supports_return_p_restricted(rng):
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.3, 0.7])
    assert torch.equal(ops.residual_probs(p, q), p)
    q = torch.tensor([0.5, 0.0, 0.2, 0.3])
    assert torch.allclose(ops.residual_probs(p, q), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_out_argument_is_written():
    p = torch.tensor([[0.2, 0.8]])
    out = torch.empty(1, 2)
    assert ops.residual_probs(p, torch.tensor([[0.6, 0.4]]), out=out) is out
    assert torch.allclose(out, torch.tensor([[0.0, 1.0]]))


def test_opcheck(rng):
    p = torch.from_numpy(rng.dirichlet(np.ones(5), size=3).astype(np.float32))
    q = torch.from_numpy(rng.dirichlet(np.ones(5), size=3).astype(np.float32))
    torch.library.opcheck(torch.ops.specdec_ext.residual_probs.default, (p, q, torch.empty(3, 5)))
    torch.library.opcheck(torch.ops.specdec_ext.residual_probs.default, (p.half(), q.half(), torch.empty(3, 5)))


def _rows(*shape, **kw):
    return torch.rand(*shape, **kw).softmax(-1)


@pytest.mark.parametrize("p, q, message", [
    (_rows(2, 5), _rows(2, 4), "draft_probs must have the shape of target_probs"),
    (_rows(2, 5), _rows(2, 5).double(), "draft_probs must have the dtype"),
    (_rows(2, 5).double(), _rows(2, 5).double(), "target_probs must have dtype"),
    (torch.tensor([0.5, -0.1, 0.6]), torch.tensor([0.3, 0.3, 0.4]), "target_probs must hold probabilities"),
    (torch.tensor([0.5, 0.5]), torch.tensor([float("nan"), 0.5]), "draft_probs must hold probabilities"),
    (_rows(2, 5), torch.rand(2, 5, device="meta"), "draft_probs must be on the same device"),
    (_rows(2, 5), _rows(2, 5) * 0.5, "every row of draft_probs must sum to 1"),
    (_rows(2, 5) * 2, _rows(2, 5), "every row of target_probs must sum to 1"),
])
def test_bad_input_names_the_argument(p, q, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        ops.residual_probs(p, q)


def test_meta_inputs_give_a_meta_result_with_the_value_check_on():
    out = ops.residual_probs(torch.empty(2, 5, device="meta"), torch.empty(2, 5, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 5)


def test_a_subnormal_residual_mass_is_normalised_not_overflowed():
    """p - q leaves 1e-39 (a subnormal float) on one token: the residual is one-hot there, where 1 / mass
    overflows to inf and a multiply by it gave [nan, nan, inf]."""
    out = ops.residual_probs(torch.tensor([[0.3, 0.7, 1e-39]]), torch.tensor([[0.3, 0.7, 0.0]]), check_values=False)
    assert out.tolist() == [[0.0, 0.0, 1.0]]
