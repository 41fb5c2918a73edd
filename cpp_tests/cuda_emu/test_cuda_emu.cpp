// The emulator's own semantics: barriers, warp operations (also when only some warps run them),
// the errors it reports instead of hanging or racing silently, cub, 16-bit types, atomics, stacks.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_emu.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>
#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <numeric>
#include <string>
#include <vector>

namespace {

std::string launch_error() { return cuda_emu::take_launch_error(); }

// ------------------------------------------------------------------------------------------------
// Block barriers

__global__ void rotate_through_shared(int* out) {
  __shared__ int slots[256];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x) * 3;
  __syncthreads();
  out[threadIdx.x] = slots[(threadIdx.x + 1) % blockDim.x];
}

TEST(CudaEmuBarrier, EveryThreadSeesEveryWriteUnderEveryOrder) {
  for (const char* order : {"shuffle", "forward", "reverse"}) {
    cuda_emu::set_schedule(order, 7);
    std::vector<int> out(256, -1);
    cuda_emu::launch_kernel(rotate_through_shared, dim3(1), dim3(256), nullptr, out.data());
    ASSERT_EQ(launch_error(), "");
    for (int t = 0; t < 256; ++t) EXPECT_EQ(out[t], (t + 1) % 256 * 3) << order;
  }
  cuda_emu::set_schedule("shuffle", 0x5eed);
}

__global__ void read_before_barrier_missing(int* out) {
  __shared__ int flag;
  if (threadIdx.x == 0) flag = 1;
  out[threadIdx.x] = flag;  // no __syncthreads(): a race
  __syncthreads();
  if (threadIdx.x == 0) flag = 0;
}

TEST(CudaEmuBarrier, AMissingBarrierIsExposedByTheSchedule) {
  // Thread 0 runs first in forward order, last in reverse order: the race shows in one of them.
  cuda_emu::set_schedule("reverse", 0);
  std::vector<int> out(64, -1);
  cuda_emu::launch_kernel(read_before_barrier_missing, dim3(1), dim3(64), nullptr, out.data());
  ASSERT_EQ(launch_error(), "");
  EXPECT_LT(std::accumulate(out.begin(), out.end(), 0), 64);
  cuda_emu::set_schedule("shuffle", 0x5eed);
}

__global__ void overwrite_before_the_neighbour_read(int* out) {
  __shared__ int slots[128];
  slots[threadIdx.x] = 1;
  __syncthreads();
  out[threadIdx.x] = slots[(threadIdx.x + 32) % 128];  // the next warp's slot
  slots[threadIdx.x] = 2;  // no __syncthreads() before: the next warp may not have read it yet
}

TEST(CudaEmuBarrier, AWarpRunsAheadToTheNextBarrier) {
  // Between barriers the warps run one after the other, each as far as it can: in reverse order
  // warp 2 overwrites its slots before warp 1 reads them.
  cuda_emu::set_schedule("reverse", 0);
  std::vector<int> out(128, -1);
  cuda_emu::launch_kernel(overwrite_before_the_neighbour_read, dim3(1), dim3(128), nullptr, out.data());
  ASSERT_EQ(launch_error(), "");
  EXPECT_EQ(std::count(out.begin(), out.end(), 2), 96);
  cuda_emu::set_schedule("shuffle", 0x5eed);
}

__global__ void vote_kernel(int* out) {
  const int odd = threadIdx.x % 2;
  out[0] = __syncthreads_count(odd);
  out[1] = __syncthreads_or(threadIdx.x == 77);
  out[2] = __syncthreads_and(threadIdx.x < 1000);
  out[3] = __syncthreads_and(threadIdx.x != 5);
  out[4] = __syncthreads_or(0);
}

TEST(CudaEmuBarrier, VotesAggregateTheWholeBlock) {
  std::vector<int> out(5, -1);
  cuda_emu::launch_kernel(vote_kernel, dim3(1), dim3(160), nullptr, out.data());
  ASSERT_EQ(launch_error(), "");
  EXPECT_EQ(out, (std::vector<int>{80, 1, 1, 0, 0}));
}

__global__ void early_exit_kernel(int* out) {
  if (threadIdx.x == 3) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

TEST(CudaEmuBarrier, AThreadThatExitsWhileOthersWaitIsAnError) {
  std::vector<int> out(64, 0);
  cuda_emu::launch_kernel(early_exit_kernel, dim3(1), dim3(64), nullptr, out.data());
  const std::string error = launch_error();
  EXPECT_NE(error.find("thread 3 exited while"), std::string::npos) << error;
}

__global__ void uneven_barrier_counts(int* out) {
  __syncthreads();
  if (threadIdx.x < 32) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void divergent_barriers(int* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

TEST(CudaEmuBarrier, UnevenOrDivergentBarriersAreErrors) {
  std::vector<int> out(64, 0);
  cuda_emu::launch_kernel(uneven_barrier_counts, dim3(1), dim3(64), nullptr, out.data());
  std::string error = launch_error();
  EXPECT_NE(error.find("exited while"), std::string::npos) << error;
  cuda_emu::launch_kernel(divergent_barriers, dim3(1), dim3(64), nullptr, out.data());
  error = launch_error();
  EXPECT_NE(error.find("divergent barrier"), std::string::npos) << error;
}

__global__ void block_and_grid_indices(int* out) {
  const unsigned linear_block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned linear_thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  out[linear_block * 24 + linear_thread] = static_cast<int>(linear_block * 1000 + linear_thread);
}

TEST(CudaEmuLaunch, ThreeDimensionalIndices) {
  std::vector<int> out(6 * 24, -1);
  cuda_emu::launch_kernel(block_and_grid_indices, dim3(3, 2, 1), dim3(2, 3, 4), nullptr, out.data());
  ASSERT_EQ(launch_error(), "");
  for (int b = 0; b < 6; ++b) {
    for (int t = 0; t < 24; ++t) EXPECT_EQ(out[b * 24 + t], b * 1000 + t);
  }
}

// ------------------------------------------------------------------------------------------------
// Warp operations

__global__ void some_warps_reduce(const int* in, int* out, int active_warps) {
  const int warp = threadIdx.x / 32;
  if (warp < active_warps) {  // the other warps never take part: only the lanes of a warp wait
    int v = in[threadIdx.x];
    for (int delta = 16; delta > 0; delta >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, delta);
    out[threadIdx.x] = v;
  }
  __syncthreads();
}

TEST(CudaEmuWarp, ShufflesInSomeWarpsOnly) {
  std::vector<int> in(256), out(256, -1);
  std::iota(in.begin(), in.end(), 0);
  cuda_emu::launch_kernel(some_warps_reduce, dim3(1), dim3(256), nullptr, in.data(), out.data(), 3);
  ASSERT_EQ(launch_error(), "");
  for (int t = 0; t < 256; ++t) {
    const int warp = t / 32;
    const int expected = warp < 3 ? 32 * (warp * 32) + 31 * 32 / 2 : -1;
    EXPECT_EQ(out[t], expected) << t;
  }
}

__global__ void shuffle_variants(int* out) {
  const int lane = threadIdx.x % 32;
  out[0 * 32 + lane] = __shfl_sync(0xFFFFFFFFu, lane * 10, 5);
  out[1 * 32 + lane] = __shfl_up_sync(0xFFFFFFFFu, lane, 3);
  out[2 * 32 + lane] = __shfl_down_sync(0xFFFFFFFFu, lane, 4, 8);
  out[3 * 32 + lane] = __shfl_xor_sync(0xFFFFFFFFu, lane, 1);
  out[4 * 32 + lane] = static_cast<int>(__ballot_sync(0xFFFFFFFFu, lane % 3 == 0));
  out[5 * 32 + lane] = __any_sync(0xFFFFFFFFu, lane == 31) + 2 * __all_sync(0xFFFFFFFFu, lane < 31);
}

TEST(CudaEmuWarp, ShuffleVariantsFollowTheHardwareRules) {
  std::vector<int> out(6 * 32, -1);
  cuda_emu::launch_kernel(shuffle_variants, dim3(1), dim3(32), nullptr, out.data());
  ASSERT_EQ(launch_error(), "");
  uint32_t ballot = 0;
  for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(out[l], 50);
    EXPECT_EQ(out[32 + l], l >= 3 ? l - 3 : l);
    EXPECT_EQ(out[64 + l], l % 8 + 4 < 8 ? l + 4 : l);  // width 8: no crossing into the next segment
    EXPECT_EQ(out[96 + l], l ^ 1);
    EXPECT_EQ(static_cast<uint32_t>(out[128 + l]), ballot);
    EXPECT_EQ(out[160 + l], 1);
  }
}

__global__ void half_warp_mask(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) out[lane] = __shfl_xor_sync(0x0000FFFFu, lane, 8);
}

__global__ void lane_of_the_mask_exits(int* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, 1, 1);
}

__global__ void mismatched_masks(int* out) {
  const unsigned mask = threadIdx.x < 16 ? 0xFFFFFFFFu : 0xFFFF0000u;
  out[threadIdx.x] = __shfl_xor_sync(mask, 1, 1);
}

__global__ void warp_op_against_block_barrier(int* out) {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, 1, 1);
    __syncthreads();
  }
}

TEST(CudaEmuWarp, PartialMasksWorkAndBrokenOnesAreErrors) {
  std::vector<int> out(32, -1);
  cuda_emu::launch_kernel(half_warp_mask, dim3(1), dim3(32), nullptr, out.data());
  ASSERT_EQ(launch_error(), "");
  for (int l = 0; l < 16; ++l) EXPECT_EQ(out[l], l ^ 8);

  cuda_emu::launch_kernel(lane_of_the_mask_exits, dim3(1), dim3(32), nullptr, out.data());
  std::string error = launch_error();
  EXPECT_NE(error.find("lane 7 of the mask has exited"), std::string::npos) << error;

  cuda_emu::launch_kernel(mismatched_masks, dim3(1), dim3(32), nullptr, out.data());
  error = launch_error();
  EXPECT_NE(error.find("with mask 0xffff"), std::string::npos) << error;  // 0xffffffff or 0xffff0000

  cuda_emu::launch_kernel(warp_op_against_block_barrier, dim3(1), dim3(32), nullptr, out.data());
  error = launch_error();
  EXPECT_NE(error.find("deadlock"), std::string::npos) << error;
}

// ------------------------------------------------------------------------------------------------
// cub

template <int kThreads>
__global__ void cub_kernel(const float* in, float* sums, float* scans, float* aggregates) {
  __shared__ union {
    typename cub::BlockReduce<float, kThreads>::TempStorage reduce;
    typename cub::BlockScan<float, kThreads>::TempStorage scan;
  } temp;
  const float v = in[threadIdx.x];
  const float sum = cub::BlockReduce<float, kThreads>(temp.reduce).Sum(v);
  if (threadIdx.x == 0) sums[0] = sum;
  __syncthreads();
  float before, aggregate;
  cub::BlockScan<float, kThreads>(temp.scan).ExclusiveSum(v, before, aggregate);
  scans[threadIdx.x] = before;
  aggregates[threadIdx.x] = aggregate;
}

template <int kThreads>
void check_cub() {
  std::vector<float> in(kThreads), scans(kThreads), aggregates(kThreads);
  for (int t = 0; t < kThreads; ++t) in[t] = static_cast<float>(t % 7 + 1);  // small integers: exact sums
  float sum = -1.0f;
  cuda_emu::launch_kernel(cub_kernel<kThreads>, dim3(1), dim3(kThreads), nullptr, in.data(), &sum, scans.data(),
                          aggregates.data());
  ASSERT_EQ(launch_error(), "");
  const float total = std::accumulate(in.begin(), in.end(), 0.0f);
  EXPECT_EQ(sum, total);
  float running = 0.0f;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(scans[t], running) << t;
    EXPECT_EQ(aggregates[t], total);
    running += in[t];
  }
}

TEST(CudaEmuCub, BlockReduceAndScanMatchSequentialSums) {
  check_cub<32>();
  check_cub<96>();
  check_cub<256>();
  check_cub<512>();
  check_cub<1024>();
}

// ------------------------------------------------------------------------------------------------
// Types, atomics, stacks

TEST(CudaEmuTypes, HalfAndBfloat16RoundTrip) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const __half h{static_cast<uint16_t>(bits)};
    const float f = __half2float(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(__float2half(f).__x, h.__x) << bits;
    const __nv_bfloat16 b{static_cast<uint16_t>(bits)};
    const float g = __bfloat162float(b);
    if (!std::isnan(g)) ASSERT_EQ(__float2bfloat16(g).__x, b.__x) << bits;
  }
  EXPECT_EQ(__half2float(__float2half(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(__half2float(__float2half(65520.0f))));
  EXPECT_EQ(__half2float(__float2half(1.0f + 1.0f / 2048)), 1.0f);  // a tie rounds to even
  EXPECT_EQ(__bfloat162float(__float2bfloat16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(__half2float(__half{0x0001}), std::ldexp(1.0f, -24));  // smallest subnormal
}

__global__ void atomic_kernel(int* counter, float* total, unsigned* maximum) {
  atomicAdd(counter, 1);
  atomicAdd(total, 0.5f);
  atomicMax(maximum, threadIdx.x + blockIdx.x * blockDim.x);
}

TEST(CudaEmuAtomics, EveryThreadCounts) {
  int counter = 0;
  float total = 0.0f;
  unsigned maximum = 0;
  cuda_emu::launch_kernel(atomic_kernel, dim3(4), dim3(128), nullptr, &counter, &total, &maximum);
  ASSERT_EQ(launch_error(), "");
  EXPECT_EQ(counter, 512);
  EXPECT_EQ(total, 256.0f);
  EXPECT_EQ(maximum, 511u);
}

__global__ void deep_stack(int* out) {
  volatile char scratch[96 * 1024];  // more than a GPU thread could have, well within a fiber's stack
  for (int i = 0; i < static_cast<int>(sizeof(scratch)); i += 4096) scratch[i] = static_cast<char>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = scratch[4096] + scratch[0];
}

TEST(CudaEmuStacks, LargeFramesSurviveBarriers) {
  std::vector<int> out(64, -1);
  cuda_emu::launch_kernel(deep_stack, dim3(2), dim3(64), nullptr, out.data());
  ASSERT_EQ(launch_error(), "");
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[t], 2 * t);
}

TEST(CudaEmuLaunch, ErrorsDoNotLeakIntoTheNextLaunch) {
  std::vector<int> out(64, 0);
  cuda_emu::launch_kernel(early_exit_kernel, dim3(1), dim3(64), nullptr, out.data());
  EXPECT_NE(launch_error(), "");
  cuda_emu::launch_kernel(rotate_through_shared, dim3(1), dim3(64), nullptr, out.data());
  EXPECT_EQ(launch_error(), "");
}

}  // namespace
