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
void kv_write_rows(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                   const at::Tensor& kv_cache) {
  const int64_t batch = key.size(0), tokens = key.size(1);
  const int64_t heads = key.size(2), head_dim = key.size(3);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t slot_elems = heads * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  word_t* k_out = static_cast<word_t*>(kv_cache.data_ptr());
  word_t* v_out = k_out + num_slots * slot_elems;
  const word_t* sources[2] = {static_cast<const word_t*>(key.data_ptr()),
                              static_cast<const word_t*>(value.data_ptr())};
  const at::Tensor* tensors[2] = {&key, &value};
  word_t* targets[2] = {k_out, v_out};
  at::parallel_for(0, batch * tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0 || slot >= num_slots) continue;  // padding (or out of range): skipped
      const int64_t b = i / tokens, t = i % tokens;
      for (int kv = 0; kv < 2; ++kv) {
        const at::Tensor& src_t = *tensors[kv];
        const word_t* src = sources[kv] + b * src_t.stride(0) + t * src_t.stride(1);
        word_t* dst = targets[kv] + slot * slot_elems;
        const int64_t sh = src_t.stride(2), sd = src_t.stride(3);
        if (sd == 1 && sh == head_dim) {
          std::memcpy(dst, src, sizeof(word_t) * slot_elems);
        } else {
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t d = 0; d < head_dim; ++d) dst[h * head_dim + d] = src[h * sh + d * sd];
        }
      }
    }
  });
}

void kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
              at::Tensor& kv_cache) {
  check_kv_write(key, value, slot_mapping, kv_cache);
  if (key.numel() == 0) return;
  if (kv_cache.element_size() == 4) {
    kv_write_rows<uint32_t>(key, value, slot_mapping, kv_cache);
  } else {
    kv_write_rows<uint16_t>(key, value, slot_mapping, kv_cache);
  }
}

template <typename word_t>
void kv_compact_rows(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                     const at::Tensor& src_positions, const at::Tensor& dst_start) {
  const int64_t planes = kv_cache.size(0), num_pages = kv_cache.size(1);
  const int64_t page_size = kv_cache.size(2);
  const int64_t slot_elems = kv_cache.size(3) * kv_cache.size(4);
  const int64_t plane_elems = num_pages * page_size * slot_elems;
  const int64_t batch = block_tables.size(0), max_pages = block_tables.size(1);
  const int64_t n = src_positions.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* src_pos = src_positions.data_ptr<int64_t>();
  const int64_t* dst0 = dst_start.data_ptr<int64_t>();
  word_t* pool = static_cast<word_t*>(kv_cache.data_ptr());
  const int64_t max_pos = max_pages * page_size;
  // The slot of logical position p of row b, or -1 when it is outside the row's table or pool.
  auto slot_of = [&](int64_t b, int64_t p) -> int64_t {
    if (p < 0 || p >= max_pos) return -1;
    const int64_t page = tables[b * max_pages + p / page_size];
    if (page < 0 || page >= num_pages) return -1;
    return page * page_size + p % page_size;
  };
  // One task per (row, plane): the copies of a row run in order, planes are independent.
  at::parallel_for(0, batch * planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / planes, x = i % planes;
      word_t* plane = pool + x * plane_elems;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = src_pos[b * n + j];
        if (p < 0) break;
        const int64_t from = slot_of(b, p), to = slot_of(b, dst0[b] + j);
        if (from < 0 || to < 0 || from == to) continue;
        std::memmove(plane + to * slot_elems, plane + from * slot_elems,
                     sizeof(word_t) * slot_elems);
      }
    }
  });
}

void kv_compact(at::Tensor& kv_cache, const at::Tensor& block_tables,
                const at::Tensor& src_positions, const at::Tensor& dst_start) {
  check_kv_compact(kv_cache, block_tables, src_positions, dst_start);
  if (kv_cache.numel() == 0 || src_positions.numel() == 0) return;
  if (kv_cache.element_size() == 4) {
    kv_compact_rows<uint32_t>(kv_cache, block_tables, src_positions, dst_start);
  } else {
    kv_compact_rows<uint16_t>(kv_cache, block_tables, src_positions, dst_start);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) {
  m.impl("kv_write", &kv_write);
  m.impl("kv_compact", &kv_compact);
}

}  // namespace specdec::cpu
