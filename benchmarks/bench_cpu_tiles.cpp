// The projections of one pass of the bundled target (6 layers of q/k/v, o, gate/up, down and the LM
// head: 44.6 MB of bf16 weights, streamed from memory: a 64-MB buffer is swept before each pass) or of
// the bundled draft (2.3 MB, cached), at M = 1 .. 16 rows, on every instruction-set path this CPU has
// (csrc/cpu/simd; amxbf16 reads the target's weights as packed AMX tiles, as the ops do), one thread,
// no torch. Time is the thread's CPU time (robust to a busy machine's descheduling, not to its memory
// traffic), median of the repeats, the paths interleaved within each; GB/s counts the weights once per
// pass. "warm" times a path's second pass in a row instead of a pass after the sweep: the target's
// weights then come from wherever its first left them (a CPU with a large L3 holds all 45 MB, as in
// decoding).
// Results: BENCHMARKS.md ("The CPU backend on every instruction set", "Intel AMX").
//
//   g++ -std=c++20 -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off -Icsrc
//       benchmarks/bench_cpu_tiles.cpp csrc/cpu/simd/*.cpp -o /tmp/bench_cpu_tiles && /tmp/bench_cpu_tiles [repeats] [warm]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cpu/fused_linear.h"
#include "cpu/isa.h"

using namespace specdec::cpu;

namespace {

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

struct Weight {
  std::vector<uint16_t> bits, amx_tiles;  // bf16 [rows, cols]; the same as simd/amx.h's packed tiles
  int64_t rows, cols;
  std::vector<std::vector<unsigned char>> panels;  // per Isa value: its path's panels for bf16 activations

  GemmWeight view(Isa isa) const {
    GemmWeight g{bits.data(), DType::kBF16, rows, cols, cols};
    g.panels = panels[static_cast<int>(isa)].data();
    if (isa == Isa::kAmxBf16) g.amx_packed = amx_tiles.data();
    return g;
  }
};

std::vector<Weight> model(bool draft, std::mt19937& rng) {
  const int64_t d = draft ? 128 : 512, inter = draft ? 512 : 1280, layers = draft ? 2 : 6, vocab = 8192;
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<Weight> out;
  auto add = [&](int64_t n, int64_t k) {
    Weight w{std::vector<uint16_t>(n * k), {}, n, k};
    for (uint16_t& x : w.bits) x = float_to_bf16(normal(rng));
    w.amx_tiles.resize(amx::packed_elements(GemmWeight{w.bits.data(), DType::kBF16, n, k, k}));
    amx::pack_weight(GemmWeight{w.bits.data(), DType::kBF16, n, k, k}, w.amx_tiles.data());
    for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Bf16, Isa::kAmxBf16, Isa::kNeon}) {
      const float f = 0.0f;
      const uint16_t h = 0;
      const GemmActivations bf16{&f, 0, &h, 0};
      if (static_cast<int>(w.panels.size()) <= static_cast<int>(isa)) w.panels.resize(static_cast<int>(isa) + 1);
      if (isa_supported(isa))
        with_panels(isa, bf16, GemmWeight{w.bits.data(), DType::kBF16, n, k, k}, w.panels[static_cast<int>(isa)]);
    }
    out.push_back(std::move(w));
  };
  for (int64_t l = 0; l < layers; ++l) add(3 * d, d), add(d, d), add(2 * inter, d), add(d, inter);
  add(vocab, d);
  return out;
}

// One pass: every weight applied to M rows of bf16-rounded activations (a bf16 model's), as linear_on does.
double pass_seconds(Isa isa, const std::vector<Weight>& weights, int64_t M, bool cached, std::vector<float>& x) {
  std::vector<float> out(M * 8192);
  ActivationBuffers buffers;
  const double t0 = thread_seconds();
  for (const Weight& w : weights) {
    const GemmActivations a = prepare_gemm_activations(isa, x.data(), M, w.cols, nullptr, 0.0f, true, cached, buffers);
    const GemmWeight g = w.view(isa);
    const LinearOutput o{out.data(), w.rows, nullptr};
    fused_linear_range(isa, a, M, LinearEpilogue::kStore, &g, &o, 1, 0, num_tiles(w.rows), cached);
  }
  return thread_seconds() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 15;
  const bool warm = argc > 2 && std::string(argv[2]) == "warm";
  std::mt19937 rng(1);
  std::vector<uint8_t> sweep(64 << 20);
  std::vector<float> x(16 * 1280);
  for (float& v : x) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  std::printf("model   path        rows   ms/pass   GB/s  (median of %d, thread CPU time%s)\n", repeats,
              warm ? ", target warm" : "");
  for (bool draft : {false, true}) {
    const std::vector<Weight> weights = model(draft, rng);
    double bytes = 0.0;
    for (const Weight& w : weights) bytes += 2.0 * w.bits.size();
    std::vector<Isa> paths;
    for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kNeon, Isa::kAvx512Bf16, Isa::kAmxBf16})
      if (isa_supported(isa)) paths.push_back(isa);
    for (int64_t M : {1, 2, 3, 5, 9, 16}) {
      std::vector<std::vector<double>> times(paths.size());
      for (int r = 0; r < repeats; ++r) {  // the paths interleaved within every repeat
        for (size_t p = 0; p < paths.size(); ++p) {
          if (!draft && !warm)
            for (size_t i = 0; i < sweep.size(); i += 64) sweep[i]++;
          if (!draft && warm)  // (amxbf16 reads its packed copy, the others the weights: each its own pass first)
            pass_seconds(paths[p], weights, M, draft, x);
          times[p].push_back(pass_seconds(paths[p], weights, M, draft, x));
        }
      }
      for (size_t p = 0; p < paths.size(); ++p) {
        std::sort(times[p].begin(), times[p].end());
        const double t = times[p][times[p].size() / 2];
        std::printf("%-7s %-11s %4lld %9.3f %6.1f\n", draft ? "draft" : "target", isa_name(paths[p]),
                    static_cast<long long>(M), t * 1e3, bytes / t / 1e9);
      }
    }
  }
  return 0;
}
