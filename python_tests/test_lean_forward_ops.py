"""The lean-forward ops (fused_linear, rope_cache_write, cache_attention) against float64 NumPy
references and against torch, on every instruction-set path this CPU runs (forced by
SPECDEC_CPU_ISA), with odd shapes (hidden sizes not a multiple of 16, 1 and 16 rows), fp32/bf16/fp16
weights and caches; batch invariance bit for bit; opcheck; argument errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specdec_ext import ops
from lean_forward_cases import ISAS, isa, random_trees  # noqa: F401 (isa: a fixture)
from reference_lean_forward import FP32_EPS, cache_attention as ref_attention, fused_linear as ref_linear
from reference_lean_forward import rope as ref_rope, round_bf16, to_f64

WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weights(rng, shapes, dtype):
    return [torch.tensor(rng.standard_normal(s) * 0.1, dtype=torch.float32).to(dtype) for s in shapes]


def _check(outs, expected, bounds):
    for out, exp, bound in zip(outs, expected, bounds):
        err = np.abs(to_f64(out) - exp)
        assert np.all(err <= bound), f"max error {err.max():.3g}, worst error/bound {(err / bound).max():.3g}"


# --------------------------------------------------------------------------------------------- fused_linear
SHAPES = [(1, 16, 4), (1, 77, 33), (16, 77, 33), (5, 512, 130), (3, 1280, 17), (16, 31, 5), (9, 64, 64)]


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("norm", [False, True])
def test_fused_linear_store_matches_numpy(isa, M, K, N, dtype, norm):
    rng = np.random.default_rng(M * 1000 + K + N)
    x = torch.tensor(rng.standard_normal((M, K)) * 3, dtype=torch.float32)
    (w,) = _weights(rng, [(N, K)], dtype)
    bias = torch.tensor(rng.standard_normal(N), dtype=torch.float32).to(dtype)
    g = torch.tensor(1 + 0.2 * rng.standard_normal(K), dtype=torch.float32).to(dtype) if norm else None
    for bf16 in ([False, True] if dtype == torch.bfloat16 else [False]):
        out = torch.full((M, N), float("nan"))
        ops.fused_linear(x, [w], [out], biases=[bias], norm_weight=g, norm_eps=1e-5, bf16_activations=bf16)
        exp, bounds = ref_linear(to_f64(x), [to_f64(w)], [to_f64(bias)], None if g is None else to_f64(g), 1e-5,
                                 "store", bf16, None)
        if bf16 and norm:  # a 1-ulp fp32 difference in the norm may round one activation the other way
            bounds = [bounds[0] + 2.0 ** -8 * np.abs(to_f64(x)).max() * 2 * np.abs(to_f64(w)).max()]
        _check([out], exp, bounds)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_fused_linear_several_weights_add_and_swiglu(isa, dtype):
    rng = np.random.default_rng(7)
    M, K = 6, 45
    x = torch.tensor(rng.standard_normal((M, K)), dtype=torch.float32)
    wq, wk, wv = _weights(rng, [(40, K), (12, K), (13, K)], dtype)
    bk = torch.tensor(rng.standard_normal(12), dtype=torch.float32)
    outs = [torch.empty(M, n) for n in (40, 12, 13)]
    ops.fused_linear(x, [wq, wk, wv], outs, biases=[None, bk, None])
    exp, bounds = ref_linear(to_f64(x), [to_f64(w) for w in (wq, wk, wv)], [None, to_f64(bk), None], None, 0.0,
                             "store", False, None)
    _check(outs, exp, bounds)
    # add: the residual stream
    residual = torch.tensor(rng.standard_normal((M, 40)), dtype=torch.float32)
    before = to_f64(residual)
    ops.fused_linear(x, [wq], [residual], epilogue="add")
    exp, bounds = ref_linear(to_f64(x), [to_f64(wq)], [None], None, 0.0, "add", False, [before])
    _check([residual], exp, bounds)
    # swiglu: gate and up side by side, with biases
    wg, wu = _weights(rng, [(23, K), (23, K)], dtype)
    bg, bu = (torch.tensor(rng.standard_normal(23), dtype=torch.float32) for _ in range(2))
    act = torch.empty(M, 23)
    ops.fused_linear(x, [wg, wu], [act], biases=[bg, bu], epilogue="swiglu")
    exp, bounds = ref_linear(to_f64(x), [to_f64(wg), to_f64(wu)], [to_f64(bg), to_f64(bu)], None, 0.0, "swiglu",
                             False, None)
    _check([act], exp, bounds)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_fused_linear_matches_torch(isa, dtype):
    """Against torch's own RMSNorm, linear and SiLU in fp32 over the same (widened) weights."""
    rng = np.random.default_rng(11)
    M, K, N = 7, 96, 50
    x = torch.tensor(rng.standard_normal((M, K)), dtype=torch.float32)
    g = torch.tensor(1 + 0.1 * rng.standard_normal(K), dtype=torch.float32)
    wg, wu = _weights(rng, [(N, K), (N, K)], dtype)
    act = torch.empty(M, N)
    ops.fused_linear(x, [wg, wu], [act], norm_weight=g, norm_eps=1e-6, epilogue="swiglu")
    h = F.rms_norm(x, (K,), g, 1e-6)
    expected = F.silu(F.linear(h, wg.float())) * F.linear(h, wu.float())
    torch.testing.assert_close(act, expected, rtol=1e-4, atol=1e-5)
    if dtype == torch.bfloat16:  # a bf16 model's linear: bf16 inputs, fp32 sums
        out = torch.empty(M, N)
        ops.fused_linear(x, [wg], [out], bf16_activations=True)
        torch.testing.assert_close(out, F.linear(x.bfloat16().float(), wg.float()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_fused_linear_rows_are_batch_invariant(isa, dtype):
    """A row's outputs do not depend on the other rows of the call, bit for bit (1 to 16 rows)."""
    rng = np.random.default_rng(5)
    K, N = 83, 37
    x = torch.tensor(rng.standard_normal((16, K)), dtype=torch.float32)
    g = torch.tensor(1 + 0.1 * rng.standard_normal(K), dtype=torch.float32)
    (w,) = _weights(rng, [(N, K)], dtype)
    bf16 = dtype == torch.bfloat16
    alone = []
    for m in range(16):
        out = torch.empty(1, N)
        ops.fused_linear(x[m:m + 1].clone(), [w], [out], norm_weight=g, bf16_activations=bf16)
        alone.append(out)
    alone = torch.cat(alone)
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16):  # every block split of the paths (6, 4 + 3, 5 + 4 + 4, ...)
        out = torch.empty(M, N)
        ops.fused_linear(x[:M].clone(), [w], [out], norm_weight=g, bf16_activations=bf16)
        assert torch.equal(out, alone[:M]), M


def test_fused_linear_follows_its_weights_changes_views_and_reuse(isa):
    # (every path reads a packed copy of a weight, kept per storage and layout: csrc/cpu/packed_weights.h)
    rng = np.random.default_rng(12)
    x = torch.tensor(rng.standard_normal((3, 64)), dtype=torch.float32)
    base = _weights(rng, [(80, 64)], torch.bfloat16)[0]

    def run(w):
        out = torch.empty(3, w.shape[0])
        ops.fused_linear(x, [w], [out], bf16_activations=True)
        return out

    def check(w):
        exp, bounds = ref_linear(to_f64(x), [to_f64(w)], [None], None, 1e-6, "store", True, None)
        _check([run(w)], exp, bounds)

    first = run(base)
    assert torch.equal(run(base.detach()), first)  # a detached copy: the same storage, the same bits
    check(base)
    with torch.no_grad():
        base.mul_(-2.0)  # in place: a new version
    check(base)
    check(base[16:64])  # a view with an offset: its own copy, not the whole weight's
    for seed in range(3):  # weights freed and allocated again (an address may come back)
        check(_weights(np.random.default_rng(seed), [(80, 64)], torch.bfloat16)[0])


def test_fused_linear_paths_agree_and_bf16_rounding_is_torchs():
    rng = np.random.default_rng(9)
    x = torch.tensor(rng.standard_normal((4, 300)) * 7, dtype=torch.float32)
    assert np.array_equal(round_bf16(to_f64(x)), to_f64(x.bfloat16()))  # the reference rounds as torch does
    # (21 x 300: no path's AMX groups; 40 x 288 (x[:, :288]): amxbf16's AMX route, two groups and a partial one)
    for n, k in [(21, 300), (40, 288)]:
        (w,) = _weights(rng, [(n, k)], torch.bfloat16)
        xk = x[:, :k].contiguous()
        results = {}
        import os
        for name in ISAS:
            os.environ["SPECDEC_CPU_ISA"] = name
            out = torch.empty(4, n)
            ops.fused_linear(xk, [w], [out], bf16_activations=True)
            results[name] = out
        os.environ.pop("SPECDEC_CPU_ISA")
        for name in ISAS:
            torch.testing.assert_close(results[name], results[ISAS[0]], rtol=1e-5, atol=1e-5)


def test_fused_linear_errors():
    x = torch.zeros(2, 8)
    w = torch.zeros(4, 8)
    out = torch.zeros(2, 4)
    f = ops.fused_linear
    with pytest.raises(RuntimeError, match="bf16_activations needs bf16 weights"):
        f(x, [w], [out], bf16_activations=True)
    with pytest.raises(RuntimeError, match=r"weights\[0\] dimension 1 must be K"):
        f(x, [torch.zeros(4, 9)], [out])
    with pytest.raises(RuntimeError, match="takes two weights"):
        f(x, [w], [out], epilogue="swiglu")
    with pytest.raises(ValueError, match="epilogue must be one of"):
        f(x, [w], [out], epilogue="relu")
    with pytest.raises(RuntimeError, match="outs must hold 2"):
        f(x, [w, w], [out])
    with pytest.raises(RuntimeError, match="every weight must have the dtype"):
        f(x, [w, w.bfloat16()], [out, out.clone()])
    with pytest.raises(RuntimeError, match=r"outs\[0\] dimension 1 must be N"):
        f(x, [w], [torch.zeros(2, 5)])
    with pytest.raises(RuntimeError, match="x must have dtype Float"):
        f(x.double(), [w], [out])
    with pytest.raises(RuntimeError, match=r"biases\[0\] dimension 0 must be N"):
        f(x, [w], [out], biases=[torch.zeros(5)])
    with pytest.raises(RuntimeError, match="norm_weight dimension 0 must be K"):
        f(x, [w], [out], norm_weight=torch.ones(7))
    with pytest.raises(RuntimeError, match="must not be x"):
        f(x, [torch.zeros(8, 8)], [x])


def test_isa_environment_variable(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ISA", "avx1024")
    with pytest.raises(RuntimeError, match="is not one of amxbf16, avx512bf16, avx2, neon, portable, auto"):
        ops.cpu_isa()
    with pytest.raises(RuntimeError, match="is not one of"):
        ops.fused_linear(torch.zeros(1, 4), [torch.zeros(4, 4)], [torch.zeros(1, 4)])
    monkeypatch.setenv("SPECDEC_CPU_ISA", "auto")
    assert ops.cpu_isa() == ISAS[-1]
    monkeypatch.setenv("SPECDEC_CPU_ISA", "portable")
    assert ops.cpu_isa() == "portable"


def test_opcheck():
    rng = np.random.default_rng(2)
    x = torch.tensor(rng.standard_normal((3, 20)), dtype=torch.float32)
    w = torch.tensor(rng.standard_normal((6, 20)), dtype=torch.float32).bfloat16()
    g = torch.ones(20)
    torch.library.opcheck(torch.ops.specdec_ext.fused_linear.default,
                          (x, g, 1e-6, [w, w], [None, torch.zeros(6)], "store", True, [torch.empty(3, 6),
                                                                                          torch.empty(3, 6)]))
    torch.library.opcheck(torch.ops.specdec_ext.fused_linear.default,
                          (x, None, 0.0, [w, w], [], "swiglu", False, [torch.empty(3, 6)]))
    case = _rope_case(rng, M=3, H=4, Hk=2, D=8, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.specdec_ext.rope_cache_write.default, case["args"])
    q, kc, vc, start, visible = _attention_case(rng, B=2, T=3, H=4, Hk=2, D=8, dtype=torch.float32, tree=True)
    torch.library.opcheck(torch.ops.specdec_ext.cache_attention.default,
                          (q, kc, vc, start, visible, 0.35, torch.empty_like(q)))


# --------------------------------------------------------------------------------------------- rope_cache_write
def _rope_case(rng, M, H, Hk, D, dtype, P=40, Bc=3, capacity=24):
    qkv = torch.tensor(rng.standard_normal((M, (H + 2 * Hk) * D)), dtype=torch.float32)
    q = qkv[:, : H * D].view(M, H, D)  # views with a row stride: the op reads them in place
    k = qkv[:, H * D:(H + Hk) * D].view(M, Hk, D)
    v = qkv[:, (H + Hk) * D:].view(M, Hk, D)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.arange(P, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    positions = torch.tensor(rng.integers(0, P, M), dtype=torch.int64)
    rows = torch.tensor(rng.integers(0, Bc, M), dtype=torch.int64)
    slots = torch.tensor(rng.permutation(capacity)[:M], dtype=torch.int64)  # distinct slots per token
    kc = torch.zeros((Bc, Hk, capacity, D), dtype=dtype)
    vc = torch.zeros_like(kc)
    return dict(q=q, k=k, v=v, cos=cos, sin=sin, positions=positions, rows=rows, slots=slots, kc=kc, vc=vc,
                args=(q, k, v, cos, sin, positions, rows, slots, kc, vc))


@pytest.mark.parametrize("M,H,Hk,D", [(1, 4, 4, 8), (16, 8, 2, 64), (5, 6, 3, 18), (7, 2, 1, 96)])
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_rope_cache_write_matches_numpy_and_hf(M, H, Hk, D, dtype):
    rng = np.random.default_rng(M + H + D)
    c = _rope_case(rng, M, H, Hk, D, dtype)
    q0, k0, v0 = to_f64(c["q"]), to_f64(c["k"]), to_f64(c["v"])
    ops.rope_cache_write(*c["args"])
    cos, sin, pos = to_f64(c["cos"]), to_f64(c["sin"]), c["positions"].numpy()
    torch.testing.assert_close(to_f64(c["q"]), ref_rope(q0, cos, sin, pos), rtol=1e-6, atol=1e-6, check_dtype=False)
    k_rot = ref_rope(k0, cos, sin, pos)
    # HF's apply_rotary_pos_emb on the same tables (full-width cos/sin)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    full_cos = torch.cat([c["cos"], c["cos"]], -1)[c["positions"]]
    full_sin = torch.cat([c["sin"], c["sin"]], -1)[c["positions"]]
    _, hf_k = apply_rotary_pos_emb(torch.tensor(q0, dtype=torch.float32), torch.tensor(k0, dtype=torch.float32),
                                   full_cos, full_sin, unsqueeze_dim=1)
    torch.testing.assert_close(hf_k.double().numpy(), k_rot, rtol=1e-6, atol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for m in range(M):
        row, slot = int(c["rows"][m]), int(c["slots"][m])
        got_k, got_v = to_f64(c["kc"][row, :, slot]), to_f64(c["vc"][row, :, slot])
        assert np.all(np.abs(got_k - k_rot[m]) <= tol * np.abs(k_rot[m]) + 1e-7)
        assert np.all(np.abs(got_v - v0[m]) <= tol * np.abs(v0[m]) + 1e-7)
        assert torch.equal(c["vc"][row, :, slot], c["v"][m].to(dtype))  # rounded to nearest, as torch rounds
    untouched = torch.ones(c["kc"].shape[:3], dtype=torch.bool)
    untouched[c["rows"], :, c["slots"]] = False
    assert not c["kc"].float().abs().sum(-1)[untouched].any()


def test_rope_cache_write_errors():
    rng = np.random.default_rng(0)
    c = _rope_case(rng, 3, 4, 2, 8, torch.float32)
    bad = c["positions"].clone()
    bad[1] = 40
    args = list(c["args"])
    args[5] = bad
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 40 is outside \[0, 40\)"):
        ops.rope_cache_write(*args)
    args = list(c["args"])
    args[7] = c["slots"] + 100
    with pytest.raises(RuntimeError, match="cache_positions"):
        ops.rope_cache_write(*args)
    args = list(c["args"])
    args[9] = c["vc"].bfloat16()
    with pytest.raises(RuntimeError, match="v_cache must have the dtype of k_cache"):
        ops.rope_cache_write(*args)
    args = list(c["args"])
    args[1] = c["k"][:, :1]
    with pytest.raises(RuntimeError, match="k dimension 1 must be Hk"):
        ops.rope_cache_write(*args)


# --------------------------------------------------------------------------------------------- cache_attention
def _attention_case(rng, B, T, H, Hk, D, dtype, tree=False, capacity=48):
    q = torch.tensor(rng.standard_normal((B, T, H, D)), dtype=torch.float32)
    kc = torch.tensor(rng.standard_normal((B + 1, Hk, capacity, D)), dtype=torch.float32).to(dtype)
    vc = torch.tensor(rng.standard_normal((B + 1, Hk, capacity, D)), dtype=torch.float32).to(dtype)
    start = torch.tensor(rng.integers(0, capacity - T + 1, B), dtype=torch.int64)
    visible = None
    if tree:
        visible, _ = random_trees(rng, B, T)
    return q, kc, vc, start, visible


@pytest.mark.parametrize("B,T,H,Hk,D", [(1, 1, 4, 4, 64), (2, 16, 8, 2, 64), (3, 5, 6, 3, 80), (1, 9, 2, 1, 24),
                                        (2, 4, 2, 2, 160)])
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("tree", [False, True])
def test_cache_attention_matches_numpy(isa, B, T, H, Hk, D, dtype, tree):
    rng = np.random.default_rng(B * 100 + T * 10 + D)
    q, kc, vc, start, visible = _attention_case(rng, B, T, H, Hk, D, dtype, tree)
    out = ops.cache_attention(q, kc, vc, start, D ** -0.5, visible=visible)
    exp = ref_attention(to_f64(q), to_f64(kc), to_f64(vc), start.numpy(), None if visible is None else visible.numpy(),
                        D ** -0.5)
    # fp32 sums of at most 64 terms of |p v| <= max|v| and a 2-ulp exp
    assert np.abs(to_f64(out) - exp).max() <= 64 * D * FP32_EPS * np.abs(to_f64(vc)).max() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_attention_matches_torch_sdpa(isa, dtype):
    rng = np.random.default_rng(3)
    B, T, H, Hk, D = 2, 6, 4, 2, 32
    q, kc, vc, start, visible = _attention_case(rng, B, T, H, Hk, D, dtype, tree=True)
    out = ops.cache_attention(q, kc, vc, start, D ** -0.5, visible=visible)
    for b in range(B):
        S = int(start[b]) + T
        mask = torch.ones((T, S), dtype=torch.bool)
        mask[:, int(start[b]):] = visible[b]
        ref = F.scaled_dot_product_attention(q[b].transpose(0, 1), kc[b, :, :S].float(), vc[b, :, :S].float(),
                                             attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
        torch.testing.assert_close(out[b], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_attention_is_batch_invariant(isa, dtype):
    """A block of chain queries gives, bit for bit, what one query at a time over the grown prefix
    gives; a tree node gives what it gives once its path is committed next to the prefix."""
    rng = np.random.default_rng(4)
    B, T, H, Hk, D = 2, 7, 4, 2, 64
    q, kc, vc, start, _ = _attention_case(rng, B, T, H, Hk, D, dtype)
    block = ops.cache_attention(q, kc, vc, start, 0.125)
    for t in range(T):
        single = ops.cache_attention(q[:, t:t + 1].contiguous(), kc, vc, start + t, 0.125)
        assert torch.equal(single[:, 0], block[:, t]), t
    # a tree: node t at slot start + t sees the prefix, the root and its ancestors
    q, kc, vc, start, visible = _attention_case(rng, B, T, H, Hk, D, dtype, tree=True)
    tree_out = ops.cache_attention(q, kc, vc, start, 0.125, visible=visible)
    for b in range(B):
        for t in range(T):
            path = [j for j in range(T) if visible[b, t, j]]  # the root .. t, in slot order
            s0 = int(start[b])
            kc2, vc2 = kc.clone(), vc.clone()
            for i, j in enumerate(path):  # commit the path: move it next to the prefix
                kc2[b, :, s0 + i] = kc[b, :, s0 + j]
                vc2[b, :, s0 + i] = vc[b, :, s0 + j]
            start2 = start.clone()
            start2[b] = s0 + len(path) - 1
            single = ops.cache_attention(q[:, t:t + 1].contiguous(), kc2, vc2, start2, 0.125)
            assert torch.equal(single[b, 0], tree_out[b, t]), (b, t)


def test_cache_attention_errors():
    rng = np.random.default_rng(0)
    q, kc, vc, start, visible = _attention_case(rng, 2, 3, 4, 2, 8, torch.float32, tree=True)
    with pytest.raises(RuntimeError, match=r"start\[1\] = 46 must be in \[0, capacity - T\]"):
        ops.cache_attention(q, kc, vc, torch.tensor([0, 46]), 1.0)
    with pytest.raises(RuntimeError, match="multiple of the kv heads"):
        ops.cache_attention(q[:, :, :3].contiguous(), kc, vc, start, 1.0)
    with pytest.raises(RuntimeError, match="visible must have dtype Bool"):
        ops.cache_attention(q, kc, vc, start, 1.0, visible=visible.int())
    with pytest.raises(RuntimeError, match="k_cache holds 3 rows but q has B = 4"):
        ops.cache_attention(torch.zeros(4, 3, 4, 8), kc, vc, torch.zeros(4, dtype=torch.int64), 1.0)


# ---------------------------------------------------------------------------------- the bounds and the devices
@pytest.mark.parametrize("start", [2 ** 63 - 1, 2 ** 63 - 2, 14])
def test_a_start_past_the_cache_is_refused_even_where_start_plus_t_overflows(start):
    """start[b] + T <= capacity was checked as a sum, which wrapped negative near INT64_MAX and let the kernel
    read and write far out of bounds (the process died); it is now start[b] <= capacity - T."""
    q, k_cache, v_cache = torch.randn(1, 3, 2, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    with pytest.raises(RuntimeError, match=rf"cache_attention: start\[0\] = {start} must be in \[0, capacity - T\] "
                                           r"= \[0, 13\]"):
        ops.cache_attention(q, k_cache, v_cache, torch.tensor([start]), 0.3)


def test_an_operand_on_the_meta_device_beside_cpu_ones_is_refused_not_skipped():
    """A mixed-device call reaches the fake kernel, which returned without a word: the outputs stayed as they
    were (a weight left on meta, as an HF model built under init_empty_weights leaves it)."""
    x, out = torch.randn(2, 8), torch.full((2, 4), 7.0)
    with pytest.raises(RuntimeError, match=r"fused_linear: weights\[0\] must be on the same device as x \(cpu\), "
                                           r"got meta"):
        ops.fused_linear(x, [torch.empty(4, 8, device="meta")], [out])
    assert bool((out == 7.0).all())
    buffer, seq_lens, kept = torch.full((1, 6), -1, dtype=torch.int64), torch.tensor([2]), torch.full((1,), 99)
    with pytest.raises(RuntimeError, match=r"commit_tokens: num_accepted must be on the same device as tokens \(meta\)"):
        ops.commit_tokens(torch.zeros(1, 3, dtype=torch.int64, device="meta"), torch.tensor([1], dtype=torch.int32),
                          torch.tensor([True]), buffer, seq_lens, kept, torch.zeros(1, 1, dtype=torch.int64))
    cache = torch.zeros(2, 2, 4, 1, 2)
    with pytest.raises(RuntimeError, match=r"kv_write: slot_mapping must be on the same device as key \(cpu\)"):
        ops.kv_write(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2),
                     torch.zeros(1, 1, dtype=torch.int64, device="meta"), cache)
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(RuntimeError, match=r"cache_attention: start must be on the same device as q \(cpu\)"):
        ops.cache_attention(q, torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8), torch.zeros(1, dtype=torch.int64,
                            device="meta"), 0.3)
