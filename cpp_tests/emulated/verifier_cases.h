// Random chain_verify / tree_verify inputs, the CPU op and the emulated CUDA kernels run on them,
// and their comparison: statuses and greedy rows exactly, every other row exactly unless its
// float64 decision margin (reference_margin.h) says a draw lies within rounding of a boundary.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "reference_margin.h"

namespace specdec_test {

struct CaseOptions {
  bool tree = false;
  at::ScalarType dtype = at::kFloat;
  int64_t batch = 4;
  int64_t drafts = 4;  // k for chains, N for trees
  int64_t vocab = 7;
  bool draft_probs = false;
  bool explicit_uniforms = true;  // else Philox seeds and offsets
  bool sampling_filters = true;   // random temperature / top-k / top-p per row, else none (T = 1)
  uint64_t seed = 0;
};

VerifierInputs make_case(const CaseOptions& options);

struct VerifierOutputs {
  at::Tensor tokens, num_accepted, path;  // path: trees only
};

VerifierOutputs run_cpu(const VerifierInputs& in);
// The emulated kernels; `error` gets the emulator's error ("" when the launches ran cleanly).
VerifierOutputs run_emulated(const VerifierInputs& in, std::string& error);

// Decision margins below this (relative to the quantities compared) excuse a mismatch: fp32 sums
// of up to 151936 terms in different orders differ by about 1e-6 relative.
constexpr double kMarginTolerance = 2e-5;

struct Comparison {
  int64_t rows = 0;
  int64_t identical = 0;
  int64_t status_rows = 0;
  int64_t boundary_mismatches = 0;  // different tokens, the float64 margin below kMarginTolerance
  int64_t accepted_drafts = 0;
  std::vector<std::string> failures;
  std::vector<std::string> boundary_rows;  // the excused mismatches, described

  void add(const Comparison& other);
  std::string summary() const;
};

Comparison compare(const VerifierInputs& in, const VerifierOutputs& cpu, const VerifierOutputs& emulated);

std::string describe_row(const VerifierInputs& in, int64_t row);

}  // namespace specdec_test
