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
// decoder_layers: L Llama-family decoder layers in one call, each as the four projections, the rotary
// + cache write and the attention above compose it (the same kernels, the same bits):
//   x = x + o(attention(rope(q(n1(x)), k(n1(x))), v(n1(x))));  x = x + down(silu(gate(n2(x))) * up(n2(x)))
//   x            [M, d] fp32 contiguous, M = B * T: the residual stream, updated in place
//   weights      kLayerWeights per layer: input norm [d], q [H*D, d], k [Hk*D, d], v [Hk*D, d],
//                o [d, H*D], post-attention norm [d], gate [I, d], up [I, d], down [d, I]
//   biases       [] or kLayerBiases per layer (None or a vector): q, k, v, o, gate, up, down
//   norm_eps     kLayerNormEps per layer: the input and the post-attention norms' epsilons
//   cos, sin, positions, cache_positions as rope_cache_write; cache_rows [M]: one row per block of T
//   k_cache, v_cache [L, Bc, Hk, capacity, D]; start, visible, scale as cache_attention (batch row b
//                reads cache row cache_rows[b * T])
//
// greedy_chain: a greedy draft of `steps` tokens per row in one call, each step the one-token pass
// (embedding, decoder_layers, final RMSNorm + head) and its argmax, as separate calls give it, bit for bit:
//   tokens       [B, n] int64 contiguous, steps <= n: tokens[:, 0] given; for i = 1 .. steps - 1, token
//                tokens[:, i - 1] is fed at slot start[b] + i - 1 (its rotary position too) and
//                tokens[:, i] = argmax of its logits[:vocab_limit] (the lowest index on ties, a NaN first)
//   embed        [V_in, d] fp32/bf16/fp16 contiguous: the input embedding (tokens < V_in)
//   weights, biases, norm_eps, bf16_activations, cos, sin, k_cache, v_cache, scale as decoder_layers
//   cache_rows, start [B] int64: each row's cache row and first slot (start[b] + steps - 1 <= capacity)
//   norm_weight  [d]; final_norm_eps; head_weight [V_out, d], head_bias [V_out] or None: the logits
//   vocab_limit  1 .. V_out: the logits the argmax reads (a target's smaller vocabulary)
//   check_logits a target's greedy decoding: logits [:vocab_limit] with a NaN or +inf, or all -inf, raise
//                ValueError naming the row (chain_verify's check), instead of giving an argmax
//   feed         [B, W] int64 or None: the committed tokens the draft has not seen, fed first in one pass
//                at slots start[b] .. start[b] + W - 1 (columns from feed_counts[b] on are padding, written
//                past the row's tokens); tokens[:, 0] is then the argmax at column feed_counts[b] - 1 and
//                the chain feeds from slot start[b] + feed_counts[b]
//   feed_counts  [B] int64 in [1, W], with feed: each row's real columns
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <string>

#include "checks.h"
#include "cpu/attention_types.h"

namespace specdec {

constexpr int64_t kMaxHeadDim = cpu::kMaxAttentionHeadDim;  // the kernels' key-chunk arrays
constexpr int64_t kLayerWeights = 9;  // decoder_layers: the weights of one layer, in the order above
constexpr int64_t kLayerBiases = 7;
constexpr int64_t kLayerNormEps = 2;

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
  TORCH_CHECK(epilogue == "store" || epilogue == "add" || epilogue == "swiglu", op,
              ": epilogue must be \"store\", \"add\" or \"swiglu\", got \"", epilogue, "\"");
  TORCH_CHECK(!weights.empty(), op, ": weights must hold at least one weight");
  const bool swiglu = epilogue == "swiglu";
  TORCH_CHECK(!swiglu || weights.size() == 2, op, ": epilogue \"swiglu\" takes two weights (gate, up), got ",
              weights.size());
  TORCH_CHECK(outs.size() == (swiglu ? 1 : weights.size()), op, ": outs must hold ", swiglu ? 1 : weights.size(),
              " tensor(s) (", swiglu ? "the gated product" : "one per weight", "), got ", outs.size());
  TORCH_CHECK(biases.size() == 0 || biases.size() == weights.size(), op,
              ": biases must be empty or hold one entry (a tensor or None) per weight, got ", biases.size(),
              " for ", weights.size(), " weights");
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const std::string name = "weights[" + std::to_string(i) + "]";
    check_rank(op, name.c_str(), w, 2, "[N, K]");
    check_size(op, name.c_str(), w, 1, K, "K (x dimension 1)");
    check_dtype(op, name.c_str(), w, {at::kFloat, at::kBFloat16, at::kHalf});
    TORCH_CHECK(w.scalar_type() == weights[0].scalar_type(), op, ": every weight must have the dtype of weights[0] (",
                weights[0].scalar_type(), "), ", name, " is ", w.scalar_type());
    check_same_device(op, name.c_str(), w, x, "x");
    check_contiguous(op, name.c_str(), w);
    if (swiglu) check_size(op, name.c_str(), w, 0, weights[0].size(0), "N (weights[0] dimension 0)");
    if (biases.size() > 0 && biases.get(i).has_value()) {
      const std::string bname = "biases[" + std::to_string(i) + "]";
      check_float_vector(op, bname.c_str(), *biases.get(i), w.size(0), x, "N (the weight's dimension 0)");
    }
  }
  TORCH_CHECK(!bf16_activations || weights[0].scalar_type() == at::kBFloat16, op,
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
    TORCH_CHECK(!o.is_same(x), op, ": ", name, " must not be x");
  }
}

inline void check_kv_cache_pair(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& reference, const char* reference_name) {
  check_rank(op, "k_cache", k_cache, 4, "[Bc, Hk, capacity, D]");
  check_dtype(op, "k_cache", k_cache, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "k_cache", k_cache);
  check_same_device(op, "k_cache", k_cache, reference, reference_name);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have the shape of k_cache ",
              shape_str(k_cache.sizes()), ", got ", shape_str(v_cache.sizes()));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), op, ": v_cache must have the dtype of k_cache (",
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
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == head_dim, op, ": ", name,
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
  TORCH_CHECK(D % 2 == 0 && D <= kMaxHeadDim, op, ": the head dimension must be even and at most ", kMaxHeadDim,
              ", got ", D);
  check_rank(op, "q", q, 3, "[M, H, D]");
  const int64_t M = q.size(0);
  check_heads(op, "q", q, M, -1, D);
  check_heads(op, "k", k, M, kv_heads, D);
  check_heads(op, "v", v, M, kv_heads, D);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"cos", cos}, {"sin", sin}}) {
    check_rank(op, name, t, 2, "[P, D/2]");
    check_size(op, name, t, 1, D / 2, "D/2");
    check_dtype(op, name, t, {at::kFloat});
    check_same_device(op, name, t, q, "q");
    check_contiguous(op, name, t);
  }
  TORCH_CHECK(sin.size(0) == cos.size(0), op, ": sin must have the shape of cos ", shape_str(cos.sizes()),
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
  TORCH_CHECK(D <= kMaxHeadDim, op, ": the head dimension must be at most ", kMaxHeadDim, ", got ", D);
  TORCH_CHECK(k_cache.size(1) > 0 && H % k_cache.size(1) == 0, op, ": the query heads (", H,
              ") must be a multiple of the kv heads (", k_cache.size(1), ")");
  TORCH_CHECK(k_cache.size(0) >= B, op, ": k_cache holds ", k_cache.size(0), " rows but q has B = ", B);
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
  TORCH_CHECK(out.sizes() == q.sizes(), op, ": out must have the shape of q ", shape_str(q.sizes()), ", got ",
              shape_str(out.sizes()));
  check_dtype(op, "out", out, {at::kFloat});
  check_same_device(op, "out", out, q, "q");
  check_contiguous(op, "out", out);
}

// The shapes decoder_layers takes (the per-op checks run on each layer's pieces as well).
struct DecoderLayersShape {
  int64_t layers, batch, tokens, heads, kv_heads, head_dim, intermediate;
};

inline DecoderLayersShape check_decoder_layers(const at::Tensor& x, const at::TensorList weights,
                                               const c10::List<c10::optional<at::Tensor>>& biases,
                                               c10::ArrayRef<double> norm_eps, const at::Tensor& cache_rows,
                                               const at::Tensor& k_cache, const at::Tensor& v_cache,
                                               const at::Tensor& start) {
  constexpr const char* op = "decoder_layers";
  check_rank(op, "x", x, 2, "[M, d]");
  check_dtype(op, "x", x, {at::kFloat});
  check_contiguous(op, "x", x);
  const int64_t n = static_cast<int64_t>(weights.size());
  TORCH_CHECK(n > 0 && n % kLayerWeights == 0, op, ": weights must hold ", kLayerWeights,
              " tensors per layer (input norm, q, k, v, o, post norm, gate, up, down), got ", n);
  const int64_t L = n / kLayerWeights;
  TORCH_CHECK(biases.size() == 0 || static_cast<int64_t>(biases.size()) == kLayerBiases * L, op,
              ": biases must be empty or hold ", kLayerBiases, " entries per layer (q, k, v, o, gate, up, down): ",
              kLayerBiases * L, " for ", L, " layers, got ", biases.size());
  TORCH_CHECK(static_cast<int64_t>(norm_eps.size()) == kLayerNormEps * L, op, ": norm_eps must hold ",
              kLayerNormEps, " values per layer: ", kLayerNormEps * L, " for ", L, " layers, got ", norm_eps.size());
  check_rank(op, "k_cache", k_cache, 5, "[L, Bc, Hk, capacity, D]");
  check_size(op, "k_cache", k_cache, 0, L, "the layers in weights");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have the shape of k_cache ",
              shape_str(k_cache.sizes()), ", got ", shape_str(v_cache.sizes()));
  const int64_t Hk = k_cache.size(2), D = k_cache.size(4);
  const at::Tensor& wq = weights[1];
  check_rank(op, "weights[1] (q)", wq, 2, "[H*D, d]");
  TORCH_CHECK(D > 0 && wq.size(0) % D == 0, op, ": the q weight's ", wq.size(0),
              " rows must be a multiple of the head dimension ", D, " (k_cache dimension 4)");
  const int64_t H = wq.size(0) / D;
  check_rank(op, "weights[6] (gate)", weights[6], 2, "[I, d]");
  check_rank(op, "start", start, 1, "[B]");
  check_dtype(op, "start", start, {at::kLong});
  check_contiguous(op, "start", start);
  const int64_t M = x.size(0), B = start.size(0);
  TORCH_CHECK(B > 0 && M % B == 0, op, ": x has ", M, " rows, not a whole number of blocks for the ", B,
              " rows of start");
  const int64_t T = M / B;
  check_rank(op, "cache_rows", cache_rows, 1, "[M]");
  check_size(op, "cache_rows", cache_rows, 0, M, "M (x dimension 0)");
  check_dtype(op, "cache_rows", cache_rows, {at::kLong});
  check_contiguous(op, "cache_rows", cache_rows);
  const int64_t* rows = cache_rows.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(rows[m] == rows[(m / T) * T], op, ": cache_rows[", m, "] = ", rows[m], " differs from its block's "
                "first token (cache_rows[", (m / T) * T, "] = ", rows[(m / T) * T], "): a block of T = ", T,
                " tokens belongs to one cache row");
  return {L, B, T, H, Hk, D, weights[6].size(0)};
}

// The shapes greedy_chain takes beyond decoder_layers' (which checks the layers at every step).
inline void check_greedy_chain(const at::Tensor& tokens, int64_t steps, const at::Tensor& embed,
                               const at::Tensor& cache_rows, const at::Tensor& start, const at::Tensor& k_cache,
                               const at::Tensor& norm_weight,
                               const at::Tensor& head_weight, const c10::optional<at::Tensor>& head_bias,
                               int64_t vocab_limit, const c10::optional<at::Tensor>& feed,
                               const c10::optional<at::Tensor>& feed_counts) {
  constexpr const char* op = "greedy_chain";
  check_rank(op, "tokens", tokens, 2, "[B, n]");
  check_dtype(op, "tokens", tokens, {at::kLong});
  check_contiguous(op, "tokens", tokens);
  const int64_t B = tokens.size(0), n = tokens.size(1);
  TORCH_CHECK(B > 0 && n > 0, op, ": tokens must hold at least one row and one column, got ", shape_str(tokens.sizes()));
  TORCH_CHECK(steps >= 1 && steps <= n, op, ": steps must be in [1, n] = [1, ", n, "], got ", steps);
  check_rank(op, "embed", embed, 2, "[V_in, d]");
  check_dtype(op, "embed", embed, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "embed", embed);
  check_same_device(op, "embed", embed, tokens, "tokens");
  const int64_t d = embed.size(1);
  for (const char* name : {"cache_rows", "start"}) {
    const at::Tensor& t = name[0] == 'c' ? cache_rows : start;
    check_rank(op, name, t, 1, "[B]");
    check_size(op, name, t, 0, B, "B (tokens dimension 0)");
    check_dtype(op, name, t, {at::kLong});
    check_contiguous(op, name, t);
  }
  check_float_vector(op, "norm_weight", norm_weight, d, embed, "d (embed dimension 1)");
  check_rank(op, "head_weight", head_weight, 2, "[V_out, d]");
  check_size(op, "head_weight", head_weight, 1, d, "d (embed dimension 1)");
  const int64_t V = head_weight.size(0);
  if (head_bias.has_value()) check_float_vector(op, "head_bias", *head_bias, V, embed, "V_out (head_weight dimension 0)");
  TORCH_CHECK(vocab_limit >= 1 && vocab_limit <= V, op, ": vocab_limit must be in [1, V_out] = [1, ", V, "], got ",
              vocab_limit);
  TORCH_CHECK(feed.has_value() == feed_counts.has_value(), op, ": feed and feed_counts come together (got ",
              feed.has_value() ? "feed without feed_counts)" : "feed_counts without feed)");
  int64_t W = 0;
  const int64_t* counts = nullptr;
  if (feed.has_value()) {
    check_rank(op, "feed", *feed, 2, "[B, W]");
    check_size(op, "feed", *feed, 0, B, "B (tokens dimension 0)");
    check_dtype(op, "feed", *feed, {at::kLong});
    check_contiguous(op, "feed", *feed);
    check_same_device(op, "feed", *feed, tokens, "tokens");
    W = feed->size(1);
    TORCH_CHECK(W > 0, op, ": feed must hold at least one column, got ", shape_str(feed->sizes()));
    check_rank(op, "feed_counts", *feed_counts, 1, "[B]");
    check_size(op, "feed_counts", *feed_counts, 0, B, "B (tokens dimension 0)");
    check_dtype(op, "feed_counts", *feed_counts, {at::kLong});
    check_contiguous(op, "feed_counts", *feed_counts);
    check_same_device(op, "feed_counts", *feed_counts, tokens, "tokens");
    counts = feed_counts->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(counts[b] >= 1 && counts[b] <= W, op, ": feed_counts[", b, "] = ", counts[b],
                  " must be in [1, W] = [1, ", W, "]");
    const int64_t* fed = feed->data_ptr<int64_t>();
    for (int64_t m = 0; m < B * W; ++m)
      TORCH_CHECK(fed[m] >= 0 && fed[m] < embed.size(0), op, ": feed[", m / W, ", ", m % W, "] = ", fed[m],
                  " is outside the embedding's [0, ", embed.size(0), ")");
  }
  // Every slot of the chain checked up front: decoder_layers checks each step's, after earlier steps wrote.
  check_rank(op, "k_cache", k_cache, 5, "[L, Bc, Hk, capacity, D]");
  const int64_t capacity = k_cache.size(3);
  const int64_t* first = start.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(first[b] >= 0 && first[b] + W <= capacity, op, ": start[", b, "] = ", first[b],
                " must be in [0, capacity - W] = [0, ", capacity - W, "] (the feed writes its W = ", W,
                " columns from slot start)");
    const int64_t chain_start = first[b] + (counts == nullptr ? 0 : counts[b]);
    TORCH_CHECK(chain_start + steps - 1 <= capacity, op, ": start[", b, "] = ", chain_start,
                counts == nullptr ? "" : " (with its feed_counts)", " must be in [0, capacity - (steps - 1)] = [0, ",
                capacity - steps + 1, "] (the chain feeds ", steps - 1, " tokens from slot start)");
  }
  if (feed.has_value()) return;  // tokens[:, 0] is the feed's argmax
  const int64_t* given = tokens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(given[b * n] >= 0 && given[b * n] < embed.size(0), op, ": tokens[", b, ", 0] = ", given[b * n],
                " is outside the embedding's [0, ", embed.size(0), ")");
}

}  // namespace specdec
