"""Typed wrappers over ``torch.ops.specdec_ext.*`` (numpydoc with a ``Shape:`` line per tensor) and
the fake kernels of every op, one module per op family."""
from .sampling import chain_verify, philox_uniforms, residual_probs

__all__ = ["chain_verify", "philox_uniforms", "residual_probs"]
