"""generate(..., draft=EagleDrafterSpec) end to end (the plan's drafter "eagle"; issue 27's integration):
greedy equal to plain greedy on each runner and as a tree, the plan's lines, the audit at T = 1, and a head
made for another target refused before any work."""
from __future__ import annotations

import copy

import pytest
import torch

import specdec_ext
from eagle_utils import random_head, tiny_target
from specdec_ext.eagle import EagleDrafterSpec, EagleMismatchError, save_eagle
from test_generate_utils import hf_greedy

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30]]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, draft_vocab=48)


@pytest.mark.parametrize("runner,kw", [("auto", dict(k=4)), ("auto", dict(draft_tree=(2, 3, 6))),
                                       ("paged", dict(k=3)), ("recompute", dict(k=2)), ("auto", dict())])
def test_generate_with_an_eagle_head_is_plain_greedy(target, head, runner, kw):
    result = specdec_ext.generate(PROMPTS, target, EagleDrafterSpec(head), max_new_tokens=16, runner=runner, **kw)
    assert result.token_ids == [hf_greedy(target, p, 16) for p in PROMPTS]
    plan = result.plan
    assert plan.drafter == "eagle" and plan.hidden_taps == (2, 3, 3) and plan.target_capabilities.hidden_taps
    assert "hidden taps" in plan.explain() and not plan.cuda_graphs


def test_a_batch_with_more_rows_than_cache_positions_on_the_paged_runner(target, head):
    """The paged runner's taps wrote and read rows through its arange of positions: 32 rows of a 14-position
    cache (4 + 4 + two steps of 3 drafts) raised a size mismatch."""
    prompts = [[5, 17, 3, b] for b in range(32)]
    result = specdec_ext.generate(prompts, target, EagleDrafterSpec(head), max_new_tokens=4, k=3, runner="paged")
    assert result.token_ids == specdec_ext.plain_generate(prompts, target, max_new_tokens=4).token_ids


def test_a_head_for_a_gpt2_target_takes_its_mlp_width_and_drafts_losslessly():
    """GPT-2's config names its MLP width n_inner (None: 4 x n_embd); EagleConfig.for_target read
    intermediate_size alone and raised AttributeError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=5, n_head=2)).eval()
    head = random_head(gpt2)
    assert head.config.intermediate_size == 4 * 32
    result = specdec_ext.generate(PROMPTS, gpt2, EagleDrafterSpec(head), max_new_tokens=8, k=3)
    assert result.plan.drafter == "eagle" and result.token_ids == [hf_greedy(gpt2, p, 8) for p in PROMPTS]


def test_with_no_room_for_drafts_the_default_k_decodes_plain_as_the_other_drafters_do(target, head):
    """The default k where the cache leaves no room for a draft: plain decoding (it built a draft-model runner
    for the EAGLE head and refused the call with a message about position_ids); and where not even plain
    decoding fits, the cache's message with the numbers."""
    prompt, new = PROMPTS[0], 20  # plain decoding writes 7 + 20 - 1 = 26 positions
    result = specdec_ext.generate([prompt], target, EagleDrafterSpec(head), max_new_tokens=new, max_seq_len=27)
    assert result.plan.drafter == "none" and result.token_ids == [hf_greedy(target, prompt, new)]
    with pytest.raises(ValueError, match="needs 30 cache positions but the cache holds 27 \\(max_seq_len\\)"):
        specdec_ext.generate([prompt], target, EagleDrafterSpec(head), max_new_tokens=new + 4, max_seq_len=27)


def test_a_checkpoint_directory_is_a_draft(target, head, tmp_path):
    save_eagle(head, str(tmp_path))
    out = specdec_ext.generate(PROMPTS, target, str(tmp_path), max_new_tokens=8, k=3)
    assert out.plan.drafter == "eagle" and out.token_ids == [hf_greedy(target, p, 8) for p in PROMPTS]


def test_the_audit_passes_at_t1(target, head):
    report = specdec_ext.audit(target, EagleDrafterSpec(head), [PROMPTS[0]], positions=2, samples=400,
                               run_break_even=False, verbose=False, progress=False)
    assert report.passed, report.text()


def test_the_bundled_head_is_loaded_once_per_target(monkeypatch):
    """generate(..., draft="eagle") on the bundled target reads the head's files once (a load took 72 ms
    per call), and a copy of the target gets its own head, bound to it."""
    import specdec_ext.default_pair as default_pair

    loads = []
    load = default_pair.load_default_eagle
    monkeypatch.setattr(default_pair, "load_default_eagle", lambda target: loads.append(target) or load(target))
    target = specdec_ext.load_default_pair()[0]
    first = specdec_ext.generate("def f(x):", target, "eagle", k=2, max_new_tokens=4)
    again = specdec_ext.generate("def f(x):", target, "eagle", k=2, max_new_tokens=4)
    assert first.token_ids == again.token_ids and loads == [target]
    other = copy.deepcopy(target)
    assert specdec_ext.generate("def f(x):", other, "eagle", k=2, max_new_tokens=4).token_ids == first.token_ids
    assert loads == [target, other]


def test_a_head_for_another_target_is_refused(head):
    with pytest.raises(EagleMismatchError, match="size 64, this target's are 96"):
        specdec_ext.generate(PROMPTS, tiny_target("llama", hidden=96), EagleDrafterSpec(head), max_new_tokens=4)
    with pytest.raises(ValueError, match="draft='eagle' uses the bundled EAGLE-3 head, trained for the bundled target"):
        specdec_ext.generate(PROMPTS, tiny_target("llama"), "eagle", max_new_tokens=4)


def test_an_int8_checkpoint_loads_within_half_a_step_and_drafts_losslessly(target, head, tmp_path):
    """save_eagle(int8=True): each 2-D weight int8 with a scale per row (NumPy: |w - q * s| <= s / 2), the
    rest exact; generate with it is still plain greedy."""
    import numpy as np
    from specdec_ext.eagle import load_eagle

    save_eagle(head, str(tmp_path), int8=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.int8.safetensors"]
    loaded = load_eagle(str(tmp_path), target)
    original = head.state_dict()
    for name, tensor in loaded.state_dict().items():
        w = original[name].float().numpy()
        if original[name].dim() == 2 and name != "embed_tokens.weight":
            step = np.abs(w).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(tensor.numpy() - w) <= step / 2 + 1e-7), name
            assert not np.array_equal(tensor.numpy(), w)  # rounded, not copied
        else:
            np.testing.assert_array_equal(tensor.float().numpy(), w, err_msg=name)
    out = specdec_ext.generate(PROMPTS, target, str(tmp_path), max_new_tokens=12, k=3)
    assert out.token_ids == [hf_greedy(target, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_head_drafts_for_targets_in_either_precision(head, dtype):
    """A head kept in bf16 or fp16 (a SpecForge checkpoint's dtype) computes its norms, attention and residuals
    in fp32 as fc and lm_head do: it failed in its first projection ("expected m1 and m2 to have the same
    dtype"). Greedy: plain decoding's tokens, over an fp32 target and a bf16 one on both runners."""
    half = EagleDrafterSpec(copy.deepcopy(head).to(dtype))
    for target_dtype, runner in ((torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "paged")):
        model = tiny_target("llama").to(target_dtype)
        kw = dict(max_new_tokens=12, eos_token_id=False, runner=runner)
        expected = specdec_ext.plain_generate(PROMPTS, model, **kw).token_ids
        assert specdec_ext.generate(PROMPTS, model, half, k=3, cost_probe=False, **kw).token_ids == expected


def test_an_eagle_head_under_logits_processors_is_plain_decoding_with_them(target, head):
    kw = dict(max_new_tokens=16, presence_penalty=1.0, repetition_penalty=1.3, logit_bias={7: 3.0})
    speculative = specdec_ext.generate(PROMPTS, target, EagleDrafterSpec(head), k=3, **kw)
    assert speculative.token_ids == specdec_ext.plain_generate(PROMPTS, target, **kw).token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eagle_chains_under_graphs_forced_on_a_fake_backend_equal_the_eager_paged_run(target, head, monkeypatch,
                                                                                      temperature):
    """generate(draft=EAGLE head) with CUDA graphs forced on (the fake backend: each replay must trace what
    the graph's first replay traced): the plan captures the EAGLE chain on the paged runner in static-shapes
    mode with its hidden states tapped, the drafter feeds the prompt at prefill and k + 1 positions per
    step; tokens (greedy, and seeded samples at T = 1) and steps equal the eager host-mode paged run's.
    The CPU kernels are off so that the head runs the torch path a GPU runs."""
    from fake_graphs import FakeBackend
    from specdec_ext import cuda_graphs, plan as plan_module

    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    kwargs = dict(max_new_tokens=14, k=3, temperature=temperature, seed=[4, 5, 6], eos_token_id=False, runner="paged")
    prompts = PROMPTS + [[7, 7, 8]]
    reference = specdec_ext.generate(prompts, target, EagleDrafterSpec(head), **kwargs)
    assert not reference.plan.cuda_graphs
    backend = FakeBackend()
    monkeypatch.setattr(plan_module, "graphs_available", lambda device: (True, None))
    monkeypatch.setattr(cuda_graphs, "_CudaBackend", lambda: backend)
    result = specdec_ext.generate(prompts, target, EagleDrafterSpec(head), **kwargs)
    assert result.plan.cuda_graphs and result.plan.static_shapes and result.plan.padded_batch_size == 4
    assert "EAGLE-3 chain of fixed k" in dict(result.plan.reasons)["cuda graphs"]
    assert backend.events.count("capture") == 3 and backend.events.count("replay") >= 3 * 3
    assert result.token_ids == reference.token_ids
    assert result.stats.steps == reference.stats.steps
    if temperature == 0.0:
        assert result.token_ids == specdec_ext.plain_generate(prompts, target, max_new_tokens=14,
                                                              eos_token_id=False).token_ids
    default = specdec_ext.generate(prompts, target, EagleDrafterSpec(head), max_new_tokens=4, runner="paged")
    assert default.plan.cuda_graphs and default.plan.slots == plan_module.FIXED_K  # k=None: a fixed k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real CUDA graphs)")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eagle_chains_under_real_cuda_graphs_equal_the_eager_run(target, head, monkeypatch, temperature):
    """On a GPU the plan captures EAGLE chains by default: the same tokens and steps as with graphs off."""
    cuda_target, cuda_head = copy.deepcopy(target).cuda(), copy.deepcopy(head)  # (the fixtures stay on the CPU)
    kwargs = dict(max_new_tokens=24, k=3, temperature=temperature, seed=[4, 5, 6], eos_token_id=False)
    prompts = PROMPTS + [[7, 7, 8]]
    result = specdec_ext.generate(prompts, cuda_target, EagleDrafterSpec(cuda_head), **kwargs)
    assert result.plan.cuda_graphs
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "0")
    eager = specdec_ext.generate(prompts, cuda_target, EagleDrafterSpec(cuda_head), **kwargs)
    assert not eager.plan.cuda_graphs
    assert result.token_ids == eager.token_ids and result.stats.steps == eager.stats.steps
