// The one operator library of specdec_ext: every schema, declared once. Backends register their
// implementations with TORCH_LIBRARY_IMPL in cpu/ and cuda/; fake (meta) kernels live in
// specdec_ext/ops.py. Outputs are passed in (Tensor(a!)) so the ops are safe in CUDA graphs.
#include <torch/library.h>

TORCH_LIBRARY(specdec_ext, m) {
  // Lossless verification of a chain of k drafts per row; writes tokens [B, k+1] and
  // num_accepted [B] (a negative RowStatus for an invalid row). See csrc/sampling.h.
  m.def(
      "chain_verify(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor? num_draft, Tensor? temperature, Tensor? top_k, Tensor? top_p, Tensor? seed, "
      "Tensor? offset, Tensor? uniforms, Tensor(a!) tokens, Tensor(b!) num_accepted) -> ()");
  // normalise(max(0, p - q)) over the last dimension (p where the residual mass is zero).
  m.def("residual_probs(Tensor target_probs, Tensor draft_probs, Tensor(a!) out) -> ()");
  // The Philox uniforms the verifiers draw: out[b, c] = philox(seed[b], offset[b], c).
  m.def("philox_uniforms(Tensor seed, Tensor offset, Tensor(a!) out) -> ()");
}
