"""Float64 NumPy references of the lean-forward ops (csrc/lean_forward.h) and the error bounds the
tests hold the kernels to, chosen by precision: the kernels accumulate in fp32, so a dot product of K
terms is off by at most about K * 2^-24 times the sum of its terms' magnitudes; bf16 rounding of an
activation is exact here (the reference rounds as the kernels do)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

FP32_EPS = 2.0 ** -24


def to_f64(t) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def round_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 (ties to even), as float64: fp32 bits + 0x7fff + lsb, truncated."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(f), np.nan, out)


def activations(x: np.ndarray, norm_weight: Optional[np.ndarray], eps: float, bf16: bool) -> np.ndarray:
    """A = RMSNorm(x) * g (or x), rounded to bf16 when asked; the normalisation in fp32 as the kernel
    computes it, so that both round the same values."""
    a = x.astype(np.float32)
    if norm_weight is not None:
        mean = np.mean(a.astype(np.float64) ** 2, axis=-1, keepdims=True)
        scale = (1.0 / np.sqrt(mean + eps)).astype(np.float32)
        a = (a * scale).astype(np.float32) * norm_weight.astype(np.float32)
    a = a.astype(np.float64)
    return round_bf16(a) if bf16 else a


def silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


def fused_linear(x, weights: Sequence[np.ndarray], biases, norm_weight, eps, epilogue, bf16, outs):
    """The expected outputs (float64) and, per output, the bound of the fp32 error (float64)."""
    a = activations(x, norm_weight, eps, bf16)
    products = [a @ w.T + (0.0 if b is None else b) for w, b in zip(weights, biases)]
    bounds = [np.abs(a) @ np.abs(w).T * (4 * a.shape[1] * FP32_EPS) + 1e-30 for w in weights]
    if epilogue == "swiglu":
        g, u = products
        bg, bu = bounds
        # silu' is at most 1.1 in magnitude; exp_nonpositive is within a few ulp
        bound = 1.1 * bg * np.abs(u) + np.abs(silu(g)) * bu + 8 * FP32_EPS * np.abs(silu(g) * u)
        return [silu(g) * u], [bound]
    if epilogue == "add":
        return [o + p for o, p in zip(outs, products)], [b + 2 * FP32_EPS * np.abs(o + p) for o, b, p in
                                                        zip(outs, bounds, products)]
    return products, bounds


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """HF's rotate_half RoPE of x [M, heads, D] at the given positions (tables [P, D/2])."""
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def cache_attention(q, k_cache, v_cache, start, visible, scale):
    """softmax(scale q K^T) V per query over the prefix and its visible block keys; q [B, T, H, D],
    caches [Bc, Hk, capacity, D]."""
    B, T, H, D = q.shape
    Hk = k_cache.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            seen = [j for j in range(T) if (visible[b, t, j] if visible is not None else j <= t)]
            slots = list(range(int(start[b]))) + [int(start[b]) + j for j in seen]
            for h in range(H):
                g = h // (H // Hk)
                keys, values = k_cache[b, g, slots], v_cache[b, g, slots]
                s = keys @ q[b, t, h] * scale
                p = np.exp(s - s.max())
                out[b, t, h] = p @ values / p.sum()
    return out
