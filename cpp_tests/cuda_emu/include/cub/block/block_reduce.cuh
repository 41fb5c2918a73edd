// cub::BlockReduce for the emulator, in CUB's default (warp reductions) shape: each warp reduces
// with shuffles, lane 0 stores the warp's aggregate in TempStorage, one barrier, then thread 0
// combines them. As in CUB the result is valid in thread 0 only, and the caller must synchronise
// before TempStorage is reused (a missing barrier there shows up as wrong aggregates).
#pragma once
#include "../../cuda_emu.h"
#include "../detail/block_layout.cuh"

namespace cub {

template <typename T, int kThreads, int = 0, int = 1, int = 1>
class BlockReduce : public detail::PerWarpCollective<T, kThreads> {
  using Base = detail::PerWarpCollective<T, kThreads>;
  using Layout = typename Base::Layout;

 public:
  using typename Base::TempStorage;
  using Base::Base;

  template <typename Op>
  T Reduce(T value, Op op) {
    return Reduce(value, op, kThreads);
  }

  // Reduction over the first `valid` threads.
  template <typename Op>
  T Reduce(T value, Op op, int valid) {
    const Layout at;
    for (unsigned offset = 1; offset < 32; offset *= 2) {
      const T other = __shfl_down_sync(at.mask, value, offset);
      if (at.lane + offset < at.warp_lanes && static_cast<int>(at.tid + offset) < valid) value = op(value, other);
    }
    if (at.lane == 0) this->storage_.per_warp[at.warp] = value;
    __syncthreads();
    if (at.tid == 0) {
      for (int w = 1; w < Layout::kWarps && w * 32 < valid; ++w) value = op(value, this->storage_.per_warp[w]);
    }
    return value;
  }

  T Sum(T value) {
    return Reduce(value, [](const T& a, const T& b) { return a + b; });
  }

};

}  // namespace cub
