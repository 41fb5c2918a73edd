// Contract of the lean-forward family: the CPU decoder-layer ops the lean runner (runners/lean.py)
// composes a Llama-family forward from. CPU only; the kernels are csrc/cpu/{small_gemm,fused_linear,
// rope_cache,attention}.h, run on the instruction-set path of csrc/cpu/isa.h (SPECDEC_CPU_ISA).
//
// fused_linear: the projections of a layer, each weight read once for all M rows of the pass.
//   x            [M, K] fp32 contiguous: the rows (the residual stream, or an attention / MLP output)
//   norm_weight  [K] fp32/bf16/fp16 or None: A = RMSNorm(x) * norm_weight (eps norm_eps), else A = x
//   weights      W_i [N_i, K], one dtype for all: fp32, bf16 or fp16, contiguous
//   biases       [] or one entry per weight: None or [N_i] fp32/bf16/fp16
//   epilogue     "store": outs[i] = A W_i^T + b_i; "add": outs[i] += A W_i^T + b_i;
//                "swiglu": two weights (gate, up) of one shape, one output: silu(A Wg^T + bg) * (A Wu^T + bu)
//   bf16_activations  round A to bf16 before the products (a bf16 model's activations; bf16 weights only)
//   outs         [M, N_i] fp32 contiguous (written, or accumulated into)
//
// rope_cache_write: rotary embedding of q (in place) and k, and the write of k and v into the cache.
//   q [M, H, D], k and v [M, Hk, D] fp32, each with contiguous heads (any row stride); D even, <= 512
//   cos, sin [P, D/2] fp32 contiguous: the tables of rotary positions 0 .. P-1
//   positions, cache_rows, cache_positions [M] int64: the rotary position (< P), the cache row and
//                the cache slot (< capacity) of each token
//   k_cache, v_cache [Bc, Hk, capacity, D] fp32/bf16/fp16 contiguous, one dtype (values rounded to it)
//
// cache_attention: a block of T queries per row over the cache (see csrc/cpu/attention.h).
//   q [B, T, H, D] fp32 contiguous; H a multiple of Hk; D <= 512
//   k_cache, v_cache [Bc, Hk, capacity, D] as above, Bc >= B (row b reads cache row b)
//   start [B] int64: the block's first slot, start[b] + T <= capacity
//   visible [B, T, T] bool or None: which block tokens each query sees (None: causal, j <= t)
//   out [B, T, H, D] fp32 contiguous
//
// decoder_layers and greedy_chain read a Llama-family model as two lists in one order, the order of
// specdec_ext.ops.LlamaWeights.flat() (the one place that builds them) and of LlamaModelView below:
//   weights      Tensor?[], kModelTensors + kLayerTensors * L entries:
//                  embed [V_in, d] fp32/bf16/fp16 contiguous: the input embedding;
//                  per layer (LlamaLayerView): input_norm [d]; q [H*D, d], q_bias [H*D]; k [Hk*D, d],
//                  k_bias [Hk*D]; v [Hk*D, d], v_bias [Hk*D]; o [d, H*D], o_bias [d]; post_norm [d];
//                  gate [I, d], gate_bias [I]; up [I, d], up_bias [I]; down [d, I], down_bias [d];
//                  then norm [d] (the final RMSNorm), head [V_out, d] and head_bias [V_out]
//                The projections of one dtype (fp32, bf16 or fp16), contiguous; the norms and biases fp32,
//                bf16 or fp16 (fp32 costs no conversion per call); a bias may be None, nothing else.
//   scalars      float[], kLayerScalars * L + kModelScalars: per layer input_norm_eps, post_norm_eps;
//                then the final norm's epsilon and the attention scale (head_dim ** -0.5)
// and the pass's state as grouped lists:
//   rope         [cos, sin]: [P, D/2] fp32 contiguous each, as rope_cache_write
//   cache        [k_cache, v_cache]: [L, Bc, Hk, capacity, D] fp32/bf16/fp16 contiguous, one dtype, written
//
// decoder_layers(x, weights, scalars, bf16_activations, rope, cache, layout, visible): the L decoder
// layers in one call, each as the four projections, the rotary + cache write and the attention above
// compose it (the same kernels, the same bits); the embedding and the head of `weights` are not read:
//   x = x + o(attention(rope(q(n1(x)), k(n1(x))), v(n1(x))));  x = x + down(silu(gate(n2(x))) * up(n2(x)))
//   x            [M, d] fp32 contiguous, M = B * T: the residual stream, updated in place
//   bf16_activations  as fused_linear
//   layout       [positions, cache_rows, cache_positions, start]: positions and cache_positions [M] int64 as
//                rope_cache_write; cache_rows [M] int64, one row per block of T (batch row b reads cache
//                row cache_rows[b * T]); start [B] int64 as cache_attention
//   visible      [B, T, T] bool or None, as cache_attention
//
// greedy_chain(tokens, steps, weights, scalars, bf16_activations, rope, cache, rows, vocab_limit,
// check_logits): a greedy draft of `steps` tokens per row in one call, each step the one-token pass
// (embedding, decoder_layers, final RMSNorm + head) and its argmax, as separate calls give it, bit for bit:
//   tokens       [B, n] int64 contiguous, steps <= n: tokens[:, 0] given; for i = 1 .. steps - 1, token
//                tokens[:, i - 1] is fed at slot start[b] + i - 1 (its rotary position too) and
//                tokens[:, i] = argmax of its logits[:vocab_limit] (the lowest index on ties, a NaN first)
//   weights, scalars, bf16_activations, rope, cache as decoder_layers (tokens < V_in)
//   rows         [cache_rows, start] or [cache_rows, start, feed, feed_counts] (ChainRows):
//                cache_rows, start [B] int64: each row's cache row and first slot
//                (start[b] + steps - 1 <= capacity);
//                feed [B, W] int64: the committed tokens the draft has not seen, fed first in one pass
//                at slots start[b] .. start[b] + W - 1 (columns from feed_counts[b] on are padding, written
//                past the row's tokens); tokens[:, 0] is then the argmax at column feed_counts[b] - 1 and
//                the chain feeds from slot start[b] + feed_counts[b]; feed_counts [B] int64 in [1, W]: each
//                row's real columns
//   vocab_limit  1 .. V_out: the logits the argmax reads (a target's smaller vocabulary)
//   check_logits a target's greedy decoding: logits [:vocab_limit] with a NaN or +inf, or all -inf, raise
//                ValueError naming the row (chain_verify's check), instead of giving an argmax
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "cpu/attention_types.h"

namespace specdec {

constexpr int64_t kMaxHeadDim = cpu::kMaxAttentionHeadDim;  // the kernels' key-chunk arrays
constexpr int64_t kLayerTensors = 16;  // a layer's entries in `weights`, in the order above (LlamaLayerView)
constexpr int64_t kLayerScalars = 2;   // a layer's entries in `scalars`: its norms' epsilons
constexpr int64_t kModelTensors = 4;   // embed, then after the layers norm, head, head_bias
constexpr int64_t kModelScalars = 2;   // after the layers' epsilons: the final norm's, the attention scale

inline void check_float_vector(const char* op, const char* name, const at::Tensor& t, int64_t size,
                               const at::Tensor& reference, const char* what) {
  check_rank(op, name, t, 1, "[N]");
  check_size(op, name, t, 0, size, what);
  check_dtype(op, name, t, {at::kFloat, at::kBFloat16, at::kHalf});
  check_same_device(op, name, t, reference, "x");
  check_contiguous(op, name, t);
}

inline void check_fused_linear(const at::Tensor& x, const c10::optional<at::Tensor>& norm_weight,
                               const at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
                               const std::string& epilogue, bool bf16_activations, const at::TensorList outs) {
  constexpr const char* op = "fused_linear";
  check_rank(op, "x", x, 2, "[M, K]");
  check_dtype(op, "x", x, {at::kFloat});
  check_contiguous(op, "x", x);
  const int64_t M = x.size(0), K = x.size(1);
  if (norm_weight.has_value()) check_float_vector(op, "norm_weight", *norm_weight, K, x, "K (x dimension 1)");
  SPECDEC_CHECK(epilogue == "store" || epilogue == "add" || epilogue == "swiglu", op,
                ": epilogue must be \"store\", \"add\" or \"swiglu\", got \"", epilogue, "\"");
  SPECDEC_CHECK(!weights.empty(), op, ": weights must hold at least one weight");
  const bool swiglu = epilogue == "swiglu";
  SPECDEC_CHECK(!swiglu || weights.size() == 2, op, ": epilogue \"swiglu\" takes two weights (gate, up), got ",
                weights.size());
  SPECDEC_CHECK(outs.size() == (swiglu ? 1 : weights.size()), op, ": outs must hold ", swiglu ? 1 : weights.size(),
                " tensor(s) (", swiglu ? "the gated product" : "one per weight", "), got ", outs.size());
  SPECDEC_CHECK(biases.size() == 0 || biases.size() == weights.size(), op,
                ": biases must be empty or hold one entry (a tensor or None) per weight, got ", biases.size(),
                " for ", weights.size(), " weights");
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const std::string name = "weights[" + std::to_string(i) + "]";
    check_rank(op, name.c_str(), w, 2, "[N, K]");
    check_size(op, name.c_str(), w, 1, K, "K (x dimension 1)");
    check_dtype(op, name.c_str(), w, {at::kFloat, at::kBFloat16, at::kHalf});
    SPECDEC_CHECK(w.scalar_type() == weights[0].scalar_type(), op, ": every weight must have the dtype of weights[0] (",
                  weights[0].scalar_type(), "), ", name, " is ", w.scalar_type());
    check_same_device(op, name.c_str(), w, x, "x");
    check_contiguous(op, name.c_str(), w);
    if (swiglu) check_size(op, name.c_str(), w, 0, weights[0].size(0), "N (weights[0] dimension 0)");
    if (biases.size() > 0 && biases.get(i).has_value()) {
      const std::string bname = "biases[" + std::to_string(i) + "]";
      check_float_vector(op, bname.c_str(), *biases.get(i), w.size(0), x, "N (the weight's dimension 0)");
    }
  }
  SPECDEC_CHECK(!bf16_activations || weights[0].scalar_type() == at::kBFloat16, op,
                ": bf16_activations needs bf16 weights, got ", weights[0].scalar_type());
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& o = outs[i];
    const std::string name = "outs[" + std::to_string(i) + "]";
    check_rank(op, name.c_str(), o, 2, "[M, N]");
    check_size(op, name.c_str(), o, 0, M, "M (x dimension 0)");
    check_size(op, name.c_str(), o, 1, weights[i].size(0), "N (the weight's dimension 0)");
    check_dtype(op, name.c_str(), o, {at::kFloat});
    check_same_device(op, name.c_str(), o, x, "x");
    check_contiguous(op, name.c_str(), o);
    SPECDEC_CHECK(!o.is_same(x), op, ": ", name, " must not be x");
  }
}

inline void check_kv_cache_pair(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& reference, const char* reference_name) {
  check_rank(op, "k_cache", k_cache, 4, "[Bc, Hk, capacity, D]");
  check_dtype(op, "k_cache", k_cache, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "k_cache", k_cache);
  check_same_device(op, "k_cache", k_cache, reference, reference_name);
  SPECDEC_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have the shape of k_cache ",
                shape_str(k_cache.sizes()), ", got ", shape_str(v_cache.sizes()));
  SPECDEC_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), op, ": v_cache must have the dtype of k_cache (",
                k_cache.scalar_type(), "), got ", v_cache.scalar_type());
  check_contiguous(op, "v_cache", v_cache);
  check_same_device(op, "v_cache", v_cache, reference, reference_name);
}

inline void check_heads(const char* op, const char* name, const at::Tensor& t, int64_t rows, int64_t heads,
                        int64_t head_dim) {
  check_rank(op, name, t, 3, "[M, heads, D]");
  check_size(op, name, t, 0, rows, "M (q dimension 0)");
  if (heads >= 0) check_size(op, name, t, 1, heads, "Hk (k_cache dimension 1)");
  check_size(op, name, t, 2, head_dim, "D (k_cache dimension 3)");
  check_dtype(op, name, t, {at::kFloat});
  SPECDEC_CHECK(t.stride(2) == 1 && t.stride(1) == head_dim, op, ": ", name,
                " must have contiguous heads (strides [*, D, 1]), got strides ", shape_str(t.strides()));
}

inline void check_index_vector(const char* op, const char* name, const at::Tensor& t, int64_t rows,
                               const at::Tensor& reference) {
  check_rank(op, name, t, 1, "[M]");
  check_size(op, name, t, 0, rows, "M (q dimension 0)");
  check_dtype(op, name, t, {at::kLong});
  check_same_device(op, name, t, reference, "q");
  check_contiguous(op, name, t);
}

inline void check_rope_cache_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                                   const at::Tensor& cache_rows, const at::Tensor& cache_positions,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache) {
  constexpr const char* op = "rope_cache_write";
  check_kv_cache_pair(op, k_cache, v_cache, q, "q");
  const int64_t kv_heads = k_cache.size(1), D = k_cache.size(3);
  SPECDEC_CHECK(D > 0 && D % 2 == 0 && D <= kMaxHeadDim, op, ": the head dimension must be even, > 0 and at most ",
                kMaxHeadDim, ", got ", D);
  check_rank(op, "q", q, 3, "[M, H, D]");
  const int64_t M = q.size(0);
  check_heads(op, "q", q, M, -1, D);
  check_no_internal_overlap(op, "q", q);  // (rotated in place)
  check_heads(op, "k", k, M, kv_heads, D);
  check_heads(op, "v", v, M, kv_heads, D);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"cos", cos}, {"sin", sin}}) {
    check_rank(op, name, t, 2, "[P, D/2]");
    check_size(op, name, t, 1, D / 2, "D/2");
    check_dtype(op, name, t, {at::kFloat});
    check_same_device(op, name, t, q, "q");
    check_contiguous(op, name, t);
  }
  SPECDEC_CHECK(sin.size(0) == cos.size(0), op, ": sin must have the shape of cos ", shape_str(cos.sizes()),
                ", got ", shape_str(sin.sizes()));
  check_index_vector(op, "positions", positions, M, q);
  check_index_vector(op, "cache_rows", cache_rows, M, q);
  check_index_vector(op, "cache_positions", cache_positions, M, q);
}

inline void check_cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& start, const c10::optional<at::Tensor>& visible,
                                  const at::Tensor& out) {
  constexpr const char* op = "cache_attention";
  check_rank(op, "q", q, 4, "[B, T, H, D]");
  check_dtype(op, "q", q, {at::kFloat});
  check_contiguous(op, "q", q);
  check_kv_cache_pair(op, k_cache, v_cache, q, "q");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  check_size(op, "q", q, 3, k_cache.size(3), "D (k_cache dimension 3)");
  SPECDEC_CHECK(D <= kMaxHeadDim, op, ": the head dimension must be at most ", kMaxHeadDim, ", got ", D);
  SPECDEC_CHECK(k_cache.size(1) > 0 && H % k_cache.size(1) == 0, op, ": the query heads (", H,
                ") must be a multiple of the kv heads (", k_cache.size(1), ")");
  SPECDEC_CHECK(k_cache.size(0) >= B, op, ": k_cache holds ", k_cache.size(0), " rows but q has B = ", B);
  check_rank(op, "start", start, 1, "[B]");
  check_size(op, "start", start, 0, B, "B (q dimension 0)");
  check_dtype(op, "start", start, {at::kLong});
  check_same_device(op, "start", start, q, "q");
  check_contiguous(op, "start", start);
  if (visible.has_value()) {
    check_rank(op, "visible", *visible, 3, "[B, T, T]");
    check_size(op, "visible", *visible, 0, B, "B (q dimension 0)");
    check_size(op, "visible", *visible, 1, T, "T (q dimension 1)");
    check_size(op, "visible", *visible, 2, T, "T (q dimension 1)");
    check_dtype(op, "visible", *visible, {at::kBool});
    check_same_device(op, "visible", *visible, q, "q");
    check_contiguous(op, "visible", *visible);
  }
  SPECDEC_CHECK(out.sizes() == q.sizes(), op, ": out must have the shape of q ", shape_str(q.sizes()), ", got ",
                shape_str(out.sizes()));
  check_dtype(op, "out", out, {at::kFloat});
  check_same_device(op, "out", out, q, "q");
  check_contiguous(op, "out", out);
}

// The model of decoder_layers and greedy_chain, read by name from their `weights` and `scalars` lists
// once per call (the order at the top of this file).
using OptionalTensors = c10::List<c10::optional<at::Tensor>>;

struct Projection {
  at::Tensor weight;               // [N, K]
  c10::optional<at::Tensor> bias;  // [N] or none
};

struct LlamaLayerView {
  at::Tensor input_norm;  // [d]
  double input_norm_eps;
  Projection q, k, v, o;  // [H*D, d], [Hk*D, d], [Hk*D, d], [d, H*D]
  at::Tensor post_norm;   // [d]
  double post_norm_eps;
  Projection gate, up, down;  // [I, d], [I, d], [d, I]
};

struct LlamaModelView {
  at::Tensor embed;  // [V_in, d]
  std::vector<LlamaLayerView> layers;
  at::Tensor norm;  // [d]
  double norm_eps;
  Projection head;  // [V_out, d]
  double scale;     // the attention scale
};

// Reads `weights` and `scalars` as LlamaModelView; checks their lengths and that only biases are None
// (the tensors' shapes are checked by the ops that read them).
class ModelListReader {
 public:
  ModelListReader(const char* op, const OptionalTensors& weights) : op_(op), weights_(weights) {}
  at::Tensor tensor(const char* name, int64_t layer) {
    const c10::optional<at::Tensor> t = weights_.get(next_);
    SPECDEC_CHECK(t.has_value(), op_, ": weights[", next_, "] (", name, layer < 0 ? "" : " of layer ",
                  layer < 0 ? std::string() : std::to_string(layer), ") must be a tensor, got None");
    ++next_;
    return *t;
  }
  Projection projection(const char* name, int64_t layer) {
    Projection p{tensor(name, layer), c10::nullopt};
    p.bias = weights_.get(next_++);
    return p;
  }

 private:
  const char* op_;
  const OptionalTensors& weights_;
  size_t next_ = 0;
};

inline LlamaModelView llama_model_view(const char* op, const OptionalTensors& weights, c10::ArrayRef<double> scalars) {
  const int64_t n = static_cast<int64_t>(weights.size());
  SPECDEC_CHECK(n >= kModelTensors + kLayerTensors && (n - kModelTensors) % kLayerTensors == 0, op,
                ": weights must hold the embedding, ", kLayerTensors, " entries per layer (input_norm, q, q_bias, k, "
                "k_bias, v, v_bias, o, o_bias, post_norm, gate, gate_bias, up, up_bias, down, down_bias), then norm, "
                "head, head_bias: ", kModelTensors, " + ", kLayerTensors, " L entries for L >= 1 layers, got ", n);
  const int64_t L = (n - kModelTensors) / kLayerTensors;
  SPECDEC_CHECK(static_cast<int64_t>(scalars.size()) == kLayerScalars * L + kModelScalars, op,
                ": scalars must hold ", kLayerScalars, " norm epsilons per layer, then the final norm's epsilon and the "
                "attention scale: ", kLayerScalars * L + kModelScalars, " for ", L, " layers, got ", scalars.size());
  ModelListReader read(op, weights);
  LlamaModelView model;
  model.embed = read.tensor("embed", -1);
  model.layers.reserve(L);
  for (int64_t l = 0; l < L; ++l) {
    LlamaLayerView layer;
    layer.input_norm = read.tensor("input_norm", l);
    layer.input_norm_eps = scalars[kLayerScalars * l];
    layer.q = read.projection("q", l);
    layer.k = read.projection("k", l);
    layer.v = read.projection("v", l);
    layer.o = read.projection("o", l);
    layer.post_norm = read.tensor("post_norm", l);
    layer.post_norm_eps = scalars[kLayerScalars * l + 1];
    layer.gate = read.projection("gate", l);
    layer.up = read.projection("up", l);
    layer.down = read.projection("down", l);
    model.layers.push_back(std::move(layer));
  }
  model.norm = read.tensor("norm", -1);
  model.head = read.projection("head", -1);
  model.norm_eps = scalars[kLayerScalars * L];
  model.scale = scalars[kLayerScalars * L + 1];
  return model;
}

// decoder_layers' and greedy_chain's rope and cache lists, by name.
struct RopeCache {
  at::Tensor cos, sin;          // [P, D/2] fp32
  at::Tensor k_cache, v_cache;  // [L, Bc, Hk, capacity, D]
};

inline RopeCache rope_cache(const char* op, at::TensorList rope, at::TensorList cache) {
  SPECDEC_CHECK(rope.size() == 2, op, ": rope must hold [cos, sin], got ", rope.size(), " tensors");
  SPECDEC_CHECK(cache.size() == 2, op, ": cache must hold [k_cache, v_cache], got ", cache.size(), " tensors");
  return {rope[0], rope[1], cache[0], cache[1]};
}

// Where the tokens of a decoder_layers pass go: its `layout` list and `visible`, by name.
struct PassLayout {
  at::Tensor positions, cache_rows, cache_positions;  // [M] int64
  at::Tensor start;                                   // [B] int64
  c10::optional<at::Tensor> visible;                  // [B, T, T] bool
};

inline PassLayout pass_layout(at::TensorList layout, const c10::optional<at::Tensor>& visible) {
  SPECDEC_CHECK(layout.size() == 4, "decoder_layers: layout must hold [positions, cache_rows, cache_positions, "
                "start], got ", layout.size(), " tensors");
  return {layout[0], layout[1], layout[2], layout[3], visible};
}

// greedy_chain's `rows` list, by name.
struct ChainRows {
  at::Tensor cache_rows, start;                    // [B] int64
  c10::optional<at::Tensor> feed, feed_counts;     // [B, W], [B] int64
};

inline ChainRows chain_rows(at::TensorList rows) {
  SPECDEC_CHECK(rows.size() == 2 || rows.size() == 4, "greedy_chain: rows must hold [cache_rows, start] or "
                "[cache_rows, start, feed, feed_counts] (feed and feed_counts come together), got ", rows.size(),
                " tensors");
  if (rows.size() == 2) return {rows[0], rows[1], c10::nullopt, c10::nullopt};
  return {rows[0], rows[1], rows[2], rows[3]};
}

// The shapes decoder_layers takes (the per-op checks run on each layer's pieces as well).
struct DecoderLayersShape {
  int64_t layers, batch, tokens, heads, kv_heads, head_dim, intermediate;
};

// A contiguous [B, *] matrix of one of `dtypes`, on the device of `tokens` (whose dimension 0 is B).
inline void check_rows_matrix(const char* op, const char* name, const at::Tensor& t, const char* layout, int64_t B,
                              std::initializer_list<at::ScalarType> dtypes, const at::Tensor& tokens) {
  check_rank(op, name, t, 2, layout);
  check_size(op, name, t, 0, B, "B (tokens dimension 0)");
  check_dtype(op, name, t, dtypes);
  check_contiguous(op, name, t);
  check_same_device(op, name, t, tokens, "tokens");
}

inline void check_index_column(const char* op, const char* name, const at::Tensor& t, int64_t rows,
                               const char* what) {
  check_rank(op, name, t, 1, "[B]");
  if (rows >= 0) check_size(op, name, t, 0, rows, what);
  check_dtype(op, name, t, {at::kLong});
  check_contiguous(op, name, t);
}

inline DecoderLayersShape check_decoder_layers(const at::Tensor& x, const LlamaModelView& model,
                                               const RopeCache& state, const PassLayout& pass) {
  constexpr const char* op = "decoder_layers";
  check_rank(op, "x", x, 2, "[M, d]");
  check_dtype(op, "x", x, {at::kFloat});
  check_contiguous(op, "x", x);
  const int64_t L = static_cast<int64_t>(model.layers.size());
  const at::Tensor& k_cache = state.k_cache;
  check_rank(op, "k_cache", k_cache, 5, "[L, Bc, Hk, capacity, D]");
  check_size(op, "k_cache", k_cache, 0, L, "the layers in weights");
  SPECDEC_CHECK(state.v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have the shape of k_cache ",
                shape_str(k_cache.sizes()), ", got ", shape_str(state.v_cache.sizes()));
  const int64_t Hk = k_cache.size(2), D = k_cache.size(4);
  const at::Tensor& wq = model.layers[0].q.weight;
  check_rank(op, "q (layer 0)", wq, 2, "[H*D, d]");
  SPECDEC_CHECK(D > 0 && wq.size(0) % D == 0, op, ": the q weight's ", wq.size(0),
                " rows must be a multiple of the head dimension ", D, " (k_cache dimension 4)");
  const int64_t H = wq.size(0) / D;
  check_rank(op, "gate (layer 0)", model.layers[0].gate.weight, 2, "[I, d]");
  check_index_column(op, "start", pass.start, -1, "");
  const int64_t M = x.size(0), B = pass.start.size(0);
  SPECDEC_CHECK(B > 0, op, ": start must hold at least one row (decoder_layers runs no empty batch), got shape ",
                shape_str(pass.start.sizes()));
  SPECDEC_CHECK(M % B == 0, op, ": x has ", M, " rows, not a whole number of blocks for the ", B,
                " rows of start");
  const int64_t T = M / B;
  const at::Tensor& cache_rows = pass.cache_rows;
  check_rank(op, "cache_rows", cache_rows, 1, "[M]");
  check_size(op, "cache_rows", cache_rows, 0, M, "M (x dimension 0)");
  check_dtype(op, "cache_rows", cache_rows, {at::kLong});
  check_contiguous(op, "cache_rows", cache_rows);
  const int64_t* rows = cache_rows.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    SPECDEC_CHECK(rows[m] == rows[(m / T) * T], op, ": cache_rows[", m, "] = ", rows[m], " differs from its block's "
                  "first token (cache_rows[", (m / T) * T, "] = ", rows[(m / T) * T], "): a block of T = ", T,
                  " tokens belongs to one cache row");
  return {L, B, T, H, Hk, D, model.layers[0].gate.weight.size(0)};
}

inline void check_feed(const ChainRows& rows, int64_t B, const at::Tensor& tokens, const at::Tensor& embed) {
  constexpr const char* op = "greedy_chain";
  const at::Tensor& feed = *rows.feed;
  const at::Tensor& feed_counts = *rows.feed_counts;
  check_rows_matrix(op, "feed", feed, "[B, W]", B, {at::kLong}, tokens);
  const int64_t W = feed.size(1);
  SPECDEC_CHECK(W > 0, op, ": feed must hold at least one column, got ", shape_str(feed.sizes()));
  check_index_column(op, "feed_counts", feed_counts, B, "B (tokens dimension 0)");
  check_same_device(op, "feed_counts", feed_counts, tokens, "tokens");
  const int64_t* counts = feed_counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    SPECDEC_CHECK(counts[b] >= 1 && counts[b] <= W, op, ": feed_counts[", b, "] = ", counts[b],
                  " must be in [1, W] = [1, ", W, "]");
  const int64_t* fed = feed.data_ptr<int64_t>();
  for (int64_t m = 0; m < B * W; ++m)
    SPECDEC_CHECK(fed[m] >= 0 && fed[m] < embed.size(0), op, ": feed[", m / W, ", ", m % W, "] = ", fed[m],
                  " is outside the embedding's [0, ", embed.size(0), ")");
}

// The shapes greedy_chain takes beyond decoder_layers' (which checks the layers at every step).
inline void check_greedy_chain(const at::Tensor& tokens, int64_t steps, const LlamaModelView& model,
                               const at::Tensor& k_cache, const ChainRows& rows, int64_t vocab_limit) {
  constexpr const char* op = "greedy_chain";
  check_rank(op, "tokens", tokens, 2, "[B, n]");
  check_dtype(op, "tokens", tokens, {at::kLong});
  check_contiguous(op, "tokens", tokens);
  const int64_t B = tokens.size(0), n = tokens.size(1);
  SPECDEC_CHECK(B > 0 && n > 0, op, ": tokens must hold at least one row and one column, got ", shape_str(tokens.sizes()));
  SPECDEC_CHECK(steps >= 1 && steps <= n, op, ": steps must be in [1, n] = [1, ", n, "], got ", steps);
  const at::Tensor& embed = model.embed;
  check_rank(op, "embed", embed, 2, "[V_in, d]");
  check_dtype(op, "embed", embed, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "embed", embed);
  check_same_device(op, "embed", embed, tokens, "tokens");
  const int64_t d = embed.size(1);
  check_index_column(op, "cache_rows", rows.cache_rows, B, "B (tokens dimension 0)");
  check_index_column(op, "start", rows.start, B, "B (tokens dimension 0)");
  check_float_vector(op, "norm", model.norm, d, embed, "d (embed dimension 1)");
  check_rank(op, "head", model.head.weight, 2, "[V_out, d]");
  check_size(op, "head", model.head.weight, 1, d, "d (embed dimension 1)");
  const int64_t V = model.head.weight.size(0);
  if (model.head.bias.has_value())
    check_float_vector(op, "head_bias", *model.head.bias, V, embed, "V_out (head dimension 0)");
  SPECDEC_CHECK(vocab_limit >= 1 && vocab_limit <= V, op, ": vocab_limit must be in [1, V_out] = [1, ", V, "], got ",
                vocab_limit);
  SPECDEC_CHECK(vocab_limit <= embed.size(0), op, ": the chain feeds the ids it picks, below vocab_limit = ", vocab_limit,
                ", but embed holds V_in = ", embed.size(0), " rows (a head wider than the embedding): pass vocab_limit <= V_in");
  const bool fed = rows.feed.has_value();
  if (fed) check_feed(rows, B, tokens, embed);
  const int64_t W = fed ? rows.feed->size(1) : 0;
  const int64_t* counts = fed ? rows.feed_counts->data_ptr<int64_t>() : nullptr;
  // Every slot of the chain checked up front: decoder_layers checks each step's, after earlier steps wrote.
  check_rank(op, "k_cache", k_cache, 5, "[L, Bc, Hk, capacity, D]");
  const int64_t capacity = k_cache.size(3);
  const int64_t* first = rows.start.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    SPECDEC_CHECK(first[b] >= 0 && first[b] <= capacity - W, op, ": start[", b, "] = ", first[b],
                  W > 0 ? " must be in [0, capacity - W] = [0, " : " must be in [0, capacity] = [0, ", capacity - W,
                  W > 0 ? "] (the feed writes its W columns from slot start)" : "] (a slot index)");
    const int64_t chain_start = first[b] + (counts == nullptr ? 0 : counts[b]);
    SPECDEC_CHECK(chain_start <= capacity - (steps - 1), op, ": start[", b, "] = ", chain_start,
                  counts == nullptr ? "" : " (with its feed_counts)", " must be in [0, capacity - (steps - 1)] = [0, ",
                  capacity - steps + 1, "] (the chain feeds ", steps - 1, " tokens from slot start)");
  }
  if (fed) return;  // tokens[:, 0] is the feed's argmax
  const int64_t* given = tokens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    SPECDEC_CHECK(given[b * n] >= 0 && given[b * n] < embed.size(0), op, ": tokens[", b, ", 0] = ", given[b * n],
                  " is outside the embedding's [0, ", embed.size(0), ")");
}

// eagle_chain (EAGLE-3's greedy chain): the layer's q, k, v read 2d wide ([embedding; features]), its
// residual stream and the head d wide; `eagle` = [hidden_norm [d], target_ids [V_d] int64 in [0, V_in)].
// Returns (B, steps capacity-checked).
inline void check_eagle_chain(const at::Tensor& tokens, int64_t steps, const at::Tensor& last,
                              const LlamaModelView& model, at::TensorList eagle, c10::ArrayRef<double> eagle_scalars,
                              const RopeCache& state, const at::Tensor& start, at::TensorList feed) {
  constexpr const char* op = "eagle_chain";
  SPECDEC_CHECK(model.layers.size() == 1, op, ": weights must hold one layer (the EAGLE-3 layer), got ",
                model.layers.size());
  SPECDEC_CHECK(eagle.size() == 2, op, ": eagle must hold [hidden_norm, target_ids], got ", eagle.size(), " tensors");
  SPECDEC_CHECK(eagle_scalars.size() == 2, op, ": eagle_scalars must hold [hidden_norm_eps, norm_before_residual], got ",
                eagle_scalars.size());
  check_rank(op, "tokens", tokens, 2, "[B, n]");
  check_dtype(op, "tokens", tokens, {at::kLong});
  check_contiguous(op, "tokens", tokens);
  const int64_t B = tokens.size(0), n = tokens.size(1);
  SPECDEC_CHECK(B > 0 && n > 0, op, ": tokens must hold at least one row and one column, got ",
                shape_str(tokens.sizes()));
  SPECDEC_CHECK(steps >= 1 && steps <= n, op, ": steps must be in [1, n] = [1, ", n, "], got ", steps);
  const at::Tensor& embed = model.embed;  // (the model's width d: the other arguments are checked against it)
  check_rank(op, "embed", embed, 2, "[V_in, d]");
  check_dtype(op, "embed", embed, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "embed", embed);
  const int64_t d = embed.size(1);
  check_rows_matrix(op, "last", last, "[B, d]", B, {at::kFloat}, tokens);
  check_size(op, "last", last, 1, d, "d (embed dimension 1)");
  const LlamaLayerView& w = model.layers[0];
  check_float_vector(op, "input_norm", w.input_norm, d, last, "d (embed dimension 1)");
  check_float_vector(op, "hidden_norm", eagle[0], d, last, "d (embed dimension 1)");
  check_rank(op, "q", w.q.weight, 2, "[H*D, 2d]");
  check_size(op, "q", w.q.weight, 1, 2 * d, "2d: the layer reads [embedding; features]");
  check_rank(op, "gate", w.gate.weight, 2, "[I, d]");
  check_float_vector(op, "norm", model.norm, d, last, "d (embed dimension 1)");
  check_rank(op, "head", model.head.weight, 2, "[V_d, d]");
  check_size(op, "head", model.head.weight, 1, d, "d (embed dimension 1)");
  const at::Tensor& target_ids = eagle[1];
  check_index_column(op, "target_ids", target_ids, model.head.weight.size(0), "V_d (head dimension 0)");
  const int64_t* ids = target_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < target_ids.numel(); ++i)
    SPECDEC_CHECK(ids[i] >= 0 && ids[i] < embed.size(0), op, ": target_ids[", i, "] = ", ids[i],
                  " is outside the embedding's [0, ", embed.size(0), ")");
  const at::Tensor& k_cache = state.k_cache;
  check_rank(op, "k_cache", k_cache, 5, "[1, Bc, Hk, capacity, D]");
  check_size(op, "k_cache", k_cache, 0, 1, "one layer");
  SPECDEC_CHECK(state.v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have the shape of k_cache ",
                shape_str(k_cache.sizes()), ", got ", shape_str(state.v_cache.sizes()));
  SPECDEC_CHECK(k_cache.size(1) >= B, op, ": the cache holds ", k_cache.size(1), " rows, fewer than B = ", B);
  // The layer's shapes, so that a wrong one fails here and not after tokens[:, 0] is written.
  const int64_t Hk = k_cache.size(2), D = k_cache.size(4);
  SPECDEC_CHECK(D > 0 && Hk > 0 && w.q.weight.size(0) % (D * Hk) == 0, op, ": the q weight's ", w.q.weight.size(0),
                " rows must be a multiple of Hk * D = ", Hk * D, " (k_cache dimensions 2 and 4)");
  const int64_t HD = w.q.weight.size(0), I = w.gate.weight.size(0);
  for (const auto& [name, weight, rows, cols] :
       {std::tuple<const char*, const at::Tensor*, int64_t, int64_t>{"k", &w.k.weight, Hk * D, 2 * d},
        {"v", &w.v.weight, Hk * D, 2 * d}, {"o", &w.o.weight, d, HD}, {"up", &w.up.weight, I, d},
        {"gate", &w.gate.weight, I, d}, {"down", &w.down.weight, d, I}}) {
    check_rank(op, name, *weight, 2, "[N, K]");
    SPECDEC_CHECK(weight->size(0) == rows && weight->size(1) == cols, op, ": ", name, " must have shape [", rows, ", ",
                  cols, "], got ", shape_str(weight->sizes()));
  }
  SPECDEC_CHECK(state.cos.dim() == 2 && state.cos.size(1) == D / 2 && state.sin.sizes() == state.cos.sizes(), op,
                ": rope must hold cos and sin of shape [P, D/2] = [P, ", D / 2, "], got ", shape_str(state.cos.sizes()),
                " and ", shape_str(state.sin.sizes()));
  check_index_column(op, "start", start, B, "B (tokens dimension 0)");
  SPECDEC_CHECK(feed.empty() || feed.size() == 3, op, ": feed must be empty or hold [tokens, features, counts], got ",
                feed.size(), " tensors");
  int64_t W = 0;
  const int64_t* counts = nullptr;
  if (!feed.empty()) {
    check_rows_matrix(op, "feed tokens", feed[0], "[B, W]", B, {at::kLong}, tokens);
    W = feed[0].size(1);
    SPECDEC_CHECK(W > 0, op, ": the feed must hold at least one column, got ", shape_str(feed[0].sizes()));
    const int64_t* fed = feed[0].data_ptr<int64_t>();
    for (int64_t i = 0; i < B * W; ++i)
      SPECDEC_CHECK(fed[i] >= 0 && fed[i] < embed.size(0), op, ": feed tokens[", i / W, ", ", i % W, "] = ", fed[i],
                    " is outside the embedding's [0, ", embed.size(0), ")");
    check_rank(op, "feed features", feed[1], 3, "[B, W, d]");
    SPECDEC_CHECK(feed[1].size(0) == B && feed[1].size(1) == W && feed[1].size(2) == d, op,
                  ": feed features must have shape [B, W, d] = [", B, ", ", W, ", ", d, "], got ",
                  shape_str(feed[1].sizes()));
    check_dtype(op, "feed features", feed[1], {at::kFloat});
    check_contiguous(op, "feed features", feed[1]);
    check_index_column(op, "feed counts", feed[2], B, "B (tokens dimension 0)");
    counts = feed[2].data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      SPECDEC_CHECK(counts[b] >= 0 && counts[b] <= W, op, ": feed counts[", b, "] = ", counts[b],
                    " must be in [0, W] = [0, ", W, "]");
  }
  // Every slot the feed and the chain write (start[b] .. start[b] + W - 1, then start[b] + count ..
  // start[b] + count + steps - 2) checked before the first pass.
  const int64_t limit = std::min(k_cache.size(3), state.cos.size(0));
  const int64_t* first = start.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    SPECDEC_CHECK(first[b] >= 0 && first[b] <= limit - W, op, ": start[", b, "] = ", first[b], " must be in [0, ",
                  limit - W, W > 0 ? "] (the feed writes its W columns from start; " : "] (a slot index; ",
                  "the cache and the rotary tables hold ", limit, ")");
    const int64_t chain = first[b] + (counts == nullptr ? 0 : counts[b]);
    SPECDEC_CHECK(chain <= limit - (steps - 1), op, ": start[", b, "] = ", chain, counts == nullptr ? "" :
                  " (with its feed count)", " must be in [0, ", limit - steps + 1, "] (the chain writes ", steps - 1,
                  " slots from start; the cache and the rotary tables hold ", limit, ")");
  }
}

}  // namespace specdec
