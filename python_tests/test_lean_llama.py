"""LeanLlamaRunner: logits equal to a plain HF forward (the recompute oracle) through ragged starts,
padded multi-token chunks, commits and truncations; unsupported configs fall back; the decode loop
over it reproduces HF greedy."""
from __future__ import annotations

import pytest
import torch
import transformers

import specdec_ext
from specdec_ext.runners import LeanLlamaRunner, PagedModelRunner, RecomputeRunner, unsupported_reason

TOL = 1e-4
VOCAB = 100


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(arch: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "llama_bias":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=True, mlp_bias=True, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **common))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 / 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def drive(model, lean_kw=None, oracle_model=None, steps=8, seed=0, B=3, max_seq_len=48, vocab=VOCAB):
    """Run the same random script on the lean runner and the oracle; return the max |logit diff|."""
    lean = LeanLlamaRunner(model, max_batch_size=B + 1, max_seq_len=max_seq_len, **(lean_kw or {}))
    oracle = RecomputeRunner(oracle_model or model, max_batch_size=B + 1, max_seq_len=max_seq_len)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 12, (B,), generator=g)]
    worst = (lean.start(prompts) - oracle.start(prompts)).abs().max().item()
    assert lean.lengths.tolist() == [len(p) for p in prompts]
    for step in range(steps):
        T = [1, 2, 3, 5][step % 4]
        ids = torch.randint(0, vocab, (B, T), generator=g)
        num = None if step % 3 == 0 else torch.randint(0 if T > 1 else 1, T + 1, (B,), generator=g)
        a, b = lean.forward(ids, num), oracle.forward(ids, num)
        assert a.shape == (B, T, lean.vocab_size) and a.dtype == torch.float32
        counts = [T] * B if num is None else num.tolist()
        for r in range(B):
            if counts[r]:
                worst = max(worst, (a[r, : counts[r]] - b[r, : counts[r]]).abs().max().item())
        kept = torch.tensor([int(torch.randint(0, c + 1, (1,), generator=g)) for c in counts])
        lean.commit(kept)
        oracle.commit(kept)
        if step % 3 == 2:
            new = torch.tensor([max(1, int(n) - int(torch.randint(0, 3, (1,), generator=g)))
                                for n in oracle.lengths])
            lean.truncate(new)
            oracle.truncate(new)
        assert lean.lengths.tolist() == oracle.lengths.tolist()
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_bias", "mistral"])
@pytest.mark.parametrize("seed", [0, 1])
def test_logits_match_hf_through_ragged_chunks_commits_and_truncations(arch, seed):
    model = tiny(arch, seed=seed)
    assert unsupported_reason(model) is None
    assert drive(model, seed=seed) < TOL


def test_batch_of_one_and_mha():
    model = tiny("llama", num_key_value_heads=4)
    assert drive(model, B=1, steps=12) < TOL


def test_weights_are_the_models_own_tensors():
    model = tiny("llama")
    lean = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=8)
    assert lean.weights.head.weight is model.lm_head.weight
    assert lean.weights.layers[0].q.weight is model.model.layers[0].self_attn.q_proj.weight
    assert lean.weights.embed is model.model.embed_tokens.weight


def test_batch_larger_than_the_cache():
    model = tiny("llama")
    lean = LeanLlamaRunner(model, max_batch_size=40, max_seq_len=4)
    oracle = RecomputeRunner(model, max_batch_size=40, max_seq_len=4)
    prompts = [[b % VOCAB, (3 * b) % VOCAB][: 1 + b % 2] for b in range(40)]
    assert (lean.start(prompts) - oracle.start(prompts)).abs().max() < TOL
    ids = torch.arange(40)[:, None] % VOCAB
    assert (lean.forward(ids) - oracle.forward(ids)).abs().max() < TOL


def test_cache_grows_past_the_padding_slack():
    model = tiny("llama")
    lean = LeanLlamaRunner(model, max_batch_size=2, max_seq_len=10)
    oracle = RecomputeRunner(model, max_batch_size=2, max_seq_len=10)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9]]
    lean.start(prompts), oracle.start(prompts)
    ids = torch.randint(0, VOCAB, (2, 40))
    num = torch.tensor([2, 9])
    a, b = lean.forward(ids, num), oracle.forward(ids, num)
    assert (a[0, :2] - b[0, :2]).abs().max() < TOL and (a[1, :9] - b[1, :9]).abs().max() < TOL
    with pytest.raises(ValueError, match="max_seq_len"):
        lean.forward(ids[:, :3])


def test_bundled_draft_fp32_and_bf16_computed_in_fp32():
    default_pair = pytest.importorskip("specdec_ext.default_pair")
    _, draft32, _ = default_pair.load_default_pair(dtype=torch.float32)
    assert unsupported_reason(draft32) is None
    V = draft32.config.vocab_size
    assert drive(draft32, steps=6, max_seq_len=64, vocab=V) < TOL
    # bf16 weights upcast exactly: the fp32 lean runner over them is the fp32 model
    _, draft16, _ = default_pair.load_default_pair(dtype=torch.bfloat16)
    assert drive(draft16, lean_kw=dict(compute_dtype=torch.float32), oracle_model=draft32, steps=6,
                 max_seq_len=64, vocab=V) < TOL


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_bf16_model_dtype_is_close(kernels, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", kernels)
    model = tiny("llama").to(torch.bfloat16)
    assert drive(model, steps=4) < 0.1  # bf16 rounding only
    # the cached keys are the bf16 k exactly: in bf16 on the CPU kernels (their attention accumulates
    # in fp32), in fp32 on the torch path (torch's bf16 SDPA is slow for one query)
    lean = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=16)
    cache_dtype = torch.bfloat16 if kernels == "1" else torch.float32
    assert lean.dtype == torch.bfloat16 and lean.k_cache.dtype == lean.v_cache.dtype == cache_dtype
    lean.start([[1, 2, 3]])
    cached = lean.k_cache[:, 0, :, :3].float()  # [layers, kv_heads, 3, D]
    assert torch.equal(cached, cached.to(torch.bfloat16).float())


def test_unsupported_configs_raise_and_the_plan_falls_back():
    from specdec_ext.plan import make_plan

    cases = [
        tiny("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        tiny("llama", hidden_act="gelu"),
        transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=8)).eval(),
        transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4)).eval(),
    ]
    def target_runner(model, runner="auto"):
        return make_plan(model, None, drafter="none", prompt_lengths=[4], max_new_tokens=8, runner=runner).target_runner

    for model in cases:
        reason = unsupported_reason(model, 32)
        assert reason is not None
        with pytest.raises(NotImplementedError):
            LeanLlamaRunner(model, max_batch_size=1, max_seq_len=32)
        assert target_runner(model) == "paged"
        with pytest.raises(ValueError, match="runner='lean' cannot run the target model"):
            target_runner(model, "lean")
    assert target_runner(tiny("qwen2")) == "lean"


class _ScaledLinear(torch.nn.Linear):  # an adapter's shape: the weight alone is not what it computes
    def forward(self, x):
        return super().forward(x) * 3.0


def test_hooked_or_adapted_modules_run_on_the_paged_runner_with_their_effect():
    """A hook or an adapted projection changes what the model computes, which the lean forward (the weights
    alone) cannot see: the plan falls back to the paged runner (the HF modules) and the tokens are HF's."""
    from specdec_ext import generate

    def hf_greedy(model, prompt):
        ids = torch.tensor([prompt])
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                              pad_token_id=0)[0, len(prompt):].tolist()

    def layer_hook(model):
        return model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 5.0 + 0.3)

    def adapter(model):
        old = model.model.layers[0].mlp.down_proj
        new = _ScaledLinear(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        model.model.layers[0].mlp.down_proj = new

    prompt = [5, 17, 3, 44, 9]
    for change, reason in ((layer_hook, "forward hook on model.layers.0.mlp"), (adapter, "down_proj is a _ScaledLinear")):
        model = tiny("llama", seed=5)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
        plain = generate([prompt], model, "ngram", max_new_tokens=10, k=2).token_ids[0]
        change(model)
        assert reason in unsupported_reason(model, 32)
        result = generate([prompt], model, "ngram", max_new_tokens=10, k=2)
        assert result.plan.target_runner == "paged"
        assert result.token_ids[0] == hf_greedy(model, prompt) != plain
    model = tiny("llama", seed=5)
    internal = layer_hook(model)
    list(internal.hooks_dict_ref().values())[0].specdec_internal = True  # (the package's own: taps, pass counts)
    model(input_ids=torch.tensor([prompt]), output_hidden_states=True)  # (transformers' capturing hooks stay)
    assert unsupported_reason(model, 32) is None


@pytest.mark.parametrize("kernels,dtype,compute", [("1", torch.float32, None), ("1", torch.bfloat16, None),
                                                   ("0", torch.bfloat16, torch.float32)])
def test_a_weight_written_through_data_is_read_again_by_the_next_runner(kernels, dtype, compute, monkeypatch):
    """``.data`` writes (a LoRA merge, a fine-tuning step) leave the version counter as it was: the packed
    copies of the CPU kernels and cached_cast's copies are rechecked by a fingerprint at the next runner."""
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", kernels)
    model = tiny("llama", seed=6).to(dtype)

    def last_logits():
        lean = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=16, compute_dtype=compute)
        return lean.start([[5, 17, 3, 44, 9]])

    before = last_logits()
    with torch.no_grad():
        hf = lambda: model(torch.tensor([[5, 17, 3, 44, 9]])).logits[0, -1].float()  # noqa: E731
        version = model.model.layers[0].mlp.down_proj.weight._version
        model.model.layers[0].mlp.down_proj.weight.data.mul_(-4.0)
        assert model.model.layers[0].mlp.down_proj.weight._version == version  # (unseen by the counter)
        expected = hf()
    after = last_logits()
    assert not torch.allclose(after[0], before[0], atol=1e-3)
    assert torch.allclose(after[0], expected, atol=0.05 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("kernels,dtype,compute", [("1", torch.float32, None), ("1", torch.bfloat16, None),
                                                   ("0", torch.bfloat16, torch.float32)])
def test_refresh_weights_reads_a_one_row_write_that_the_fingerprint_misses(kernels, dtype, compute, monkeypatch):
    """One row written through ``.data`` changes none of the fingerprint's 64 sampled elements (rows 0, V/64,
    2V/64, ...): specdec_ext.refresh_weights() drops every cached copy, and the next runner reads the write."""
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", kernels)
    model = tiny("llama", seed=6).to(dtype)
    prompt = [[5, 17, 3, 44, 9]]

    def last_logits():
        return LeanLlamaRunner(model, max_batch_size=1, max_seq_len=16, compute_dtype=compute).start(prompt)[0]

    last_logits()  # the copies are made
    head = model.lm_head.weight
    rows, cols = head.shape
    packed_samples = {(i * rows // 64, (i * 40503 + i * rows // 64) % cols) for i in range(64)}  # packed_weights.cpp
    step = max(1, rows * cols // 64)
    cast_samples = {divmod(j * step, cols) for j in range(64)}  # lean_forward._sampled
    row = 1
    unsampled = [c for c in range(cols) if (row, c) not in packed_samples | cast_samples]
    with torch.no_grad():
        head.data[row, unsampled] += 3.0
        expected = model(torch.tensor(prompt)).logits[0, -1].float()
    assert not torch.allclose(last_logits(), expected, atol=0.05)  # the write the fingerprint misses
    specdec_ext.refresh_weights()
    after = last_logits()
    bf16 = dtype == torch.bfloat16  # (row 1's logit is now ~19: bf16's steps there are 0.125)
    assert torch.allclose(after, expected, atol=0.05 if bf16 else 1e-4, rtol=0.02 if bf16 else 1e-5)


def test_interface_errors():
    lean = LeanLlamaRunner(tiny("llama"), max_batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError):
        lean.forward(torch.tensor([[1]]))  # before start
    lean.start([[1, 2], [3]])
    with pytest.raises(ValueError, match="tree_parents must be"):
        lean.forward(torch.tensor([[1, 2], [3, 4]]), tree_parents=torch.tensor([[-1, 0], [-1, 0]], dtype=torch.int32))
    lean.forward(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="not a tree forward"):
        lean.commit_tree(torch.tensor([[0], [0]]), torch.tensor([1, 1]))
    lean.forward(torch.tensor([[1, 2], [3, 4]]), tree_parents=torch.tensor([[-1], [-1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="row 1: path"):
        lean.commit_tree(torch.tensor([[0], [3]]), torch.tensor([1, 1]))
    lean.forward(torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="commit"):
        lean.commit(torch.tensor([1, 2]))
    lean.commit(torch.tensor([2, 1]))
    assert lean.lengths.tolist() == [4, 2]
    with pytest.raises(ValueError, match="truncate"):
        lean.truncate(torch.tensor([5, 1]))
    lean.truncate(torch.tensor([1, 2]))
    assert lean.lengths.tolist() == [1, 2]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_forwards_and_commits_match_the_paged_runner(seed):
    """Random trees (ragged node counts), random accepted paths, then chain forwards: the lean
    runner's logits equal the paged runner's (itself checked against plain HF forwards)."""

    model = tiny("llama", seed=seed)
    B, N = 3, 6
    lean = LeanLlamaRunner(model, max_batch_size=B, max_seq_len=96)
    paged = PagedModelRunner(model, max_batch_size=B, max_seq_len=96)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (B,), generator=g)]
    worst = (lean.start(prompts) - paged.start(prompts)).abs().max().item()
    for step in range(6):
        parents = torch.tensor([[-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, N)]
                                for _ in range(B)], dtype=torch.int32)  # topological: parents[i] < i
        ids = torch.randint(0, VOCAB, (B, N + 1), generator=g)
        counts = torch.randint(1, N + 2, (B,), generator=g)
        a = lean.forward(ids, counts, tree_parents=parents)
        b = paged.forward(ids, counts, tree_parents=parents)
        for r in range(B):
            worst = max(worst, (a[r, : counts[r]] - b[r, : counts[r]]).abs().max().item())
        path = torch.full((B, N), -1, dtype=torch.int32)
        accepted = torch.zeros(B, dtype=torch.int32)
        for r in range(B):  # walk down from the root through random children among the used nodes
            node, depth = -1, 0
            while True:
                children = [i for i in range(int(counts[r]) - 1) if int(parents[r, i]) == node]
                if not children or torch.rand(1, generator=g).item() < 0.2:
                    break
                node = children[int(torch.randint(0, len(children), (1,), generator=g))]
                path[r, depth], depth = node, depth + 1
            accepted[r] = depth
        lean.commit_tree(path, accepted)
        paged.commit_tree(path, accepted)
        assert lean.lengths.tolist() == paged.lengths.tolist()
        chain = torch.randint(0, VOCAB, (B, 2), generator=g)
        worst = max(worst, (lean.forward(chain) - paged.forward(chain)).abs().max().item())
        lean.commit(torch.ones(B, dtype=torch.int64))
        paged.commit(torch.ones(B, dtype=torch.int64))
    assert worst < TOL, worst


def test_generate_over_the_lean_runner_matches_hf_greedy():
    from specdec_ext import generate

    target = tiny("llama", seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    draft = tiny("qwen2", seed=4)
    prompts = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20]]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                              pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    for k in (1, 4):
        result = generate(prompts, target, draft, max_new_tokens=20, k=k, runner="lean")
        assert result.plan.target_runner == result.plan.draft_runner == "lean"
        assert result.token_ids == refs


def test_a_collected_models_packed_weight_copies_are_freed(monkeypatch):
    """The CPU kernels pack each weight once (csrc/cpu/packed_weights.h); a collected model's copies were dropped
    only when another weight was packed (a deleted fp32 bundled pair kept 91 MB). A collection now sweeps them."""
    import gc

    from specdec_ext import ops

    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "1")
    gc.collect()
    before = ops.packed_weight_bytes()
    model = tiny("llama", seed=6)
    LeanLlamaRunner(model, max_batch_size=1, max_seq_len=16).start([[5, 17, 3, 44, 9]])
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    assert ops.packed_weight_bytes() - before >= weights // 2
    del model
    gc.collect()
    assert ops.packed_weight_bytes() <= before
