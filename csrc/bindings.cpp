// The Python module specdec_ext._C. Loading it runs the static TORCH_LIBRARY registrations of
// every op; the module itself carries the pybind11 classes and build facts.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "suffix_automaton.h"

namespace {

// --- SuffixAutomaton (the lookup drafter's index; csrc/suffix_automaton.h) -----------------------
// extend() takes a 1-D integer tensor (fast path: one copy) or any sequence of ints.
void suffix_automaton_extend(specdec::SuffixAutomaton& self, const pybind11::handle& tokens) {
  if (THPVariable_Check(tokens.ptr())) {
    at::Tensor t = THPVariable_Unpack(tokens.ptr());
    if (t.dim() != 1 || !(at::isIntegralType(t.scalar_type(), /*includeBool=*/false))) {
      throw pybind11::type_error("SuffixAutomaton.extend: a tensor of tokens must be 1-D with an integer dtype, "
                                 "got " + std::to_string(t.dim()) + "-D " + c10::toString(t.scalar_type()));
    }
    t = t.to(at::kCPU, at::kLong).contiguous();
    self.extend(t.data_ptr<int64_t>(), static_cast<size_t>(t.numel()));
    return;
  }
  if (pybind11::isinstance<pybind11::str>(tokens) || pybind11::isinstance<pybind11::bytes>(tokens) ||
      !pybind11::isinstance<pybind11::sequence>(tokens)) {
    const std::string type_name = pybind11::str(pybind11::type::of(tokens).attr("__name__"));
    throw pybind11::type_error("SuffixAutomaton.extend: tokens must be a sequence of ints or a 1-D integer "
                               "tensor, got " + type_name);
  }
  std::vector<int64_t> values;
  try {
    values = tokens.cast<std::vector<int64_t>>();
  } catch (const pybind11::cast_error&) {
    throw pybind11::type_error("SuffixAutomaton.extend: every token must be an int");
  }
  self.extend(values);
}

void register_suffix_automaton(pybind11::module_& m) {
  namespace py = pybind11;
  using specdec::SuffixAutomaton;
  py::class_<SuffixAutomaton>(m, "SuffixAutomaton", R"doc(
Suffix automaton over a growing token sequence s: the index of the lookup (n-gram) drafter.

The match is the longest suffix of s that also occurs earlier (ending before the last position).
propose(m) returns up to m tokens that followed its EARLIEST earlier occurrence; when that
continuation runs into the end of s (a repeat of period P < m) and overlap_copy is on, the copy
continues from the proposal itself (LZ77-style), so a loop "a b a b" proposes "a b a b ...".
Nothing is proposed while the match is shorter than min_match. Amortised O(1) per appended token
(O(log sigma) transition lookups at wide states); propose is O(m). Append-only.

Parameters: min_match (int >= 1, default 2), overlap_copy (bool, default True).)doc")
      .def(py::init<int64_t, bool>(), py::arg("min_match") = SuffixAutomaton::kDefaultMinMatch,
           py::arg("overlap_copy") = true)
      .def("extend", &suffix_automaton_extend, py::arg("tokens"),
           "Append tokens (a sequence of ints >= 0 or a 1-D integer tensor). Raises ValueError on a "
           "negative id (nothing is appended then).")
      .def("propose", &SuffixAutomaton::propose, py::arg("max_tokens"),
           "Up to max_tokens tokens that followed the earliest earlier occurrence of the match: a list "
           "of ints, empty when match_length() < min_match or max_tokens == 0; ValueError when "
           "max_tokens < 0.")
      .def("match_length", &SuffixAutomaton::match_length,
           "Length of the longest suffix that also occurs earlier (0: none), whatever min_match.")
      .def("match_end", &SuffixAutomaton::match_end,
           "End index of the earliest earlier occurrence of that suffix; -1 when there is none.")
      .def("tokens", [](const SuffixAutomaton& self) { return self.tokens(); }, "Every token seen, as a list.")
      .def("clear", &SuffixAutomaton::clear, "Forget every token.")
      .def("reserve", &SuffixAutomaton::reserve, py::arg("num_tokens"), "Reserve room for num_tokens tokens.")
      .def_property_readonly("min_match", &SuffixAutomaton::min_match)
      .def_property_readonly("overlap_copy", &SuffixAutomaton::overlap_copy)
      .def_property_readonly("num_states", &SuffixAutomaton::num_states)
      .def("__len__", &SuffixAutomaton::size)
      .def("__repr__", [](const SuffixAutomaton& self) {
        return "SuffixAutomaton(tokens=" + std::to_string(self.size()) + ", match_length=" +
               std::to_string(self.match_length()) + ", min_match=" + std::to_string(self.min_match()) +
               ", overlap_copy=" + (self.overlap_copy() ? "True" : "False") + ")";
      });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "specdec_ext kernels: torch ops under torch.ops.specdec_ext";
#ifdef SPECDEC_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  register_suffix_automaton(m);
}
