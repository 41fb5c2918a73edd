// The one operator library of specdec_ext: every schema, declared once. Backends register their
// implementations with TORCH_LIBRARY_IMPL in cpu/ and cuda/; fake (meta) kernels live in
// specdec_ext/ops/. Outputs are passed in (Tensor(a!)) so the ops are safe in CUDA graphs.
#include <torch/library.h>

TORCH_LIBRARY(specdec_ext, m) {
  // Lossless verification of a chain of k drafts per row; writes tokens [B, k+1] and
  // num_accepted [B] (a negative RowStatus for an invalid row). See csrc/sampling.h.
  m.def(
      "chain_verify(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor? num_draft, Tensor? temperature, Tensor? top_k, Tensor? top_p, Tensor? seed, "
      "Tensor? offset, Tensor? uniforms, Tensor(a!) tokens, Tensor(b!) num_accepted) -> ()");
  // A drafter's sampled step: each row's filtered distribution written to probs [B,V] and one
  // token drawn from it, tokens [B] (a negative RowStatus for an invalid row). See csrc/sampling.h.
  m.def(
      "sample_filtered(Tensor logits, Tensor? temperature, Tensor? top_k, Tensor? top_p, Tensor? seed, "
      "Tensor? offset, Tensor? uniforms, Tensor(a!) probs, Tensor(b!) tokens) -> ()");
  // normalise(max(0, p - q)) over the last dimension (p where the residual mass is zero).
  m.def("residual_probs(Tensor target_probs, Tensor draft_probs, Tensor(a!) out) -> ()");
  // The Philox uniforms the verifiers draw: out[b, c] = philox(seed[b], offset[b], c).
  m.def("philox_uniforms(Tensor seed, Tensor offset, Tensor(a!) out) -> ()");
  // Tree attention mask [B,N,N] and node depths [B,N] from parents [B,N] (see csrc/tree.h).
  m.def("build_tree_mask(Tensor parents, Tensor? num_nodes, Tensor(a!) mask, Tensor(b!) depth) -> ()");
  // Lossless verification of a token tree per row: path [B,N], tokens [B,N+1], num_accepted [B] (csrc/tree.h).
  m.def("tree_verify(Tensor target_logits, Tensor tree_token_ids, Tensor parents, Tensor? draft_probs, Tensor? num_nodes, Tensor? temperature, Tensor? top_k, Tensor? top_p, Tensor? seed, Tensor? offset, Tensor? uniforms, Tensor(a!) path, Tensor(b!) tokens, Tensor(c!) num_accepted) -> ()");
  // Scatter K/V [B, T, H, D] into pool slots by slot_mapping [B, T] (-1 skips). See csrc/kv_cache.h.
  m.def("kv_write(Tensor key, Tensor value, Tensor slot_mapping, Tensor(a!) kv_cache) -> ()");
  // Per row, move positions src_positions[b, j] to dst_start[b] + j through block_tables.
  m.def("kv_compact(Tensor(a!) kv_cache, Tensor block_tables, Tensor src_positions, Tensor dst_start) -> ()");
  // A step's emitted tokens into the token buffer: seq_lens, num_kept and the next pending token (csrc/token_buffer.h).
  m.def("commit_tokens(Tensor tokens, Tensor num_accepted, Tensor active, Tensor(a!) token_buffer, "
        "Tensor(b!) seq_lens, Tensor(c!) num_kept, Tensor(d!) next_input) -> ()");
  // The lean runner's CPU forward (csrc/lean_forward.h): projections with a fused RMSNorm / residual /
  // SwiGLU epilogue, rotary embedding + cache write, attention of a short query block over the cache,
  // whole decoder layers composed of them in one call, and a greedy draft chain of such passes.
  m.def("fused_linear(Tensor x, Tensor? norm_weight, float norm_eps, Tensor[] weights, Tensor?[] biases, "
        "str epilogue, bool bf16_activations, Tensor(a!)[] outs) -> ()");
  m.def("rope_cache_write(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor cache_rows, Tensor cache_positions, Tensor(b!) k_cache, Tensor(c!) v_cache) -> ()");
  m.def("cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor start, Tensor? visible, float scale, "
        "Tensor(a!) out) -> ()");
  // decoder_layers and greedy_chain: the model as `weights` and `scalars` in LlamaWeights.flat()'s order
  // (embed, 16 entries per layer, norm, head, head_bias; per layer two epsilons, the final norm's, the
  // attention scale), rope = [cos, sin], cache = [k_cache, v_cache] (lean_forward.h).
  m.def("decoder_layers(Tensor(a!) x, Tensor?[] weights, float[] scalars, bool bf16_activations, Tensor[] rope, "
        "Tensor(b!)[] cache, Tensor[] layout, Tensor? visible=None) -> ()");
  m.def("greedy_chain(Tensor(a!) tokens, int steps, Tensor?[] weights, float[] scalars, bool bf16_activations, "
        "Tensor[] rope, Tensor(b!)[] cache, Tensor[] rows, int vocab_limit, bool check_logits=False) -> ()");
  // EAGLE-3's greedy chain: `weights` / `scalars` a one-layer model whose q, k, v read 2d (the layer's
  // input_norm normalises the embedding half), eagle = [hidden_norm, target_ids], eagle_scalars =
  // [hidden_norm_eps, norm_before_residual]; cache = [k_cache, v_cache] [1, Bc, Hk, capacity, D];
  // feed = [] or [tokens [B, W], features [B, W, d], counts [B]] (a block fed first; last then written).
  m.def("eagle_chain(Tensor(a!) tokens, int steps, Tensor(c!) last, Tensor?[] weights, float[] scalars, "
        "Tensor[] eagle, float[] eagle_scalars, Tensor[] rope, Tensor(b!)[] cache, Tensor start, "
        "Tensor[] feed) -> ()");
  // The OpenAI sampling surface in place on a verification pass's logits [B, P, V]: logit bias,
  // repetition / frequency / presence penalties counting each column's draft prefix, a grammar
  // bitmask, min_p (csrc/logits_processing.h).
  m.def("process_logits(Tensor(a!) logits, Tensor draft_tokens, Tensor? parents, Tensor num_draft, Tensor? output_counts, Tensor? prompt_mask, Tensor? logit_bias, Tensor? allowed, Tensor? presence_penalty, Tensor? frequency_penalty, Tensor? repetition_penalty, Tensor? min_p, Tensor? temperature) -> ()");
  // The instruction-set path the CPU forward kernels take now (SPECDEC_CPU_ISA or the best available).
  m.def("cpu_isa() -> str");
}
