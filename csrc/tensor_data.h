// Raw pointers of checked tensors, for the op views of common/op_views.h.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include "common/op_views.h"
#include "message.h"

namespace specdec {

template <typename T>
const T* optional_data(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// The element type of a tensor whose dtype a check has restricted to fp32, fp16 or bf16.
inline ElementType element_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ElementType::kFloat32;
    case at::kHalf:
      return ElementType::kFloat16;
    case at::kBFloat16:
      return ElementType::kBFloat16;
    default:
      SPECDEC_CHECK(false, "specdec_ext: no kernel for dtype ", t.scalar_type());
  }
}

}  // namespace specdec
