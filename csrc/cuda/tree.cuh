// CUDA kernels of the tree family (contract in ../tree.h, semantics of cpu/tree.cpp). No torch
// includes; grids, workspace and launches are in tree.cu, the torch wrappers in tree_ops.cpp.
//
// build_tree_mask_kernel: one block per row. The row's tree is validated first (num_nodes, then
// every used parent, exactly the CPU's order), the row's [N, N] mask is zero-filled with 16-byte
// stores, and after a barrier each thread walks the parent links of its nodes (at most N steps,
// parents precede children) setting mask[i, ancestor] and counting the depth.
//
// tree_verify_kernel: one block per row, walking the tree exactly as the CPU does. The current
// target distribution p = w / mass of the node being expanded is held as:
//   - implicit (src = -1): w_j = kept(j) exp((l_j - max) / T) recomputed from the logits row
//     (kept(j) = float_key(l_j) >= threshold, the top-k/top-p threshold of sampling_math.h), or
//   - materialised in one of the row's fp32 workspace buffers (src = 0 or 1), written by the first
//     rejection at that node: p <- normalise(max(0, p - q)) reads w (implicit or buffer src) and the
//     q row once and writes the residual into the other buffer (the old p survives in its buffer,
//     so "p kept where the residual mass is 0" costs nothing); the deterministic rule (q one-hot at
//     the rejected token) writes the buffer once and afterwards only sums it and zeroes one entry.
// So an accepted node costs one pass over its logits row (max + exp-sum, block_row_stats of
// distribution.cuh) plus, for filtered rows, the ThresholdSearch passes; each rejection one pass
// over (w, q); the recovered/bonus draw one inverse-CDF pass (chunked block scan, stopping at the
// tile holding the crossing). Any number of rejections in sequence is supported (up to N).
// Children are found by a block-wide search of parents[start, n) for the current node (a block min
// per child tried), so nothing in shared memory depends on N.
//
// Every branch below depends only on block-uniform values (block reductions broadcast their
// result; scalars are loaded by all threads from the same address after a barrier), so every
// thread reaches every barrier. The workspace is written and read by the same block: it is read
// with ordinary loads (never __ldg / ld.global.nc), and every write is followed by a barrier
// (inside the block reduction that ends each pass) before it is read.
#pragma once
#include <cstdint>

#include "../common/op_views.h"
#include "../common/philox.h"
#include "../common/sampling_math.h"
#include "distribution.cuh"
#include "verifier_row.cuh"

namespace specdec::cuda {

constexpr int kMaskThreads = 256;
constexpr int kTreeThreads = 512;
constexpr int kTreeGroups = 2;        // load groups of 8 per thread per span in the row passes
constexpr int kTreeSampleGroups = 2;  // load groups per thread per tile of the inverse-CDF pass
constexpr int64_t kTreeBufferAlign = 8;  // buffer strides are multiples of 8 floats (32 bytes)

// ---------------------------------------------------------------------------------------------
// build_tree_mask

// Zero bytes [0, count) of dst with 16-byte stores where aligned. Any thread mapping.
__device__ __forceinline__ void block_zero_bytes(bool* dst, int64_t count, int threads) {
  unsigned char* bytes = reinterpret_cast<unsigned char*>(dst);
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(bytes) & 15u);
  int64_t head = misalign == 0 ? 0 : 16 - misalign;
  if (head > count) head = count;
  for (int64_t i = threadIdx.x; i < head; i += threads) bytes[i] = 0;
  const int64_t body = (count - head) / 16;
  uint4* vec = reinterpret_cast<uint4*>(bytes + head);
  for (int64_t i = threadIdx.x; i < body; i += threads) vec[i] = make_uint4(0u, 0u, 0u, 0u);
  for (int64_t i = head + body * 16 + threadIdx.x; i < count; i += threads) bytes[i] = 0;
}

__global__ void __launch_bounds__(kMaskThreads) build_tree_mask_kernel(
    const int32_t* __restrict__ parents, const int32_t* __restrict__ num_nodes,
    bool* __restrict__ mask, int32_t* __restrict__ depth, int64_t nodes) {
  const int64_t b = blockIdx.x;
  const int32_t* row_parents = parents + b * nodes;
  bool* row_mask = mask + b * nodes * nodes;
  int32_t* row_depth = depth + b * nodes;
  const int64_t n = num_nodes ? num_nodes[b] : nodes;  // block-uniform

  int32_t status = 0;
  if (n < 0 || n > nodes) {
    status = kStatusNumNodesOutOfRange;
  } else {
    bool bad = false;
    for (int64_t i = threadIdx.x; i < n; i += kMaskThreads) {
      const int32_t parent = row_parents[i];
      bad |= parent < -1 || parent >= i;
    }
    if (__syncthreads_or(bad)) status = kStatusInvalidTree;
  }

  block_zero_bytes(row_mask, nodes * nodes, kMaskThreads);
  if (status != 0) {  // invalid row: mask all false, every depth entry the status
    for (int64_t i = threadIdx.x; i < nodes; i += kMaskThreads) row_depth[i] = status;
    return;
  }
  __syncthreads();  // the zero fill is complete before the true entries are written
  for (int64_t i = threadIdx.x; i < nodes; i += kMaskThreads) {
    bool* mask_i = row_mask + i * nodes;
    if (i >= n) {  // unused slot: sees only itself
      mask_i[i] = true;
      row_depth[i] = 0;
      continue;
    }
    int32_t d = 0;
    for (int64_t j = i; j >= 0; j = row_parents[j]) {  // parents[j] < j for used nodes (validated)
      mask_i[j] = true;
      ++d;
    }
    row_depth[i] = d;
  }
}

// ---------------------------------------------------------------------------------------------
// tree_verify: weight sources and row passes

// Weights recomputed from a logits row: kept(j) exp((l_j - max) / T) (the CPU's materialised
// weights_ after load(); never used for greedy rows).
template <typename T>
struct LogitWeights {
  const T* row;
  float max_logit;
  float inv_temperature;
  uint32_t threshold;  // 0 keeps every token

  __device__ __forceinline__ float weight(float logit) const {
    return float_key(logit) >= threshold ? exp_weight(weight_exponent(logit, max_logit, inv_temperature)) : 0.0f;
  }
  __device__ __forceinline__ float at(int64_t j) const { return weight(to_float(row[j])); }
  __device__ __forceinline__ void prefetch(int64_t) const {}  // (block_inverse_cdf's source hook)
  // Elements [start, start + 8) clipped to end (0 past it); returns how many are in range.
  __device__ __forceinline__ int load(int64_t start, int64_t end, float (&w)[kVec]) const {
    float v[kVec];
    const int n = load_group(row, start, end, -INFINITY, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) w[e] = e < n ? weight(v[e]) : 0.0f;
    return n;
  }
};

// Weights materialised in a workspace buffer written by this block: ordinary loads only (the
// read-only data path is not coherent with the block's own writes). `start` is always a multiple
// of 8 and buffers are 32-byte aligned, so full groups take two 16-byte loads.
struct BufferWeights {
  const float* buf;

  __device__ __forceinline__ float at(int64_t j) const { return buf[j]; }
  __device__ __forceinline__ void prefetch(int64_t) const {}  // (block_inverse_cdf's source hook)
  __device__ __forceinline__ int load(int64_t start, int64_t end, float (&w)[kVec]) const {
    const int64_t remaining = end - start;
    if (remaining >= kVec) {
      const float4 a = reinterpret_cast<const float4*>(buf + start)[0];
      const float4 b = reinterpret_cast<const float4*>(buf + start)[1];
      w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
      w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
      return kVec;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) w[e] = e < remaining ? buf[start + e] : 0.0f;
    return remaining <= 0 ? 0 : static_cast<int>(remaining);
  }
};

// Stores the in-range elements of a group (start a multiple of 8, dst 32-byte aligned).
__device__ __forceinline__ void store_group(float* dst, int64_t start, int64_t end,
                                            const float (&r)[kVec]) {
  const int64_t remaining = end - start;
  if (remaining >= kVec) {
    reinterpret_cast<float4*>(dst + start)[0] = make_float4(r[0], r[1], r[2], r[3]);
    reinterpret_cast<float4*>(dst + start)[1] = make_float4(r[4], r[5], r[6], r[7]);
    return;
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (e < remaining) dst[start + e] = r[e];
  }
}

// The CPU's residual element: max(0, w * (1 / mass) - q), the product rounded on its own.
__device__ __forceinline__ float residual_weight(float w, float inv_mass, float q) {
  const float r = __fmul_rn(w, inv_mass) - q;
  return r > 0.0f ? r : 0.0f;
}

// q rule: r_j = max(0, w_j / mass - q_j) written to dst, its sum into `mass`; returns whether every
// q_j lies in [0, 1] (false for NaN) and they sum to 1 within kProbabilitySumTolerance.
// TargetDistribution::subtract with a q row.
template <int kThreads, int kGroups, typename Source>
__device__ bool block_residual_pass(const Source& src, const float* __restrict__ q_row,
                                    float inv_mass, float* dst, int64_t vocab, float& mass,
                                    BlockTemp<kThreads>& temp) {
  constexpr int64_t kSpan = int64_t{kThreads} * kGroups * kVec;
  float sum = 0.0f, q_sum = 0.0f;
  bool valid = true;
  for (int64_t base = 0; base < vocab; base += kSpan) {
    float w[kGroups][kVec], q[kGroups][kVec];
    int n[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t start = base + (int64_t{g} * kThreads + threadIdx.x) * kVec;
      n[g] = src.load(start, vocab, w[g]);
      load_group(q_row, start, vocab, 0.0f, q[g]);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (n[g] <= 0) continue;
      const int64_t start = base + (int64_t{g} * kThreads + threadIdx.x) * kVec;
      float r[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const bool in_range = e < n[g];
        valid &= !in_range || (q[g][e] >= 0.0f && q[g][e] <= 1.0f);
        q_sum += in_range ? q[g][e] : 0.0f;
        r[e] = in_range ? residual_weight(w[g][e], inv_mass, q[g][e]) : 0.0f;
        sum += r[e];
      }
      store_group(dst, start, vocab, r);
    }
  }
  const bool all_valid = __syncthreads_and(valid) != 0;
  mass = block_reduce_sum<kThreads>(sum, temp);
  const float q_total = block_reduce_sum<kThreads>(q_sum, temp);
  return all_valid && q_total >= 1.0f - kProbabilitySumTolerance && q_total <= 1.0f + kProbabilitySumTolerance;
}

// Deterministic rule: the sum of w without `token` (w_token taken as 0); with dst, the weights with
// w_token = 0 are also written there. TargetDistribution::subtract without a q row.
template <int kThreads, int kGroups, typename Source>
__device__ float block_remove_pass(const Source& src, int64_t token, float* dst, int64_t vocab,
                                   BlockTemp<kThreads>& temp) {
  constexpr int64_t kSpan = int64_t{kThreads} * kGroups * kVec;
  float sum = 0.0f;
  for (int64_t base = 0; base < vocab; base += kSpan) {
    float w[kGroups][kVec];
    int n[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      n[g] = src.load(base + (int64_t{g} * kThreads + threadIdx.x) * kVec, vocab, w[g]);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (n[g] <= 0) continue;
      const int64_t start = base + (int64_t{g} * kThreads + threadIdx.x) * kVec;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (start + e == token) w[g][e] = 0.0f;
        sum += w[g][e];  // 0 past the end
      }
      if (dst != nullptr) store_group(dst, start, vocab, w[g]);
    }
  }
  return block_reduce_sum<kThreads>(sum, temp);
}

// The smallest c in [start, n) with parents[c] == node, or kNoIndex.
template <int kThreads>
__device__ int64_t block_find_child(const int32_t* __restrict__ row_parents, int64_t start,
                                    int64_t n, int64_t node, BlockTemp<kThreads>& temp) {
  if (start >= n) return kNoIndex;  // block-uniform
  int64_t found = kNoIndex;
  for (int64_t c = start + threadIdx.x; c < n; c += kThreads) {
    if (row_parents[c] == node) {
      found = c;  // the thread's first hit is its smallest
      break;
    }
  }
  return block_reduce_index<kThreads>(found, IndexMin(), temp);
}

// ---------------------------------------------------------------------------------------------
// tree_verify kernel

// tree_verify's kernel parameters: the op's view (common/op_views.h) and the fp32 workspace.
struct TreeVerifyParams : TreeVerifyView {
  float* workspace;  // [B, num_buffers, stride]
  int64_t stride;    // floats per buffer, a multiple of kTreeBufferAlign, >= vocab
  int num_buffers;   // 2 with draft_probs (ping-pong), else 1
};

template <typename T>
__global__ void __launch_bounds__(kTreeThreads) tree_verify_kernel(TreeVerifyParams p) {
  constexpr int kThreads = kTreeThreads;
  constexpr int kGroups = kTreeGroups;
  __shared__ BlockTemp<kThreads> temp;
  const int64_t b = blockIdx.x;
  const int64_t nodes = p.drafts;
  const int64_t vocab = p.vocab;
  const int32_t* row_parents = p.parents + b * nodes;
  const int64_t* row_ids = p.token_ids + b * nodes;
  int32_t* row_path = p.path + b * nodes;
  int64_t* row_tokens = p.tokens + b * (nodes + 1);
  float* const row_workspace = p.workspace + b * p.num_buffers * p.stride;
  const FilterParams filter = p.sampling.filter(b);
  const int64_t n = p.row_count(b);

  // Status checks in the CPU's order; every value here is block-uniform.
  int32_t status = validate_filter(filter);
  if (status == 0 && (n < 0 || n > nodes)) status = kStatusNumNodesOutOfRange;
  if (status == 0) {
    bool bad = false;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const int32_t parent = row_parents[i];
      bad |= parent < -1 || parent >= i;
    }
    if (__syncthreads_or(bad)) status = kStatusInvalidTree;
  }
  if (status == 0) status = block_draws_and_ids_status<kThreads>(p, b, filter, n);
  const bool greedy = is_greedy(filter.temperature);
  const float inv_temperature = inverse_temperature(filter.temperature);
  const bool filtered = is_filtered(filter, vocab);

  int64_t accepted = 0;  // the depth of `current`
  int64_t current = -1;  // the root: the committed token
  int64_t emitted = -1;
  while (status == 0) {
    // p <- the filtered target at logits row current + 1.
    const T* row = static_cast<const T*>(p.logits) + (b * (nodes + 1) + current + 1) * vocab;
    const RowStats stats =
        block_row_stats<T, kThreads, kGroups>(row, 0, vocab, inv_temperature, greedy, temp);
    if (!stats.valid()) {
      status = kStatusNonFiniteLogits;
      break;
    }
    uint32_t threshold = 0u;
    float mass = greedy ? 1.0f : stats.sum;
    if (filtered) {
      block_filter_threshold<T, kThreads, kGroups>(row, vocab, filter, stats, inv_temperature,
                                                   threshold, mass, temp);
    }
    const LogitWeights<T> logit_weights{row, stats.max_logit, inv_temperature, threshold};
    int src = -1;  // -1: w implicit from the logits; 0 / 1: w materialised in that buffer

    int64_t next = -1;
    for (int64_t start = current + 1;;) {
      const int64_t c = block_find_child<kThreads>(row_parents, start, n, current, temp);
      if (c == kNoIndex) break;  // every child of `current` rejected, or a leaf
      start = c + 1;
      const int64_t x = row_ids[c];
      const float* q_row = p.draft_probs ? p.draft_probs + (b * nodes + c) * vocab : nullptr;
      const float qx = q_row ? q_row[x] : 1.0f;
      if (!(qx > 0.0f && qx <= 1.0f)) {  // (q(x) = 0: x cannot have been drawn from q)
        status = kStatusInvalidDraftProbs;
        break;
      }
      float px;
      if (greedy) {
        px = x == stats.argmax ? 1.0f : 0.0f;
      } else {
        const float wx = src < 0 ? logit_weights.at(x) : row_workspace[src * p.stride + x];
        px = wx / mass;
      }
      if (accept_draft(p.sampling.draw(b, c), px, qx)) {
        next = c;
        break;
      }
      // Rejected: p <- normalise(max(0, p - q)) for the next child (TargetDistribution::subtract).
      if (greedy) {
        // max(0, onehot(a) - q) is zero or a multiple of onehot(a): p stays; only q is checked.
        if (q_row != nullptr && !block_probs_valid<kThreads>(q_row, vocab, temp)) {
          status = kStatusInvalidDraftProbs;
          break;
        }
        continue;
      }
      if (q_row != nullptr) {
        const int dst = src == 0 ? 1 : 0;
        float* dst_buf = row_workspace + dst * p.stride;
        const float inv_mass = 1.0f / mass;
        float residual_mass;
        const bool valid =
            src < 0 ? block_residual_pass<kThreads, kGroups>(logit_weights, q_row, inv_mass,
                                                             dst_buf, vocab, residual_mass, temp)
                    : block_residual_pass<kThreads, kGroups>(
                          BufferWeights{row_workspace + src * p.stride}, q_row, inv_mass, dst_buf,
                          vocab, residual_mass, temp);
        if (!valid) {
          status = kStatusInvalidDraftProbs;
          break;
        }
        if (residual_mass > 0.0f) {  // else p is kept (its weights are still in src)
          src = dst;
          mass = residual_mass;
        }
      } else if (src < 0) {  // first removal at this node: materialise w without x in buffer 0
        const float removed_mass = block_remove_pass<kThreads, kGroups>(
            logit_weights, x, row_workspace, vocab, temp);
        if (removed_mass > 0.0f) {
          src = 0;
          mass = removed_mass;
        }
      } else {  // later removals: sum in place, then zero w_x
        float* buf = row_workspace + src * p.stride;
        const float removed_mass =
            block_remove_pass<kThreads, kGroups>(BufferWeights{buf}, x, nullptr, vocab, temp);
        if (removed_mass > 0.0f) {
          if (threadIdx.x == 0) buf[x] = 0.0f;
          __syncthreads();  // visible before w is read again
          mass = removed_mass;
        }
      }
    }
    if (status != 0) break;
    if (next < 0) {  // the recovered or bonus token, from the current p
      if (greedy) {
        emitted = stats.argmax;
      } else {
        const float target = p.sampling.draw(b, n) * mass;
        emitted = src < 0 ? block_inverse_cdf<kThreads, kTreeSampleGroups>(logit_weights, vocab,
                                                                           target, temp)
                          : block_inverse_cdf<kThreads, kTreeSampleGroups>(
                                BufferWeights{row_workspace + src * p.stride}, vocab, target, temp);
      }
      break;
    }
    if (threadIdx.x == 0) {
      row_path[accepted] = static_cast<int32_t>(next);
      row_tokens[accepted] = row_ids[next];
    }
    ++accepted;
    current = next;
  }

  __syncthreads();  // thread 0's path writes come before the fills below
  for (int64_t c = threadIdx.x; c <= nodes; c += kThreads) {
    if (status != 0) {
      if (c < nodes) row_path[c] = kEmptySlot;
      row_tokens[c] = kEmptySlot;
    } else {
      if (c < nodes && c >= accepted) row_path[c] = kEmptySlot;
      if (c == accepted) row_tokens[c] = emitted;
      if (c > accepted) row_tokens[c] = kEmptySlot;
    }
  }
  if (threadIdx.x == 0) p.num_accepted[b] = status != 0 ? status : static_cast<int32_t>(accepted);
}

}  // namespace specdec::cuda
