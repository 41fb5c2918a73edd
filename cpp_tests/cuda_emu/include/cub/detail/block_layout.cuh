// What the emulator's cub collectives share: where the calling thread sits in a block of kThreads
// threads (its linear index, its warp and lane, the mask of its warp's lanes), and TempStorage
// with one T per warp.
#pragma once
#include "../../cuda_emu.h"

namespace cub::detail {

template <int kThreads>
struct BlockLayout {
  static constexpr int kWarps = (kThreads + 31) / 32;
  unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  unsigned lane = tid % 32;
  unsigned warp = tid / 32;
  unsigned warp_lanes = kThreads - warp * 32 < 32 ? kThreads - warp * 32 : 32;
  unsigned mask = warp_lanes == 32 ? 0xFFFFFFFFu : (1u << warp_lanes) - 1u;
};

template <typename T, int kThreads>
class PerWarpCollective {
 public:
  using Layout = BlockLayout<kThreads>;
  struct TempStorage {
    T per_warp[Layout::kWarps];
  };
  explicit PerWarpCollective(TempStorage& storage) : storage_(storage) {}

 protected:
  TempStorage& storage_;
};

}  // namespace cub::detail
