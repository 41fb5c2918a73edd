// Device kernels of the paged KV cache family (contract in ../kv_cache.h). No torch includes:
// elements are moved as raw words (uint16_t for bf16/fp16, uint32_t for fp32).
#pragma once
#include <cstdint>

namespace specdec::cuda {

// One block per token (b, t); threads stride over the H * D elements of K and V.
template <typename word_t>
__global__ void kv_write_kernel(const word_t* __restrict__ key, const word_t* __restrict__ value,
                                const int64_t* __restrict__ slot_mapping, word_t* __restrict__ pool,
                                int64_t tokens, int64_t heads, int64_t head_dim,
                                int64_t ks0, int64_t ks1, int64_t ks2, int64_t ks3,
                                int64_t vs0, int64_t vs1, int64_t vs2, int64_t vs3,
                                int64_t num_slots) {
  const int64_t i = blockIdx.x;
  const int64_t slot = slot_mapping[i];
  if (slot < 0 || slot >= num_slots) return;  // padding (or out of range): skipped
  const int64_t b = i / tokens, t = i % tokens;
  const int64_t slot_elems = heads * head_dim;
  word_t* k_dst = pool + slot * slot_elems;
  word_t* v_dst = pool + (num_slots + slot) * slot_elems;
  const word_t* k_src = key + b * ks0 + t * ks1;
  const word_t* v_src = value + b * vs0 + t * vs1;
  for (int64_t e = threadIdx.x; e < slot_elems; e += blockDim.x) {
    const int64_t h = e / head_dim, d = e % head_dim;
    k_dst[e] = k_src[h * ks2 + d * ks3];
    v_dst[e] = v_src[h * vs2 + d * vs3];
  }
}

// One block per (row, plane); the copies of a row run in order j = 0..N-1. Each thread owns the
// same element indices for every j, so a copy that reads a slot an earlier copy wrote sees it
// (sequential semantics) without block synchronisation.
template <typename word_t>
__global__ void kv_compact_kernel(word_t* __restrict__ pool, const int32_t* __restrict__ tables,
                                  const int64_t* __restrict__ src_positions,
                                  const int64_t* __restrict__ dst_start, int64_t planes,
                                  int64_t num_pages, int64_t page_size, int64_t slot_elems,
                                  int64_t max_pages, int64_t n) {
  const int64_t b = blockIdx.x / planes, x = blockIdx.x % planes;
  word_t* plane = pool + x * num_pages * page_size * slot_elems;
  const int64_t max_pos = max_pages * page_size;
  const int32_t* table = tables + b * max_pages;
  const int64_t first = dst_start[b];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = src_positions[b * n + j];
    if (p < 0) break;
    const int64_t q = first + j;
    if (p >= max_pos || q < 0 || q >= max_pos) continue;
    const int64_t src_page = table[p / page_size], dst_page = table[q / page_size];
    if (src_page < 0 || src_page >= num_pages || dst_page < 0 || dst_page >= num_pages) continue;
    const int64_t from = src_page * page_size + p % page_size;
    const int64_t to = dst_page * page_size + q % page_size;
    if (from == to) continue;
    for (int64_t e = threadIdx.x; e < slot_elems; e += blockDim.x) {
      plane[to * slot_elems + e] = plane[from * slot_elems + e];
    }
  }
}

}  // namespace specdec::cuda
