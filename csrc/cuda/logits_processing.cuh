// CUDA kernels of process_logits (contract and per-token maths in ../logits_processing.h, semantics
// of cpu/logits_processing.cpp). No torch includes; grids and launches are in
// logits_processing.cu, the torch wrapper in logits_processing_ops.cpp.
//
// process_logits_kernel: one block per (row b, column c); a stale column (c > num_draft[b]) exits
// at once, the whole block. The column's prefix is counted in shared memory first: the tokens and
// parent links of nodes 0 .. c-1 are staged by all threads, thread 0 walks node c - 1 to the root
// inserting each token into an open-addressing table (token -> occurrences, kPathSlots slots for at
// most kMaxProcessDrafts tokens, so at most half full). Then every thread takes the tokens
// t = threadIdx.x + j * kProcessThreads: the raw logit, the committed count plus the table's extra
// count, the bias, the prompt flag and the bitmask bit give the processed logit (processed_logit,
// the CPU's very function) in one read of each input; a token is read and written by the same
// thread, so the prefix's raw logits are never overwritten before they are used. With min_p on
// (block-uniform: a row's parameters) the first pass only reads and finds the column's largest
// finite logit (a block max), and a second pass recomputes each logit, cuts it and stores it: the
// cut sees the fp32 values, as on the CPU, not the values rounded to the dtype.
//
// process_logits_check_kernel: one block; each thread or-s row_value_errors over its rows, the
// block or-s the threads' bits into one word (the wrapper reads it on the host);
// process_logits_tables_check_kernel then or-s table_errors (output_counts, logit_bias) into it over a grid.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "../common/op_views.h"
#include "../logits_processing.h"
#include "launches.h"  // kMaxProcessDrafts

namespace specdec::cuda {

constexpr int kProcessThreads = 256;
constexpr int kPathSlots = 1024;        // the prefix table's slots: at most half full
constexpr int kCheckThreads = 256;

__device__ __forceinline__ float load_as_float(const float* p) { return *p; }
__device__ __forceinline__ float load_as_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_rounded(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_rounded(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_rounded(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// The occurrences of each token in a column's prefix: an open-addressing table with linear probing.
struct PrefixCounts {
  int32_t keys[kPathSlots];  // token, or -1 for an empty slot
  int32_t counts[kPathSlots];

  __device__ __forceinline__ static uint32_t slot_of(int32_t token) {
    return (static_cast<uint32_t>(token) * 2654435761u) >> 22;  // Fibonacci hashing to 10 bits
  }
  __device__ __forceinline__ void insert(int32_t token) {  // one thread at a time
    uint32_t s = slot_of(token);
    while (keys[s] != -1 && keys[s] != token) s = (s + 1) & (kPathSlots - 1);
    if (keys[s] == token) {
      ++counts[s];
    } else {
      keys[s] = token;
      counts[s] = 1;
    }
  }
  __device__ __forceinline__ int32_t count(int32_t token) const {
    for (uint32_t s = slot_of(token);; s = (s + 1) & (kPathSlots - 1)) {
      const int32_t key = keys[s];
      if (key == token) return counts[s];
      if (key == -1) return 0;
    }
  }
};

struct ProcessShared {
  PrefixCounts prefix;
  int32_t tokens[kMaxProcessDrafts];   // nodes 0 .. c-1: token ids (-1 outside [0, V))
  int32_t parents[kMaxProcessDrafts];  // their parent links
  typename cub::BlockReduce<float, kProcessThreads>::TempStorage reduce;
  float column_max;
};

struct FloatMax {
  __device__ __forceinline__ float operator()(float a, float b) const { return b > a ? b : a; }
};

template <typename T>
__global__ void __launch_bounds__(kProcessThreads) process_logits_kernel(ProcessLogitsView v) {
  __shared__ ProcessShared shared;
  const int64_t positions = v.positions();
  const int64_t b = blockIdx.x / positions;
  const int64_t c = blockIdx.x % positions;
  if (c > v.num_draft[b]) return;  // stale column (block-uniform)

  // The prefix of column c: stage nodes 0 .. c-1, then thread 0 walks node c - 1 to the root.
  for (int s = threadIdx.x; s < kPathSlots; s += kProcessThreads) shared.prefix.keys[s] = -1;
  for (int64_t i = threadIdx.x; i < c; i += kProcessThreads) {
    const int64_t token = v.draft_tokens[b * v.drafts + i];
    shared.tokens[i] = token >= 0 && token < v.vocab ? static_cast<int32_t>(token) : -1;
    shared.parents[i] = static_cast<int32_t>(v.parent(b, i));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int64_t i = c - 1; i >= 0;) {
      if (shared.tokens[i] >= 0) shared.prefix.insert(shared.tokens[i]);
      const int64_t next = shared.parents[i];
      if (next >= i) break;  // not a tree (values unchecked under graph capture): the walk ends
      i = next;
    }
  }
  __syncthreads();

  const RowProcessors r = RowProcessors::of(v, b);
  const uint32_t* words = v.allowed ? v.allowed + (b * positions + c) * v.words : nullptr;
  T* column = static_cast<T*>(v.logits) + (b * positions + c) * v.vocab;
  const bool has_prefix = c > 0;
  const auto logit_at = [&](int64_t t) {
    const int32_t extra = has_prefix ? shared.prefix.count(static_cast<int32_t>(t)) : 0;
    return processed_logit(v, r, b, words, t, load_as_float(column + t), extra);
  };

  if (!r.min_p_on) {
    for (int64_t t = threadIdx.x; t < v.vocab; t += kProcessThreads) store_rounded(column + t, logit_at(t));
    return;
  }
  float thread_max = -INFINITY;
  for (int64_t t = threadIdx.x; t < v.vocab; t += kProcessThreads) {
    const float l = logit_at(t);
    if (is_finite_float(l) && l > thread_max) thread_max = l;
  }
  const float block_max = cub::BlockReduce<float, kProcessThreads>(shared.reduce).Reduce(thread_max, FloatMax());
  if (threadIdx.x == 0) shared.column_max = block_max;
  __syncthreads();
  const float column_max = shared.column_max;
  for (int64_t t = threadIdx.x; t < v.vocab; t += kProcessThreads) {
    store_rounded(column + t, min_p_cut(logit_at(t), column_max, r));
  }
}

__global__ void __launch_bounds__(kCheckThreads) process_logits_check_kernel(ProcessLogitsView v, int32_t* errors) {
  __shared__ uint32_t block_errors;
  if (threadIdx.x == 0) block_errors = 0u;
  __syncthreads();
  uint32_t thread_errors = 0u;
  for (int64_t b = threadIdx.x; b < v.batch; b += kCheckThreads) thread_errors |= row_value_errors(v, b);
  if (thread_errors != 0u) atomicOr(&block_errors, thread_errors);
  __syncthreads();
  if (threadIdx.x == 0) *errors = static_cast<int32_t>(block_errors);
}

// The [B, V] tables' values (table_errors) over a grid-stride loop of many blocks, or-ed into *errors after
// process_logits_check_kernel has written it (the same stream): [B, V] entries are too many for one block.
__global__ void __launch_bounds__(kCheckThreads) process_logits_tables_check_kernel(ProcessLogitsView v,
                                                                                  int32_t* errors) {
  const int64_t stride = int64_t{gridDim.x} * kCheckThreads;
  const uint32_t thread_errors =
      table_errors(v, int64_t{blockIdx.x} * kCheckThreads + threadIdx.x, v.batch * v.vocab, stride);
  if (thread_errors != 0u) atomicOr(reinterpret_cast<unsigned int*>(errors), thread_errors);
}

}  // namespace specdec::cuda
