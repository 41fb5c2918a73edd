// Calls registered specdec_ext ops through the dispatcher, as the Python wrappers do.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <optional>

namespace specdec_test {

using OptTensor = std::optional<at::Tensor>;
using Tensor = at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline void chain_verify(const Tensor& logits, const Tensor& draft, const OptTensor& draft_probs,
                         const OptTensor& num_draft, const OptTensor& temperature, const OptTensor& top_k,
                         const OptTensor& top_p, const OptTensor& seed, const OptTensor& offset,
                         const OptTensor& uniforms, Tensor& tokens, Tensor& num_accepted) {
  static auto op = find_op<void(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, Tensor&, Tensor&)>("specdec_ext::chain_verify");
  op.call(logits, draft, draft_probs, num_draft, temperature, top_k, top_p, seed, offset, uniforms, tokens,
          num_accepted);
}

inline void tree_verify(const Tensor& logits, const Tensor& ids, const Tensor& parents, const OptTensor& draft_probs,
                        const OptTensor& num_nodes, const OptTensor& temperature, const OptTensor& top_k,
                        const OptTensor& top_p, const OptTensor& seed, const OptTensor& offset,
                        const OptTensor& uniforms, Tensor& path, Tensor& tokens, Tensor& num_accepted) {
  static auto op = find_op<void(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, Tensor&, Tensor&, Tensor&)>(
      "specdec_ext::tree_verify");
  op.call(logits, ids, parents, draft_probs, num_nodes, temperature, top_k, top_p, seed, offset, uniforms, path,
          tokens, num_accepted);
}

inline void build_tree_mask(const Tensor& parents, const OptTensor& num_nodes, Tensor& mask, Tensor& depth) {
  static auto op = find_op<void(const Tensor&, const OptTensor&, Tensor&, Tensor&)>("specdec_ext::build_tree_mask");
  op.call(parents, num_nodes, mask, depth);
}

inline void residual_probs(const Tensor& p, const Tensor& q, Tensor& out) {
  static auto op = find_op<void(const Tensor&, const Tensor&, Tensor&)>("specdec_ext::residual_probs");
  op.call(p, q, out);
}

inline void sample_filtered(const Tensor& logits, const OptTensor& temperature, const OptTensor& top_k,
                            const OptTensor& top_p, const OptTensor& seed, const OptTensor& offset,
                            const OptTensor& uniforms, Tensor& probs, Tensor& tokens) {
  static auto op = find_op<void(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, Tensor&, Tensor&)>("specdec_ext::sample_filtered");
  op.call(logits, temperature, top_k, top_p, seed, offset, uniforms, probs, tokens);
}

inline void philox_uniforms(const Tensor& seed, const Tensor& offset, Tensor& out) {
  static auto op = find_op<void(const Tensor&, const Tensor&, Tensor&)>("specdec_ext::philox_uniforms");
  op.call(seed, offset, out);
}

inline void kv_write(const Tensor& key, const Tensor& value, const Tensor& slot_mapping, Tensor& kv_cache) {
  static auto op = find_op<void(const Tensor&, const Tensor&, const Tensor&, Tensor&)>("specdec_ext::kv_write");
  op.call(key, value, slot_mapping, kv_cache);
}

inline void kv_compact(Tensor& kv_cache, const Tensor& block_tables, const Tensor& src_positions,
                       const Tensor& dst_start) {
  static auto op = find_op<void(Tensor&, const Tensor&, const Tensor&, const Tensor&)>("specdec_ext::kv_compact");
  op.call(kv_cache, block_tables, src_positions, dst_start);
}

inline void commit_tokens(const Tensor& tokens, const Tensor& num_accepted, const Tensor& active, Tensor& token_buffer,
                          Tensor& seq_lens, Tensor& num_kept, Tensor& next_input) {
  static auto op = find_op<void(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, Tensor&)>(
      "specdec_ext::commit_tokens");
  op.call(tokens, num_accepted, active, token_buffer, seq_lens, num_kept, next_input);
}

}  // namespace specdec_test
