// CPU backend of the paged KV cache family (contract in ../kv_cache.h). Elements are moved as raw
// 2- or 4-byte words: the ops copy, they never compute.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "../kv_cache.h"

namespace specdec::cpu {
namespace {

template <typename word_t>
void kv_write_rows(const KvWriteView& v) {
  const int64_t slot_elems = v.heads * v.head_dim;
  word_t* k_out = static_cast<word_t*>(v.pool);
  const word_t* sources[2] = {static_cast<const word_t*>(v.key), static_cast<const word_t*>(v.value)};
  const int64_t* strides[2] = {v.key_strides, v.value_strides};
  word_t* targets[2] = {k_out, k_out + v.num_slots * slot_elems};
  at::parallel_for(0, v.batch * v.tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = v.slot_mapping[i];
      if (slot < 0 || slot >= v.num_slots) continue;  // padding (or out of range): skipped
      const int64_t b = i / v.tokens, t = i % v.tokens;
      for (int kv = 0; kv < 2; ++kv) {
        const int64_t* s = strides[kv];
        const word_t* src = sources[kv] + b * s[0] + t * s[1];
        word_t* dst = targets[kv] + slot * slot_elems;
        if (s[3] == 1 && s[2] == v.head_dim) {
          std::memcpy(dst, src, sizeof(word_t) * slot_elems);
        } else {
          for (int64_t h = 0; h < v.heads; ++h)
            for (int64_t d = 0; d < v.head_dim; ++d) dst[h * v.head_dim + d] = src[h * s[2] + d * s[3]];
        }
      }
    }
  });
}

void kv_write(const KvWriteView& view, const at::Tensor& /*kv_cache*/) {
  view.word_bytes == 4 ? kv_write_rows<uint32_t>(view) : kv_write_rows<uint16_t>(view);
}

template <typename word_t>
void kv_compact_rows(const KvCompactView& v) {
  const int64_t plane_elems = v.num_pages * v.page_size * v.slot_elems;
  const int64_t max_pos = v.max_pages * v.page_size;
  word_t* pool = static_cast<word_t*>(v.pool);
  // The slot of logical position p of row b, or -1 when it is outside the row's table or pool.
  auto slot_of = [&](int64_t b, int64_t p) -> int64_t {
    if (p < 0 || p >= max_pos) return -1;
    const int64_t page = v.block_tables[b * v.max_pages + p / v.page_size];
    if (page < 0 || page >= v.num_pages) return -1;
    return page * v.page_size + p % v.page_size;
  };
  // One task per (row, plane): the copies of a row run in order, planes are independent.
  at::parallel_for(0, v.batch * v.planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / v.planes, x = i % v.planes;
      word_t* plane = pool + x * plane_elems;
      for (int64_t j = 0; j < v.positions; ++j) {
        const int64_t p = v.src_positions[b * v.positions + j];
        if (p < 0) break;
        const int64_t from = slot_of(b, p), to = slot_of(b, v.dst_start[b] + j);
        if (from < 0 || to < 0 || from == to) continue;
        std::memmove(plane + to * v.slot_elems, plane + from * v.slot_elems, sizeof(word_t) * v.slot_elems);
      }
    }
  });
}

void kv_compact(const KvCompactView& view, const at::Tensor& /*kv_cache*/) {
  view.word_bytes == 4 ? kv_compact_rows<uint32_t>(view) : kv_compact_rows<uint16_t>(view);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) { register_kv_cache_ops<kv_write, kv_compact>(m); }

}  // namespace specdec::cpu
