"""ops.eagle_chain: EAGLE-3's greedy draft chain in one op call (eagle/kernels.py ``kernel_greedy_chain``)
equals the head and layer passes it replaces, step by step on the same kernels (``kernel_head``,
``kernel_block``, torch.argmax, the d2t map): the same tokens and the same cache up to the RMSNorms'
rounding, on every instruction-set path, fp32 and bf16 kernel weights, biases, norm_before_residual, rows
at different slots, with and without a feed of the target's features first; a NumPy float64 reference of
one chain; errors named before anything is written; opcheck; and the drafter's greedy steps take it (no
layer pass of their own)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_utils import eagle_generate, random_head, tiny_target
from lean_forward_cases import ISAS
from specdec_ext import ops
from specdec_ext.eagle import kernels
from specdec_ext.eagle.model import EagleKV
from test_generate_utils import hf_greedy

pytestmark = pytest.mark.usefixtures("single_thread")

CAPACITY = 64
STARTS = (9, 30, 0)  # each row's first chain slot: rows at different lengths


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _state(head, rows=3, seed=0):
    """Layer outputs [B, h], the rows' first slots, and a cache holding earlier tokens' keys and values."""
    g = torch.Generator().manual_seed(seed)
    last = torch.randn((rows, head.config.hidden_size), generator=g) * 2
    cache = EagleKV(head.config, rows, CAPACITY, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return last, torch.tensor(STARTS[:rows]), cache


def _step_by_step(head, tokens, steps, last, start, cache):
    """The chain as the kernels ran it before the op: one kernel_head, argmax, d2t and kernel_block per step."""
    out = last
    for i in range(steps):
        token = head.target_ids[kernels.kernel_head(head, out).argmax(-1)]
        tokens[:, i] = token
        if i + 1 < steps:
            out = kernels.kernel_block(head, token[:, None], out[:, None], start + i, cache)[:, 0]
    return tokens


def _copy(cache):
    twin = EagleKV.__new__(EagleKV)
    twin.k, twin.v = cache.k.clone(), cache.v.clone()
    return twin


@pytest.mark.parametrize("kernel_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", [{}, dict(attention_bias=True), dict(norm_before_residual=True)])
def test_the_chain_equals_its_steps_on_every_path(target, kernel_dtype, overrides, monkeypatch):
    head = random_head(target, draft_vocab=48, **overrides)
    head.kernel_dtype = kernel_dtype
    if overrides.get("attention_bias"):
        with torch.no_grad():
            for proj in (head.midlayer.self_attn.q_proj, head.midlayer.self_attn.o_proj):
                proj.bias.normal_()
    steps = 5
    for isa in ISAS:
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        last, start, cache = _state(head)
        reference_cache = _copy(cache)
        expected = _step_by_step(head, torch.zeros((3, steps), dtype=torch.int64), steps, last, start,
                                 reference_cache)
        tokens = torch.full((3, steps + 2), -1, dtype=torch.int64)
        with torch.no_grad():
            head.greedy_chain(tokens, steps, last, start, cache)
        assert torch.equal(tokens[:, :steps], expected), isa
        assert torch.equal(tokens[:, steps:], torch.full((3, 2), -1)), "columns past steps are left alone"
        for name in ("k", "v"):  # the fed slots agree (the RMSNorms round differently); the others are untouched
            torch.testing.assert_close(getattr(cache, name), getattr(reference_cache, name), rtol=1e-4, atol=1e-4)
        assert torch.equal(last, _state(head)[0]), "last is read, not written"


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_a_chain_equals_a_numpy_float64_reference(target):
    """One row, three tokens, fp32 kernel weights: the tokens, and each fed slot's key and value, from
    the layer written out in NumPy (float64, rotate-half RoPE, softmax attention over slots < its own)."""
    head = random_head(target, draft_vocab=48)
    head.kernel_dtype = torch.float32
    last, start, cache = _state(head, rows=1)
    before_k, before_v = cache.k.double().numpy().copy(), cache.v.double().numpy().copy()
    tokens = torch.zeros((1, 3), dtype=torch.int64)
    with torch.no_grad():
        head.greedy_chain(tokens, 3, last, start, cache)
    c, layer = head.config, head.midlayer
    W = {name: p.detach().double().numpy() for name, p in head.named_parameters()}
    H, Hk, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ids = head.target_ids.numpy()
    k_cache, v_cache = before_k[0], before_v[0]  # [Hk, capacity, D]
    inv = head.inv_freq.double().numpy()
    out = last.double().numpy()[0]
    s0 = int(start[0])
    expected = []
    for i in range(3):
        logits = _rms(out, W["norm.weight"], head.norm.eps) @ W["lm_head.weight"].T
        token = int(ids[int(np.argmax(logits))])
        expected.append(token)
        if i == 2:
            break
        emb = _rms(W["embed_tokens.weight"][token], W["midlayer.input_layernorm.weight"], layer.input_layernorm.eps)
        normed = _rms(out, W["midlayer.hidden_norm.weight"], layer.hidden_norm.eps)
        x = np.concatenate([emb, normed])
        q = (W["midlayer.self_attn.q_proj.weight"] @ x).reshape(H, D)
        k = (W["midlayer.self_attn.k_proj.weight"] @ x).reshape(Hk, D)
        v = (W["midlayer.self_attn.v_proj.weight"] @ x).reshape(Hk, D)
        pos = s0 + i
        angle = pos * inv
        cos, sin = np.cos(angle) * head.rope_scale, np.sin(angle) * head.rope_scale
        rot = lambda t: np.concatenate([t[:, :D // 2] * cos - t[:, D // 2:] * sin,
                                        t[:, D // 2:] * cos + t[:, :D // 2] * sin], -1)
        q, k = rot(q), rot(k)
        k_cache[:, pos], v_cache[:, pos] = k, v
        attended = np.empty((H, D))
        for h in range(H):
            kv = h // (H // Hk)
            scores = k_cache[kv, : pos + 1] @ q[h] * D ** -0.5
            p = np.exp(scores - scores.max())
            attended[h] = (p / p.sum()) @ v_cache[kv, : pos + 1]
        residual = out + W["midlayer.self_attn.o_proj.weight"] @ attended.reshape(-1)
        n2 = _rms(residual, W["midlayer.post_attention_layernorm.weight"], layer.post_attention_layernorm.eps)
        gate, up = W["midlayer.mlp.gate_proj.weight"] @ n2, W["midlayer.mlp.up_proj.weight"] @ n2
        out = residual + W["midlayer.mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
    assert tokens[0].tolist() == expected
    np.testing.assert_allclose(cache.k[0].double().numpy(), k_cache, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cache.v[0].double().numpy(), v_cache, rtol=1e-4, atol=1e-4)


def _op_args(head, tokens, steps, last, start, cache, feed=()):
    layer = head.midlayer
    tensors, scalars = kernels._chain_weights(head).flat()
    cos, sin = kernels._rope(head, cache.capacity)
    return (tokens, steps, last, tensors, scalars, [layer.hidden_norm.weight, head.target_ids.contiguous()],
            [layer.hidden_norm.eps, 0.0], [cos, sin], [cache.k[None], cache.v[None]], start, list(feed))


def _feed(head, rows=3, width=4, counts=(4, 2, 0), seed=3):
    """A feed block: tokens [B, W], features [B, W, h], counts [B] (a row with nothing to feed)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, head.config.vocab_size, (rows, width), generator=g)
    features = torch.randn((rows, width, head.config.hidden_size), generator=g)
    return tokens, features, torch.tensor(counts[:rows])


@pytest.mark.parametrize("overrides", [{}, dict(norm_before_residual=True)])
def test_a_feed_then_the_chain_equals_the_feed_pass_and_the_steps(target, overrides, monkeypatch):
    """With a feed the op first runs the layer over each row's block (what the drafter's feed runs with
    kernel_block), takes each row's output at its last real column as ``last`` (a row with a count of 0
    keeps its own) and starts its chain count slots later."""
    head = random_head(target, draft_vocab=48, **overrides)
    for isa in ISAS:
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        last, start, cache = _state(head)
        tokens_f, features, counts = _feed(head)
        reference_cache = _copy(cache)
        out = kernels.kernel_block(head, tokens_f, features, start, reference_cache)  # [B, W, h]
        rows = torch.arange(3)
        expected_last = torch.where((counts > 0)[:, None], out[rows, (counts - 1).clamp(min=0)], last)
        expected = _step_by_step(head, torch.zeros((3, 4), dtype=torch.int64), 4, expected_last, start + counts,
                                 reference_cache)
        tokens = torch.zeros((3, 4), dtype=torch.int64)
        with torch.no_grad():
            kernels.kernel_greedy_chain(head, tokens, 4, last, start, cache, feed=(tokens_f, features, counts))
        assert torch.equal(tokens, expected), isa
        torch.testing.assert_close(last, expected_last, rtol=1e-4, atol=1e-4)
        assert torch.equal(last[2], _state(head)[0][2]), "a row with nothing fed keeps its last"
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(cache, name), getattr(reference_cache, name), rtol=1e-4, atol=1e-4)


def test_bad_input_is_named_before_anything_is_written(target):
    head = random_head(target, draft_vocab=48)
    op = torch.ops.specdec_ext.eagle_chain.default
    last, start, cache = _state(head)
    k_before = cache.k.clone()
    tokens = torch.zeros((3, 4), dtype=torch.int64)

    def call(**changes):
        args = dict(zip(("tokens", "steps", "last", "weights", "scalars", "eagle", "eagle_scalars", "rope",
                         "cache", "start", "feed"), _op_args(head, tokens, 4, last, start, cache)))
        args.update(changes)
        op(*args.values())

    with pytest.raises(RuntimeError, match=r"eagle_chain: steps must be in \[1, n\] = \[1, 4\], got 5"):
        call(steps=5)
    with pytest.raises(RuntimeError, match=r"eagle_chain: start\[1\] = 62 must be in \[0, 61\]"):
        call(start=torch.tensor([0, 62, 0]))
    tokens_f, features, counts = _feed(head)
    with pytest.raises(RuntimeError, match=r"eagle_chain: feed counts\[0\] = 5 must be in \[0, W\] = \[0, 4\]"):
        call(feed=[tokens_f, features, torch.tensor([5, 0, 0])])
    with pytest.raises(RuntimeError, match=r"eagle_chain: start\[1\] = 61 must be in \[0, 60\] \(the feed writes"):
        call(start=torch.tensor([0, 61, 0]), feed=[tokens_f, features, counts])
    with pytest.raises(RuntimeError, match=r"eagle_chain: start\[0\] = 62 \(with its feed count\) must be in"):
        call(start=torch.tensor([58, 0, 0]), feed=[tokens_f, features, counts])
    with pytest.raises(RuntimeError, match=r"eagle_chain: feed features must have shape \[B, W, d\]"):
        call(feed=[tokens_f, features[:, :3].contiguous(), counts])
    with pytest.raises(RuntimeError, match=r"eagle_chain: last dimension 0 must be B \(tokens dimension 0\) = 3, "
                                           r"got shape \[2, 64\]"):
        call(last=last[:2].contiguous())
    wrong_ids = head.target_ids.clone()
    wrong_ids[3] = 10_000
    with pytest.raises(RuntimeError, match=r"eagle_chain: target_ids\[3\] = 10000 is outside the embedding's"):
        call(eagle=[head.midlayer.hidden_norm.weight, wrong_ids])
    tensors = list(_op_args(head, tokens, 4, last, start, cache)[3])
    tensors[2] = tensors[2][:, :64].contiguous()  # q reading d columns, as a Llama layer's
    with pytest.raises(RuntimeError, match="eagle_chain: q dimension 1 must be 2d"):
        call(weights=tensors)
    tensors = list(_op_args(head, tokens, 4, last, start, cache)[3])
    tensors[8] = tensors[8][:, :32].contiguous()  # o, the layer's output projection
    with pytest.raises(RuntimeError, match=r"eagle_chain: o must have shape \[64, 64\], got \[64, 32\]"):
        call(weights=tensors)
    cos, sin = kernels._rope(head, cache.capacity)
    with pytest.raises(RuntimeError, match=r"eagle_chain: rope must hold cos and sin of shape \[P, D/2\] = \[P, 8\]"):
        call(rope=[cos[:, :3].contiguous(), sin[:, :3].contiguous()])
    assert torch.equal(cache.k, k_before) and torch.equal(tokens, torch.zeros((3, 4), dtype=torch.int64))
    assert torch.equal(last, _state(head)[0])


def test_eagle_chain_opcheck(target):
    head = random_head(target, draft_vocab=48, attention_bias=True)
    last, start, cache = _state(head)
    tokens = torch.zeros((3, 4), dtype=torch.int64)
    torch.library.opcheck(torch.ops.specdec_ext.eagle_chain.default, _op_args(head, tokens, 4, last, start, cache))
    torch.library.opcheck(torch.ops.specdec_ext.eagle_chain.default,
                          _op_args(head, tokens, 4, last, start, cache, feed=_feed(head)))


def test_the_drafters_greedy_chains_take_the_op(target, monkeypatch):
    """Greedy generation with a head on the kernels runs each step's feed and chain in one eagle_chain call
    (no kernel_block of its own), and the output is still plain greedy."""
    head = random_head(target, draft_vocab=48)
    calls = {"chain": 0, "block": 0}
    chain, block = kernels.kernel_greedy_chain, kernels.kernel_block

    def count(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr("specdec_ext.eagle.drafter.kernel_greedy_chain", count("chain", chain))
    monkeypatch.setattr("specdec_ext.eagle.model.kernel_block", count("block", block))
    prompt = [5, 17, 3, 44, 9, 12, 61]
    assert eagle_generate(target, head, [prompt], 16, k=4) == [hf_greedy(target, prompt, 16)]
    assert calls["chain"] >= 4 and calls["block"] == 0
    assert ops.CPU_ONLY_OPS.count("eagle_chain") == 1
