"""Typed wrappers over ``torch.ops.specdec_ext.*`` (numpydoc with a ``Shape:`` line per tensor) and
the fake kernels of every op, one module per op family (``commit_tokens`` is the op itself: its module
says why)."""
from .kv_cache import kv_compact, kv_write
from .lean_forward import (CPU_ONLY_OPS, EagleLayerExtras, Linear, LlamaLayerWeights, LlamaWeights,
                           cache_attention, cpu_isa, decoder_layers, eagle_chain, fused_linear, greedy_chain,
                           llama_head, packed_weight_bytes, rope_cache_write, rope_tables)
from .processing import process_logits
from .sampling import GREEDY_TEMPERATURE, chain_verify, philox_uniforms, residual_probs, sample_filtered
from .token_buffer import commit_tokens
from .tree import build_tree_mask, tree_verify

__all__ = ["CPU_ONLY_OPS", "EagleLayerExtras", "GREEDY_TEMPERATURE", "Linear", "LlamaLayerWeights", "LlamaWeights",
           "build_tree_mask", "cache_attention", "chain_verify", "commit_tokens", "cpu_isa", "decoder_layers",
           "eagle_chain", "fused_linear", "greedy_chain", "kv_compact", "kv_write", "llama_head", "packed_weight_bytes", "philox_uniforms",
           "process_logits", "residual_probs", "rope_cache_write", "rope_tables", "sample_filtered", "tree_verify"]
