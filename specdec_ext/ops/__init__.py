"""Typed wrappers over ``torch.ops.specdec_ext.*`` (numpydoc with a ``Shape:`` line per tensor) and
the fake kernels of every op, one module per op family."""
from ._common import GREEDY_TEMPERATURE
from .kv_cache import kv_compact, kv_write
from .lean_forward import (CPU_ONLY_OPS, cache_attention, cpu_isa, decoder_layers, fused_linear, greedy_chain,
                           rope_cache_write)
from .sampling import chain_verify, philox_uniforms, residual_probs
from .tree import build_tree_mask, tree_verify

__all__ = ["CPU_ONLY_OPS", "GREEDY_TEMPERATURE", "build_tree_mask", "cache_attention", "chain_verify", "cpu_isa",
           "decoder_layers", "fused_linear", "greedy_chain", "kv_compact", "kv_write", "philox_uniforms", "residual_probs", "rope_cache_write", "tree_verify"]
