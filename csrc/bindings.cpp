// The Python module specdec_ext._C. Loading it runs the static TORCH_LIBRARY registrations of
// every op; the module itself carries the pybind11 classes and build facts.
#include <torch/extension.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "specdec_ext kernels: torch ops under torch.ops.specdec_ext";
#ifdef SPECDEC_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
