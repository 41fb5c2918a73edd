// Calls registered specdec_ext ops through the dispatcher, as the Python wrappers do.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <optional>

namespace specdec_test {

using OptTensor = std::optional<at::Tensor>;

inline void chain_verify(const at::Tensor& logits, const at::Tensor& draft, const OptTensor& draft_probs,
                         const OptTensor& num_draft, const OptTensor& temperature, const OptTensor& top_k,
                         const OptTensor& top_p, const OptTensor& seed, const OptTensor& offset,
                         const OptTensor& uniforms, at::Tensor& tokens, at::Tensor& num_accepted) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdec_ext::chain_verify", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                   const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                   const OptTensor&, const OptTensor&, at::Tensor&, at::Tensor&)>();
  op.call(logits, draft, draft_probs, num_draft, temperature, top_k, top_p, seed, offset, uniforms, tokens,
          num_accepted);
}

inline void residual_probs(const at::Tensor& p, const at::Tensor& q, at::Tensor& out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdec_ext::residual_probs", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  op.call(p, q, out);
}

}  // namespace specdec_test
