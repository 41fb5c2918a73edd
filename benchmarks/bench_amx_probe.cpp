// A probe, not a kernel of the library: what Intel AMX's BF16 tiles would make of the bundled target's
// projections (6 layers of q/k/v, o, gate/up, down and the LM head: 44.6 MB of bf16 weights, streamed
// from memory: a 64-MB buffer is swept before each pass) at M = 1 .. 16 rows, against the project's
// avx512bf16 tile path (csrc/cpu/fused_linear.h) on the same weights and bf16-rounded activations. One
// thread, no torch; time is the thread's CPU time, median of the repeats, the two interleaved.
//
// The AMX GEMM: out[M, N] = x[M, K] . W[N, K]^T, the weight as the tile multiplicand A (16 output features
// x 32 bf16 of K, pre-packed so that every A tile is 1 KB contiguous) and the activations as B in the
// VNNI layout (16 pairs of K x M rows x 2 bf16), four 16 x M fp32 accumulator tiles (64 features) per
// pass over K. Run on a CPU with AMX (Sapphire Rapids or later) under Linux >= 5.16.
// Results: BENCHMARKS.md ("On a second machine, an Intel Xeon with AMX").
//
//   g++ -std=c++20 -O3 -march=native -fno-math-errno -fno-trapping-math -ffp-contract=off -Icsrc
//       benchmarks/bench_amx_probe.cpp -o /tmp/bench_amx_probe && /tmp/bench_amx_probe [repeats]
#include <immintrin.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/fused_linear.h"
#include "cpu/isa.h"

using namespace specdec::cpu;

namespace {

constexpr int kTileRows = 16;         // output features per A tile, K pairs per B tile
constexpr int kTileK = 32;            // bf16 of K per tile row (64 bytes)
constexpr int kAccumulators = 4;      // C tiles per pass over K: 64 output features
constexpr int kPrefetchTiles = 4;     // steps of K a weight tile is prefetched ahead (one line of each)
constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureXtiledata = 18;     // ... the AMX tile data

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0-3: C (16 features x M fp32), tmm4 and tmm6: A (16 features x 32 bf16), tmm5: B (16 K pairs x M x 2 bf16)
void configure_tiles(int M) {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < kAccumulators; ++t) config.rows[t] = kTileRows, config.colsb[t] = M * 4;
  config.rows[4] = config.rows[6] = kTileRows, config.colsb[4] = config.colsb[6] = kTileK * 2;
  config.rows[5] = kTileRows, config.colsb[5] = M * 4;
  _tile_loadconfig(&config);
}

// Shape: w [N, K] bf16 -> packed [N / 16][K / 32][16][32] bf16 (every A tile 1 KB contiguous)
void pack_weight(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed) {
  for (int64_t n0 = 0; n0 < N; n0 += kTileRows)
    for (int64_t k0 = 0; k0 < K; k0 += kTileK)
      for (int f = 0; f < kTileRows; ++f)
        std::memcpy(packed + ((n0 / kTileRows) * (K / kTileK) + k0 / kTileK) * kTileRows * kTileK + f * kTileK,
                    w + (n0 + f) * K + k0, kTileK * 2);
}

// Shape: x [M, K] bf16 -> vnni [K / 2][M][2] bf16
void pack_vnni(const uint16_t* x, int M, int64_t K, uint16_t* vnni) {
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < M; ++m) vnni[(k / 2) * M * 2 + m * 2 + (k & 1)] = x[m * K + k];
}

// Shape: vnni [K / 2][M][2] bf16, packed [N / 16][K / 32][16][32] bf16 -> out [M, N] fp32 (N a multiple of 64)
void amx_gemm(const uint16_t* vnni, int M, const uint16_t* packed, int64_t N, int64_t K, float* out) {
  alignas(64) float c[kAccumulators][kTileRows * 16];
  const int64_t k_tiles = K / kTileK, tile = kTileRows * kTileK;
  for (int64_t n0 = 0; n0 < N; n0 += kAccumulators * kTileRows) {
    const uint16_t* a = packed + (n0 / kTileRows) * k_tiles * tile;
    _tile_zero(0);  // (the _tile_ intrinsics are statements: asm macros)
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < k_tiles; ++k) {
      _tile_loadd(5, vnni + k * kTileRows * M * 2, M * 4);
      for (int b = 0; b < kAccumulators; ++b)  // the A tiles kPrefetchTiles steps of K ahead
        _mm_prefetch(reinterpret_cast<const char*>(a + (b * k_tiles + k + kPrefetchTiles) * tile), _MM_HINT_T0);
      _tile_loadd(4, a + (0 * k_tiles + k) * tile, kTileK * 2);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, a + (1 * k_tiles + k) * tile, kTileK * 2);
      _tile_dpbf16ps(1, 6, 5);
      _tile_loadd(4, a + (2 * k_tiles + k) * tile, kTileK * 2);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, a + (3 * k_tiles + k) * tile, kTileK * 2);
      _tile_dpbf16ps(3, 6, 5);
    }
    _tile_stored(0, c[0], M * 4);
    _tile_stored(1, c[1], M * 4);
    _tile_stored(2, c[2], M * 4);
    _tile_stored(3, c[3], M * 4);
    for (int b = 0; b < kAccumulators; ++b)
      for (int f = 0; f < kTileRows; ++f)
        for (int m = 0; m < M; ++m) out[m * N + n0 + b * kTileRows + f] = c[b][f * M + m];
  }
}

struct Weight {
  std::vector<uint16_t> bits, packed;  // bf16 [rows, cols]; the AMX layout of the same
  int64_t rows, cols;
};

}  // namespace

int main(int argc, char** argv) {
  if (!isa_supported(Isa::kAvx512Bf16) || syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::printf("this CPU or kernel offers no AMX tiles (or no AVX512-BF16 to compare with)\n");
    return 1;
  }
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 9;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<Weight> weights;
  const int64_t d = 512, inter = 1280, layers = 6, vocab = 8192;
  auto add = [&](int64_t n, int64_t k) {
    Weight w{std::vector<uint16_t>(n * k), std::vector<uint16_t>(n * k), n, k};
    for (uint16_t& x : w.bits) x = float_to_bf16(normal(rng));
    pack_weight(w.bits.data(), n, k, w.packed.data());
    weights.push_back(std::move(w));
  };
  for (int64_t l = 0; l < layers; ++l) add(3 * d, d), add(d, d), add(2 * inter, d), add(d, inter);
  add(vocab, d);
  double bytes = 0.0;
  for (const Weight& w : weights) bytes += 2.0 * w.bits.size();
  std::vector<float> x(16 * inter);
  for (float& v : x) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  std::vector<uint8_t> sweep(64 << 20);
  auto sweep_caches = [&] { for (size_t i = 0; i < sweep.size(); i += 64) sweep[i]++; };
  std::printf("rows  avx512bf16 ms  amx ms   GB/s avx512 / amx   largest difference (of the largest output)\n");
  for (int M : {1, 2, 3, 5, 9, 16}) {
    std::vector<float> a32(M * inter), tiles_out(M * vocab), amx_out(M * vocab);
    std::vector<uint16_t> a16(M * inter), vnni(M * inter);
    std::vector<double> tiles_s, amx_s;
    double difference = 0.0;
    for (int r = 0; r < repeats; ++r) {
      sweep_caches();
      double begin = thread_seconds();
      for (const Weight& w : weights) {
        prepare_activations(x.data(), w.cols, M, w.cols, nullptr, 0.0f, true, a32.data(), w.cols, a16.data(), w.cols);
        const GemmActivations a{a32.data(), w.cols, a16.data(), w.cols};
        const GemmWeight g{w.bits.data(), DType::kBF16, w.rows, w.cols, w.cols};
        const LinearOutput o{tiles_out.data(), w.rows, nullptr};
        fused_linear_range(Isa::kAvx512Bf16, a, M, LinearEpilogue::kStore, &g, &o, 1, 0, num_tiles(w.rows), false);
      }
      tiles_s.push_back(thread_seconds() - begin);
      sweep_caches();
      begin = thread_seconds();
      configure_tiles(M);
      for (const Weight& w : weights) {
        prepare_activations(x.data(), w.cols, M, w.cols, nullptr, 0.0f, true, a32.data(), w.cols, a16.data(), w.cols);
        pack_vnni(a16.data(), M, w.cols, vnni.data());
        amx_gemm(vnni.data(), M, w.packed.data(), w.rows, w.cols, amx_out.data());
      }
      _tile_release();
      amx_s.push_back(thread_seconds() - begin);
      if (r == 0) {  // the LM head's logits, the last weight's outputs
        double largest = 0.0;
        for (int64_t i = 0; i < M * vocab; ++i) largest = std::max(largest, static_cast<double>(std::fabs(tiles_out[i])));
        for (int64_t i = 0; i < M * vocab; ++i)
          difference = std::max(difference, std::fabs(static_cast<double>(tiles_out[i]) - amx_out[i]) / largest);
      }
    }
    std::sort(tiles_s.begin(), tiles_s.end());
    std::sort(amx_s.begin(), amx_s.end());
    const double t = tiles_s[repeats / 2], u = amx_s[repeats / 2];
    std::printf("%4d  %13.3f  %6.3f   %6.1f / %5.1f        %.1e\n", M, t * 1e3, u * 1e3, bytes / t / 1e9, bytes / u / 1e9,
                difference);
  }
  return 0;
}
