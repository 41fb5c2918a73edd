"""generate() on numerical and model-variety edge cases, with tiny models built from configs on the CPU.

What is checked, against HF's own greedy ``generate(do_sample=False)`` (fp32 models) or the library's own
plain decoding (bf16/fp16 targets, which README "Status" says may round differently from HF), and against the
exact law of the first tokens (chi-square, sampling_stats.py) for sampling:

* dtypes: fp16 / bf16 / fp64 targets with drafts in another dtype; fp16 logits that overflow (a clear error);
  very large (lm_head x 1e4) and flat (x 0, x 1e-6) logits; exact greedy ties (HF's argmax: the lowest id);
* vocabularies: 1, 2 and 150k tokens, tied embeddings, a draft scoring more or fewer ids than the target;
* architectures as target and as draft across the lean and the paged runner, chains, k="auto", trees, ngram;
* positions at the end of the context, rope scaling (linear, dynamic, llama3, yarn, longrope);
* models in train mode, with requires_grad weights, under gradient checkpointing, on the meta device, with
  weights that share storage or are views.

Eight tests here failed when this file was written, each a bug since fixed (their docstrings say what broke);
they accept either the correct output or a clear ValueError raised before decoding.
"""
from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import transformers

import architectures
from sampling_stats import chi_square_p, exact_joint
from specdec_ext import generate, plain_generate
from specdec_ext.models import VocabularyMismatchError
from test_generate_utils import char_tokenizer, hf_greedy, noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

PROMPTS = [[5, 17, 3, 44, 9, 12, 61, 7], [2, 30, 4, 8, 11, 12, 13, 14, 15, 16, 3]]
NEW = 12
DRAFTERS = [dict(k=3), dict(k="auto"), dict(draft_tree=(2, 2, 4)), dict(draft="ngram", k=3)]
PASS_P = 1e-4  # a correct sampler fails a chi-square test with this probability (the runs are seeded)
SAMPLES = 3000
TINY_VOCAB = 8
SAMPLE_PROMPT = [1, 4, 2, 6]


def run(target, draft_model, prompts=PROMPTS, new=NEW, **kw):
    """generate() greedy by default, no EOS; ``draft=`` in ``kw`` ("ngram", ...) overrides ``draft_model``."""
    draft = kw.pop("draft", draft_model)
    return generate(prompts, target, draft, max_new_tokens=new, eos_token_id=False, cost_probe=False, **kw)


def hf_refs(model, prompts=PROMPTS, new=NEW):
    """HF greedy per prompt, each alone (on a copy: some rotary embeddings keep state between forwards)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [hf_greedy(copy.deepcopy(model), p, new) for p in prompts]


def plain(model, prompts=PROMPTS, new=NEW, **kw):
    return plain_generate(prompts, model, max_new_tokens=new, eos_token_id=False, **kw).token_ids


def sample_first_tokens(target, draft, **kw):
    """SAMPLES seeded rows of SAMPLE_PROMPT, three new tokens each: the chi-square p-value against the target."""
    out = generate([SAMPLE_PROMPT] * SAMPLES, target, draft, max_new_tokens=3, seed=list(range(SAMPLES)),
                   eos_token_id=False, cost_probe=False, temperature=1.0, **kw)
    return chi_square_p(out.token_ids, exact_joint(target, SAMPLE_PROMPT)), out


def causal_lm(arch: str, *, vocab: int = 96, seed: int = 0, tie: bool = False, hidden: int = 32,
              logit_scale: float = 4.0):
    """tiny_model with tied embeddings as an option."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                  num_attention_heads=4, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=tie)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    else:
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    return model.eval()


def correct_or_refused(call, expected, *words):
    """The promise for an input the library may not support: the right tokens, or a ValueError raised before
    decoding whose message names each of ``words`` (case-insensitive). Anything else (another exception from
    inside the loop, other tokens) fails."""
    try:
        out = call()
    except ValueError as error:
        message = str(error).lower()
        missing = [w for w in words if w.lower() not in message]
        assert not missing, f"refused, but the message does not name {missing}: {error}"
        return None
    assert out.token_ids == expected
    return out


# ------------------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])  # the lean runner and the paged one
@pytest.mark.parametrize("target_dtype,draft_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16)])
def test_a_draft_in_another_dtype_than_the_target_is_lossless_greedy(arch, target_dtype, draft_dtype):
    base = tiny_model(arch, logit_scale=8.0, layers=2)
    target = copy.deepcopy(base).to(target_dtype)
    draft = noisy_copy(base).to(draft_dtype)
    # fp32: HF's greedy; half precision: the library's plain decoding over the same runner (README "Status")
    expected = hf_refs(target) if target_dtype == torch.float32 else plain(target)
    for kw in DRAFTERS:
        out = run(target, draft, **kw)
        assert out.token_ids == expected, (kw, out.plan.target_runner)
    assert out.plan.target_runner == ("lean" if arch == "llama" else "paged")


def test_fp64_llama_runs_on_the_lean_runner_and_fp64_elsewhere_is_refused_by_dtype():
    target = tiny_model("llama", logit_scale=4.0)
    draft = noisy_copy(target)
    expected = hf_refs(target)
    assert run(target.double(), draft, k=3).token_ids == expected
    assert run(target, draft.double(), draft_tree=(2, 2, 4)).token_ids == expected
    neox = tiny_model("gpt_neox").double()
    with pytest.raises(ValueError, match=r"target model is torch.float64: the paged runner's cache holds"):
        run(neox, "ngram", k=2)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_fp16_logits_that_overflow_are_a_clear_error_not_tokens(arch):
    target = tiny_model(arch, logit_scale=1e6).half()  # fp16 logits past 65504: +inf
    with torch.no_grad():
        assert torch.isinf(target(torch.tensor([PROMPTS[0]])).logits).any()
    for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(k=3, temperature=1.0, seed=0)):
        with pytest.raises(ValueError, match=r"NaN or \+inf logit"):
            run(target, noisy_copy(target), **kw)
    with pytest.raises(ValueError, match=r"NaN or \+inf logit"):
        plain(target)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_draft_whose_fp16_logits_overflow_cannot_change_greedy_output(arch):
    target = tiny_model(arch, logit_scale=4.0)
    draft = tiny_model(arch, logit_scale=1e6, seed=1).half()
    expected = hf_refs(target)
    for kw in (dict(k=3), dict(draft_tree=(2, 2, 4))):
        assert run(target, draft, **kw).token_ids == expected


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("scale", [1e4, 1e-6, 0.0])  # huge, nearly flat and exactly flat logits
def test_very_large_and_flat_logits_greedy_equals_hf(arch, scale):
    target = tiny_model(arch, logit_scale=scale)
    draft = noisy_copy(tiny_model(arch, logit_scale=max(scale, 1.0)))
    expected = hf_refs(target)
    if scale == 0.0:
        assert expected == [[0] * NEW] * len(PROMPTS)  # every logit equal: the lowest id
    for kw in DRAFTERS + [dict(k=3, runner="paged")]:
        assert run(target, draft, **kw).token_ids == expected, kw
    # a temperature just above greedy over logits ~1e3-1e4 (logits / T ~ 1e9, finite in fp32) is still greedy
    if scale == 1e4:
        assert run(target, draft, k=3, temperature=2e-5, seed=0).token_ids == expected


def tied_logits_pair(arch: str):
    """A target whose logits tie exactly: rows 7 and 40 of its LM head are one vector w, rows 8 and 41 are -w,
    every other row 0, so the argmax is 7 or 8 (HF: the lowest id) and 40 or 41 ties with it. The draft
    scores 40 / 41 highest, so it proposes the later id of each tie."""
    target = tiny_model(arch)
    with torch.no_grad():
        head = target.get_output_embeddings().weight
        w = head[3].clone() * 50
        head.zero_()
        head[7], head[40], head[8], head[41] = w, w, -w, -w
    draft = copy.deepcopy(target)
    with torch.no_grad():
        head = draft.get_output_embeddings().weight
        head[7], head[8], head[40], head[41] = 0, 0, 1.5 * w, -1.5 * w
    return target, draft


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_greedy_ties_go_to_the_lowest_id_as_hfs_argmax(arch, dtype):
    target, draft = tied_logits_pair(arch)
    target, draft = target.to(dtype), draft.to(dtype)
    with torch.no_grad():
        last = target(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert last[7] == last[40] and last[8] == last[41]
    expected = hf_refs(target)
    assert all(t in (7, 8) for row in expected for t in row)
    for kw in DRAFTERS + [dict(k=3, runner="paged"), dict(k=3, runner="recompute")]:
        assert run(target, draft, **kw).token_ids == expected, kw


def test_top_k_1_keeps_every_token_tied_at_the_top_as_hf():
    """HF's top-k keeps every logit equal to the k-th largest: top_k=1 over a tie samples among the tied ids."""
    target, draft = tied_logits_pair("llama")
    for kw in (dict(k=2), dict(draft_tree=(2, 2, 4)), dict(draft="ngram", k=2)):
        out = generate([PROMPTS[0]] * 400, target, kw.pop("draft", draft), max_new_tokens=1, seed=list(range(400)),
                       temperature=1.0, top_k=1, eos_token_id=False, cost_probe=False, **kw)
        counts = Counter(row[0] for row in out.token_ids)
        assert set(counts) == {7, 40} and min(counts.values()) > 150, counts


# ------------------------------------------------------------------------------------------------ vocabularies
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("vocab", [1, 2])
def test_a_vocabulary_of_one_or_two_tokens(arch, vocab):
    target, draft = causal_lm(arch, vocab=vocab), causal_lm(arch, vocab=vocab, seed=1)
    prompts = [[0] * 5, [vocab - 1] * 3]
    expected = hf_refs(target, prompts)
    for kw in [dict(k=3), dict(k="auto"), dict(draft="ngram", k=3), dict(draft_tree=(1, 2, 2)),
               dict(k=3, logprobs=20)]:
        out = run(target, draft, prompts, **kw)
        assert out.token_ids == expected, kw
    assert all(len(entry.top) == vocab for entry in out.logprobs[0])
    sampled = run(target, draft, prompts, k=3, temperature=1.0, top_k=5, top_p=0.5, seed=0)
    assert all(0 <= t < vocab for row in sampled.token_ids for t in row)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("vocab,tree", [(1, (2, 2, 4)), (2, (3, 2, 4)), (96, (100, 1, 4))])
def test_a_tree_branching_wider_than_the_vocabulary_is_refused(arch, vocab, tree):
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): draft_tree=(b, d, N) with b larger than the draft's vocabulary raises torch's "RuntimeError: selected
    index k out of range" from Tensor.topk inside the first draft step (drafters/tree_drafter.py: grow_tree's
    ``logprobs.topk(branch)`` greedy, draw_without_replacement's ``q.topk(b)`` sampled), after the prefill.
    Promise: a clear error before decoding, or (b clamped to the vocabulary) the target's greedy tokens."""
    target, draft = causal_lm(arch, vocab=vocab), causal_lm(arch, vocab=vocab, seed=1)
    prompts = [[0] * 5, [vocab - 1] * 3]
    correct_or_refused(lambda: run(target, draft, prompts, draft_tree=tree), hf_refs(target, prompts),
                       "draft_tree", "vocabulary")


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_tied_embeddings(arch):
    target, draft = causal_lm(arch, tie=True), causal_lm(arch, seed=1, tie=True)
    assert target.get_output_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    expected = hf_refs(target)
    for kw in DRAFTERS + [dict(k=3, runner="paged")]:
        assert run(target, draft, **kw).token_ids == expected, kw


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_150k_vocabulary_with_a_small_hidden_size(arch):
    target = causal_lm(arch, vocab=150_000, hidden=16)
    draft = causal_lm(arch, vocab=150_000, hidden=16, seed=1)
    prompts = [[149_999, 5, 100_000, 7], [3, 4]]
    expected = hf_refs(target, prompts, new=6)
    for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(draft="ngram", k=2)):
        assert run(target, draft, prompts, new=6, **kw).token_ids == expected, kw
    sampled = run(target, draft, prompts, new=6, k=3, temperature=1.0, top_p=0.9, seed=0)
    assert all(0 <= t < 150_000 for row in sampled.token_ids for t in row)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])  # the draft's runner
def test_a_draft_scoring_more_ids_than_the_target_never_proposes_them(arch):
    """Tokenizer of 61 ids, target of 64, draft of 80 whose padding rows (64..79) win its argmax every time:
    its proposals are cut to the target's vocabulary (model_drafter._fit_vocab), greedy and sampled."""
    tokenizer = char_tokenizer()
    target = tiny_model("llama", vocab=64, logit_scale=4.0)
    draft = tiny_model(arch, vocab=80, seed=3, logit_scale=4.0)
    with torch.no_grad():
        draft.get_output_embeddings().weight[64:] *= 40.0
        assert (draft(torch.tensor([PROMPTS[0]])).logits.argmax(-1) >= 64).all()
    expected = hf_refs(target)
    for kw in DRAFTERS[:3]:
        out = run(target, draft, tokenizer=tokenizer, draft_tokenizer=tokenizer, **kw)
        assert out.token_ids == expected, kw
    sampled = run(target, draft, tokenizer=tokenizer, draft_tokenizer=tokenizer, k=3, temperature=1.0, seed=0)
    assert all(t < 64 for row in sampled.token_ids for t in row)
    with pytest.raises(VocabularyMismatchError, match="first ids only one of them has: 64, 65"):
        run(target, draft, k=3)  # without tokenizers nothing says which ids are real


def test_sampling_stays_the_targets_with_a_larger_or_smaller_draft_vocabulary():
    tokenizer = char_tokenizer(list("abcdef"))  # 8 ids
    target = tiny_model("llama", vocab=TINY_VOCAB, seed=3, logit_scale=3.0)
    wide = tiny_model("llama", vocab=12, seed=4, logit_scale=3.0)  # padding rows 8..11, loud
    with torch.no_grad():
        wide.lm_head.weight[TINY_VOCAB:] *= 5
    for kw in (dict(k=2), dict(draft_tree=(2, 2, 4))):
        p, out = sample_first_tokens(target, wide, tokenizer=tokenizer, draft_tokenizer=tokenizer, **kw)
        assert p > PASS_P and 0.05 < out.stats.acceptance_rate < 0.95, kw
    padded = tiny_model("gpt_neox", vocab=12, seed=3, logit_scale=3.0)  # a target padded past the tokenizer
    with torch.no_grad():
        padded.get_output_embeddings().weight[TINY_VOCAB:] *= 5
    narrow = tiny_model("llama", vocab=TINY_VOCAB, seed=4, logit_scale=3.0)
    p, out = sample_first_tokens(padded, narrow, k=2, tokenizer=tokenizer, draft_tokenizer=tokenizer)
    assert p > PASS_P
    assert any(t >= TINY_VOCAB for row in out.token_ids for t in row)  # the padding ids were emitted


# ------------------------------------------------------------------------------------------------ sampling
def test_sampling_with_half_precision_models_is_the_targets_distribution():
    target = tiny_model("llama", vocab=TINY_VOCAB, seed=3, logit_scale=3.0)
    draft = tiny_model("llama", vocab=TINY_VOCAB, seed=4, logit_scale=3.0)
    for t, d, kw in ((copy.deepcopy(target).bfloat16(), draft, dict(k=2)),  # lean target in bf16
                     (target, copy.deepcopy(draft).bfloat16(), dict(draft_tree=(2, 2, 4))),
                     (target, copy.deepcopy(draft).half(), dict(k=2))):
        p, out = sample_first_tokens(t, d, **kw)
        assert p > PASS_P and 0.05 < out.stats.acceptance_rate < 0.95, kw
    neox = tiny_model("gpt_neox", vocab=TINY_VOCAB, seed=3, logit_scale=3.0).half()  # paged, fp16
    neox_draft = tiny_model("gpt_neox", vocab=TINY_VOCAB, seed=4, logit_scale=3.0).bfloat16()
    p, _ = sample_first_tokens(neox, neox_draft, k=2)
    assert p > PASS_P


def test_sampling_with_a_draft_of_another_architecture_and_flat_or_broken_drafts():
    target = architectures.tiny_model("qwen2", vocab=TINY_VOCAB, logit_scale=3.0)  # lean
    gpt2 = architectures.tiny_model("gpt2", vocab=TINY_VOCAB, seed=1, logit_scale=3.0)  # paged
    p, out = sample_first_tokens(target, gpt2, k=2)
    assert p > PASS_P and out.plan.draft_runner == "paged"
    flat = tiny_model("llama", vocab=TINY_VOCAB, seed=4, logit_scale=0.0)  # q uniform
    assert sample_first_tokens(target, flat, k=2)[0] > PASS_P
    nan_draft = tiny_model("llama", vocab=TINY_VOCAB, seed=4, logit_scale=1e8).half()  # fp16 weights inf: NaN
    assert sample_first_tokens(target, nan_draft, draft_tree=(2, 2, 4))[0] > PASS_P


# ------------------------------------------------------------------------------------------------ architectures
PAIRS = [("llama", "gpt2"), ("gpt_neox", "qwen2"), ("phi", "mistral"), ("gemma", "llama"), ("qwen2", "gpt_neox"),
         ("gpt2", "phi"), ("mistral", "gemma2"), ("qwen3", "starcoder2")]


@pytest.mark.parametrize("target_type,draft_type", PAIRS)
def test_target_and_draft_of_different_architectures_and_runners(target_type, draft_type):
    target = architectures.tiny_model(target_type)
    draft = architectures.tiny_model(draft_type, seed=1)
    prompts = architectures.PROMPTS  # longer than the sliding windows (8) of mistral, gemma2, starcoder2
    expected = hf_refs(target, prompts, new=16)
    for kw in DRAFTERS:
        out = run(target, draft, prompts, new=16, **kw)
        assert out.token_ids == expected, kw
    lean = ("llama", "qwen2")  # (mistral's window of 8 is shorter than the cache: paged)
    assert out.plan.target_runner == ("lean" if target_type in lean else "paged")
    sampled = run(target, draft, prompts, new=16, k=3, temperature=0.8, top_p=0.9, seed=1)
    again = run(target, draft, prompts, new=16, k=3, temperature=0.8, top_p=0.9, seed=1)
    assert sampled.token_ids == again.token_ids


def test_sliding_windows_take_the_paged_runner_or_are_refused_by_the_lean_one():
    cfg = architectures.tiny_config("qwen2")
    cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = True, 8, 1
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{k: v for k, v in cfg.to_dict().items() if k != "layer_types"})
    target = transformers.Qwen2ForCausalLM(config).eval()
    target.generation_config.eos_token_id = None
    assert config.layer_types == ["full_attention", "sliding_attention"]
    prompts = architectures.PROMPTS
    expected = hf_refs(target, prompts, new=16)
    for kw in (dict(k=3), dict(draft_tree=(2, 3, 6))):
        out = run(target, noisy_copy(target), prompts, new=16, **kw)
        assert out.token_ids == expected and out.plan.target_runner == "paged"
    with pytest.raises(ValueError, match=r"runner='lean' cannot run the target model: layer types"):
        run(target, noisy_copy(target), prompts, k=3, runner="lean")


# ------------------------------------------------------------------------------------------------ positions
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "opt"])
def test_a_prompt_ending_at_the_context_limit_minus_max_new_tokens(model_type):
    cfg = architectures.tiny_config(model_type)
    for key in ("max_position_embeddings", "n_positions"):
        if hasattr(cfg, key):
            setattr(cfg, key, 40)
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    target.generation_config.eos_token_id = None
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(4)
    draft = noisy_copy(target)
    new = 10
    prompt = [(7 * i + 3) % 128 for i in range(40 - new + 1)]  # prompt + new - 1 (the last is never fed) = 40
    short = prompt[:5]
    expected = hf_refs(target, [prompt, short], new=new)
    for kw in (dict(k=None), dict(k="auto"), dict(draft="ngram")):
        out = run(target, draft, [prompt, short], new=new, **kw)
        assert out.token_ids == expected and out.plan.drafter == "none", kw  # no room for drafts: plain
    assert run(target, draft, [prompt[:-3], short], new=new).plan.slots == 1  # (3 positions: one draft slot)
    with pytest.raises(ValueError, match=r"prompt 0 has 31 tokens; with max_new_tokens=10 and 2 draft slots it "
                                         r"needs 45 cache positions but the cache holds 40"):
        run(target, draft, [prompt], new=new, k=2)
    with pytest.raises(ValueError, match=r"prompt 0 has 32 tokens; .* needs 41 cache positions but the cache holds 40"):
        run(target, draft, [prompt + [1]], new=new)


def llama_with_rope(rope: dict, *, max_positions: int = 64, seed: int = 0, qk_scale: float = 1.0,
                    hidden: int = 32, layers: int = 1):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None, tie_word_embeddings=False, rope_parameters=rope)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
        for layer in model.model.layers:  # sharper attention: the rotary frequencies matter more
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    return model


ROPES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_scaling_runs_on_the_paged_runner_and_equals_hf(name):
    target = llama_with_rope(ROPES[name])
    prompts = [[5, 17, 3, 44, 9, 12, 61, 7, 30, 2, 11, 14], [3, 4, 5]]
    expected = hf_refs(target, prompts, new=40)  # past 16 positions (llama3's and yarn's original length)
    for kw in DRAFTERS:
        out = run(copy.deepcopy(target), llama_with_rope(ROPES[name], seed=1), prompts, new=40, **kw)
        assert out.token_ids == expected and out.plan.target_runner == "paged", kw
    with pytest.raises(ValueError, match=r"runner='lean' cannot run the target model: rope_type"):
        run(target, "ngram", prompts, k=2, runner="lean")


DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 16.0}
DYNAMIC_PROMPTS = [[73, 24, 52, 86, 20, 48, 0, 27, 70, 66, 61, 12, 38, 44], [60, 19, 81, 9, 46, 14, 26, 72]]


def test_dynamic_rope_past_max_position_embeddings_keeps_the_targets_output_or_is_refused():
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): HF's dynamic NTK rope recomputes its frequencies from the furthest position of each forward once it
    passes max_position_embeddings (transformers' dynamic_rope_update). A verify pass reaches k positions
    further than a plain step, so past the limit the target scores with other frequencies than in its own
    decoding: the greedy tokens differ from HF's generate and from plain_generate, silently. max_seq_len past
    max_position_embeddings only warns "outputs there may degrade", yet running past it is what dynamic rope is
    for. plan._check_rope_switch refuses the same situation for longrope only. Promise: HF's tokens, or a
    clear refusal naming the rope."""
    target = llama_with_rope(DYNAMIC, max_positions=16, qk_scale=10.0, hidden=64, layers=2)
    expected = hf_refs(target, DYNAMIC_PROMPTS, new=16)
    assert plain(copy.deepcopy(target), DYNAMIC_PROMPTS[:1], new=16, max_seq_len=64) == expected[:1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the max_seq_len warning)
        for draft in (copy.deepcopy(target), "ngram"):
            correct_or_refused(lambda: run(copy.deepcopy(target), draft, DYNAMIC_PROMPTS, new=16, k=3,
                                           max_seq_len=64), expected, "dynamic")


def test_a_long_row_may_not_switch_a_longrope_targets_short_rows_to_its_long_factors():
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): HF's longrope takes the long factors for a whole forward once its furthest position passes
    original_max_position_embeddings. In a batch whose longest prompt is past it (which plan._check_rope_switch
    lets run: "long throughout"), every forward reaches past it, so the short rows, which alone would stay on
    the short factors, are scored with the long ones: their tokens depend on the batch (plain_generate too),
    silently, against "a row's tokens depend on its prompt and seed only, not on the batch". Promise: each
    row's own greedy tokens, or a clear refusal naming longrope."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [8.0] * 8,
            "original_max_position_embeddings": 16}
    target = llama_with_rope(rope, max_positions=256, qk_scale=10.0, hidden=64, layers=2)
    shorts = [[17, 72, 1], [8, 32, 15], [63, 57, 60, 83]]
    long = [(11 * i + 5) % 96 for i in range(20)]
    expected = hf_refs(target, shorts + [long], new=6)
    assert run(target, copy.deepcopy(target), shorts, new=6, k=2).token_ids == expected[:3]  # without the long row
    correct_or_refused(lambda: run(target, copy.deepcopy(target), shorts + [long], new=6, k=2), expected,
                       "longrope")
    correct_or_refused(lambda: plain_generate(shorts + [long], target, max_new_tokens=6, eos_token_id=False),
                       expected, "longrope")


def mpt_model(max_seq_len: int):
    cfg = architectures.tiny_config("mpt")
    cfg.max_seq_len = max_seq_len
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def test_mpt_runs_inside_its_alibi_table_and_is_refused_past_it():
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): MPT's context is config.max_seq_len (its ALiBi bias is built that long), which the plan never
    reads: plan._max_positions reads config.max_position_embeddings only (None for MPT), so nothing bounds
    the rows. And the paged runner attends over whole pages (DEFAULT_PAGE_SIZE = 16 keys each): an MPT with
    max_seq_len=24 fails inside HF's attention ("The size of tensor a (32) must match the size of tensor b (24)")
    for a 10-token prompt and 10 new tokens, which HF's generate runs. Promise: HF's tokens inside the context,
    a clear error past it."""
    target = mpt_model(24)
    prompt = list(range(1, 11))
    expected = hf_refs(target, [prompt], new=10)
    for draft in ("ngram", noisy_copy(target)):
        correct_or_refused(lambda: run(target, draft, [prompt], new=10, k=2), expected, "max_seq_len")
    correct_or_refused(lambda: plain_generate([prompt], target, max_new_tokens=10, eos_token_id=False), expected,
                       "max_seq_len")
    roomy = mpt_model(48)
    assert run(roomy, "ngram", [prompt], new=10, k=2).token_ids == hf_refs(roomy, [prompt], new=10)
    with pytest.raises(ValueError, match="48"):  # 40 + 10 positions past MPT's 48: refused, with the limit
        run(roomy, "ngram", [list(range(1, 41))], new=10, k=2)


@pytest.mark.parametrize("model_type", ["gptj", "ctrl"])
def test_a_sinusoidal_position_table_is_bounded_like_gpt2s_wpe(model_type):
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): generate()'s docstring: max_seq_len past max_position_embeddings warns, "a model with an absolute
    position table, GPT-2's wpe, is bounded by the table". plan._position_table recognises only nn.Embedding
    modules named wpe / embed_positions / position_embeddings; GPT-J's and CodeGen's sin/cos table is a buffer
    (rotary_emb.embed_positions) and CTRL's another (transformer.pos_encoding), so past it the run crashes with
    "IndexError: index 24 is out of bounds for dimension 0 with size 24" after some tokens were emitted
    (streamed). Promise: a clear ValueError before decoding, as for GPT-2."""
    cfg = architectures.tiny_config(model_type)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, 24)
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    target.generation_config.eos_token_id = None
    prompt = list(range(1, 21))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="24"):
            run(target, "ngram", [prompt], new=12, k=2, max_seq_len=64)


# ------------------------------------------------------------------------------------------------ model state
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_train_mode_requires_grad_and_gradient_checkpointing(arch):
    target = tiny_model(arch, logit_scale=4.0)
    draft = noisy_copy(target)
    expected = hf_refs(target)
    t, d = copy.deepcopy(target).train(), copy.deepcopy(draft).train()  # no dropout: deterministic
    for p in list(t.parameters()) + list(d.parameters()):
        p.requires_grad_(True)
    with torch.enable_grad():
        for kw in DRAFTERS:
            assert run(t, d, **kw).token_ids == expected, kw
        run(t, d, k=3, temperature=1.0, seed=0)
    assert t.training and all(p.grad is None for p in t.parameters())
    t.gradient_checkpointing_enable()
    d.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(draft="ngram", k=3)):
            assert run(t, d, **kw).token_ids == expected, kw
    with torch.inference_mode():
        assert run(target, draft, k=3).token_ids == expected


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_model_on_the_meta_device_is_refused(arch):
    target = tiny_model(arch)
    with pytest.raises(ValueError, match="target model's weights are on the meta device"):
        run(copy.deepcopy(target).to("meta"), "ngram", k=2)
    with pytest.raises(ValueError, match="meta"):
        run(target, copy.deepcopy(target).to("meta"), k=2)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("part", ["lm_head", "mlp"])
def test_a_model_partly_on_the_meta_device_is_refused(arch, part):
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): plan._check_model_state checks the first parameter only (plan.py, _Models.of passes
    ``next(target_model.parameters())``), so a target whose embedding is loaded but whose LM head or an MLP
    weight is still on the meta device (a partial load) runs: on the paged runner (gpt_neox) torch's
    F.linear(cpu, meta) returns an uninitialised CPU tensor, and generate() returns tokens from garbage logits
    (meta LM head: silently; meta MLP weight: NaN there, "chain_verify: target_logits: row 1 has a NaN"); on
    the lean runner (llama) it fails inside the kernels ("decoder_layers: weights[18] must be on the same
    device as x (cpu), got meta"). Promise: the refusal it gives a model wholly on meta."""
    target = tiny_model(arch)
    module = (target.get_output_embeddings() if part == "lm_head" else
              next(m for n, m in target.named_modules() if n.endswith(("mlp.up_proj", "mlp.dense_h_to_4h"))))
    module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"))
    for draft in ("ngram", tiny_model(arch, seed=1)):
        with pytest.raises(ValueError, match="meta device"):
            run(target, draft, k=2)


def test_weights_that_share_storage():
    target = tiny_model("llama", logit_scale=4.0, layers=2, hidden=64)
    expected = hf_refs(target)
    fused = copy.deepcopy(target)  # q, k and v: views of one fused tensor (storage offsets)
    for layer in fused.model.layers:
        attn = layer.self_attn
        qkv = torch.cat([attn.q_proj.weight.data, attn.k_proj.weight.data, attn.v_proj.weight.data]).clone()
        q, k = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        attn.q_proj.weight = torch.nn.Parameter(qkv[:q])
        attn.k_proj.weight = torch.nn.Parameter(qkv[q:q + k])
        attn.v_proj.weight = torch.nn.Parameter(qkv[q + k:])
    shared = copy.deepcopy(target)  # one Parameter in two layers
    shared.model.layers[1].mlp.up_proj.weight = shared.model.layers[0].mlp.up_proj.weight
    for model in (fused, shared):
        ref = expected if model is fused else hf_refs(model)
        for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(draft="ngram", k=3), dict(k=3, runner="paged")):
            assert run(model, noisy_copy(model), **kw).token_ids == ref, kw
        assert run(model, model, k=3).token_ids == ref  # the draft is the target itself
    draft = noisy_copy(target)
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight  # the draft shares the target's embedding
    assert run(target, draft, k=3).token_ids == expected
    with torch.no_grad():  # in-place edits and a replaced Parameter are seen by the next call
        target.lm_head.weight.data = target.lm_head.weight.data.flip(0).clone()
    target.model.layers[1].self_attn.q_proj.weight = torch.nn.Parameter(torch.randn(64, 64))
    assert run(target, draft, k=3).token_ids == hf_refs(target)


NON_CONTIGUOUS = {
    "down_proj transposed twice": lambda m: [setattr(l.mlp.down_proj, "weight", torch.nn.Parameter(
        l.mlp.down_proj.weight.data.t().contiguous().t())) for l in m.model.layers],
    "lm_head every other column": lambda m: setattr(m.lm_head, "weight", torch.nn.Parameter(
        torch.stack([m.lm_head.weight.data, m.lm_head.weight.data], -1)[..., 0])),
}


@pytest.mark.parametrize("how", sorted(NON_CONTIGUOUS))
def test_non_contiguous_weights_run_on_the_paged_runner(how):
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): a Llama whose weight is a non-contiguous view (a transposed checkpoint tensor, a strided slice)
    fails in the CPU kernels: "RuntimeError: fused_linear: weights[0] must be contiguous" (and "greedy_chain:
    embed must be contiguous" for the embedding of a draft), while the paged runner and HF run it.
    runners/lean.py unsupported_reason does not look at the weights' layout, nor does _llama_weights copy
    them. Promise: HF's tokens (a contiguous copy, or the paged runner) or a clear refusal."""
    target = tiny_model("llama", logit_scale=4.0, layers=2, hidden=64)
    NON_CONTIGUOUS[how](target)
    assert not all(p.is_contiguous() for p in target.parameters())
    expected = hf_refs(target)
    assert run(target, noisy_copy(target), k=3, runner="paged").token_ids == expected
    for draft in (noisy_copy(target), "ngram"):
        correct_or_refused(lambda: run(target, draft, k=3), expected, "contiguous")


def test_a_target_with_an_embedding_in_another_dtype_runs():
    """Was a bug (fixed; the tests accept the correct output or a clear refusal): a Llama whose embedding is bf16 and the rest fp32 (a partial cast; HF's generate runs it) fails in
    every runner that keeps a cache: the lean runner takes the embedding's dtype for the model's
    (runners/lean.py, ``weight_dtype = model.model.embed_tokens.weight.dtype``, then bf16_activations over
    fp32 projections: "fused_linear: bf16_activations needs bf16 weights, got Float"), the paged runner sizes
    its cache in the first parameter's dtype (runners/paged.py, ``param = next(model.parameters())``: "kv_write:
    key must have the dtype of kv_cache (BFloat16), got Float"). Promise: HF's tokens, or a clear refusal
    naming the dtypes."""
    target = tiny_model("llama", logit_scale=4.0, layers=2, hidden=64)
    target.model.embed_tokens.to(torch.bfloat16)
    expected = hf_refs(target)
    assert run(target, noisy_copy(target), k=3, runner="recompute").token_ids == expected
    for kw in (dict(k=3), dict(k=3, runner="paged")):
        correct_or_refused(lambda: run(target, noisy_copy(tiny_model("llama", layers=2, hidden=64)), **kw),
                           expected, "dtype")


# ------------------------------------------------------------------------------------------------ logprobs
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_greedy_logprobs_against_plain_decoding(arch):
    """The lean runner's CPU kernels give plain decoding's logprobs bit for bit. Over the paged runner (HF's
    modules) a verify pass of several tokens rounds differently from a one-token pass: 1 ulp-level
    differences (4.8e-7 measured), though README "Serve" says greedy logprobs "equal plain decoding's bit for
    bit" without naming the runner."""
    target = tiny_model(arch, logit_scale=1.0, layers=2, hidden=64)
    draft = noisy_copy(target)
    before = plain_generate(PROMPTS, target, max_new_tokens=16, eos_token_id=False, logprobs=2)
    after = generate(PROMPTS, target, draft, k=3, max_new_tokens=16, eos_token_id=False, logprobs=2)
    assert after.token_ids == before.token_ids
    if arch == "llama":
        assert after.logprobs == before.logprobs
    for row_a, row_b in zip(after.logprobs, before.logprobs):
        for a, b in zip(row_a, row_b):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
