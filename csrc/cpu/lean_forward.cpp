// CPU bodies of the lean-forward ops (contract in ../lean_forward.h): argument checks, the
// instruction-set path, the threads; the arithmetic is in the torch-free kernel headers.
#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "../lean_forward.h"
#include "attention.h"
#include "fused_linear.h"
#include "isa.h"
#include "packed_weights.h"
#include "rope_cache.h"

namespace specdec::cpu {
namespace {

Isa isa_or_throw() {
  try {
    return selected_isa();
  } catch (const std::exception& error) {
    SPECDEC_CHECK(false, error.what());
  }
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return DType::kBF16;
    case at::kHalf:
      return DType::kF16;
    default:
      return DType::kF32;
  }
}

// Runs fn(begin, end) over [0, total) in chunks that the threads take in turn: a core slowed by a
// neighbour (this code shares its machines) then costs its share, not the whole pass.
// A call whose work (the bytes it reads times the rows that use them) is under kParallelMinWork runs
// on the calling thread: waking the others costs more than they would save (a draft model's
// one-token projections and attention at a few hundred positions).
constexpr int64_t kParallelMinWork = 256 << 10;

template <typename Fn>
void parallel_chunks(int64_t total, int64_t chunk, int64_t work, const Fn& fn) {
  if (total <= 0) return;
  const int64_t chunks = (total + chunk - 1) / chunk;
  const int64_t threads = work < kParallelMinWork ? 1 : std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1) return fn(0, total);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      fn(c * chunk, std::min(total, (c + 1) * chunk));
  });
}

// The ops' bodies take the instruction-set path from their caller: an op reads SPECDEC_CPU_ISA once
// per call (getenv at every kernel of decoder_layers cost more than a small kernel).
// weights_cached: see gemm_tiles (small_gemm.h).
void linear_on(Isa isa, const at::Tensor& x, const c10::optional<at::Tensor>& norm_weight, double norm_eps,
               at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases, const std::string& epilogue,
               bool bf16_activations, at::TensorList outs, bool weights_cached = false) {
  check_fused_linear(x, norm_weight, weights, biases, epilogue, bf16_activations, outs);
  SPECDEC_CHECK(!norm_weight.has_value() || (std::isfinite(norm_eps) && norm_eps >= 0.0),
                "fused_linear: norm_eps must be finite and >= 0, got ", norm_eps);
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return;
  const int count = static_cast<int>(weights.size());
  const LinearEpilogue mode = epilogue == "swiglu" ? LinearEpilogue::kSwiGLU
                              : epilogue == "add"  ? LinearEpilogue::kAdd
                                                   : LinearEpilogue::kStore;
  // The activations, prepared once on this thread (rows are independent, so M does not matter).
  thread_local ActivationBuffers buffers;
  const at::Tensor norm32 = norm_weight ? norm_weight->to(at::kFloat).contiguous() : at::Tensor();
  const GemmActivations a =
      prepare_gemm_activations(isa, x.data_ptr<float>(), M, K, norm_weight ? norm32.data_ptr<float>() : nullptr,
                               static_cast<float>(norm_eps), bf16_activations, weights_cached, buffers);

  GemmWeight w[kMaxGemmWeights + 1];
  LinearOutput o[kMaxGemmWeights + 1];
  const bool many = count > kMaxGemmWeights + 1;  // (heap vectors only then: they cost at small shapes)
  std::vector<GemmWeight> many_w(many ? count : 0);
  std::vector<LinearOutput> many_o(many ? count : 0);
  std::vector<at::Tensor> bias32(biases.size() > 0 ? count : 0);  // biases in fp32, converted once per call
  c10::SmallVector<at::Tensor, 2 * (kMaxGemmWeights + 1)> packed(2 * count);  // (held for the call)
  GemmWeight* ws = many ? many_w.data() : w;
  LinearOutput* os = many ? many_o.data() : o;
  const TilePath path = tile_path(isa);
  for (int i = 0; i < count; ++i) {
    const at::Tensor& wi = weights[i];
    ws[i] = {wi.data_ptr(), dtype_of(wi), wi.size(0), wi.size(1), wi.stride(0)};
    bool amx_whole = false;  // the AMX tiles cover every feature: no panels needed
    if (a.vnni != nullptr && amx::takes_route(a, ws[i]) && amx::full_groups(ws[i]) > 0) {
      packed[2 * i] = amx_packed_weight(wi);
      ws[i].amx_packed = static_cast<const uint16_t*>(packed[2 * i].data_ptr());
      amx_whole = ws[i].rows % amx::kGroup == 0;
    }
    if (!amx_whole) {
      packed[2 * i + 1] = panel_packed_weight(wi, path.layout(ws[i].type, a.bf16 != nullptr));
      ws[i].panels = packed[2 * i + 1].data_ptr();
    }
    const at::Tensor& out = outs[mode == LinearEpilogue::kSwiGLU ? 0 : i];
    const bool has_bias = biases.size() > 0 && biases.get(i).has_value();
    if (has_bias) bias32[i] = biases.get(i)->to(at::kFloat).contiguous();
    os[i] = {out.data_ptr<float>(), out.size(1), has_bias ? bias32[i].data_ptr<float>() : nullptr};
  }
  const int64_t total = fused_linear_num_tiles(mode, ws, count);
  // A group of panels per chunk (64 features): the kernels compute whole groups, so a chunk that cut one
  // would compute it twice.
  int64_t bytes = 0;
  for (int i = 0; i < count; ++i) bytes += ws[i].rows * ws[i].cols * (ws[i].type == DType::kF32 ? 4 : 2);
  parallel_chunks(total, kMaxGroupFeatures / kTileN, bytes * M, [&](int64_t begin, int64_t end) {
    fused_linear_range(isa, a, M, mode, ws, os, count, begin, end, weights_cached);
  });
}

void fused_linear(const at::Tensor& x, const c10::optional<at::Tensor>& norm_weight, double norm_eps,
                  at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
                  const std::string& epilogue, bool bf16_activations, at::TensorList outs) {
  linear_on(isa_or_throw(), x, norm_weight, norm_eps, weights, biases, epilogue, bf16_activations, outs);
}

void check_index_range(const char* name, const at::Tensor& t, int64_t limit, const char* what,
                       const char* op = "rope_cache_write") {
  const int64_t* values = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    SPECDEC_CHECK(values[i] >= 0 && values[i] < limit, op, ": ", name, "[", i, "] = ", values[i],
                  " is outside [0, ", limit, ") (", what, ")");
}

void rope_cache_write(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& cache_rows,
                      const at::Tensor& cache_positions, at::Tensor& k_cache, at::Tensor& v_cache) {
  check_rope_cache_write(q, k, v, cos, sin, positions, cache_rows, cache_positions, k_cache, v_cache);
  check_index_range("positions", positions, cos.size(0), "the rows of cos");
  check_index_range("cache_rows", cache_rows, k_cache.size(0), "k_cache dimension 0");
  check_index_range("cache_positions", cache_positions, k_cache.size(2), "k_cache dimension 2");
  const int64_t M = q.size(0);
  if (M == 0) return;
  const RopeCacheProblem p{q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0),
                           v.data_ptr<float>(), v.stride(0), q.size(1), k_cache.size(1), k_cache.size(3),
                           cos.data_ptr<float>(), sin.data_ptr<float>(), positions.data_ptr<int64_t>(),
                           cache_rows.data_ptr<int64_t>(), cache_positions.data_ptr<int64_t>(),
                           k_cache.data_ptr(), v_cache.data_ptr(), dtype_of(k_cache), k_cache.size(2)};
  // A few rows of a decode pass are not worth waking a thread for; a prefill's hundreds are.
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) { rope_cache_rows(p, begin, end); });
}

// cache_attention's body; rows: the cache row of each batch row, or null (row b).
void attend(Isa isa, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& start, const c10::optional<at::Tensor>& visible, double scale, at::Tensor& out,
            const int64_t* rows) {
  check_cache_attention(q, k_cache, v_cache, start, visible, out);
  SPECDEC_CHECK(std::isfinite(scale) && scale > 0.0, "cache_attention: scale must be finite and > 0 (head_dim ** -0.5 "
                "for a Llama), got ", scale);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  const int64_t capacity = k_cache.size(2);
  const int64_t* starts = start.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    SPECDEC_CHECK(starts[b] >= 0 && starts[b] <= capacity - T, "cache_attention: start[", b, "] = ", starts[b],
                  " must be in [0, capacity - T] = [0, ", capacity - T, "] (the block's T = ", T,
                  " tokens sit at slots start .. start + T - 1)");
    SPECDEC_CHECK(rows == nullptr || (rows[b] >= 0 && rows[b] < k_cache.size(0)), "cache_attention: the cache row of "
                  "batch row ", b, " is ", rows == nullptr ? b : rows[b], ", outside [0, ", k_cache.size(0), ")");
    longest = std::max(longest, starts[b]);
  }
  if (q.numel() == 0) return;
  const AttentionProblem p{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), dtype_of(k_cache),
                           starts, visible ? reinterpret_cast<const uint8_t*>(visible->data_ptr<bool>()) : nullptr,
                           B, T, H, k_cache.size(1), q.size(3), capacity, static_cast<float>(scale),
                           out.data_ptr<float>(), rows};
  const int64_t cache_bytes = 2 * B * k_cache.size(1) * (longest + T) * q.size(3) * k_cache.element_size();
  parallel_chunks(attention_num_tasks(p), 1, cache_bytes * T, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    thread_local std::vector<int64_t> keys;
    scratch.resize(attention_scratch_floats(longest, T));
    keys.resize(attention_scratch_keys(T));
    cache_attention_range(isa, p, begin, end, scratch.data(), keys.data());
  });
}

void cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& start, const c10::optional<at::Tensor>& visible, double scale,
                     at::Tensor& out) {
  attend(isa_or_throw(), q, k_cache, v_cache, start, visible, scale, out, nullptr);
}

// The biases of the projections a fused_linear call reads (an empty list when none has one).
OptionalTensors biases_of(std::initializer_list<const Projection*> projections) {
  OptionalTensors out;
  bool any = false;
  for (const Projection* p : projections) any = any || p->bias.has_value();
  if (!any) return out;
  for (const Projection* p : projections) out.push_back(p->bias);
  return out;
}

// The activations of one layer pass over B blocks of T tokens (M = B * T), allocated once per call.
struct LayerScratch {
  at::Tensor q, k, v, attended, act;         // [M, H*D], [M, Hk*D] x 2, [M, H*D], [M, I] fp32
  at::Tensor q_heads, k_heads, v_heads;      // [M, H, D], [M, Hk, D] x 2 (views)
  at::Tensor q_blocks, attended_blocks;      // [B, T, H, D] (views)

  LayerScratch(int64_t B, int64_t T, int64_t H, int64_t Hk, int64_t D, int64_t I, const at::TensorOptions& f32)
      : q(at::empty({B * T, H * D}, f32)), k(at::empty({B * T, Hk * D}, f32)), v(at::empty({B * T, Hk * D}, f32)),
        attended(at::empty({B * T, H * D}, f32)), act(at::empty({B * T, I}, f32)),
        q_heads(q.view({B * T, H, D})), k_heads(k.view({B * T, Hk, D})), v_heads(v.view({B * T, Hk, D})),
        q_blocks(q.view({B, T, H, D})), attended_blocks(attended.view({B, T, H, D})) {}
};

// One decoder layer over the residual stream x [M, d]: q, k, v of qkv_input (RMSNorm'd by qkv_norm when
// given), rotary + cache write, attention, x += o(.), x += down(SwiGLU(gate, up of RMSNorm(x))). A Llama
// layer reads x itself (qkv_input = x, qkv_norm = input_norm); EAGLE-3's reads the token's embedding beside
// the features (eagle_chain). rows: each block's cache row.
void layer_pass(Isa isa, const at::Tensor& qkv_input, const c10::optional<at::Tensor>& qkv_norm, double qkv_norm_eps,
                at::Tensor& x, const LlamaLayerView& w, double scale, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor& k_layer, at::Tensor& v_layer, const PassLayout& pass, const int64_t* rows,
                LayerScratch& s, bool bf16_activations, bool weights_cached) {
  static const std::string store = "store", add = "add", swiglu = "swiglu";
  linear_on(isa, qkv_input, qkv_norm, qkv_norm_eps, {w.q.weight, w.k.weight, w.v.weight},
            biases_of({&w.q, &w.k, &w.v}), store, bf16_activations, {s.q, s.k, s.v}, weights_cached);
  rope_cache_write(s.q_heads, s.k_heads, s.v_heads, cos, sin, pass.positions, pass.cache_rows, pass.cache_positions,
                   k_layer, v_layer);
  attend(isa, s.q_blocks, k_layer, v_layer, pass.start, pass.visible, scale, s.attended_blocks, rows);
  linear_on(isa, s.attended, c10::nullopt, 0.0, {w.o.weight}, biases_of({&w.o}), add, bf16_activations, {x},
            weights_cached);
  linear_on(isa, x, w.post_norm, w.post_norm_eps, {w.gate.weight, w.up.weight}, biases_of({&w.gate, &w.up}), swiglu,
            bf16_activations, {s.act}, weights_cached);
  linear_on(isa, s.act, c10::nullopt, 0.0, {w.down.weight}, biases_of({&w.down}), add, bf16_activations, {x},
            weights_cached);
}

// One call for the whole stack: the per-op Python dispatch (some 5 us a call, 37 calls a pass for a
// 6-layer model) cost more than a draft model's kernels. weights_cached: see gemm_tiles.
void decoder_layers_on(at::Tensor& x, const LlamaModelView& model, bool bf16_activations, const RopeCache& state,
                       const PassLayout& pass, bool weights_cached) {
  const DecoderLayersShape s = check_decoder_layers(x, model, state, pass);
  const int64_t M = x.size(0);
  LayerScratch scratch(s.batch, s.tokens, s.heads, s.kv_heads, s.head_dim, s.intermediate, x.options());
  // Every index checked before the first layer writes anything (the per-op checks repeat them per layer).
  constexpr const char* op = "decoder_layers";
  const at::Tensor& k_cache = state.k_cache;
  check_index_vector(op, "positions", pass.positions, M, x);
  check_index_vector(op, "cache_positions", pass.cache_positions, M, x);
  check_index_range("positions", pass.positions, state.cos.size(0), "the rows of cos", op);
  check_index_range("cache_rows", pass.cache_rows, k_cache.size(1), "k_cache dimension 1", op);
  check_index_range("cache_positions", pass.cache_positions, k_cache.size(3), "k_cache dimension 3", op);
  const int64_t* starts = pass.start.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b)
    SPECDEC_CHECK(starts[b] >= 0 && starts[b] <= k_cache.size(3) - s.tokens, op, ": start[", b, "] = ", starts[b],
                  " must be in [0, capacity - T] = [0, ", k_cache.size(3) - s.tokens, "]");
  std::vector<int64_t> rows(s.batch);
  for (int64_t b = 0; b < s.batch; ++b) rows[b] = pass.cache_rows.data_ptr<int64_t>()[b * s.tokens];
  const Isa isa = isa_or_throw();
  for (int64_t l = 0; l < s.layers; ++l) {
    const LlamaLayerView& w = model.layers[l];
    at::Tensor k_layer = k_cache.select(0, l), v_layer = state.v_cache.select(0, l);
    layer_pass(isa, x, w.input_norm, w.input_norm_eps, x, w, model.scale, state.cos, state.sin, k_layer, v_layer,
               pass, rows.data(), scratch, bf16_activations, weights_cached);
  }
}

// Weights that fit in this many bytes (a small draft model's) stay in cache from one pass to the next
// (a quarter of a 32-MB L3, which the target's stream shares), so their passes read them as cached.
constexpr int64_t kCachedModelBytes = 8 << 20;

// The bytes a pass over the layers streams: the norms and the projections' weights.
int64_t layer_bytes(const LlamaModelView& model) {
  int64_t total = 0;
  for (const LlamaLayerView& w : model.layers)
    for (const at::Tensor* t : {&w.input_norm, &w.q.weight, &w.k.weight, &w.v.weight, &w.o.weight, &w.post_norm,
                                &w.gate.weight, &w.up.weight, &w.down.weight})
      total += static_cast<int64_t>(t->nbytes());
  return total;
}

void decoder_layers(at::Tensor& x, const OptionalTensors& weights, at::ArrayRef<double> scalars, bool bf16_activations,
                    at::TensorList rope, at::TensorList cache, at::TensorList layout,
                    const c10::optional<at::Tensor>& visible) {
  const LlamaModelView model = llama_model_view("decoder_layers", weights, scalars);
  decoder_layers_on(x, model, bf16_activations, rope_cache("decoder_layers", rope, cache), pass_layout(layout, visible),
                    layer_bytes(model) <= kCachedModelBytes);
}

// The lowest index of the row's largest value, a NaN before anything (torch.argmax's answers).
int64_t argmax_row(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

// What chain_verify accepts of a greedy row's logits: no NaN, no +inf, not every one -inf.
bool logits_valid(const float* row, int64_t n) {
  bool finite_seen = false;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i]) || row[i] == INFINITY) return false;
    finite_seen = finite_seen || row[i] != -INFINITY;
  }
  return finite_seen;
}

// The embedding rows of tokens[0 .. count) into x [count, d] fp32.
void embed_rows(const at::Tensor& embed, const int64_t* tokens, int64_t count, float* x) {
  const DType type = dtype_of(embed);
  const int64_t d = embed.size(1);
  for (int64_t m = 0; m < count; ++m)
    for (int64_t k = 0; k < d; ++k) x[m * d + k] = load_as_float(type, embed.data_ptr(), tokens[m] * d + k);
}

// The argmax of each of the B logits rows [:vocab_limit] into token[b * n + column].
void argmax_rows(const at::Tensor& logits, int64_t vocab_limit, bool check_logits, int64_t step, int64_t* token,
                 int64_t n, int64_t column) {
  const int64_t B = logits.size(0), V = logits.size(1);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = logits.data_ptr<float>() + b * V;
    SPECDEC_CHECK_VALUE(!check_logits || logits_valid(row, vocab_limit), "greedy_chain: target_logits: row ", b,
                        " has a NaN or +inf logit (or every logit is -inf) at chain step ", step);
    token[b * n + column] = argmax_row(row, vocab_limit);
  }
}

// The final norm and head of the rows x [B, d] into logits [B, V], and each row's argmax into column
// `column` of tokens [B, n] (step: the chain step, for check_logits' message).
struct ChainHead {
  Isa isa;
  const LlamaModelView& model;
  OptionalTensors biases;
  bool bf16_activations, cached, check_logits;
  int64_t vocab_limit;
  at::Tensor logits;  // [B, V] fp32

  void argmax(const at::Tensor& x, int64_t step, int64_t* token, int64_t n, int64_t column) {
    linear_on(isa, x, model.norm, model.norm_eps, {model.head.weight}, biases, "store", bf16_activations, {logits},
              cached);
    argmax_rows(logits, vocab_limit, check_logits, step, token, n, column);
  }
};

// The feed's pass: feed [B, W] at slots start[b] .. start[b] + W - 1 (a row's padding columns, past
// its count, are written beyond its tokens, where the chain overwrites them); x [B, d] gets each row's
// last real column and chain_start[b] moves past its count.
void feed_pass(const ChainRows& rows, bool bf16_activations, const RopeCache& state, ChainHead& head, at::Tensor& x,
               std::vector<int64_t>& chain_start) {
  const LlamaModelView& model = head.model;
  const int64_t B = x.size(0), d = x.size(1), W = rows.feed->size(1);
  const int64_t* counts = rows.feed_counts->data_ptr<int64_t>();
  at::Tensor block = at::empty({B * W, d}, x.options());
  at::Tensor block_slots = at::empty({B * W}, rows.start.options());
  at::Tensor block_rows = at::empty({B * W}, rows.start.options());
  for (int64_t m = 0; m < B * W; ++m) {
    block_slots.data_ptr<int64_t>()[m] = chain_start[m / W] + m % W;
    block_rows.data_ptr<int64_t>()[m] = rows.cache_rows.data_ptr<int64_t>()[m / W];
  }
  embed_rows(model.embed, rows.feed->data_ptr<int64_t>(), B * W, block.data_ptr<float>());
  decoder_layers_on(block, model, bf16_activations, state,
                    {block_slots, block_rows, block_slots, rows.start, c10::nullopt}, head.cached);
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(block.data_ptr<float>() + (b * W + counts[b] - 1) * d, d, x.data_ptr<float>() + b * d);
    chain_start[b] += counts[b];
  }
}

// A greedy draft in one call: the Python of a draft step (forward, argmax, commit: some 20 torch calls)
// cost more than the draft model's kernels, which this runs back to back, the same calls as the steps.
// With feed, the pass over the committed tokens the draft has not seen is the chain's first (a separate
// forward cost a draft step about as much again as the chain's passes).
void greedy_chain(at::Tensor& tokens, int64_t steps, const OptionalTensors& weights, at::ArrayRef<double> scalars,
                  bool bf16_activations, at::TensorList rope, at::TensorList cache, at::TensorList rows,
                  int64_t vocab_limit, bool check_logits) {
  constexpr const char* op = "greedy_chain";
  const LlamaModelView model = llama_model_view(op, weights, scalars);
  const RopeCache state = rope_cache(op, rope, cache);
  const ChainRows chain = chain_rows(rows);
  check_greedy_chain(tokens, steps, model, state.k_cache, chain, vocab_limit);
  const int64_t B = tokens.size(0), n = tokens.size(1), d = model.embed.size(1), V = model.head.weight.size(0);
  const auto f32 = model.embed.options().dtype(at::kFloat);
  at::Tensor x = at::empty({B, d}, f32);
  at::Tensor slots = at::empty({B}, chain.start.options());
  int64_t* token = tokens.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t head_bytes = static_cast<int64_t>(model.head.weight.nbytes());
  ChainHead head{isa_or_throw(), model, biases_of({&model.head}), bf16_activations,
                 layer_bytes(model) + head_bytes <= kCachedModelBytes, check_logits, vocab_limit,
                 at::empty({B, V}, f32)};
  std::vector<int64_t> chain_start(chain.start.data_ptr<int64_t>(), chain.start.data_ptr<int64_t>() + B);
  if (chain.feed.has_value()) {
    feed_pass(chain, bf16_activations, state, head, x, chain_start);
    head.argmax(x, 0, token, n, 0);
  }
  for (int64_t i = 1; i < steps; ++i) {
    for (int64_t b = 0; b < B; ++b) {
      embed_rows(model.embed, token + b * n + i - 1, 1, x.data_ptr<float>() + b * d);
      slot[b] = chain_start[b] + i - 1;
    }
    // A chain token sits at its slot's rotary position; decoder_layers checks the slots and rows.
    decoder_layers_on(x, model, bf16_activations, state, {slots, chain.cache_rows, slots, slots, c10::nullopt},
                      head.cached);
    head.argmax(x, i, token, n, i);
  }
}

// rows x [M, d] -> out (row stride out_stride): x * rsqrt(mean(x^2) + eps) * weight, in fp32.
void rms_rows(const float* x, int64_t M, int64_t d, const at::Tensor& weight, double eps, float* out,
              int64_t out_stride) {
  const at::Tensor w32 = weight.to(at::kFloat).contiguous();
  const float* w = w32.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * d;
    float squares = 0.0f;
    for (int64_t k = 0; k < d; ++k) squares += row[k] * row[k];
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t k = 0; k < d; ++k) out[m * out_stride + k] = row[k] * scale * w[k];
  }
}

// The EAGLE-3 layer's q, k, v input [M, 2d] = [input_norm(embed(tokens)); hidden_norm(g)] and its residual
// stream [M, d] (hidden_norm(g) with norm_before_residual, else g), for M rows of features g [M, d].
struct EagleInputs {
  const LlamaModelView& model;
  const at::Tensor& hidden_norm;
  double hidden_norm_eps;
  bool norm_before_residual;

  void build(const int64_t* tokens, const float* g, int64_t M, at::Tensor& features, at::Tensor& residual,
             at::Tensor& embedded) const {
    const LlamaLayerView& w = model.layers[0];
    const int64_t d = residual.size(1);
    float* x = features.data_ptr<float>();
    embed_rows(model.embed, tokens, M, embedded.data_ptr<float>());
    rms_rows(embedded.data_ptr<float>(), M, d, w.input_norm, w.input_norm_eps, x, 2 * d);
    rms_rows(g, M, d, hidden_norm, hidden_norm_eps, x + d, 2 * d);
    if (norm_before_residual)
      residual.copy_(features.narrow(1, d, d));
    else if (residual.data_ptr<float>() != g)
      std::copy_n(g, M * d, residual.data_ptr<float>());
  }
};

// EAGLE-3's greedy chain in one call (specdec_ext/eagle/kernels.py): the Python of a chain step (some 25
// torch calls around the head's matrices) cost as much as the matrices. With a feed, first the layer pass
// over each row's block of committed tokens and their features (feed = [tokens [B, W], features [B, W, d],
// counts [B]] at slots start[b] .. start[b] + W - 1; a row's columns past its count are padding, written
// past its tokens), last[b] := the output at its column counts[b] - 1 (rows with a count of 0 keep theirs),
// and the chain starts at start[b] + counts[b]. Step i: the head (final norm, lm_head) of the layer output
// gives draft id argmax, tokens[:, i] = target_ids[it]; then, before the next step, the layer pass of that
// token at its slot: q, k, v of [input_norm(embed(token)); hidden_norm(out)], the residual stream
// hidden_norm(out) or out (norm_before_residual), the rest a Llama layer's. The fed tokens' keys and
// values are in the cache afterwards.
void eagle_chain(at::Tensor& tokens, int64_t steps, at::Tensor& last, const OptionalTensors& weights,
                 at::ArrayRef<double> scalars, at::TensorList eagle, at::ArrayRef<double> eagle_scalars,
                 at::TensorList rope, at::TensorList cache, const at::Tensor& start, at::TensorList feed) {
  constexpr const char* op = "eagle_chain";
  const LlamaModelView model = llama_model_view(op, weights, scalars);
  const RopeCache state = rope_cache(op, rope, cache);
  check_eagle_chain(tokens, steps, last, model, eagle, eagle_scalars, state, start, feed);
  const LlamaLayerView& w = model.layers[0];
  const EagleInputs inputs{model, eagle[0], eagle_scalars[0], eagle_scalars[1] != 0.0};
  const int64_t* target_ids = eagle[1].data_ptr<int64_t>();
  const int64_t B = tokens.size(0), n = tokens.size(1), d = last.size(1), Vd = model.head.weight.size(0);
  const int64_t Hk = state.k_cache.size(2), D = state.k_cache.size(4), H = w.q.weight.size(0) / D;
  const int64_t I = w.gate.weight.size(0);
  const auto f32 = last.options();
  at::Tensor k_layer = state.k_cache.select(0, 0), v_layer = state.v_cache.select(0, 0);
  int64_t bytes = static_cast<int64_t>(model.head.weight.nbytes());
  for (const at::Tensor* t : {&w.q.weight, &w.k.weight, &w.v.weight, &w.o.weight, &w.gate.weight, &w.up.weight,
                              &w.down.weight})
    bytes += static_cast<int64_t>(t->nbytes());
  const bool cached = bytes <= kCachedModelBytes;
  const Isa isa = isa_or_throw();
  at::Tensor cache_rows = at::arange(B, start.options());
  std::vector<int64_t> chain_start(start.data_ptr<int64_t>(), start.data_ptr<int64_t>() + B);
  if (!feed.empty()) {
    const int64_t W = feed[0].size(1), M = B * W;
    const int64_t* counts = feed[2].data_ptr<int64_t>();
    at::Tensor features = at::empty({M, 2 * d}, f32), residual = at::empty({M, d}, f32);
    at::Tensor embedded = at::empty({M, d}, f32);
    inputs.build(feed[0].data_ptr<int64_t>(), feed[1].data_ptr<float>(), M, features, residual, embedded);
    at::Tensor slots = at::empty({M}, start.options()), rows = at::empty({M}, start.options());
    for (int64_t m = 0; m < M; ++m) {
      slots.data_ptr<int64_t>()[m] = chain_start[m / W] + m % W;
      rows.data_ptr<int64_t>()[m] = m / W;
    }
    LayerScratch scratch(B, W, H, Hk, D, I, f32);
    layer_pass(isa, features, c10::nullopt, 0.0, residual, w, model.scale, state.cos, state.sin, k_layer, v_layer,
               {slots, rows, slots, start, c10::nullopt}, cache_rows.data_ptr<int64_t>(), scratch, false, cached);
    for (int64_t b = 0; b < B; ++b) {
      if (counts[b] == 0) continue;
      std::copy_n(residual.data_ptr<float>() + (b * W + counts[b] - 1) * d, d, last.data_ptr<float>() + b * d);
      chain_start[b] += counts[b];
    }
  }
  at::Tensor out = last.clone();                     // [B, d] the layer's output, then its residual stream
  at::Tensor features = at::empty({B, 2 * d}, f32);  // [B, 2d] the layer's q, k, v input
  at::Tensor embedded = at::empty({B, d}, f32);
  at::Tensor logits = at::empty({B, Vd}, f32);
  at::Tensor slots = at::empty({B}, start.options());
  LayerScratch scratch(B, 1, H, Hk, D, I, f32);
  const OptionalTensors head_bias = biases_of({&model.head});
  int64_t* token = tokens.data_ptr<int64_t>();
  std::vector<int64_t> drafted(B);  // this step's tokens, fed to the next step's layer pass
  for (int64_t i = 0; i < steps; ++i) {
    linear_on(isa, out, model.norm, model.norm_eps, {model.head.weight}, head_bias, "store", false, {logits}, cached);
    for (int64_t b = 0; b < B; ++b) {
      token[b * n + i] = target_ids[argmax_row(logits.data_ptr<float>() + b * Vd, Vd)];
      drafted[b] = token[b * n + i];
      slots.data_ptr<int64_t>()[b] = chain_start[b] + i;
    }
    if (i + 1 == steps) break;
    inputs.build(drafted.data(), out.data_ptr<float>(), B, features, out, embedded);
    layer_pass(isa, features, c10::nullopt, 0.0, out, w, model.scale, state.cos, state.sin, k_layer, v_layer,
               {slots, cache_rows, slots, slots, c10::nullopt}, cache_rows.data_ptr<int64_t>(), scratch, false, cached);
  }
}

std::string cpu_isa() { return isa_name(isa_or_throw()); }

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) {
  m.impl("fused_linear", &fused_linear);
  m.impl("rope_cache_write", &rope_cache_write);
  m.impl("cache_attention", &cache_attention);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("greedy_chain", &greedy_chain);
  m.impl("eagle_chain", &eagle_chain);
}

TORCH_LIBRARY_IMPL(specdec_ext, CompositeExplicitAutograd, m) { m.impl("cpu_isa", &cpu_isa); }

}  // namespace specdec::cpu
