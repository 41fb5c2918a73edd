// CUDA kernels of the sampling family (contract in ../sampling.h, semantics of cpu/sampling.cpp).
// No torch includes; grids and launches are in sampling.cu, the torch wrappers in sampling_ops.cpp.
//
// chain_verify runs as two kernels:
//
// 1. chain_stats_kernel, one block per (row, position, chunk of 8192 logits): max, validity, and
//    the argmax (greedy rows) or the exp-sum (sampling rows) of every position a row can reach
//    (positions past num_draft are skipped). It reads the logits once, vectorised, with the whole
//    GPU busy: B * (k+1) * ceil(V / 8192) blocks of 256 threads, about ten instructions per logit.
// 2. chain_decide_kernel, one block per row: merges the chunk statistics of every reachable
//    position at once (one warp per position) while loading the l[x], q[x] the decisions need,
//    walks the positions in order as the CPU does (arithmetic only), then draws the recovered or
//    bonus token: a pass computing the residual mass sum_j max(0, p_j - q_j) when draft_probs
//    are given (for deterministic drafts it is 1 - p(x), known from the statistics), and one
//    inverse-CDF pass that stops at the tile holding the crossing (half a row on average).
//    Filtered rows (top-k / top-p) run the ThresholdSearch passes here, on the positions they
//    reach only (the slow path: up to 32 passes per search, mostly from L2).
//
// Why not one kernel with one block per row walking the positions sequentially (fewest bytes:
// positions after the first rejection are never read)? At B = 64 it keeps only 64 of 132 SMs
// busy, and the statistics pass of every position read would be a dependent, latency-bound
// stream per SM. Splitting the statistics across (row, position, chunk) blocks reads at most
// (k+1)/E times the bytes (E = positions reached) but at full-GPU bandwidth, and what is left
// per row is about one pass over one position (plus its q row). With draft_probs given the
// q row pass of kernel 2 dominates; splitting it the same way (chunk masses of the residual in
// a third kernel, then a scan inside one chunk) is the next step if profiles ask for it.
//
// sample_filtered: one block per row: the row's statistics (and the filter's passes), a pass writing
// p, and the inverse-CDF pass of the verifiers' bonus draw.
//
// residual_probs: one block per row, two passes (mass, then write). philox_uniforms: one thread
// per draw.
#pragma once
#include <cstdint>

#include "../common/op_views.h"
#include "../common/philox.h"
#include "../common/sampling_math.h"
#include "distribution.cuh"
#include "verifier_row.cuh"

namespace specdec::cuda {

constexpr int kStatsThreads = 256;
constexpr int kStatsGroups = 4;
constexpr int64_t kStatsChunk = int64_t{kStatsThreads} * kStatsGroups * kVec;  // 8192 logits
constexpr int kDecideThreads = 512;
constexpr int kFastPositions = 64;  // rows with k+1 <= 64 merge all positions' statistics at once
constexpr int kDecideGroups = 4;   // load groups per thread in the reduction passes
constexpr int kSampleGroups = 4;   // load groups per thread per tile of the inverse-CDF pass
constexpr int kResidualThreads = 512;
constexpr int kDraftSampleThreads = 512;
constexpr int kDraftSampleGroups = 2;
constexpr int kPhiloxThreads = 256;

inline int64_t stats_chunks(int64_t vocab) { return (vocab + kStatsChunk - 1) / kStatsChunk; }

// chain_verify's kernel parameters: the op's view (common/op_views.h) and the statistics workspace.
struct ChainVerifyParams : ChainVerifyView {
  RowStats* stats;     // [B, k+1, num_chunks] workspace
  int64_t num_chunks;  // stats_chunks(vocab)
};

template <typename T>
__global__ void __launch_bounds__(kStatsThreads, 4) chain_stats_kernel(ChainVerifyParams p) {
  __shared__ BlockTemp<kStatsThreads> temp;
  const int64_t k = p.drafts;
  const int64_t chunk = blockIdx.x % p.num_chunks;
  const int64_t position_row = blockIdx.x / p.num_chunks;  // b * (k+1) + i
  const int64_t b = position_row / (k + 1);
  const int64_t i = position_row % (k + 1);
  const int64_t n = p.row_count(b);
  if (n < 0 || n > k || i > n) return;  // never read by the decision kernel
  // Greedy (and invalid) temperatures take the argmax path; the decision kernel rejects the latter.
  const float temperature = p.sampling.filter(b).temperature;
  const bool greedy = is_greedy(temperature);
  const int64_t begin = chunk * kStatsChunk;
  const int64_t end = begin + kStatsChunk < p.vocab ? begin + kStatsChunk : p.vocab;
  const RowStats s = block_row_stats<T, kStatsThreads, kStatsGroups>(
      static_cast<const T*>(p.logits) + position_row * p.vocab, begin, end,
      inverse_temperature(temperature), greedy, temp);
  if (threadIdx.x == 0) p.stats[position_row * p.num_chunks + chunk] = s;
}

template <typename T>
__global__ void __launch_bounds__(kDecideThreads) chain_decide_kernel(ChainVerifyParams p) {
  constexpr int kThreads = kDecideThreads;
  __shared__ BlockTemp<kThreads> temp;
  using Dist = DistState<1>;
  const int64_t b = blockIdx.x;
  const int64_t k = p.drafts;
  const int64_t vocab = p.vocab;
  const T* logits = static_cast<const T*>(p.logits);
  const FilterParams filter = p.sampling.filter(b);
  const int64_t n = p.row_count(b);

  // Every value below is block-uniform: all threads take the same branches.
  int32_t status = validate_filter(filter);
  if (status == 0 && (n < 0 || n > k)) status = kStatusNumDraftOutOfRange;
  if (status == 0) status = block_draws_and_ids_status<kThreads>(p, b, filter, n);
  const bool greedy = is_greedy(filter.temperature);
  const float inv_temperature = inverse_temperature(filter.temperature);
  const bool filtered = is_filtered(filter, vocab);

  // Fast path (unfiltered rows, k+1 <= kFastPositions): the statistics of every reachable position
  // are merged up front, one warp per position, and the l[x], q[x] the decisions need are loaded at
  // the same time, so the sequential walk below waits on memory once instead of per position.
  __shared__ RowStats position_stats[kFastPositions];
  __shared__ float position_logit_x[kFastPositions];
  __shared__ float position_q_x[kFastPositions];
  const bool fast = !filtered && n + 1 <= kFastPositions;
  if (status == 0 && fast) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int64_t i = warp; i <= n; i += kThreads / 32) {
      const RowStats s = warp_merge_stats(p.stats + (b * (k + 1) + i) * p.num_chunks,
                                          static_cast<int>(p.num_chunks), inv_temperature, greedy);
      if (lane == 0) position_stats[i] = s;
      if (lane == 1 && i < n) {
        const int64_t x = p.token_ids[b * k + i];
        position_logit_x[i] = to_float(logits[(b * (k + 1) + i) * vocab + x]);
        position_q_x[i] = p.draft_probs ? p.draft_probs[(b * k + i) * vocab + x] : 1.0f;
      }
    }
    __syncthreads();
  }

  // p at position i: merged chunk statistics, then the filter's threshold if any.
  auto load_position = [&](int64_t i, Dist& d) -> int32_t {
    const RowStats s = fast ? position_stats[i]
                            : block_merge_stats<kThreads>(
                                  p.stats + (b * (k + 1) + i) * p.num_chunks,
                                  static_cast<int>(p.num_chunks), inv_temperature, greedy, temp);
    if (!s.valid()) return kStatusNonFiniteLogits;
    uint32_t threshold = 0;
    float mass = s.sum;
    if (filtered) {
      block_filter_threshold<T, kThreads, kDecideGroups>(logits + (b * (k + 1) + i) * vocab,
                                                         vocab, filter, s, inv_temperature,
                                                         threshold, mass, temp);
    }
    d = Dist::from_stats(s, inv_temperature, greedy, threshold, mass);
    return 0;
  };

  Dist d;
  int64_t accepted = 0;
  int64_t emitted = -1;
  bool rejected = false;
  const float* q_row = nullptr;
  int64_t x = -1;
  float weight_x = 0.0f;  // unnormalised p(x) at the current position
  for (; status == 0 && accepted < n; ++accepted) {
    x = p.token_ids[b * k + accepted];
    status = load_position(accepted, d);
    if (status != 0) break;
    q_row = p.draft_probs ? p.draft_probs + (b * k + accepted) * vocab : nullptr;
    const float q = fast ? position_q_x[accepted] : (q_row ? q_row[x] : 1.0f);
    if (!(q > 0.0f && q <= 1.0f)) {  // (q(x) = 0: x cannot have been drawn from q)
      status = kStatusInvalidDraftProbs;
      break;
    }
    const float logit_x = fast ? position_logit_x[accepted]
                               : to_float(logits[(b * (k + 1) + accepted) * vocab + x]);
    weight_x = d.weight(x, logit_x);
    if (accept_draft(p.sampling.draw(b, accepted), weight_x / d.mass, q)) continue;
    rejected = true;
    break;
  }

  if (status == 0 && rejected) {  // the recovered token, from normalise(max(0, p - q))
    const T* row = logits + (b * (k + 1) + accepted) * vocab;
    if (greedy) {
      // p is one-hot at the argmax: the residual is that one-hot (or p itself), whatever q is.
      if (q_row && !block_probs_valid<kThreads>(q_row, vocab, temp)) status = kStatusInvalidDraftProbs;
      emitted = d.argmax;
    } else {
      if (!q_row && !filtered && 2.0f * weight_x < d.mass) {
        // Deterministic draft: the residual is p without x, of mass 1 - p(x), taken from the
        // statistics when p(x) < 1/2 (the subtraction then loses at most a bit); otherwise a pass.
        d.push_level(nullptr, x, __fmul_rn(d.mass - weight_x, 1.0f / d.mass));
      } else {
        status = block_subtract<T, kThreads, kDecideGroups>(d, row, vocab, q_row, x, temp);
      }
      if (status == 0) {
        emitted = block_sample<T, kThreads, kSampleGroups>(d, row, vocab, p.sampling.draw(b, n), temp);
      }
    }
  }
  if (status == 0 && !rejected) {  // every draft accepted: the bonus token
    status = load_position(n, d);
    if (status == 0) {
      emitted = greedy ? d.argmax
                       : block_sample<T, kThreads, kSampleGroups>(
                             d, logits + (b * (k + 1) + n) * vocab, vocab, p.sampling.draw(b, n), temp);
    }
  }

  for (int64_t c = threadIdx.x; c <= k; c += kThreads) {
    int64_t token = kEmptySlot;
    if (status == 0) {
      if (c < accepted) token = p.token_ids[b * k + c];
      if (c == accepted) token = emitted;
    }
    p.tokens[b * (k + 1) + c] = token;
  }
  if (threadIdx.x == 0) p.num_accepted[b] = status != 0 ? status : static_cast<int32_t>(accepted);
}

// Row b's filtered distribution written to probs and one token drawn from it (CPU: sample_filtered_rows).
// Every branch below depends on block-uniform values only.
template <typename T>
__global__ void __launch_bounds__(kDraftSampleThreads) sample_filtered_kernel(SampleFilteredView p) {
  constexpr int kThreads = kDraftSampleThreads;
  __shared__ BlockTemp<kThreads> temp;
  const int64_t b = blockIdx.x;
  const FilterParams filter = p.sampling.filter(b);
  int32_t status = validate_filter(filter);
  if (status == 0) status = p.sampling.missing_draws_status(filter);
  const float u = p.sampling.draw(b, 0);
  if (status == 0 && p.sampling.has_draws() && !is_valid_uniform(u)) status = kStatusInvalidUniform;
  const T* row = static_cast<const T*>(p.logits) + b * p.vocab;
  DistState<0> d;
  if (status == 0) {
    status = block_load_distribution<T, kThreads, kDraftSampleGroups>(row, p.vocab, filter, d, temp);
  }
  float* probs = p.probs + b * p.probs_row_stride;
  for (int64_t j = threadIdx.x; j < p.vocab; j += kThreads) {
    probs[j] = status == 0 ? d.prob(j, to_float(row[j])) : NAN;
  }
  if (status != 0) {
    if (threadIdx.x == 0) p.tokens[b] = status;
    return;
  }
  const int64_t token = d.greedy ? d.argmax : block_sample<T, kThreads, kDraftSampleGroups>(d, row, p.vocab, u, temp);
  if (threadIdx.x == 0) p.tokens[b] = token;
}

// out = normalise(max(0, p - q)) per row of length V, or p where that mass is 0.
template <typename T>
__global__ void __launch_bounds__(kResidualThreads) residual_probs_kernel(
    const T* __restrict__ target, const T* __restrict__ draft, float* __restrict__ out,
    int64_t vocab) {
  constexpr int kThreads = kResidualThreads;
  constexpr int kGroups = 2;
  constexpr int64_t kSpan = int64_t{kThreads} * kGroups * kVec;
  __shared__ BlockTemp<kThreads> temp;
  const int64_t row = blockIdx.x;
  const T* p_row = target + row * vocab;
  const T* q_row = draft + row * vocab;
  float* out_row = out + row * vocab;

  float sum = 0.0f;
  for (int64_t base = 0; base < vocab; base += kSpan) {
    float pv[kGroups][kVec], qv[kGroups][kVec];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t start = base + (int64_t{g} * kThreads + threadIdx.x) * kVec;
      load_group(p_row, start, vocab, 0.0f, pv[g]);
      load_group(q_row, start, vocab, 0.0f, qv[g]);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float d = pv[g][e] - qv[g][e];
        sum += d > 0.0f ? d : 0.0f;
      }
    }
  }
  const float mass = block_reduce_sum<kThreads>(sum, temp);
  const bool keep_p = !(mass > 0.0f);
  const float inv_mass = keep_p ? 1.0f : 1.0f / mass;
  const bool divide = !isfinite(inv_mass);  // a subnormal mass: its reciprocal overflows
  for (int64_t base = 0; base < vocab; base += kSpan) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t start = base + (int64_t{g} * kThreads + threadIdx.x) * kVec;
      if (start >= vocab) continue;
      float pv[kVec], qv[kVec], r[kVec];
      load_group(p_row, start, vocab, 0.0f, pv);
      load_group(q_row, start, vocab, 0.0f, qv);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float d = pv[e] - qv[e];
        const float kept = d > 0.0f ? d : 0.0f;
        r[e] = keep_p ? pv[e] : (divide ? kept / mass : kept * inv_mass);
      }
      float* dst = out_row + start;
      if (vocab - start >= kVec && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
        reinterpret_cast<float4*>(dst)[0] = make_float4(r[0], r[1], r[2], r[3]);
        reinterpret_cast<float4*>(dst)[1] = make_float4(r[4], r[5], r[6], r[7]);
      } else {
        for (int e = 0; e < kVec && start + e < vocab; ++e) dst[e] = r[e];
      }
    }
  }
}

__global__ void __launch_bounds__(kPhiloxThreads) philox_uniforms_kernel(
    const int64_t* __restrict__ seed, const int64_t* __restrict__ offset, float* __restrict__ out,
    int64_t rows, int64_t columns) {
  const int64_t index = int64_t{blockIdx.x} * kPhiloxThreads + threadIdx.x;
  if (index >= rows * columns) return;
  const int64_t r = index / columns;
  out[index] = philox_uniform(seed[r], offset[r], index % columns);
}

}  // namespace specdec::cuda
