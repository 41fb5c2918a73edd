// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
//
// One implementation for the CPU and CUDA kernels, so that both draw the same uniforms for the
// same (seed, offset, position). A request's draws depend only on its own (seed, offset), never on
// its row in the batch.
//   key     = (seed_lo, seed_hi)
//   counter = (offset_lo, offset_hi, position, 0)
// The uniform for (seed, offset, position) is the first output word mapped to [0, 1).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SPECDEC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPECDEC_HOST_DEVICE inline
#endif

namespace specdec {

struct Philox4x32 {
  uint32_t v[4];
};

namespace philox_detail {
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;

SPECDEC_HOST_DEVICE void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}
}  // namespace philox_detail

SPECDEC_HOST_DEVICE Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  using namespace philox_detail;
  for (int round = 0; round < kRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, counter.v[0], hi0, lo0);
    mulhilo(kMul1, counter.v[2], hi1, lo1);
    Philox4x32 next;
    next.v[0] = hi1 ^ counter.v[1] ^ key0;
    next.v[1] = lo1;
    next.v[2] = hi0 ^ counter.v[3] ^ key1;
    next.v[3] = lo0;
    counter = next;
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// 24 random bits scaled by 2^-24: exactly representable in fp32, in [0, 1 - 2^-24].
SPECDEC_HOST_DEVICE float uint_to_unit_float(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

SPECDEC_HOST_DEVICE float philox_uniform(int64_t seed, int64_t offset, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint64_t o = static_cast<uint64_t>(offset);
  Philox4x32 counter;
  counter.v[0] = static_cast<uint32_t>(o);
  counter.v[1] = static_cast<uint32_t>(o >> 32);
  counter.v[2] = static_cast<uint32_t>(static_cast<uint64_t>(position));
  counter.v[3] = 0u;
  const Philox4x32 out =
      philox4x32_10(counter, static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return uint_to_unit_float(out.v[0]);
}

}  // namespace specdec
