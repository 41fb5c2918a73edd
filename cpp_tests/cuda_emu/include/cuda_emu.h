// cuda_emu: the project's CUDA-on-CPU emulator, for running the kernels of csrc/cuda under ctest on
// a machine without a GPU (docs/testing.md says why and how far to trust it).
//
// Every CUDA thread is a fiber with its own stack (a guard page below it) and runs on the launching
// OS thread; the threads of one block run until they block, in a seeded shuffled order per round
// (CUDA_EMU_ORDER = shuffle | forward | reverse, CUDA_EMU_SEED), so a missing barrier shows up
// under orders a GPU may take. Blocks run one after the other.
//   - __syncthreads (and _and/_or/_count) wait until every thread of the block has arrived. A thread
//     that exits while others wait, or threads that meet at different barriers (source lines) or
//     different barrier kinds, is an error of the launch (a hardware GPU would hang, race or count
//     the exited thread as arrived, depending on the architecture).
//   - Warp operations (__shfl*_sync, __ballot_sync, __any/__all_sync, __syncwarp) wait for the lanes
//     of their mask among the 32 lanes of a warp, so warp-level code that only some warps run is
//     emulated exactly; a lane of the mask that exits, waits elsewhere or uses another mask or
//     operation is an error; so is a shuffle that reads a lane outside the mask.
//   - A launch in which no thread can proceed (a deadlock) is an error, not a hang.
//   - __shared__ variables are function statics per OS thread, shared by the block's fibers.
// Errors stop the launch; launch_kernel records them and take_launch_error() returns them.
#pragma once
#include <math.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#define SPECDEC_CUDA_EMULATOR 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace cuda_emu {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kMaxBlockThreads = 1024;

struct ThreadIndex {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The CUDA thread running on this OS thread (aborts outside a kernel).
const ThreadIndex& current_thread();

enum class BarrierKind { kSync, kAnd, kOr, kCount };
// Waits at a block barrier; returns the block's count / and / or of the predicates (kSync: 0).
int block_barrier(BarrierKind kind, int predicate, const char* site);

enum class WarpOpKind { kSync, kShuffleIndex, kShuffleUp, kShuffleDown, kShuffleXor, kVote };
// Waits for the lanes of `mask` at a warp operation of `kind`; deposits `size` bytes of `value` and
// copies into `result` the bytes that lane `src_lane` deposited (nothing when result is null).
// Returns the ballot of the lanes' predicates.
uint32_t warp_exchange(WarpOpKind kind, uint32_t mask, const void* value, size_t size, unsigned src_lane,
                       void* result, int predicate, const char* site);
// Mask of the lanes of this thread's warp that have not exited.
uint32_t active_mask();
unsigned lane_id();

// The order in which the threads of a block are resumed each round ("shuffle", "forward" or
// "reverse"; shuffle is seeded with `seed`) for the launches that follow on this OS thread. The
// default comes from CUDA_EMU_ORDER and CUDA_EMU_SEED.
void set_schedule(const std::string& order, uint64_t seed);

// Runs every block of the grid, each thread calling body(); returns "" or the first error.
std::string run_grid(dim3 grid, dim3 block, const std::function<void()>& body);
void record_launch_error(const std::string& error);
// The first error of the launches since the last call ("" when they ran cleanly), and clears it.
std::string take_launch_error();

// Runs launches() (launch_kernel calls) and returns the first error they recorded, or "".
template <typename Launches>
std::string errors_of(Launches&& launches) {
  take_launch_error();
  launches();
  return take_launch_error();
}

// The launch the project's launch code (csrc/cuda/launch.cuh) calls: synchronous; kernel
// parameters are copied per thread as in CUDA.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t /*stream*/, Args... args) {
  const std::string error = run_grid(grid, block, [&] { kernel(args...); });
  if (!error.empty()) record_launch_error(error);
}

// Shuffle source lanes, as the hardware computes them within segments of `width` lanes.
template <typename T>
T shuffle(WarpOpKind kind, uint32_t mask, T value, int operand, int width, const char* site) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16, "cuda_emu shuffles up to 16-byte values");
  const unsigned lane = lane_id();
  const unsigned w = static_cast<unsigned>(width);
  const unsigned segment = lane / w * w;
  unsigned src = lane;
  switch (kind) {
    case WarpOpKind::kShuffleIndex:
      src = segment + static_cast<unsigned>(operand) % w;
      break;
    case WarpOpKind::kShuffleUp:
      src = lane % w >= static_cast<unsigned>(operand) ? lane - operand : lane;
      break;
    case WarpOpKind::kShuffleDown:
      src = lane % w + static_cast<unsigned>(operand) < w ? lane + operand : lane;
      break;
    case WarpOpKind::kShuffleXor:
      src = lane ^ static_cast<unsigned>(operand);
      if (src / w != lane / w) src = lane;
      break;
    default:
      break;
  }
  T result;
  warp_exchange(kind, mask, &value, sizeof(T), src, &result, 0, site);
  return result;
}

}  // namespace cuda_emu

#define CUDA_EMU_STRINGIFY2(x) #x
#define CUDA_EMU_STRINGIFY(x) CUDA_EMU_STRINGIFY2(x)
#define CUDA_EMU_SITE __FILE__ ":" CUDA_EMU_STRINGIFY(__LINE__)

#define threadIdx (::cuda_emu::current_thread().thread_idx)
#define blockIdx (::cuda_emu::current_thread().block_idx)
#define blockDim (::cuda_emu::current_thread().block_dim)
#define gridDim (::cuda_emu::current_thread().grid_dim)
#define warpSize 32

#define __syncthreads() ((void)::cuda_emu::block_barrier(::cuda_emu::BarrierKind::kSync, 1, CUDA_EMU_SITE))
#define __syncthreads_and(p) ::cuda_emu::block_barrier(::cuda_emu::BarrierKind::kAnd, (p) ? 1 : 0, CUDA_EMU_SITE)
#define __syncthreads_or(p) ::cuda_emu::block_barrier(::cuda_emu::BarrierKind::kOr, (p) ? 1 : 0, CUDA_EMU_SITE)
#define __syncthreads_count(p) \
  ::cuda_emu::block_barrier(::cuda_emu::BarrierKind::kCount, (p) ? 1 : 0, CUDA_EMU_SITE)

#define CUDA_EMU_SHFL(kind, mask, value, operand, ...) \
  ::cuda_emu::shuffle(::cuda_emu::WarpOpKind::kind, mask, value, operand, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, \
                      CUDA_EMU_SITE)
#define __shfl_sync(mask, value, lane, ...) CUDA_EMU_SHFL(kShuffleIndex, mask, value, lane, __VA_ARGS__)
#define __shfl_up_sync(mask, value, delta, ...) CUDA_EMU_SHFL(kShuffleUp, mask, value, delta, __VA_ARGS__)
#define __shfl_down_sync(mask, value, delta, ...) CUDA_EMU_SHFL(kShuffleDown, mask, value, delta, __VA_ARGS__)
#define __shfl_xor_sync(mask, value, lane_mask, ...) CUDA_EMU_SHFL(kShuffleXor, mask, value, lane_mask, __VA_ARGS__)
#define __ballot_sync(mask, p) \
  ::cuda_emu::warp_exchange(::cuda_emu::WarpOpKind::kVote, mask, nullptr, 0, 0, nullptr, (p) ? 1 : 0, CUDA_EMU_SITE)
#define __any_sync(mask, p) (__ballot_sync(mask, p) != 0u)
#define __all_sync(mask, p) (__ballot_sync(mask, p) == static_cast<unsigned>(mask))
#define __syncwarp(...) \
  ((void)::cuda_emu::warp_exchange(::cuda_emu::WarpOpKind::kSync, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 0xFFFFFFFFu, \
                                   nullptr, 0, 0, nullptr, 0, CUDA_EMU_SITE))
#define __activemask() ::cuda_emu::active_mask()

// --- math and bit intrinsics (exact libm results: CUDA's __expf is an approximation, as the
// CPU backend's exp is, so emulated and CPU sums differ in the last bits as on a GPU)
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Built with -ffp-contract=off (cpp_tests/CMakeLists), so no product here is fused into an fma.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline uint32_t __float_as_uint(float x) { return std::bit_cast<uint32_t>(x); }
inline float __uint_as_float(uint32_t u) { return std::bit_cast<float>(u); }
inline int __float_as_int(float x) { return static_cast<int>(__float_as_uint(x)); }
inline float __int_as_float(int i) { return __uint_as_float(static_cast<uint32_t>(i)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  return b < a ? b : a;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// --- atomics (blocks run one after the other, but a test may launch from several OS threads)
template <typename T>
inline T atomicAdd(T* address, T value) {
  if constexpr (std::is_floating_point_v<T>) {
    T old;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    T updated = old + value;
    while (!__atomic_compare_exchange(address, &old, &updated, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
      updated = old + value;
    }
    return old;
  } else {
    return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
  }
}
// The read-modify-writes the compiler has builtins for.
#define CUDA_EMU_ATOMIC(name, builtin)                    \
  template <typename T>                                   \
  inline T name(T* address, T value) {                    \
    return builtin(address, value, __ATOMIC_SEQ_CST);     \
  }
CUDA_EMU_ATOMIC(atomicSub, __atomic_fetch_sub)
CUDA_EMU_ATOMIC(atomicExch, __atomic_exchange_n)
CUDA_EMU_ATOMIC(atomicOr, __atomic_fetch_or)
CUDA_EMU_ATOMIC(atomicAnd, __atomic_fetch_and)
CUDA_EMU_ATOMIC(atomicXor, __atomic_fetch_xor)
#undef CUDA_EMU_ATOMIC
template <typename T>
inline T atomicCAS(T* address, T compare, T value) {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
// Stores `value` where better(value, current) holds; returns the old value.
template <typename T, typename Better>
inline T atomic_update_if(T* address, T value, Better better) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (better(value, old) &&
         !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomicMin(T* address, T value) {
  return atomic_update_if(address, value, [](T a, T b) { return a < b; });
}
template <typename T>
inline T atomicMax(T* address, T value) {
  return atomic_update_if(address, value, [](T a, T b) { return b < a; });
}
