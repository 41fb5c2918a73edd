#include "verifier_cases.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <limits>
#include <sstream>

#include "emulated_kernels.h"
#include "op_call.h"
#include "sampling.h"
#include "tree.h"

namespace specdec_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

at::Tensor pick(const std::vector<double>& choices, int64_t n, at::ScalarType dtype, at::Generator& gen) {
  const at::Tensor index = torch::randint(static_cast<int64_t>(choices.size()), {n}, gen, torch::kLong);
  return torch::tensor(choices, torch::kDouble).index({index}).to(dtype);
}

}  // namespace

VerifierInputs make_case(const CaseOptions& o) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const int64_t B = o.batch, n = o.drafts, V = o.vocab;
  VerifierInputs in;
  // Logits of three scales (flat to peaky), a few -inf (masked tokens) and ties.
  const at::Tensor scale = pick({0.5, 2.0, 6.0}, B, at::kFloat, gen).view({B, 1, 1});
  at::Tensor logits = torch::randn({B, n + 1, V}, gen) * scale;
  logits = torch::where(torch::rand({B, n + 1, V}, gen) < 0.01, logits.round(), logits);
  logits = torch::where(torch::rand({B, n + 1, V}, gen) < 0.02, torch::full({}, -kInf), logits);
  in.logits = logits.to(o.dtype);

  // Topological trees (parent < own index), or chains; drafts are often the argmax at their parent.
  at::Tensor parents = torch::arange(-1, n - 1, torch::kInt).repeat({B, 1});
  if (o.tree && n > 0) {
    const at::Tensor span = torch::arange(n, torch::kDouble).add(1).repeat({B, 1});
    parents = (torch::rand({B, n}, gen, torch::kDouble) * span).floor().to(torch::kInt) - 1;
  }
  const at::Tensor parent_rows = (parents.to(torch::kLong) + 1).clamp_min(0);
  const at::Tensor argmax_at_parent =
      in.logits.to(at::kFloat).argmax(-1).gather(1, parent_rows.clamp_max(n));  // [B, n]
  const at::Tensor random_ids = torch::randint(V, {B, n}, gen, torch::kLong);
  in.ids = torch::where(torch::rand({B, n}, gen) < 0.6, argmax_at_parent, random_ids).contiguous();
  if (o.tree) in.parents = parents.contiguous();

  if (o.draft_probs) {  // q: a perturbed softmax of the target at the draft's parent position
    const at::Tensor at_parent =
        in.logits.to(at::kFloat).gather(1, parent_rows.unsqueeze(-1).expand({B, n, V}).clamp_max(n));
    const at::Tensor noisy = torch::nan_to_num(at_parent, 0.0, 0.0, -1e30) * 0.7 + torch::randn({B, n, V}, gen);
    in.draft_probs = torch::softmax(noisy, -1).contiguous();
  }
  if (n > 0) in.counts = torch::randint(n + 1, {B}, gen, torch::kInt);
  if (o.sampling_filters) {
    in.temperature = pick({0.0, 1e-39, 0.3, 0.7, 1.0, 1.0, 2.0, kInf, 1e30}, B, at::kFloat, gen);
    in.top_k = pick({0, 0, 1, 3, 50, static_cast<double>(V + 5)}, B, at::kInt, gen);
    in.top_p = pick({1.0, 1.0, 0.95, 0.8, 0.3}, B, at::kFloat, gen);
  }
  if (o.explicit_uniforms) {
    in.uniforms = torch::rand({B, n + 1}, gen);
  } else {
    in.seed = torch::randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {B}, gen,
                             torch::kLong);
    in.offset = torch::randint(1000, {B}, gen, torch::kLong);
  }
  return in;
}

VerifierOutputs run_cpu(const VerifierInputs& in) {
  const int64_t B = in.logits.size(0), n = in.ids.size(1);
  VerifierOutputs out{torch::full({B, n + 1}, 77, torch::kLong), torch::full({B}, 77, torch::kInt),
                      torch::full({B, n}, 77, torch::kInt)};
  if (in.parents) {
    tree_verify(in.logits, in.ids, *in.parents, in.draft_probs, in.counts, in.temperature, in.top_k, in.top_p, in.seed,
                in.offset, in.uniforms, out.path, out.tokens, out.num_accepted);
  } else {
    chain_verify(in.logits, in.ids, in.draft_probs, in.counts, in.temperature, in.top_k, in.top_p, in.seed, in.offset,
                 in.uniforms, out.tokens, out.num_accepted);
  }
  return out;
}

VerifierOutputs run_emulated(const VerifierInputs& in, std::string& error) {
  const int64_t B = in.logits.size(0), n = in.ids.size(1);
  VerifierOutputs out{torch::full({B, n + 1}, 77, torch::kLong), torch::full({B}, 77, torch::kInt),
                      torch::full({B, n}, 77, torch::kInt)};
  const specdec::VerifierArgs args{in.logits,
                                   in.ids,
                                   in.draft_probs,
                                   in.counts,
                                   {in.temperature, in.top_k, in.top_p, in.seed, in.offset, in.uniforms},
                                   out.tokens,
                                   out.num_accepted};
  if (in.parents) {
    const specdec::TreeVerifyArgs tree_args{args, *in.parents, out.path};
    specdec::check_tree_verify(tree_args);
    error = specdec::emulated::tree_verify(specdec::tree_verify_view(tree_args));
  } else {
    specdec::check_chain_verify(args);
    error = specdec::emulated::chain_verify(specdec::verifier_view(args));
  }
  return out;
}

std::string describe_row(const VerifierInputs& in, int64_t b) {
  std::ostringstream os;
  os << (in.parents ? "tree" : "chain") << " row " << b << " (V=" << in.logits.size(2) << " n=" << in.ids.size(1)
     << " " << c10::toString(in.logits.scalar_type()) << (in.draft_probs ? " q" : " no-q")
     << " T=" << (in.temperature ? in.temperature->index({b}).item<float>() : 1.0f)
     << " top_k=" << (in.top_k ? in.top_k->index({b}).item<int32_t>() : 0)
     << " top_p=" << (in.top_p ? in.top_p->index({b}).item<float>() : 1.0f)
     << (in.uniforms ? " uniforms" : " philox") << ")";
  return os.str();
}

namespace {

std::string list(const at::Tensor& row) {
  std::ostringstream os;
  const at::Tensor values = row.to(at::kLong).contiguous();
  for (int64_t i = 0; i < values.numel(); ++i) os << (i ? ", " : "[") << values.data_ptr<int64_t>()[i];
  os << "]";
  return os.str();
}

std::string row_outputs(const VerifierOutputs& out, int64_t b, bool tree) {
  std::ostringstream os;
  os << "num_accepted " << out.num_accepted[b].item<int32_t>() << " tokens " << list(out.tokens[b]);
  if (tree) os << " path " << list(out.path[b]);
  return os.str();
}

}  // namespace

Comparison compare(const VerifierInputs& in, const VerifierOutputs& cpu, const VerifierOutputs& emulated) {
  Comparison c;
  const bool tree = in.parents.has_value();
  for (int64_t b = 0; b < in.logits.size(0); ++b) {
    ++c.rows;
    const int32_t status = cpu.num_accepted[b].item<int32_t>();
    bool equal = torch::equal(cpu.tokens[b], emulated.tokens[b]) &&
                 emulated.num_accepted[b].item<int32_t>() == status &&
                 (!tree || torch::equal(cpu.path[b], emulated.path[b]));
    if (status < 0) ++c.status_rows;
    if (equal) {
      ++c.identical;
      c.accepted_drafts += std::max(status, 0);
      continue;
    }
    const bool both_valid = status >= 0 && emulated.num_accepted[b].item<int32_t>() >= 0;
    const double margin = both_valid ? decision_margin(in, b) : 0.0;
    std::ostringstream os;
    os << describe_row(in, b) << ": cpu " << row_outputs(cpu, b, tree) << " | emulated "
       << row_outputs(emulated, b, tree) << " | float64 margin " << margin;
    if (both_valid && margin < kMarginTolerance) {
      ++c.boundary_mismatches;
      c.boundary_rows.push_back(os.str());
    } else {
      c.failures.push_back(os.str());
    }
  }
  return c;
}

void Comparison::add(const Comparison& other) {
  rows += other.rows;
  identical += other.identical;
  status_rows += other.status_rows;
  boundary_mismatches += other.boundary_mismatches;
  accepted_drafts += other.accepted_drafts;
  failures.insert(failures.end(), other.failures.begin(), other.failures.end());
  boundary_rows.insert(boundary_rows.end(), other.boundary_rows.begin(), other.boundary_rows.end());
}

std::string Comparison::summary() const {
  std::ostringstream os;
  os << identical << "/" << rows << " rows identical (" << status_rows << " with a status, " << accepted_drafts
     << " drafts accepted), " << boundary_mismatches << " different within " << kMarginTolerance
     << " of a decision boundary, " << failures.size() << " failures";
  return os.str();
}

}  // namespace specdec_test
