"""The lean runner on the CPU kernels (runners/lean.py, lean_cpu.py): bf16 Llama / Qwen2 / Mistral logits
within bf16 tolerance of HF's fp32 forward of the same weights, on every instruction-set path;
verification passes (chains and trees) equal to one-token passes bit for bit, so greedy speculative
decoding equals greedy plain decoding (a hooked head too: heads on the target); the torch path (SPECDEC_CPU_KERNELS=0) still matches HF."""
from __future__ import annotations

import pytest
import torch

from specdec_ext import generate, ops, plain_generate
from specdec_ext.runners import LeanLlamaRunner
from specdec_ext.runners.lean_cpu import kernels_reason
from lean_forward_cases import ISAS
from test_lean_llama import TOL, _one_thread, drive, tiny  # noqa: F401  (_one_thread: an autouse fixture)

ARCHS = ["llama", "qwen2", "mistral", "llama_bias"]
# head_dim 30 and a hidden size of 120: neither a multiple of 16
SHAPE = dict(hidden_size=120, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2)


def _bf16_pair(arch, seed=0):
    """A bf16 model and the fp32 model of the same (bf16-valued) weights."""
    model16 = tiny(arch, seed=seed, **SHAPE).to(torch.bfloat16)
    model32 = tiny(arch, seed=seed, **SHAPE)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})
    return model16, model32


def _runner_logits(model, ids, split=9):
    """Prefill ids[:split], then one chain pass over the rest: logits of positions split-1 .. end."""
    lean = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=64)
    assert lean.kernels_reason is None
    first = lean.start([ids[0, :split].tolist()])
    rest = lean.forward(ids[:, split:])[0]
    return torch.cat([first, rest])


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_within_bf16_tolerance_of_hf_fp32(arch, monkeypatch):
    model16, model32 = _bf16_pair(arch)
    ids = torch.randint(0, 100, (1, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model32(ids).logits[0, 8:]
        hf_bf16 = model16(ids).logits[0, 8:].float()
    scale = ref.abs().max().item()
    for isa in ISAS:
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        err = (_runner_logits(model16, ids) - ref).abs().max().item()
        # bf16 keeps 8 significant bits: a couple of roundings of the logits' magnitude, and no worse
        # than HF's own bf16 forward is from fp32 (ours keeps the residual stream in fp32)
        assert err <= 2.0 ** -7 * scale, (isa, err, scale)
        assert err <= 1.5 * (hf_bf16 - ref).abs().max().item() + 1e-3, (isa, err)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_and_fp16_weights(arch, monkeypatch):
    model = tiny(arch, **SHAPE)
    for isa in ISAS:
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        assert drive(model, steps=4) < TOL
    model16 = tiny(arch, **SHAPE).half()
    model32 = tiny(arch, **SHAPE)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})
    # fp16 weights are read as they are and widened: computing in fp32 over them is the fp32 model
    assert drive(model16, lean_kw=dict(compute_dtype=torch.float32), oracle_model=model32, steps=4) < TOL


def _passes_equal_one_token_passes(model, isa, monkeypatch, tree):
    monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 100, (11,), generator=g).tolist()
    block = torch.randint(0, 100, (1, 7), generator=g)
    lean = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=64)
    lean.start([prompt])
    if tree:  # token 0 the root; nodes 0..5 with parents -1, 0, 0, 1, 3, -1 (tokens 1..6)
        parents = torch.tensor([[-1, 0, 0, 1, 3, -1]], dtype=torch.int32)
        logits = lean.forward(block, tree_parents=parents)[0]
        path_tokens = [0, 1, 2, 4, 5]  # root, node 0, node 1, node 3, node 4
        expected_rows = path_tokens
    else:
        logits = lean.forward(block)[0]
        path_tokens = expected_rows = list(range(7))
    one = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=64)
    one.start([prompt])
    for row, t in zip(expected_rows, path_tokens):
        single = one.forward(block[:, t:t + 1])[0, 0]
        one.commit(torch.tensor([1]))
        assert torch.equal(single, logits[row]), (isa, tree, t)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verification_passes_equal_one_token_passes_bit_for_bit(tree, dtype, monkeypatch):
    model = tiny("qwen2", **SHAPE).to(dtype)
    for isa in ISAS:
        _passes_equal_one_token_passes(model, isa, monkeypatch, tree)


def test_greedy_speculative_decoding_equals_plain_on_the_bundled_bf16_pair():
    default_pair = pytest.importorskip("specdec_ext.default_pair")
    target, draft, tokenizer = default_pair.load_default_pair(dtype=torch.bfloat16)
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self"]
    plain = plain_generate(prompts, target, tokenizer=tokenizer, max_new_tokens=48)
    assert plain.plan.target_runner == "lean"
    for kw in (dict(k=4), dict(k=None), dict(draft_tree=(2, 3, 6)), dict(draft="heads")):
        kw = {"draft": draft, **kw}
        spec = generate(prompts, target, tokenizer=tokenizer, max_new_tokens=48, **kw)
        assert spec.token_ids == plain.token_ids, kw
        if kw.get("k", 0) is not None:  # k=None follows measured times: on a busy machine it may draft little
            assert spec.stats.tokens_per_pass > 1.5, kw


def test_a_hooked_head_gives_the_kernels_logits_and_its_hooks_see_its_input():
    model16, _ = _bf16_pair("llama")
    ids = torch.randint(0, model16.config.vocab_size, (1, 14))
    unhooked = _runner_logits(model16, ids)
    head = model16.lm_head
    seen = {}
    handles = [head.register_forward_pre_hook(lambda m, args: seen.setdefault("input", []).append(args[0])),
               head.register_forward_pre_hook(lambda m, args, kwargs: seen.setdefault("kwargs", []).append(kwargs),
                                              with_kwargs=True),
               head.register_forward_hook(lambda m, args, out: seen.setdefault("output", []).append(out))]
    hooked = _runner_logits(model16, ids)
    assert torch.equal(hooked, unhooked)  # not torch's bf16 head: the kernel's numbers either way
    prefill_h, chain_h = seen["input"]
    assert prefill_h.shape == (1, 120) and chain_h.shape == (1, 5, 120) and chain_h.dtype == torch.bfloat16
    assert seen["kwargs"] == [{}, {}]
    assert torch.equal(torch.cat([seen["output"][0], seen["output"][1][0]]), hooked)
    seen.clear()
    with torch.no_grad():
        model16(ids)  # HF's forward feeds the head the final norm's output: ours is that within bf16
    torch.testing.assert_close(chain_h[0].float(), seen["input"][0][0, 9:].float(), rtol=0.02, atol=0.02)
    for handle in handles:
        handle.remove()
    handle = head.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with pytest.raises(RuntimeError, match="forward pre-hook on the LM head, returned a new input"):
        _runner_logits(model16, ids)
    handle.remove()
    for rewrite in (lambda m, args, out: out * 2, lambda m, args, out: out.mul_(2)):  # new logits, or in place
        handle = head.register_forward_hook(rewrite)
        assert torch.equal(_runner_logits(model16, ids), unhooked * 2)  # what the hooked head gives
        handle.remove()
    handle = head.register_forward_hook(lambda m, args, out: out[..., :3])
    with pytest.raises(RuntimeError, match=r"forward hook on the LM head, returned .* for logits of shape"):
        _runner_logits(model16, ids)
    handle.remove()


def test_torch_path_still_matches_hf(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    for arch in ("llama", "qwen2"):
        model = tiny(arch)
        lean = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=8)
        assert lean.kernels_reason == "SPECDEC_CPU_KERNELS=0"
        assert drive(model, steps=4) < TOL


def test_kernels_reason_and_no_fp32_copies():
    cpu = torch.device("cpu")
    assert kernels_reason(cpu, torch.bfloat16, torch.bfloat16, 64) is None
    assert kernels_reason(cpu, torch.bfloat16, torch.float32, 64) is None
    assert "weights in torch.float64" in kernels_reason(cpu, torch.float64, torch.float64, 64)
    assert "head_dim 7" in kernels_reason(cpu, torch.float32, torch.float32, 7)
    assert "CPU only" in kernels_reason(torch.device("meta"), torch.float32, torch.float32, 64)
    model = tiny("llama").to(torch.bfloat16)
    lean = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=8, compute_dtype=torch.float32)
    # computing in fp32 reads the bf16 weights themselves (widened in the kernel), into an fp32 cache
    assert lean.weights.layers[0].q.weight is model.model.layers[0].self_attn.q_proj.weight
    assert lean.k_cache.dtype == torch.float32 and not lean.bf16_activations
    assert ops.cpu_isa() in ISAS
