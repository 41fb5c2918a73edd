// The ops' Autograd kernel: they have no derivative and write their outputs in place, so with grad mode on a
// written tensor that requires grad is refused, naming the op and the argument (autograd's graph through it
// would be silently wrong: a gradient computed from the tensor's old value), the version of every written
// tensor is bumped (autograd's check for a tensor it saved and that changed since), and the call goes on below
// autograd. Inputs that require grad are read as they are (the outputs carry no gradient: the ops are for
// inference); under torch.no_grad() nothing is refused.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include "message.h"

namespace specdec {
namespace {

// Calls fn(tensor, index) for every defined tensor in ``value``: a Tensor (index -1), a Tensor[] or a Tensor?[].
template <class Fn>
void for_each_tensor(const c10::IValue& value, Fn fn) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (t.defined()) fn(t, -1);
  } else if (value.isTensorList()) {
    const auto list = value.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) fn(list.get(i), static_cast<int64_t>(i));
  } else if (value.isList()) {
    const auto list = value.toListRef();
    for (size_t i = 0; i < list.size(); ++i)
      if (list[i].isTensor() && list[i].toTensor().defined()) fn(list[i].toTensor(), static_cast<int64_t>(i));
  }
}

// Every op call passes here (the decode loop's included): only the written arguments are read (the weights'
// lists never), and the message is made only for a refusal.
void refuse_grad(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t n = arguments.size();
  const bool grad_mode = c10::GradMode::is_enabled();  // (under torch.no_grad() nothing is recorded: weights may require grad)
  for (size_t i = 0; i < n; ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();  // (the schema's Tensor(a!): written in place)
    if (alias == nullptr || !alias->isWrite()) continue;
    for_each_tensor((*stack)[stack->size() - n + i], [&](const at::Tensor& t, int64_t index) {
      SPECDEC_CHECK(!grad_mode || !t.requires_grad(), op.schema().name(), ": ", arguments[i].name(),
                    index < 0 ? std::string() : "[" + std::to_string(index) + "]", " requires grad, and the op "
                    "writes it in place without a derivative: call it under torch.no_grad(), or pass a tensor that "
                    "does not require grad (.detach())");
      if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
    });
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_ext, Autograd, m) {
  for (const char* op : {"chain_verify", "sample_filtered", "residual_probs", "philox_uniforms", "build_tree_mask",
                         "tree_verify", "kv_write", "kv_compact", "commit_tokens", "fused_linear", "rope_cache_write",
                         "cache_attention", "decoder_layers", "greedy_chain", "eagle_chain", "process_logits"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&specdec::refuse_grad>());
}
