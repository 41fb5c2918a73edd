// Block-level device functions over one row of logits: the CUDA counterpart of
// cpu/distribution.h, shared by the chain verifier (sampling.cuh) and the tree verifier.
// No torch includes: element types are float, __half and __nv_bfloat16.
//
// Every function named block_* must be called by all threads of the block with the same
// arguments (they synchronise, and return the same value in every thread). They use one
// BlockTemp<kThreads> in shared memory, which they may reuse one after the other.
//
// The semantics are those of the CPU backend (sampling_math.h): p is softmax(logits / T) restricted
// to the tokens whose float_key is >= a threshold found by ThresholdSearch (top-k, then top-p), the
// residual after rejecting a draft sampled from q is max(0, p - q) renormalised, and a token is
// drawn by inverse CDF. Sums are fp32 in a different order than the CPU's sequential loops, so a
// sampled token can differ from the CPU's only when u * mass lies within rounding of a CDF step.
//
// A distribution is never materialised: DistState describes it (max logit, 1/T, key threshold, mass
// and up to kMaxLevels residual updates p <- normalise(max(0, p - q))), and weight() recomputes any
// p_j from the logit (and the q rows) on the fly, exactly as the CPU's subtract() chain would:
//   w0_j = kept(j) * exp((l_j - max) / T)                     (one-hot at the argmax when greedy)
//   w(t+1)_j = max(0, w(t)_j * (1 / mass(t)) - q(t)_j)        (q one-hot at a token when q_row is null)
//   p_j = w(last)_j / mass(last)
//
// Contents: load_group (vectorised loads), exp_weight; block_row_stats (max, validity, argmax or
// exp-sum of a row or chunk), block_merge_stats / warp_merge_stats (of per-chunk statistics);
// block_measure_at / block_filter_threshold (ThresholdSearch for top-k, top-p); DistState (weight,
// prob, push_level); block_load_distribution (p from a logits row), block_weight_mass,
// block_subtract (the residual update), block_probs_valid; block_sample (inverse CDF).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../common/sampling_math.h"

namespace specdec::cuda {

constexpr int kVec = 8;                      // elements per thread per load group (16 B of 16-bit, 32 B of fp32)
constexpr float kExpMinArg = -87.3f;         // exp() underflows to 0 below this, as cpu::exp_nonpositive
constexpr int64_t kNoIndex = INT64_MAX;
constexpr int32_t kNoIndex32 = INT32_MAX;  // vocabularies are below 2^31 (checked on the host)

// ---------------------------------------------------------------------------------------------
// Loads

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ void load_vec8(const float* p, float (&v)[kVec]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ float2 pair_to_float2(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 pair_to_float2(__nv_bfloat162 h) { return __bfloat1622float2(h); }

// Eight 16-bit elements as one 16-byte load of four pairs (Pair: __half2 or __nv_bfloat162).
template <typename Pair, typename T>
__device__ __forceinline__ void load_vec8_pairs(const T* p, float (&v)[kVec]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const Pair* pairs = reinterpret_cast<const Pair*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = pair_to_float2(pairs[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load_vec8(const __half* p, float (&v)[kVec]) { load_vec8_pairs<__half2>(p, v); }
__device__ __forceinline__ void load_vec8(const __nv_bfloat16* p, float (&v)[kVec]) {
  load_vec8_pairs<__nv_bfloat162>(p, v);
}

// Elements [start, start + 8) of row, clipped to `end`, as floats; missing ones are `fill`.
// One vector load when the 8 elements are in range and 16-byte aligned, scalar loads otherwise
// (the tail of a row, or rows whose length breaks the alignment, e.g. V = 32001).
// Returns the number of elements in range (0..8).
template <typename T>
__device__ __forceinline__ int load_group(const T* __restrict__ row, int64_t start, int64_t end,
                                          float fill, float (&v)[kVec]) {
  const int64_t remaining = end - start;
  if (remaining >= kVec && (reinterpret_cast<uintptr_t>(row + start) & 15u) == 0) {
    load_vec8(row + start, v);
    return kVec;
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) v[e] = e < remaining ? to_float(row[start + e]) : fill;
  return remaining <= 0 ? 0 : (remaining >= kVec ? kVec : static_cast<int>(remaining));
}

// Asks L2 for the line holding p (no register result, no wait): used one tile ahead by passes
// that stop early and so cannot keep many loads in flight.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)  // PTX only: the CPU emulator of cpp_tests/cuda_emu has no L2 to ask
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// exp(x) for x <= 0 with the CPU's underflow rule (0 below kExpMinArg, NaN gives 0: a -inf logit
// at T = +inf, sampling_math.h).
__device__ __forceinline__ float exp_weight(float x) { return x >= kExpMinArg ? __expf(x) : 0.0f; }

// ---------------------------------------------------------------------------------------------
// Reduction types

// Max logit (lowest index on ties; the index is only tracked for greedy rows) and validity.
struct MaxStats {
  float max;
  int32_t argmax;
  int32_t nonfinite;  // a NaN or +inf was seen

  __device__ static MaxStats identity() { return {-INFINITY, kNoIndex32, 0}; }
};

struct MaxStatsOp {
  __device__ MaxStats operator()(const MaxStats& a, const MaxStats& b) const {
    const bool take_b = b.max > a.max || (b.max == a.max && b.argmax < a.argmax);
    return {take_b ? b.max : a.max, take_b ? b.argmax : a.argmax, a.nonfinite | b.nonfinite};
  }
};

struct Float2Sum {
  __device__ float2 operator()(const float2& a, const float2& b) const {
    return make_float2(a.x + b.x, a.y + b.y);
  }
};
struct IndexMin {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};
struct IndexMax {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

// One pass of ThresholdSearch: (measure at the pivot, smallest key >= pivot, largest key < pivot).
struct KeyMeasure {
  float measure;
  uint32_t min_above;
  uint32_t max_below;
};
struct KeyMeasureOp {
  __device__ KeyMeasure operator()(const KeyMeasure& a, const KeyMeasure& b) const {
    return {a.measure + b.measure, min(a.min_above, b.min_above), max(a.max_below, b.max_below)};
  }
};

// Statistics of a row (or of a chunk of it): what a verifier needs to decide acceptance without
// a second pass. Greedy rows get the argmax and no sum; sampling rows the sum and no argmax.
struct RowStats {
  float max_logit;
  int32_t argmax;     // lowest index of the max (greedy rows only)
  int32_t nonfinite;
  float sum;          // sum_j exp((l_j - max_logit) / T) (sampling rows only)

  __device__ bool valid() const { return !nonfinite && max_logit > -INFINITY; }
};

// Shared memory of the block_* functions: cub scratch plus broadcast slots.
template <int kThreads>
struct BlockTemp {
  union {
    typename cub::BlockReduce<MaxStats, kThreads>::TempStorage max_stats;
    typename cub::BlockReduce<float2, kThreads>::TempStorage sum2;
    typename cub::BlockReduce<KeyMeasure, kThreads>::TempStorage key;
    typename cub::BlockReduce<int64_t, kThreads>::TempStorage index;
    typename cub::BlockScan<float, kThreads>::TempStorage scan;
  } cub;
  MaxStats max_stats;
  float2 sum2;
  KeyMeasure key;
  int64_t index;
};

// A block reduction whose result every thread receives, through `slot` (two barriers: the second
// lets the caller reuse `temp` right away). `storage` is the cub scratch for T inside BlockTemp.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T block_reduce_broadcast(T v, Op op,
                                                    typename cub::BlockReduce<T, kThreads>::TempStorage& storage,
                                                    T& slot) {
  const T r = cub::BlockReduce<T, kThreads>(storage).Reduce(v, op);
  if (threadIdx.x == 0) slot = r;
  __syncthreads();
  const T out = slot;
  __syncthreads();
  return out;
}

template <int kThreads>
__device__ __forceinline__ MaxStats block_reduce_max(MaxStats v, BlockTemp<kThreads>& temp) {
  return block_reduce_broadcast<kThreads>(v, MaxStatsOp(), temp.cub.max_stats, temp.max_stats);
}

template <int kThreads>
__device__ __forceinline__ float block_reduce_sum(float v, BlockTemp<kThreads>& temp) {
  return block_reduce_broadcast<kThreads>(make_float2(v, 0.0f), Float2Sum(), temp.cub.sum2, temp.sum2).x;
}

template <int kThreads>
__device__ __forceinline__ KeyMeasure block_reduce_key(KeyMeasure v, BlockTemp<kThreads>& temp) {
  return block_reduce_broadcast<kThreads>(v, KeyMeasureOp(), temp.cub.key, temp.key);
}

template <int kThreads, typename Op>
__device__ __forceinline__ int64_t block_reduce_index(int64_t v, Op op, BlockTemp<kThreads>& temp) {
  return block_reduce_broadcast<kThreads>(v, op, temp.cub.index, temp.index);
}

// ---------------------------------------------------------------------------------------------
// Row statistics in one pass over [begin, end): max, validity, and either the argmax (greedy) or
// the exp-sum. Each thread loads kGroups groups of 8 (coalesced: group g of thread t starts at
// base + (g * kThreads + t) * 8) before using any, takes their max (fmaxf skips NaN), then sums
// exps relative to its running max (rescaled when a later span raises it), and the block merges
// the threads' partials. The per-element work is kept to a few instructions because this pass
// runs over every logit of every position (it is the bandwidth-critical loop).
template <typename T, int kThreads, int kGroups>
__device__ RowStats block_row_stats(const T* __restrict__ row, int64_t begin, int64_t end,
                                    float inv_temperature, bool greedy,
                                    BlockTemp<kThreads>& temp) {
  constexpr int64_t kSpan = int64_t{kThreads} * kGroups * kVec;
  float thread_max = -INFINITY;
  int32_t thread_argmax = kNoIndex32;
  bool nan = false;
  float sum = 0.0f;  // relative to thread_max
  for (int64_t base = begin; base < end; base += kSpan) {
    float v[kGroups][kVec];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      load_group(row, base + (int64_t{g} * kThreads + threadIdx.x) * kVec, end, -INFINITY, v[g]);
    }
    float span_max = -INFINITY;  // the -inf fill of missing elements changes neither max nor NaN
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        span_max = fmaxf(span_max, v[g][e]);
        nan |= v[g][e] != v[g][e];
      }
    }
    if (greedy) {
      if (span_max > thread_max) {  // strict: an earlier span keeps its (lower) index on ties
        int32_t first = kNoIndex32;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          const int32_t start = static_cast<int32_t>(base + (int64_t{g} * kThreads + threadIdx.x) * kVec);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if (first == kNoIndex32 && v[g][e] == span_max) first = start + e;
          }
        }
        thread_max = span_max;
        thread_argmax = first;
      }
    } else {
      if (span_max > thread_max) {
        if (thread_max > -INFINITY) sum *= __expf(weight_exponent(thread_max, span_max, inv_temperature));
        thread_max = span_max;
      }
      if (thread_max > -INFINITY) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum += exp_weight(weight_exponent(v[g][e], thread_max, inv_temperature));
        }
      }
    }
  }
  const MaxStats block = block_reduce_max<kThreads>(
      MaxStats{thread_max, thread_argmax, (nan || thread_max == INFINITY) ? 1 : 0}, temp);
  float total = 0.0f;
  if (!greedy) {
    float partial = 0.0f;
    if (thread_max > -INFINITY && block.max < INFINITY) {
      partial = sum * __expf(weight_exponent(thread_max, block.max, inv_temperature));
    }
    total = block_reduce_sum<kThreads>(partial, temp);
  }
  return {block.max, block.argmax, block.nonfinite, total};
}

// Merges per-chunk RowStats (from a kernel that computed them in parallel) into the row's.
template <int kThreads>
__device__ RowStats block_merge_stats(const RowStats* __restrict__ chunks, int num_chunks,
                                      float inv_temperature, bool greedy,
                                      BlockTemp<kThreads>& temp) {
  MaxStats ms = MaxStats::identity();
  const MaxStatsOp op;
  for (int c = threadIdx.x; c < num_chunks; c += kThreads) {
    const RowStats& s = chunks[c];
    ms = op(ms, MaxStats{s.max_logit, s.argmax, s.nonfinite});
  }
  const MaxStats block = block_reduce_max<kThreads>(ms, temp);
  float total = 0.0f;
  if (!greedy) {
    float partial = 0.0f;
    if (block.max > -INFINITY && block.max < INFINITY) {
      for (int c = threadIdx.x; c < num_chunks; c += kThreads) {
        const RowStats& s = chunks[c];
        if (s.max_logit > -INFINITY) {
          partial += s.sum * __expf(weight_exponent(s.max_logit, block.max, inv_temperature));
        }
      }
    }
    total = block_reduce_sum<kThreads>(partial, temp);
  }
  return {block.max, block.argmax, block.nonfinite, total};
}

// The same merge by one warp (for verifiers that merge several positions at once, one per warp).
// Every lane gets the max statistics; lane 0 gets the sum.
__device__ __forceinline__ MaxStats warp_reduce_max(MaxStats v) {
  const MaxStatsOp op;
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    MaxStats other;
    other.max = __shfl_xor_sync(0xFFFFFFFFu, v.max, delta);
    other.argmax = __shfl_xor_sync(0xFFFFFFFFu, v.argmax, delta);
    other.nonfinite = __shfl_xor_sync(0xFFFFFFFFu, v.nonfinite, delta);
    v = op(v, other);
  }
  return v;
}

__device__ __forceinline__ RowStats warp_merge_stats(const RowStats* __restrict__ chunks,
                                                     int num_chunks, float inv_temperature,
                                                     bool greedy) {
  const int lane = threadIdx.x & 31;
  MaxStats ms = MaxStats::identity();
  const MaxStatsOp op;
  for (int c = lane; c < num_chunks; c += 32) {
    const RowStats& s = chunks[c];
    ms = op(ms, MaxStats{s.max_logit, s.argmax, s.nonfinite});
  }
  ms = warp_reduce_max(ms);
  float partial = 0.0f;
  if (!greedy && ms.max > -INFINITY && ms.max < INFINITY) {
    for (int c = lane; c < num_chunks; c += 32) {
      const RowStats& s = chunks[c];
      if (s.max_logit > -INFINITY) {
        partial += s.sum * __expf(weight_exponent(s.max_logit, ms.max, inv_temperature));
      }
    }
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    partial += __shfl_xor_sync(0xFFFFFFFFu, partial, delta);
  }
  return {ms.max, ms.argmax, ms.nonfinite, partial};
}

// ---------------------------------------------------------------------------------------------
// Filtering (top-k, top-p): ThresholdSearch passes over the row, one block reduction each.

// measure(pivot) = sum over key(l_j) >= pivot of 1 (count_only) or exp((l_j - max) / T), with the
// smallest key >= pivot and the largest key < pivot.
template <typename T, int kThreads, int kGroups>
__device__ KeyMeasure block_measure_at(const T* __restrict__ row, int64_t vocab, uint32_t pivot,
                                       bool count_only, float max_logit, float inv_temperature,
                                       BlockTemp<kThreads>& temp) {
  constexpr int64_t kSpan = int64_t{kThreads} * kGroups * kVec;
  KeyMeasure km{0.0f, 0xFFFFFFFFu, 0u};
  for (int64_t base = 0; base < vocab; base += kSpan) {
    float v[kGroups][kVec];
    int n[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      n[g] = load_group(row, base + (int64_t{g} * kThreads + threadIdx.x) * kVec, vocab,
                        -INFINITY, v[g]);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (e < n[g]) {
          const uint32_t key = float_key(v[g][e]);
          if (key >= pivot) {
            km.measure += count_only ? 1.0f : exp_weight(weight_exponent(v[g][e], max_logit, inv_temperature));
            km.min_above = min(km.min_above, key);
          } else {
            km.max_below = max(km.max_below, key);
          }
        }
      }
    }
  }
  return block_reduce_key<kThreads>(km, temp);
}

// The key threshold lambda = max(lambda_k, lambda_p) of sampling_math.h and the kept mass
// sum_{key >= lambda} exp((l - max) / T). `stats` must be valid (finite max).
template <typename T, int kThreads, int kGroups>
__device__ void block_filter_threshold(const T* __restrict__ row, int64_t vocab,
                                       const FilterParams& filter, const RowStats& stats,
                                       float inv_temperature, uint32_t& threshold, float& mass,
                                       BlockTemp<kThreads>& temp) {
  // The search may start below the smallest key: it finds the largest key K with measure(K) >=
  // target, which does not depend on the start (measure(0) is the whole row, >= any target).
  const uint32_t past_max_key = float_key(stats.max_logit) + 1u;
  threshold = 0u;
  auto run_search = [&](ThresholdSearch search, bool count_only) {
    while (!search.done()) {
      const KeyMeasure m = block_measure_at<T, kThreads, kGroups>(
          row, vocab, search.pivot(), count_only, stats.max_logit, inv_temperature, temp);
      search.update(m.measure, m.min_above, m.max_below);
    }
    return search.lo;
  };
  if (filter.top_k > 0 && filter.top_k < vocab) {
    threshold = run_search({threshold, past_max_key, static_cast<float>(filter.top_k)}, true);
  }
  if (filter.top_p < 1.0f) {
    const float kept = block_measure_at<T, kThreads, kGroups>(row, vocab, threshold, false,
                                                              stats.max_logit, inv_temperature,
                                                              temp).measure;
    threshold = run_search({threshold, past_max_key, filter.top_p * kept}, false);
  }
  mass = block_measure_at<T, kThreads, kGroups>(row, vocab, threshold, false, stats.max_logit,
                                                inv_temperature, temp).measure;
}

// ---------------------------------------------------------------------------------------------
// The distribution of one position, recomputed on the fly.

struct ResidualLevel {
  const float* q_row;  // the subtracted draft distribution, or null: one-hot at `token`
  int64_t token;
  float inv_mass;      // 1 / mass of the distribution this level was subtracted from
};

template <int kMaxLevels>
struct DistState {
  float max_logit;
  float inv_temperature;
  uint32_t key_threshold;  // kept(j) = float_key(l_j) >= key_threshold; 0 keeps every token
  int32_t greedy;          // p is one-hot at argmax
  int64_t argmax;
  float mass;              // sum of the current weights
  int32_t num_levels;
  ResidualLevel levels[kMaxLevels > 0 ? kMaxLevels : 1];

  // p before any residual update, from the row's statistics (and the filter's threshold/mass).
  __device__ static DistState from_stats(const RowStats& s, float inv_temperature, bool greedy,
                                         uint32_t key_threshold, float mass) {
    DistState d;
    d.max_logit = s.max_logit;
    d.inv_temperature = inv_temperature;
    d.key_threshold = key_threshold;
    d.greedy = greedy;
    d.argmax = s.argmax;
    d.mass = greedy ? 1.0f : mass;
    d.num_levels = 0;
    return d;
  }

  __device__ float base_weight(int64_t j, float logit) const {
    if (greedy) return j == argmax ? 1.0f : 0.0f;
    return float_key(logit) >= key_threshold ? exp_weight(weight_exponent(logit, max_logit, inv_temperature))
                                             : 0.0f;
  }
  // One residual update, written as the CPU's subtract(): r = w * (1 / mass) - q, clamped at 0.
  // __fmul_rn keeps nvcc from fusing it into an fma (the CPU rounds the product).
  __device__ static float residual(float w, float inv_mass, float q) {
    const float r = __fmul_rn(w, inv_mass) - q;
    return r > 0.0f ? r : 0.0f;
  }
  // Unnormalised weight of token j (p_j = weight / mass); scalar loads of the q rows.
  __device__ float weight(int64_t j, float logit) const {
    float w = base_weight(j, logit);
#pragma unroll
    for (int t = 0; t < kMaxLevels; ++t) {
      if (t < num_levels) {
        const ResidualLevel& level = levels[t];
        const float q = level.q_row ? level.q_row[j] : (j == level.token ? 1.0f : 0.0f);
        w = residual(w, level.inv_mass, q);
      }
    }
    return w;
  }
  __device__ float prob(int64_t j, float logit) const { return weight(j, logit) / mass; }

  // p <- max(0, p - q) with the given residual mass (from block_residual_mass). The caller keeps
  // p unchanged instead when that mass is not > 0 (the CPU's rule).
  __device__ void push_level(const float* q_row, int64_t token, float residual_mass) {
    const ResidualLevel level{q_row, token, 1.0f / mass};
#pragma unroll
    for (int t = 0; t < kMaxLevels; ++t) {  // constant indices keep `levels` in registers
      if (t == num_levels) levels[t] = level;
    }
    ++num_levels;
    mass = residual_mass;
  }

  // Weights of the 8 elements [start, start + 8) (0 past `end`) from a row of logits; q_valid
  // becomes false when the q row of the last level holds a NaN, negative or > 1 value there, and
  // q_sum adds its values there.
  template <typename T>
  __device__ __forceinline__ void group_weights(const T* __restrict__ row, int64_t start,
                                                int64_t end, float (&w)[kVec],
                                                bool& q_valid, float& q_sum) const {
    float v[kVec];
    const int n = load_group(row, start, end, -INFINITY, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) w[e] = e < n ? base_weight(start + e, v[e]) : 0.0f;
#pragma unroll
    for (int t = 0; t < kMaxLevels; ++t) {
      if (t < num_levels) {
        const ResidualLevel& level = levels[t];
        float q[kVec];
        if (level.q_row) {
          load_group(level.q_row, start, end, 0.0f, q);
          if (t == num_levels - 1) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              q_valid &= (e >= n) || (q[e] >= 0.0f && q[e] <= 1.0f);
              q_sum += e < n ? q[e] : 0.0f;
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) q[e] = start + e == level.token ? 1.0f : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) w[e] = e < n ? residual(w[e], level.inv_mass, q[e]) : 0.0f;
      }
    }
  }
};

// Sum of the weights of `d` over the row (sum_j max(0, p_j - q_j) when d's last level is the new
// residual update) and whether the last level's q row is a valid distribution: entries in [0, 1], their
// sum within kProbabilitySumTolerance of 1 (true when it has no q row). Returns the validity; `mass`
// gets the sum.
template <typename T, int kThreads, int kGroups, int kMaxLevels>
__device__ bool block_weight_mass(const DistState<kMaxLevels>& d, const T* __restrict__ row,
                                  int64_t vocab, float& mass, BlockTemp<kThreads>& temp) {
  constexpr int64_t kSpan = int64_t{kThreads} * kGroups * kVec;
  float sum = 0.0f, q_sum = 0.0f;
  bool valid = true;
  for (int64_t base = 0; base < vocab; base += kSpan) {
    float w[kGroups][kVec];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      d.group_weights(row, base + (int64_t{g} * kThreads + threadIdx.x) * kVec, vocab, w[g], valid, q_sum);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum += w[g][e];
    }
  }
  const bool all_valid = __syncthreads_and(valid) != 0;
  mass = block_reduce_sum<kThreads>(sum, temp);
  const bool has_q = d.num_levels > 0 && d.levels[d.num_levels - 1].q_row != nullptr;
  const float q_total = has_q ? block_reduce_sum<kThreads>(q_sum, temp) : 1.0f;
  return all_valid && q_total >= 1.0f - kProbabilitySumTolerance && q_total <= 1.0f + kProbabilitySumTolerance;
}

// The CPU's subtract(): p <- normalise(max(0, p - q)) for a draft sampled from q (a probability
// row, or one-hot at `token` when q_row is null), keeping p where that residual has zero mass.
// One pass (residual mass and validity of q). Returns 0 or kStatusInvalidDraftProbs. The caller
// sizes kMaxLevels for the number of updates it applies (e.g. the depth of a tree).
template <typename T, int kThreads, int kGroups, int kMaxLevels>
__device__ int32_t block_subtract(DistState<kMaxLevels>& d, const T* __restrict__ row,
                                  int64_t vocab, const float* q_row, int64_t token,
                                  BlockTemp<kThreads>& temp) {
  DistState<kMaxLevels> r = d;
  r.push_level(q_row, token, 0.0f);
  float residual_mass;
  if (!block_weight_mass<T, kThreads, kGroups>(r, row, vocab, residual_mass, temp)) {
    return kStatusInvalidDraftProbs;
  }
  if (residual_mass > 0.0f) {
    r.mass = residual_mass;
    d = r;
  }
  return 0;
}

// p at a position from its row of logits alone (no precomputed statistics): one statistics pass,
// then the filter's ThresholdSearch passes when top-k / top-p are on. Returns 0 or
// kStatusNonFiniteLogits. `filter` must be valid (validate_filter).
template <typename T, int kThreads, int kGroups, int kMaxLevels>
__device__ int32_t block_load_distribution(const T* __restrict__ row, int64_t vocab,
                                           const FilterParams& filter,
                                           DistState<kMaxLevels>& d, BlockTemp<kThreads>& temp) {
  const bool greedy = is_greedy(filter.temperature);
  const float inv_temperature = inverse_temperature(filter.temperature);
  const RowStats s =
      block_row_stats<T, kThreads, kGroups>(row, 0, vocab, inv_temperature, greedy, temp);
  if (!s.valid()) return kStatusNonFiniteLogits;
  uint32_t threshold = 0u;
  float mass = s.sum;
  if (is_filtered(filter, vocab)) {
    block_filter_threshold<T, kThreads, kGroups>(row, vocab, filter, s, inv_temperature,
                                                 threshold, mass, temp);
  }
  d = DistState<kMaxLevels>::from_stats(s, inv_temperature, greedy, threshold, mass);
  return 0;
}

// Whether a probability row is a distribution: every entry in [0, 1] (false for NaN), the sum within
// kProbabilitySumTolerance of 1.
template <int kThreads>
__device__ bool block_probs_valid(const float* __restrict__ q_row, int64_t vocab, BlockTemp<kThreads>& temp) {
  bool valid = true;
  float sum = 0.0f;
  for (int64_t start = int64_t{threadIdx.x} * kVec; start < vocab; start += int64_t{kThreads} * kVec) {
    float q[kVec];
    load_group(q_row, start, vocab, 0.0f, q);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      valid &= q[e] >= 0.0f && q[e] <= 1.0f;
      sum += q[e];
    }
  }
  const bool all_valid = __syncthreads_and(valid) != 0;
  const float total = block_reduce_sum<kThreads>(sum, temp);
  return all_valid && total >= 1.0f - kProbabilitySumTolerance && total <= 1.0f + kProbabilitySumTolerance;
}

// Inverse CDF over the weights of src: the smallest j whose running sum exceeds target, or the
// last j with a positive weight when rounding leaves the running sum at or below it (0 if none).
// Never materialises the weights: tiles of kThreads * kGroups * 8 elements, thread t holding the
// contiguous elements [tile + t * kGroups * 8, ...); per tile one block exclusive scan of the
// threads' sums gives each thread its starting running sum, each thread finds its first crossing
// and a block min picks the lowest. The pass stops at the tile that holds the crossing.
// Source: load(start, end, w[8]) (elements [start, start + 8) clipped to end, 0 past it) and
// prefetch(start) (a hint for the next tile's elements from start; may do nothing).
template <int kThreads, int kGroups, typename Source>
__device__ int64_t block_inverse_cdf(const Source& src, int64_t vocab, float target,
                                     BlockTemp<kThreads>& temp) {
  constexpr int kPerThread = kGroups * kVec;
  constexpr int64_t kTile = int64_t{kThreads} * kPerThread;
  float running = 0.0f;  // sum of the weights of the previous tiles (block-uniform)
  int64_t last_positive = -1;
  for (int64_t base = 0; base < vocab; base += kTile) {
    const int64_t start = base + int64_t{threadIdx.x} * kPerThread;
    if (start + kTile < vocab) src.prefetch(start + kTile);  // while this tile is loaded and scanned
    float w[kGroups][kVec];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) src.load(start + g * kVec, vocab, w[g]);
    float own = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) own += w[g][e];
    }
    float before, tile_total;
    cub::BlockScan<float, kThreads>(temp.cub.scan).ExclusiveSum(own, before, tile_total);
    float acc = running + before;
    int64_t crossing = kNoIndex;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (w[g][e] > 0.0f) {
          acc += w[g][e];
          const int64_t j = start + g * kVec + e;
          last_positive = j;
          if (acc > target && crossing == kNoIndex) crossing = j;
        }
      }
    }
    __syncthreads();  // the scan's storage is reused by the reduction below
    const int64_t first = block_reduce_index<kThreads>(crossing, IndexMin(), temp);
    if (first != kNoIndex) return first;
    running += tile_total;
  }
  const int64_t last = block_reduce_index<kThreads>(last_positive, IndexMax(), temp);
  return last >= 0 ? last : 0;
}

// A DistState's weights over one logits row as a block_inverse_cdf source (prefetching the row and
// the residual levels' q rows). The validity flag and q sum group_weights reports are not needed
// here: the q rows were checked when the levels were added.
template <typename T, int kMaxLevels>
struct DistWeights {
  const DistState<kMaxLevels>& d;
  const T* __restrict__ row;

  __device__ __forceinline__ void load(int64_t start, int64_t end, float (&w)[kVec]) const {
    bool unused_valid = true;
    float unused_sum = 0.0f;
    d.group_weights(row, start, end, w, unused_valid, unused_sum);
  }
  __device__ __forceinline__ void prefetch(int64_t start) const {
    prefetch_l2(row + start);
#pragma unroll
    for (int t = 0; t < kMaxLevels; ++t) {
      if (t < d.num_levels && d.levels[t].q_row) prefetch_l2(d.levels[t].q_row + start);
    }
  }
};

// Inverse CDF of a DistState at u: block_inverse_cdf at target u * d.mass.
template <typename T, int kThreads, int kGroups, int kMaxLevels>
__device__ int64_t block_sample(const DistState<kMaxLevels>& d, const T* __restrict__ row,
                                int64_t vocab, float u, BlockTemp<kThreads>& temp) {
  return block_inverse_cdf<kThreads, kGroups>(DistWeights<T, kMaxLevels>{d, row}, vocab, u * d.mass, temp);
}

}  // namespace specdec::cuda
