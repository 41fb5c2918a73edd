// Contract of the paged KV cache family: kv_write and kv_compact. A backend registers its
// implementations with register_kv_cache_ops(), whose adapters run the checks here first and skip
// empty calls. Rollback is metadata only (lengths and freed
// pages, kept by specdec_ext/kv_cache.py); these ops move data.
//
// Pool layout: kv_cache [X, num_pages, page_size, H, D] contiguous, fp32/bf16/fp16, where X = 2
// (K then V) for one layer, or 2 * num_layers when a whole model's pool [L, 2, ...] is viewed as
// one tensor. Slot s of the pool is (page s / page_size, offset s % page_size).
//
// kv_write: scatter the K/V of T new tokens per row into their slots.
//   key, value    [B, T, H, D] same dtype as kv_cache, any strides (HF's [B, H, T, D].transpose(1, 2)
//                 is accepted without a copy)
//   slot_mapping  [B, T] int64 contiguous: the slot of token (b, t); negative = skip (padding).
//                 Slots >= num_pages * page_size are skipped too (never written out of bounds; the
//                 Python wrapper can validate them on the host).
//   kv_cache      [2, num_pages, page_size, H, D] out (in place): kv_cache[0] <- key, kv_cache[1] <- value
//
// kv_compact: per row, move the K/V of accepted tree nodes to consecutive positions.
//   kv_cache      [X, num_pages, page_size, H, D] out (in place): every X slice is moved alike
//   block_tables  [B, P] int32: the page of logical position p of row b is block_tables[b, p / page_size]
//   src_positions [B, N] int64: logical positions to keep, in order; the first negative entry ends
//                 the row. Copies run as if sequentially in j = 0..N-1: position src_positions[b, j]
//                 -> dst_start[b] + j (a no-op when equal). The intended use (sources strictly
//                 increasing and src >= dst) never reads a slot an earlier copy overwrote.
//                 Positions outside [0, P * page_size) or mapping to a page outside
//                 [0, num_pages) are skipped (never read or written out of bounds).
//   dst_start     [B] int64: the first destination position of each row
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "checks.h"
#include "common/op_views.h"

namespace specdec {

inline void check_kv_pool(const char* op, const at::Tensor& kv_cache, bool one_layer) {
  check_rank(op, "kv_cache", kv_cache, 5,
             one_layer ? "[2, num_pages, page_size, H, D]" : "[X, num_pages, page_size, H, D]");
  check_dtype(op, "kv_cache", kv_cache, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "kv_cache", kv_cache);
  if (one_layer) check_size(op, "kv_cache", kv_cache, 0, 2, "2 (K and V)");
}

inline void check_kv_write(const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& slot_mapping, const at::Tensor& kv_cache) {
  constexpr const char* op = "kv_write";
  check_kv_pool(op, kv_cache, /*one_layer=*/true);
  const int64_t heads = kv_cache.size(3), head_dim = kv_cache.size(4);
  check_rank(op, "key", key, 4, "[B, T, H, D]");
  const int64_t batch = key.size(0), tokens = key.size(1);
  check_size(op, "key", key, 2, heads, "H (kv_cache dimension 3)");
  check_size(op, "key", key, 3, head_dim, "D (kv_cache dimension 4)");
  SPECDEC_CHECK(key.scalar_type() == kv_cache.scalar_type(), op,
                ": key must have the dtype of kv_cache (", kv_cache.scalar_type(), "), got ",
                key.scalar_type());
  check_same_device(op, "key", key, kv_cache, "kv_cache");
  SPECDEC_CHECK(value.sizes() == key.sizes(), op, ": value must have the shape of key ",
                shape_str(key.sizes()), ", got ", shape_str(value.sizes()));
  SPECDEC_CHECK(value.scalar_type() == kv_cache.scalar_type(), op,
                ": value must have the dtype of kv_cache (", kv_cache.scalar_type(), "), got ",
                value.scalar_type());
  check_same_device(op, "value", value, kv_cache, "kv_cache");
  check_matrix(op, "slot_mapping", slot_mapping, "[B, T]", batch, "B (key dimension 0)", tokens,
               "T (key dimension 1)", at::kLong, kv_cache, "kv_cache");
  check_written_apart(op, {{"kv_cache", &kv_cache}},
                      {{"key", &key}, {"value", &value}, {"slot_mapping", &slot_mapping}});
}

inline void check_kv_compact(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                             const at::Tensor& src_positions, const at::Tensor& dst_start) {
  constexpr const char* op = "kv_compact";
  check_kv_pool(op, kv_cache, /*one_layer=*/false);
  check_rank(op, "block_tables", block_tables, 2, "[B, P]");
  const int64_t batch = block_tables.size(0);
  check_dtype(op, "block_tables", block_tables, {at::kInt});
  check_same_device(op, "block_tables", block_tables, kv_cache, "kv_cache");
  check_contiguous(op, "block_tables", block_tables);
  check_rank(op, "src_positions", src_positions, 2, "[B, N]");
  check_size(op, "src_positions", src_positions, 0, batch, "B (block_tables dimension 0)");
  check_dtype(op, "src_positions", src_positions, {at::kLong});
  check_same_device(op, "src_positions", src_positions, kv_cache, "kv_cache");
  check_contiguous(op, "src_positions", src_positions);
  check_rank(op, "dst_start", dst_start, 1, "[B]");
  check_size(op, "dst_start", dst_start, 0, batch, "B (block_tables dimension 0)");
  check_dtype(op, "dst_start", dst_start, {at::kLong});
  check_same_device(op, "dst_start", dst_start, kv_cache, "kv_cache");
  check_contiguous(op, "dst_start", dst_start);
}

inline KvWriteView kv_write_view(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                                 const at::Tensor& kv_cache) {
  KvWriteView v;
  v.key = key.data_ptr();
  v.value = value.data_ptr();
  for (int dim = 0; dim < 4; ++dim) {
    v.key_strides[dim] = key.stride(dim);
    v.value_strides[dim] = value.stride(dim);
  }
  v.slot_mapping = slot_mapping.data_ptr<int64_t>();
  v.pool = kv_cache.data_ptr();
  v.batch = key.size(0);
  v.tokens = key.size(1);
  v.heads = key.size(2);
  v.head_dim = key.size(3);
  v.num_slots = kv_cache.size(1) * kv_cache.size(2);
  v.word_bytes = static_cast<int32_t>(kv_cache.element_size());
  return v;
}

inline KvCompactView kv_compact_view(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                     const at::Tensor& src_positions, const at::Tensor& dst_start) {
  KvCompactView v;
  v.pool = kv_cache.data_ptr();
  v.block_tables = block_tables.data_ptr<int32_t>();
  v.src_positions = src_positions.data_ptr<int64_t>();
  v.dst_start = dst_start.data_ptr<int64_t>();
  v.planes = kv_cache.size(0);
  v.num_pages = kv_cache.size(1);
  v.page_size = kv_cache.size(2);
  v.slot_elems = kv_cache.size(3) * kv_cache.size(4);
  v.batch = block_tables.size(0);
  v.max_pages = block_tables.size(1);
  v.positions = src_positions.size(1);
  v.word_bytes = static_cast<int32_t>(kv_cache.element_size());
  return v;
}

// The schemas around a backend's implementations, which get the raw view of checked, non-empty
// arguments (and the pool, for its device).
using KvWriteImpl = void (*)(const KvWriteView&, const at::Tensor& kv_cache);
using KvCompactImpl = void (*)(const KvCompactView&, const at::Tensor& kv_cache);

template <KvWriteImpl Impl>
void kv_write_op(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                 at::Tensor& kv_cache) {
  check_kv_write(key, value, slot_mapping, kv_cache);
  if (key.numel() > 0) Impl(kv_write_view(key, value, slot_mapping, kv_cache), kv_cache);
}

template <KvCompactImpl Impl>
void kv_compact_op(at::Tensor& kv_cache, const at::Tensor& block_tables, const at::Tensor& src_positions,
                   const at::Tensor& dst_start) {
  check_kv_compact(kv_cache, block_tables, src_positions, dst_start);
  if (kv_cache.numel() > 0 && src_positions.numel() > 0) {
    Impl(kv_compact_view(kv_cache, block_tables, src_positions, dst_start), kv_cache);
  }
}

// Registers a backend's implementations of the family's ops under their schemas.
template <KvWriteImpl KvWrite, KvCompactImpl KvCompact>
void register_kv_cache_ops(torch::Library& m) {
  m.impl("kv_write", &kv_write_op<KvWrite>);
  m.impl("kv_compact", &kv_compact_op<KvCompact>);
}

}  // namespace specdec
