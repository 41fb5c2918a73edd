// Argument checks shared by every op family. Each message names the op, the argument, what was
// expected and what was passed, so a wrong call fails with a sentence instead of a crash.
#pragma once
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <initializer_list>
#include <string>

#include "message.h"

namespace specdec {

inline void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank,
                       const char* layout) {
  SPECDEC_CHECK(t.dim() == rank, op, ": ", name, " must be a ", rank, "-D tensor ", layout,
                ", got shape ", shape_str(t.sizes()));
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        std::initializer_list<at::ScalarType> allowed) {
  for (auto s : allowed)
    if (t.scalar_type() == s) return;
  std::string names;  // only on failure
  for (auto s : allowed) names += std::string(names.empty() ? "" : " or ") + c10::toString(s);
  SPECDEC_CHECK(false, op, ": ", name, " must have dtype ", names, ", got ", t.scalar_type());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                       int64_t expected, const char* what) {
  SPECDEC_CHECK(t.size(dim) == expected, op, ": ", name, " dimension ", dim, " must be ", what,
                " = ", expected, ", got shape ", shape_str(t.sizes()));
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Tensor& reference, const char* reference_name) {
  SPECDEC_CHECK(t.device() == reference.device(), op, ": ", name, " must be on the same device as ",
                reference_name, " (", reference.device(), "), got ", t.device());
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  SPECDEC_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// A tensor the op writes in place: no two of its elements may share memory (an expanded or otherwise
// self-overlapping view would be written once per alias), as torch's own in-place ops require.
inline void check_no_internal_overlap(const char* op, const char* name, const at::Tensor& t) {
  SPECDEC_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
                " is written, so no two of its elements may share memory (an expanded or self-overlapping view), "
                "got shape ", shape_str(t.sizes()), " and strides ", shape_str(t.strides()));
}

// An output the op writes and one of its inputs must not share memory: the op may write the output
// before it has read all of the input.
inline void check_no_overlap(const char* op, const char* out_name, const at::Tensor& out, const char* in_name,
                             const at::Tensor& in) {
  const at::MemOverlapStatus status = at::get_overlap_status(out, in);
  SPECDEC_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, op, ": ",
                out_name, " (written) must not share memory with ", in_name);
}

// A tensor argument by name; t null for an absent optional one.
struct NamedTensor {
  const char* name;
  const at::Tensor* t;
};

// Every tensor the op writes apart from every other one it writes and from every one it reads (the op may
// write an output before it has read all of an input). Absent (null) arguments are skipped; no allocation.
inline void check_written_apart(const char* op, std::initializer_list<NamedTensor> written,
                                std::initializer_list<NamedTensor> read) {
  for (auto out = written.begin(); out != written.end(); ++out) {
    if (out->t == nullptr) continue;
    for (const NamedTensor& in : read) {
      if (in.t != nullptr) check_no_overlap(op, out->name, *out->t, in.name, *in.t);
    }
    for (auto other = out + 1; other != written.end(); ++other) {
      if (other->t != nullptr) check_no_overlap(op, out->name, *out->t, other->name, *other->t);
    }
  }
}

// A [rows, columns] tensor of one dtype, contiguous, on the reference device.
inline void check_matrix(const char* op, const char* name, const at::Tensor& t, const char* layout,
                         int64_t rows, const char* rows_what, int64_t columns, const char* columns_what,
                         at::ScalarType dtype, const at::Tensor& reference, const char* reference_name) {
  check_rank(op, name, t, 2, layout);
  check_size(op, name, t, 0, rows, rows_what);
  check_size(op, name, t, 1, columns, columns_what);
  check_dtype(op, name, t, {dtype});
  check_same_device(op, name, t, reference, reference_name);
  check_contiguous(op, name, t);
}

// A per-row parameter: optional 1-D [B] tensor of one dtype on the reference device.
inline void check_row_param(const char* op, const char* name, const c10::optional<at::Tensor>& t,
                            int64_t batch, at::ScalarType dtype, const at::Tensor& reference,
                            const char* reference_name) {
  if (!t.has_value()) return;
  check_rank(op, name, *t, 1, "[B]");
  check_size(op, name, *t, 0, batch, "B");
  check_dtype(op, name, *t, {dtype});
  check_same_device(op, name, *t, reference, reference_name);
  check_contiguous(op, name, *t);
}

}  // namespace specdec
