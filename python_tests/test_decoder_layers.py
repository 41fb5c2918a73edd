"""ops.decoder_layers (csrc/cpu/lean_forward.cpp): a whole stack of Llama-family layers in one call.

It must give, bit for bit, what the per-op composition gives (fused_linear, rope_cache_write,
cache_attention: each compared with NumPy in test_lean_forward_ops.py), on every instruction-set path,
for chains and trees, with and without biases, grouped-query heads, and blocks whose tokens go to
other cache rows than their batch row (continuous batching's joining rows); and agree with a float64
NumPy forward within the fp32/bf16 tolerance. Then the argument errors and opcheck.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_ext import ops
from lean_forward_cases import isa, random_trees  # noqa: F401 (isa: a fixture)
from reference_lean_forward import cache_attention as ref_attention, fused_linear as ref_linear
from reference_lean_forward import rope as ref_rope, to_f64

def _stack(rng, *, layers=2, d=40, H=4, Hk=2, D=10, inter=56, dtype=torch.bfloat16, biases=False):
    """An ops.LlamaWeights of random layers (its embedding and head are not read by decoder_layers)."""
    def w(*shape, scale=0.15):
        return torch.tensor(rng.standard_normal(shape) * scale, dtype=torch.float32).to(dtype)

    stack = []
    for _ in range(layers):
        norm_in = torch.tensor(1.0 + 0.1 * rng.standard_normal(d), dtype=torch.float32)
        norm_post = torch.tensor(1.0 + 0.1 * rng.standard_normal(d), dtype=torch.float32)
        projections = [w(H * D, d), w(Hk * D, d), w(Hk * D, d), w(d, H * D), w(inter, d), w(inter, d), w(d, inter)]
        bias = [w(H * D).float(), w(Hk * D).float(), None, w(d).float(), None, w(inter).float(), None]
        q, k, v, o, gate, up, down = (ops.Linear(p, b if biases else None) for p, b in zip(projections, bias))
        stack.append(ops.LlamaLayerWeights(input_norm=norm_in, input_norm_eps=1e-6, q=q, k=k, v=v, o=o,
                                           post_norm=norm_post, post_norm_eps=1e-5, gate=gate, up=up, down=down))
    weights = ops.LlamaWeights(embed=torch.zeros(3, d, dtype=dtype), layers=tuple(stack), norm=torch.ones(d),
                               norm_eps=1e-6, head=ops.Linear(torch.zeros(5, d, dtype=dtype)),
                               inv_freq=1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)),
                               rope_scaling=1.0, heads=H, kv_heads=Hk, head_dim=D)
    return dict(weights=weights, layers=layers, d=d, H=H, Hk=Hk, D=D)


def _inputs(rng, s, *, B, T, Bc, capacity=32, tree=False, dtype=torch.bfloat16, rows=None):
    M, D = B * T, s["D"]
    x = torch.tensor(rng.standard_normal((M, s["d"])), dtype=torch.float32)
    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * s["weights"].inv_freq
    start = torch.tensor(rng.integers(0, capacity - T + 1, B), dtype=torch.int64)
    slots = (start[:, None] + torch.arange(T)).reshape(M)
    visible = None
    positions = slots
    if tree:
        visible, depth = random_trees(rng, B, T)
        positions = (start[:, None] + depth).reshape(M)
    rows = torch.arange(B) if rows is None else torch.tensor(rows)
    shape = (s["layers"], Bc, s["Hk"], capacity, D)
    kc = torch.tensor(rng.standard_normal(shape), dtype=torch.float32).to(dtype)
    vc = torch.tensor(rng.standard_normal(shape), dtype=torch.float32).to(dtype)
    return dict(x=x, cos=freqs.cos().contiguous(), sin=freqs.sin().contiguous(), positions=positions,
                cache_rows=rows.to(torch.int64).repeat_interleave(T), slots=slots, kc=kc, vc=vc, start=start,
                visible=visible, rows=rows, B=B, T=T)


def _by_ops(s, c, bf16):
    """The same stack as per-op calls (the lean runner's forward before decoder_layers)."""
    x, kc, vc = c["x"].clone(), c["kc"].clone(), c["vc"].clone()
    M, H, Hk, D = x.shape[0], s["H"], s["Hk"], s["D"]
    B, T = c["B"], c["T"]
    q, k, v = torch.empty(M, H * D), torch.empty(M, Hk * D), torch.empty(M, Hk * D)
    out = torch.empty(B, T, H, D)
    for l, w in enumerate(s["weights"].layers):
        ops.fused_linear(x, [w.q.weight, w.k.weight, w.v.weight], [q, k, v], biases=[w.q.bias, w.k.bias, w.v.bias],
                         norm_weight=w.input_norm, norm_eps=w.input_norm_eps, bf16_activations=bf16)
        ops.rope_cache_write(q.view(M, H, D), k.view(M, Hk, D), v.view(M, Hk, D), c["cos"], c["sin"], c["positions"],
                             c["cache_rows"], c["slots"], kc[l], vc[l])
        ops.cache_attention(q.view(B, T, H, D), kc[l].index_select(0, c["rows"]), vc[l].index_select(0, c["rows"]),
                            c["start"], D ** -0.5, visible=c["visible"], out=out)
        ops.fused_linear(out.view(M, H * D), [w.o.weight], [x], biases=[w.o.bias], epilogue="add",
                         bf16_activations=bf16)
        act = torch.empty(M, w.gate.weight.shape[0])
        ops.fused_linear(x, [w.gate.weight, w.up.weight], [act], biases=[w.gate.bias, w.up.bias],
                         norm_weight=w.post_norm, norm_eps=w.post_norm_eps, epilogue="swiglu", bf16_activations=bf16)
        ops.fused_linear(act, [w.down.weight], [x], biases=[w.down.bias], epilogue="add", bf16_activations=bf16)
    return x, kc, vc


def _layout(c):
    return [c["positions"], c["cache_rows"], c["slots"], c["start"]]


def _fused(s, c, bf16):
    x, kc, vc = c["x"].clone(), c["kc"].clone(), c["vc"].clone()
    ops.decoder_layers(x, s["weights"], bf16, [c["cos"], c["sin"]], [kc, vc], _layout(c), c["visible"])
    return x, kc, vc


@pytest.mark.parametrize("B,T,tree,rows", [(1, 1, False, None), (2, 9, False, None), (3, 5, True, None),
                                           (2, 4, False, [3, 1]), (1, 6, True, [2])])
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoder_layers_is_the_per_op_composition_bit_for_bit(isa, B, T, tree, rows, biases, dtype):
    rng = np.random.default_rng(B * 10 + T)
    s = _stack(rng, dtype=dtype, biases=biases)
    c = _inputs(rng, s, B=B, T=T, Bc=4, tree=tree, dtype=dtype, rows=rows)
    bf16 = dtype == torch.bfloat16
    for got, expected in zip(_fused(s, c, bf16), _by_ops(s, c, bf16)):
        assert torch.equal(got, expected)


def test_decoder_layers_matches_a_float64_forward():
    rng = np.random.default_rng(7)
    s = _stack(rng, dtype=torch.float32, biases=True, layers=2)
    c = _inputs(rng, s, B=2, T=3, Bc=2, dtype=torch.float32)
    x, kc, vc = _fused(s, c, False)
    # float64 NumPy: the same layers from the reference functions
    ex, ekc, evc = to_f64(c["x"]), to_f64(c["kc"]), to_f64(c["vc"])
    M, H, Hk, D, B, T = ex.shape[0], s["H"], s["Hk"], s["D"], c["B"], c["T"]
    pos, rows, slots = c["positions"].numpy(), c["cache_rows"].numpy(), c["slots"].numpy()
    cos, sin = to_f64(c["cos"]), to_f64(c["sin"])
    f64 = lambda t: None if t is None else to_f64(t)  # noqa: E731
    for l, w in enumerate(s["weights"].layers):
        (q, k, v), _ = ref_linear(ex, [f64(w.q.weight), f64(w.k.weight), f64(w.v.weight)],
                                  [f64(w.q.bias), f64(w.k.bias), f64(w.v.bias)], f64(w.input_norm), w.input_norm_eps,
                                  "store", False, None)
        q, k = ref_rope(q.reshape(M, H, D), cos, sin, pos), ref_rope(k.reshape(M, Hk, D), cos, sin, pos)
        ekc[l][rows, :, slots] = k
        evc[l][rows, :, slots] = v.reshape(M, Hk, D)
        att = ref_attention(q.reshape(B, T, H, D), ekc[l], evc[l], c["start"].numpy(), None, D ** -0.5)
        (ex,), _ = ref_linear(att.reshape(M, H * D), [f64(w.o.weight)], [f64(w.o.bias)], None, 0.0, "add", False, [ex])
        (act,), _ = ref_linear(ex, [f64(w.gate.weight), f64(w.up.weight)], [f64(w.gate.bias), f64(w.up.bias)],
                               f64(w.post_norm), w.post_norm_eps, "swiglu", False, None)
        (ex,), _ = ref_linear(act, [f64(w.down.weight)], [f64(w.down.bias)], None, 0.0, "add", False, [ex])
    np.testing.assert_allclose(to_f64(x), ex, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(to_f64(kc), ekc, rtol=2e-4, atol=2e-4)


def _args(s, c):
    tensors, scalars = s["weights"].flat()
    return [c["x"], list(tensors), list(scalars), True, [c["cos"], c["sin"]], [c["kc"], c["vc"]], _layout(c), None]


def test_decoder_layers_errors():
    rng = np.random.default_rng(3)
    s = _stack(rng)
    c = _inputs(rng, s, B=2, T=3, Bc=2)
    x0, kc0, vc0 = c["x"].clone(), c["kc"].clone(), c["vc"].clone()
    op = torch.ops.specdec_ext.decoder_layers

    def fails(change, match):
        args = _args(s, c)
        change(args)
        with pytest.raises(RuntimeError, match=match):
            op(*args)

    def put(index, value, entry=None):
        def change(args):
            if entry is None:
                args[index] = value
            else:
                args[index][entry] = value
        return change

    fails(lambda a: a[1].pop(), "weights must hold the embedding, 16 entries per layer")
    fails(put(1, None, 17), r"weights\[17\] \(input_norm of layer 1\) must be a tensor, got None")
    fails(lambda a: a[2].pop(), "scalars must hold 2 norm epsilons per layer, then the final norm's epsilon and the "
          "attention scale: 6 for 2 layers, got 5")
    fails(lambda a: a[4].pop(), r"rope must hold \[cos, sin\], got 1")
    fails(lambda a: a[5].pop(), r"cache must hold \[k_cache, v_cache\], got 1")
    fails(lambda a: a[6].pop(), r"layout must hold \[positions, cache_rows, cache_positions, start\], got 3")
    fails(put(5, c["kc"][0], 0), "k_cache must be a 5-D tensor")
    fails(put(5, [c["kc"][:1], c["vc"][:1]]), "k_cache dimension 0 must be the layers in weights")
    fails(put(6, torch.tensor([0, 0, 1, 1, 1, 1]), 1), r"cache_rows\[2\] = 1 differs from its block's first token")
    fails(put(6, torch.tensor([0, 0, 0, 5, 5, 5]), 1), "outside")
    fails(put(6, torch.tensor([0, 0, 0, 0]), 3), "x has 6 rows, not a whole number of blocks for the 4 rows of start")
    fails(put(0, c["x"].double()), "x must have dtype Float")
    fails(put(6, torch.tensor([0, 31]), 3), r"decoder_layers: start\[1\] = 31 must be in \[0, capacity - T\]")
    fails(put(6, torch.tensor([0, 1, 2, 3, 4, 40]), 2), r"decoder_layers: cache_positions\[5\] = 40 is outside")
    # nothing was written by the failed calls
    assert torch.equal(c["x"], x0) and torch.equal(c["kc"], kc0) and torch.equal(c["vc"], vc0)


def test_decoder_layers_opcheck():
    rng = np.random.default_rng(4)
    s = _stack(rng, layers=1, biases=True)
    c = _inputs(rng, s, B=2, T=2, Bc=3, tree=True, rows=[2, 0])
    args = _args(s, c)
    args[-1] = c["visible"]
    torch.library.opcheck(torch.ops.specdec_ext.decoder_layers.default, tuple(args))
