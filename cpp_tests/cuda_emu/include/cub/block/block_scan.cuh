// cub::BlockScan for the emulator, in CUB's default (warp scans) shape: each warp scans with
// shuffles, the last lane stores the warp's total in TempStorage, one barrier, then every thread
// adds the totals of the warps before its own. Every thread gets the block aggregate. As in CUB
// the caller must synchronise before TempStorage is reused.
#pragma once
#include "../../cuda_emu.h"
#include "../detail/block_layout.cuh"

namespace cub {

template <typename T, int kThreads, int = 0, int = 1, int = 1>
class BlockScan : public detail::PerWarpCollective<T, kThreads> {
  using Base = detail::PerWarpCollective<T, kThreads>;
  using Layout = typename Base::Layout;

 public:
  using typename Base::TempStorage;
  using Base::Base;

  void ExclusiveSum(T input, T& output, T& block_aggregate) {
    const Layout at;
    T inclusive = input;
    for (unsigned offset = 1; offset < 32; offset *= 2) {
      const T other = __shfl_up_sync(at.mask, inclusive, offset);
      if (at.lane >= offset) inclusive = inclusive + other;
    }
    const T exclusive_in_warp = __shfl_up_sync(at.mask, inclusive, 1);
    if (at.lane == at.warp_lanes - 1) this->storage_.per_warp[at.warp] = inclusive;
    __syncthreads();
    T warp_prefix{};
    T total{};
    for (int w = 0; w < Layout::kWarps; ++w) {
      if (w == static_cast<int>(at.warp)) warp_prefix = total;
      total = total + this->storage_.per_warp[w];
    }
    output = at.lane == 0 ? warp_prefix : warp_prefix + exclusive_in_warp;
    block_aggregate = total;
  }

  void ExclusiveSum(T input, T& output) {
    T aggregate;
    ExclusiveSum(input, output, aggregate);
  }

  void InclusiveSum(T input, T& output) {
    T aggregate;
    ExclusiveSum(input, output, aggregate);
    output = output + input;
  }

};

}  // namespace cub
