"""generate() called the way Hugging Face users call things: tokenizer outputs as prompts, generation_config
EOS forms, greedy equality with HF's own generate() across architectures, drafters and runners, models a
user has customised (subclassed forward, patched modules, hooks), inference_mode, the sampling surface
(limits that must be greedy, logit_bias key types), logprobs against an independent reference of the
processed target, streams, and state that must not leak between calls.

Tests whose docstring starts with "Was a defect" assert the correct behaviour of something that was wrong when the
sweep ran, fixed since.
"""
from __future__ import annotations

import copy
import threading
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import specdec_ext
from specdec_ext import generate, plain_generate
from test_generate_utils import CHAR_VOCAB, char_tokenizer, hf_greedy, noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW = 16


def _quiet_hf_greedy(model, prompt, new=NEW):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_greedy(model, prompt, new)


@pytest.fixture(scope="module")
def llama():
    target = tiny_model("llama", hidden=48, layers=2, logit_scale=4.0, vocab=64)
    return target, noisy_copy(target, noise=0.3)


@pytest.fixture(scope="module")
def llama_refs(llama):
    return [_quiet_hf_greedy(llama[0], p) for p in PROMPTS]


@pytest.fixture(scope="module")
def text_pair():
    tokenizer = char_tokenizer()
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.3), tokenizer


@pytest.fixture(scope="module")
def bpe_pair():
    """The bundled BPE tokenizer (llguidance needs a real one) over tiny random models of its vocabulary."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(Path(specdec_ext.__file__).parent / "default_pair" / "tokenizer"))
    target = tiny_model("llama", vocab=len(tokenizer), hidden=32, layers=1, seed=3, logit_scale=30.0)
    return target, noisy_copy(target, noise=0.3), tokenizer


def _greedy(target, draft, prompts=PROMPTS, **kw):
    return generate(prompts, target, draft, **{**dict(max_new_tokens=NEW, eos_token_id=False), **kw})


# ============================================================================ defects found (fixed)
BIAS_ID = 9


class _BiasedLlama(transformers.LlamaForCausalLM):
    """A user's subclass that changes the logits in forward (a soft-cap, a bias, a mask: common in research
    code); HF's generate() calls this forward, so its output is the biased model's."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                              use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        bias = torch.zeros(out.logits.shape[-1], dtype=out.logits.dtype)
        bias[BIAS_ID] = 100.0
        out.logits = out.logits + bias
        return out


def _as(cls, model):
    other = cls(model.config)
    other.load_state_dict(model.state_dict())
    other.generation_config = copy.deepcopy(model.generation_config)
    return other.eval()


def test_a_subclass_whose_forward_changes_the_logits_decodes_as_hf_generate(llama):
    """Was a defect, fixed: the lean runner (runner="auto" for any model_type "llama") reads the weights and never calls the
    model's forward, so a LlamaForCausalLM subclass that overrides forward is decoded as if it were plain Llama:
    silently other tokens than HF's generate() (the paged and recompute runners give HF's). Expected: auto picks
    a runner that calls the forward (or refuses); runner="lean" refuses with a reason."""
    target, draft = llama
    biased = _as(_BiasedLlama, target)
    expected = [_quiet_hf_greedy(biased, p) for p in PROMPTS]
    assert expected[0][:3] == [BIAS_ID] * 3  # (the override shows in HF's output)
    assert _greedy(biased, draft, k=3, runner="paged").token_ids == expected  # the paged runner gets it right
    assert _greedy(biased, draft, k=3).token_ids == expected  # runner="auto"
    with pytest.raises(ValueError, match="forward"):
        _greedy(biased, draft, k=3, runner="lean")


class _IdentityNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """A norm subclass with its own forward (here: skip the normalisation)."""

    def forward(self, hidden_states):
        return hidden_states


def _patch_act_fn(model):
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.Tanh()


def _patch_mlp_forward(model):
    mlp = model.model.layers[1].mlp
    original = mlp.forward
    mlp.forward = lambda x: original(x) * 3.0


def _patch_linear_forward(model):
    linear = model.model.layers[0].mlp.down_proj
    original = linear.forward
    linear.forward = lambda x: original(x) * 0.0


def _patch_norm_class(model):
    for layer in model.model.layers:
        norm = _IdentityNorm(layer.input_layernorm.weight.shape[0])
        norm.weight.data.copy_(layer.input_layernorm.weight.data)
        layer.input_layernorm = norm


@pytest.mark.parametrize("patch", [_patch_act_fn, _patch_mlp_forward, _patch_linear_forward, _patch_norm_class],
                         ids=["act_fn-tanh", "mlp-instance-forward", "linear-instance-forward", "norm-subclass"])
def test_a_patched_module_inside_a_llama_is_not_silently_ignored(llama, patch):
    """Was a defect, fixed: runners/lean.py unsupported_reason checks that each projection is a plain nn.Linear *class* and
    that no hooks are registered, but not an instance-level ``module.forward = ...`` patch, a replaced
    ``mlp.act_fn`` or a norm subclass with its own forward: the lean runner (auto's choice for Llama) then runs
    plain Llama math and returns other tokens than HF's generate() of the patched model, silently. The paged
    runner, which calls the modules, gives HF's tokens."""
    target, draft = llama
    model = copy.deepcopy(target)
    patch(model)
    expected = [_quiet_hf_greedy(model, p) for p in PROMPTS]
    assert expected != [_quiet_hf_greedy(target, p) for p in PROMPTS]  # (the patch changes HF's output)
    assert _greedy(model, draft, k=3, runner="paged").token_ids == expected
    assert _greedy(model, draft, k=3).token_ids == expected


def test_a_final_norm_replaced_by_another_module_runs_or_is_refused_clearly(llama):
    """Was a defect, fixed: ``model.model.norm = torch.nn.Identity()`` (an ablation; HF's generate() runs it) crashes the
    default runner with ``AttributeError: 'Identity' object has no attribute 'weight'`` from inside the lean
    runner, instead of auto falling back to the paged runner (which gives HF's tokens)."""
    target, draft = llama
    model = copy.deepcopy(target)
    model.model.norm = torch.nn.Identity()
    expected = [_quiet_hf_greedy(model, p) for p in PROMPTS]
    assert _greedy(model, draft, k=3, runner="paged").token_ids == expected
    assert _greedy(model, draft, k=3).token_ids == expected


class _PassThroughNeoX(transformers.GPTNeoXForCausalLM):
    def forward(self, *args, **kwargs):  # the usual wrapper signature (logging, profiling, adapters)
        return super().forward(*args, **kwargs)


def test_a_pass_through_forward_taking_kwargs_is_not_refused_for_want_of_position_ids():
    """Was a defect, fixed: runners/support.py looks for "position_ids" among the forward's named parameters, so a subclass
    (or an instance wrapper) whose forward is ``forward(self, *args, **kwargs)`` is refused with a false
    reason: "its forward takes no position_ids (it computes positions from the cache length ...)" although
    it passes position_ids on to HF's forward, and HF's generate() runs it."""
    target = tiny_model("gpt_neox", hidden=48, layers=2, logit_scale=4.0, vocab=64)
    draft = noisy_copy(target, noise=0.3)
    expected = [_quiet_hf_greedy(target, p) for p in PROMPTS]
    wrapped = _as(_PassThroughNeoX, target)
    assert [_quiet_hf_greedy(wrapped, p) for p in PROMPTS] == expected
    assert _greedy(wrapped, draft, k=3).token_ids == expected
    instance = copy.deepcopy(target)
    original = instance.forward
    instance.forward = lambda *a, **kw: original(*a, **kw)
    assert _greedy(instance, draft, k=3).token_ids == expected


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_stream_started_under_inference_mode_can_be_finished_outside_it(arch):
    """Was a defect, fixed: a web handler under ``@torch.inference_mode()`` makes the stream and takes its first piece; the
    rest is consumed after the handler returned (or on another thread: inference mode is thread-local, and the
    docstring says a stream "may be consumed on any thread"). The next step raises ``RuntimeError: Inplace
    update to inference tensor outside InferenceMode is not allowed``: the loop's buffers were made as
    inference tensors and are written in place outside the mode. (The reverse order works.)"""
    target = tiny_model(arch, hidden=48, layers=2, logit_scale=4.0, vocab=64)
    draft = noisy_copy(target, noise=0.3)
    expected = _greedy(target, draft, k=3).token_ids
    with torch.inference_mode():
        stream = _greedy(target, draft, k=3, stream=True)
        next(stream)
    list(stream)
    assert stream.result.token_ids == expected

    with torch.inference_mode():
        handed = _greedy(target, draft, k=3, stream=True)
        next(handed)
    errors = []

    def consume():
        try:
            list(handed)
        except Exception as error:  # (reported below)
            errors.append(error)

    worker = threading.Thread(target=consume)
    worker.start()
    worker.join()
    assert errors == [] and handed.result.token_ids == expected


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_greedy_tree_call_under_inference_mode_does_not_break_the_next_call(arch):
    """Was a defect, fixed: the tree drafter's node calibration is kept per draft model across calls
    (drafters/calibration.py); made inside ``torch.inference_mode()`` its tensors are inference tensors, and the
    next greedy draft_tree call on the same draft outside the mode dies in ``calibration.observe``
    (``scatter_add_``): "Inplace update to inference tensor outside InferenceMode is not allowed"."""
    target = tiny_model(arch, hidden=48, layers=2, logit_scale=4.0, vocab=64)
    draft = noisy_copy(target, noise=0.3)
    expected = [_quiet_hf_greedy(target, p) for p in PROMPTS]
    with torch.inference_mode():
        assert _greedy(target, draft, draft_tree=(2, 2, 4)).token_ids == expected
    assert _greedy(target, draft, draft_tree=(2, 2, 4)).token_ids == expected


def test_logit_bias_takes_numpy_and_torch_integers_as_the_other_arguments_do(llama):
    """Was a defect, fixed: every other integer argument of generate() takes numpy / torch integers (prompts, k, top_k,
    seed, eos_token_id, max_new_tokens) and temperature takes np.float32, but a logit_bias key np.int64(9) is
    refused as "not an integer token id" (false: it is one; ids from np.argsort / torch.topk are such keys) and
    a value np.float32(5.0) as "must be a number"."""
    target, draft = llama
    expected = _greedy(target, draft, k=3, logit_bias={BIAS_ID: 5.0}).token_ids
    assert expected[0][:3] == [BIAS_ID] * 3
    for bias in ({np.int64(BIAS_ID): 5.0}, {torch.tensor(BIAS_ID): 5.0}, {BIAS_ID: np.float32(5.0)}):
        assert _greedy(target, draft, k=3, logit_bias=bias).token_ids == expected, bias


def test_logit_bias_naming_one_token_twice_is_refused(llama):
    """Was a defect (minor), fixed: {9: 5.0, "9": -5.0} names token 9 twice with opposite biases; it is taken silently, and
    the bias that wins is the larger one whatever the order (Processing.of sorts the (id, bias) pairs and the
    last of a token's entries wins), not an error naming the duplicated id."""
    target, draft = llama
    with pytest.raises(ValueError, match="9"):
        _greedy(target, draft, k=3, logit_bias={BIAS_ID: 5.0, str(BIAS_ID): -5.0})


@pytest.mark.parametrize("field,value", [("num_beams", 4), ("forced_eos_token_id", 7),
                                         ("exponential_decay_length_penalty", (2, 1.5))])
def test_generation_config_settings_that_change_hfs_greedy_output_are_warned(llama, field, value):
    """Was a defect, fixed: README: generate() "warns where the config sets sampling or penalties that transformers'
    generate() would apply". A generation_config with num_beams=4 (beam search), forced_eos_token_id or
    exponential_decay_length_penalty (a length penalty) makes HF's model.generate() return other tokens (checked
    here), yet generate() decodes greedily without a word (UNREAD_GENERATION_FIELDS lists do_sample,
    repetition_penalty, no_repeat_ngram_size, ... but none of these)."""
    target, draft = llama
    model = copy.deepcopy(target)
    model.generation_config.eos_token_id = BIAS_ID
    setattr(model.generation_config, field, value)
    ids = torch.tensor([PROMPTS[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, pad_token_id=0)
    ours = generate([PROMPTS[0]], copy.deepcopy(model), draft, max_new_tokens=12, k=3)
    assert hf[0, len(PROMPTS[0]):].tolist() != ours.token_ids[0]  # (HF applies the setting)
    with pytest.warns(UserWarning, match=field):
        generate([PROMPTS[0]], model, draft, max_new_tokens=12, k=3)


# ============================================================================ greedy equals HF
ARCH_TYPES = ["llama", "gpt2", "qwen2", "mistral", "gpt_neox", "phi", "gemma"]
LEAN_TYPES = ("llama", "qwen2")  # (the tiny mistral has a sliding window shorter than the cache)
DRAFT_KINDS = [dict(k=1), dict(k=8), dict(k="auto"), dict(), dict(draft_tree=(2, 3, 6)),
               dict(draft="ngram", k=1), dict(draft="ngram", k=8), dict(draft="ngram")]


@pytest.mark.parametrize("model_type", ARCH_TYPES)
def test_greedy_equals_hf_generate_for_every_drafter_and_runner(model_type):
    import architectures

    target = architectures.tiny_model(model_type)
    draft = architectures.noisy_copy(target)
    prompts = architectures.PROMPTS
    expected = [architectures.hf_greedy(target, p, NEW) for p in prompts]
    for runner in ("auto", "lean", "paged", "recompute"):
        for kind in DRAFT_KINDS:
            kw = dict(kind)
            drafter = kw.pop("draft", draft)
            if runner == "lean" and model_type not in LEAN_TYPES:
                with pytest.raises(ValueError, match="runner='lean' cannot run the target model"):
                    _greedy(target, drafter, prompts, runner=runner, **kw)
                continue
            out = _greedy(target, drafter, prompts, runner=runner, **kw)
            assert out.token_ids == expected, (runner, kind)
            assert out.finish_reasons == ["length"] * len(prompts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_half_precision_targets_equal_hfs_greedy_with_every_drafter(arch, dtype):
    target = tiny_model(arch, hidden=48, layers=2, logit_scale=4.0, vocab=64)
    fp32_draft = noisy_copy(target, noise=0.3)
    half = copy.deepcopy(target).to(dtype)
    expected = [_quiet_hf_greedy(half, p) for p in PROMPTS]
    for drafter, kw in ((copy.deepcopy(fp32_draft).to(dtype), dict(k=3)), (fp32_draft, dict(k=3)),
                        ("ngram", dict(k=3)), (fp32_draft, dict(draft_tree=(2, 2, 4))),
                        (fp32_draft, dict(k=3, runner="paged"))):
        assert _greedy(half, drafter, **kw).token_ids == expected, kw


# ============================================================================ prompts as HF users hold them
def test_prompt_tensors_and_arrays_of_any_integer_kind_equal_the_list(llama):
    target, draft = llama
    expected = _greedy(target, draft, [PROMPTS[0]], k=3).token_ids
    for prompt in (torch.tensor(PROMPTS[0], dtype=torch.int32), torch.tensor(PROMPTS[0], dtype=torch.uint8),
                   torch.tensor([PROMPTS[0]], dtype=torch.int16), np.array(PROMPTS[0], dtype=np.int32),
                   [torch.tensor(PROMPTS[0])], tuple(PROMPTS[0]), [np.array(PROMPTS[0], dtype=np.uint16)]):
        assert _greedy(target, draft, prompt, k=3).token_ids == expected, prompt
    # a non-contiguous [B, T] view (the columns of a transposed batch)
    grid = torch.arange(5, 45).view(4, 10)
    view = grid.t()[:, 1:4]
    assert not view.is_contiguous()
    assert _greedy(target, draft, view, k=3).token_ids == _greedy(target, draft, view.tolist(), k=3).token_ids
    with pytest.raises(TypeError, match="prompt 0 must be a string or a list of int token ids"):
        _greedy(target, draft, torch.tensor([5.0, 6.0]), k=3)  # float ids are no ids
    with pytest.raises(ValueError, match="prompts is empty"):
        _greedy(target, draft, torch.zeros(0, 3, dtype=torch.long), k=3)


def test_a_batch_encoding_is_refused_and_mask_stripped_rows_equal_hfs_padded_batch(text_pair):
    """A tokenizer's padded BatchEncoding is not a prompt (its keys must not be read as two text prompts);
    rows cut by their attention_mask, from a left- or right-padded batch, give the text prompts' tokens, which
    equal HF's generate(**encoding) over the left-padded batch."""
    target, draft, tokenizer = text_pair
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    prompts = ["def f(x):\n", "import os\nimport ", "a = 1"]
    from_text = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=12, k=3, eos_token_id=False)
    for side in ("left", "right"):
        tokenizer.padding_side = side
        encoding = tokenizer(prompts, return_tensors="pt", padding=True)
        with pytest.raises(TypeError, match="BatchEncoding"):
            generate(encoding, target, draft, tokenizer=tokenizer, max_new_tokens=4, k=3)
        with pytest.raises(TypeError, match="dict"):
            generate(dict(encoding), target, draft, tokenizer=tokenizer, max_new_tokens=4, k=3)
        rows = [ids[mask.bool()] for ids, mask in zip(encoding["input_ids"], encoding["attention_mask"])]
        out = generate(rows, target, draft, tokenizer=tokenizer, max_new_tokens=12, k=3, eos_token_id=False)
        assert out.token_ids == from_text.token_ids and out.text == from_text.text
        assert out.prompt_token_ids == from_text.prompt_token_ids
    tokenizer.padding_side = "left"
    encoding = tokenizer(prompts, return_tensors="pt", padding=True)
    hf = target.generate(**encoding, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert hf[:, encoding["input_ids"].shape[1]:].tolist() == from_text.token_ids


# ============================================================================ EOS forms
def test_eos_ids_in_every_form_hf_configs_and_users_give(llama, llama_refs):
    target, draft = llama
    eos_a, eos_b = llama_refs[0][5], llama_refs[1][3]
    assert eos_a not in llama_refs[0][:5] and eos_b not in llama_refs[1][:3]
    expected = [llama_refs[0][:6], llama_refs[1][:4]]
    for eos in ([eos_a, eos_b], torch.tensor([eos_a, eos_b]), np.array([eos_a, eos_b]), (eos_b, eos_a)):
        out = _greedy(target, draft, k=3, eos_token_id=eos)
        assert out.token_ids == expected and out.finish_reasons == ["eos", "eos"], eos
    for config_eos in ([eos_a, eos_b], torch.tensor([eos_a, eos_b])):
        model = copy.deepcopy(target)
        model.generation_config.eos_token_id = config_eos
        for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(k="auto")):
            out = generate(PROMPTS, model, draft, max_new_tokens=NEW, **kw)
            assert out.token_ids == expected, (config_eos, kw)
        assert generate(PROMPTS, model, "ngram", max_new_tokens=NEW, k=3).token_ids == expected
        assert plain_generate(PROMPTS, model, max_new_tokens=NEW).token_ids == expected
    # only the generation_config's EOS is read (as HF's generate): a model config EOS differing from it is not
    model = copy.deepcopy(target)
    model.generation_config.eos_token_id = eos_a
    model.config.eos_token_id = eos_b
    out = generate(PROMPTS, model, draft, max_new_tokens=NEW, k=3)
    assert out.token_ids == [llama_refs[0][:6], llama_refs[1]] and out.finish_reasons == ["eos", "length"]
    # no EOS anywhere, an empty list, False: nothing ends a row
    for eos in ([], False, None):
        assert _greedy(target, draft, k=3, eos_token_id=eos).token_ids == llama_refs
    # an EOS inside (or ending) the prompt does not end the row
    out = generate([[5, eos_a, 7], PROMPTS[0] + [eos_a]], target, draft, max_new_tokens=8, k=3, eos_token_id=eos_a)
    assert [len(t) for t in out.token_ids] != [0, 0]
    for prompt, tokens in zip([[5, eos_a, 7], PROMPTS[0] + [eos_a]], out.token_ids):
        ref = _quiet_hf_greedy(target, prompt, 8)
        cut = ref[: ref.index(eos_a) + 1] if eos_a in ref else ref
        assert tokens == cut


def test_ragged_eos_rows_in_text_results_and_streams(text_pair):
    target, draft, tokenizer = text_pair
    prompts = ["def f(x):\n", "import os\nimport ", "a"]
    free = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=40, k=3, eos_token_id=False)
    eos = Counter(t for row in free.token_ids for t in row).most_common(1)[0][0]
    cuts = [row[: row.index(eos) + 1] if eos in row else row for row in free.token_ids]
    assert len({len(c) for c in cuts}) > 1  # ragged
    for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(k="auto"), dict(draft="ngram", k=4)):
        kw = dict(kw)
        drafter = kw.pop("draft", draft)
        out = generate(prompts, target, drafter, tokenizer=tokenizer, max_new_tokens=40, eos_token_id=eos, logprobs=1,
                       **kw)
        assert out.token_ids == cuts, kw
        assert out.text == [tokenizer.decode(c, skip_special_tokens=True) for c in cuts]
        assert [[e.token for e in row] for row in out.logprobs] == cuts
        stream = generate(prompts, target, drafter, tokenizer=tokenizer, max_new_tokens=40, eos_token_id=eos,
                          stream=True, **kw)
        ids, texts = [[] for _ in prompts], ["" for _ in prompts]
        for piece in stream:
            ids[piece.index] += piece.token_ids
            texts[piece.index] += piece
        assert ids == cuts and texts == out.text and stream.result.finish_reasons == out.finish_reasons


# ============================================================================ models as users hold them
def test_models_that_hf_generate_ran_on_hooks_compile_and_config_flags(llama, llama_refs):
    target, draft = llama
    model = copy.deepcopy(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=True, top_k=5, pad_token_id=0)
    assert _greedy(model, draft, k=3).token_ids == llama_refs  # HF's generate() first
    assert [_quiet_hf_greedy(model, p) for p in PROMPTS] == llama_refs  # and after ours
    # a forward hook on the LM head that changes the logits: every runner calls it, as HF does
    hooked = copy.deepcopy(target)
    bias = torch.zeros(64)
    bias[BIAS_ID] = 100.0
    handle = hooked.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    expected = [_quiet_hf_greedy(hooked, p) for p in PROMPTS]
    assert expected[0][0] == BIAS_ID
    for runner in ("auto", "paged", "recompute"):
        assert _greedy(hooked, draft, k=3, runner=runner).token_ids == expected, runner
    handle.remove()
    assert _greedy(hooked, draft, k=3).token_ids == llama_refs  # the hook gone, the plain tokens again
    # torch.compile'd models (OptimizedModule) as target and draft
    assert _greedy(torch.compile(target), torch.compile(draft), k=3).token_ids == llama_refs
    # use_cache=False in the config, a pad id set
    flags = copy.deepcopy(target)
    flags.config.use_cache = False
    flags.generation_config.use_cache = False
    flags.config.pad_token_id = 0
    flags.generation_config.pad_token_id = 0
    assert _greedy(flags, draft, k=3).token_ids == llama_refs
    assert _greedy(flags, draft, k=3, runner="paged").token_ids == llama_refs


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_dropout_in_train_mode_is_refused_by_name_and_the_mode_is_left_alone(arch):
    target = tiny_model(arch, hidden=48, layers=2, logit_scale=4.0, vocab=64)
    config = copy.deepcopy(target.config)
    config.attention_dropout = 0.5
    if arch == "gpt_neox":
        config.hidden_dropout = 0.5
    noisy = type(target)(config)
    noisy.load_state_dict(target.state_dict())
    noisy.generation_config = copy.deepcopy(target.generation_config)
    noisy.train()
    for run in (lambda: _greedy(noisy, noisy_copy(target), k=3), lambda: _greedy(noisy, "ngram", k=3),
                lambda: plain_generate(PROMPTS, noisy, max_new_tokens=4)):
        with pytest.raises(ValueError, match=r"target model is in training mode with dropout.*model\.eval\(\)"):
            run()
    with pytest.raises(ValueError, match=r"draft model is in training mode with dropout"):
        _greedy(target, noisy, k=3)
    assert noisy.training


# ============================================================================ sampling surface
def test_sampling_limits_that_leave_one_token_are_greedy_with_processors(llama):
    target, draft = llama
    penalties = dict(repetition_penalty=1.5, presence_penalty=0.4, logit_bias={"20": 1.0})
    greedy = _greedy(target, draft, k=3, **penalties).token_ids
    for filt in (dict(temperature=1.0, top_k=1), dict(temperature=1e-6), dict(temperature=1.0, top_p=1e-7),
                 dict(temperature=0.8, min_p=1.0)):
        for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(draft="ngram", k=3)):
            kw = dict(kw)
            drafter = kw.pop("draft", draft)
            assert _greedy(target, drafter, seed=3, **filt, **penalties, **kw).token_ids == greedy, (filt, kw)


def test_seeded_sampling_reproduces_and_the_default_k_is_the_fixed_one(llama):
    target, draft = llama
    run = dict(temperature=0.8, seed=11)
    default = _greedy(target, draft, **run).token_ids
    assert default == _greedy(target, draft, k=4, **run).token_ids  # docstring: k=None seeded is FIXED_K = 4
    assert default == _greedy(target, draft, k=4, runner="paged", **run).token_ids
    assert default == _greedy(target, draft, k=4, seed=[11, 11], temperature=0.8).token_ids
    assert default == _greedy(target, draft, k=4, seed=np.int64(11), temperature=0.8).token_ids
    assert default == _greedy(target, draft, k=4, seed=torch.tensor(11), temperature=0.8).token_ids
    assert _greedy(target, draft, [PROMPTS[1]], **run).token_ids[0] == default[1]  # batch-independent
    uniform = _greedy(target, draft, temperature=float("inf"), seed=0, k=3).token_ids
    assert uniform == _greedy(target, draft, temperature=float("inf"), seed=0, k=3).token_ids
    assert len(set(uniform[0])) > 8  # (a uniform draw over 64 ids: not one token repeated)


def _processed(raw, prompt, history, opts):
    logits = raw.astype(np.float64).copy()
    for token, bias in opts["logit_bias"].items():
        logits[int(token)] += bias
    seen = np.zeros(len(logits), dtype=bool)
    seen[list(prompt) + list(history)] = True
    r = opts["repetition_penalty"]
    logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
    counts = np.bincount(np.asarray(history, dtype=np.int64), minlength=len(logits)).astype(np.float64)
    return logits - opts["frequency_penalty"] * counts - opts["presence_penalty"] * (counts > 0)


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_logprobs_equal_an_independent_log_softmax_of_the_processed_hf_logits(arch):
    """Each new token's logprob and its top 3, for every drafter and temperature, against HF's own forward
    over prompt + tokens, processed here (logit_bias, repetition, frequency, presence) and divided by T."""
    target = tiny_model(arch, hidden=48, layers=2, logit_scale=2.0, vocab=64)
    draft = noisy_copy(target, noise=0.3)
    opts = dict(logit_bias={BIAS_ID: 2.0, "20": -3.0}, repetition_penalty=1.3, presence_penalty=0.5,
                frequency_penalty=0.3)
    for temperature in (0.0, 0.7, 1.5):
        for kw in (dict(k=3), dict(draft="ngram", k=3), dict(draft_tree=(2, 2, 4)), dict(k=1, runner="paged")):
            kw = dict(kw)
            drafter = kw.pop("draft", draft)
            out = _greedy(target, drafter, max_new_tokens=10, temperature=temperature, seed=1, logprobs=3, **opts,
                          **kw)
            for prompt, tokens, entries in zip(PROMPTS, out.token_ids, out.logprobs):
                with torch.no_grad():
                    logits = target(torch.tensor([prompt + tokens])).logits[0].double().numpy()
                for i, (token, entry) in enumerate(zip(tokens, entries)):
                    processed = _processed(logits[len(prompt) - 1 + i], prompt, tokens[:i], opts)
                    if temperature == 0.0:
                        assert token == int(np.argmax(processed))
                    ref = _log_softmax(processed / (temperature or 1.0))
                    assert entry.token == token
                    assert entry.logprob == pytest.approx(ref[token], abs=1e-5)
                    assert [t for t, _ in entry.top] == list(np.argsort(-ref, kind="stable")[:3])
                    assert [v for _, v in entry.top] == pytest.approx(sorted(ref, reverse=True)[:3], abs=1e-5)


# ============================================================================ results, stops and streams
def test_max_new_tokens_0_and_1_and_result_shapes(text_pair):
    target, draft, tokenizer = text_pair
    prompts = ["def f(x):\n", "a"]
    none = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=0, logprobs=2)
    assert none.token_ids == [[], []] and none.text == ["", ""] and none.finish_reasons == ["length"] * 2
    assert none.logprobs == [[], []] and none.prompt_token_ids == [tokenizer(p)["input_ids"] for p in prompts]
    stream = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=0, stream=True)
    assert list(stream) == [] and stream.result.token_ids == [[], []]
    for kw in (dict(k=8), dict(draft_tree=(2, 3, 6)), dict(k="auto")):
        one = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=1, **kw)
        assert [len(t) for t in one.token_ids] == [1, 1] and len(one) == 2
        assert all(type(t) is int for row in one.token_ids for t in row)
    assert generate([[5, 6]], target, draft, max_new_tokens=3, k=2).text is None  # ids, no tokenizer: no text


def test_stop_strings_inside_and_across_bpe_tokens_and_not_in_the_prompt(bpe_pair):
    target, draft, tokenizer = bpe_pair
    prompts = ["def f(x):\n", "import os\n"]
    run = dict(tokenizer=tokenizer, max_new_tokens=24, eos_token_id=False, k=3)
    full = generate(prompts, target, draft, **run)
    pieces = [tokenizer.decode([t]) for t in full.token_ids[0]]
    text = full.text[0]
    assert all(len(p) > 1 for p in pieces[:5])
    inside = len("".join(pieces[:3])) + 1  # the middle of token 3
    across = len("".join(pieces[:5]))  # the boundary of tokens 4 and 5
    for stop in (text[inside: inside + 2], text[across - 2: across + 2]):
        first = text.find(stop)
        out = generate(prompts, target, draft, stop=stop, **run)
        assert out.text[0] == text[:first] and out.finish_reasons[0] == "stop", stop
        kept = tokenizer.decode(out.token_ids[0])
        assert len(kept) >= first + len(stop) > len(tokenizer.decode(out.token_ids[0][:-1]))  # the completing token
        stream = generate(prompts, target, draft, stop=stop, stream=True, **run)
        assert "".join(p for p in stream if p.index == 0) == out.text[0]
    in_prompt = generate(prompts, target, draft, stop=["f(", ":\n" + text[:2]], **run)  # only new text is checked
    assert in_prompt.token_ids == full.token_ids and in_prompt.finish_reasons == ["length", "length"]


def test_a_stream_closed_or_left_open_does_not_change_later_calls(text_pair):
    target, draft, tokenizer = text_pair
    prompts = ["def f(x):\n", "import os\nimport ", "a"]
    run = dict(tokenizer=tokenizer, max_new_tokens=30, eos_token_id=False)
    for kw in (dict(k=3), dict(draft_tree=(2, 2, 4)), dict(k="auto"), dict(k=3, temperature=0.9, seed=4)):
        expected = generate(prompts, target, draft, **run, **kw).token_ids
        closed = generate(prompts, target, draft, stream=True, **run, **kw)
        next(closed)
        closed.close()
        assert closed.result is None and list(closed) == []
        assert generate(prompts, target, draft, **run, **kw).token_ids == expected
        open_ = generate(prompts, target, draft, stream=True, **run, **kw)
        next(open_)
        next(open_)
        assert generate(prompts, target, draft, **run, **kw).token_ids == expected  # beside an open stream
        list(open_)
        assert open_.result.token_ids == expected


def test_grammar_penalties_and_trees_leave_no_state_for_the_next_plain_call(bpe_pair):
    target, draft, tokenizer = bpe_pair
    prompts = ["def f(x):\n", "import os\n"]
    run = dict(tokenizer=tokenizer, max_new_tokens=16, eos_token_id=False, k=3)
    greedy = generate(prompts, target, draft, **run).token_ids
    sampled = generate(prompts, target, draft, temperature=0.9, seed=5, **run).token_ids
    digits = generate(prompts, target, draft, regex="[0-9]{2,5}", **run)
    assert all(t.isdigit() and 2 <= len(t) <= 5 for t in digits.text) and digits.finish_reasons == ["stop"] * 2
    generate(prompts, target, draft, repetition_penalty=2.0, presence_penalty=1.0, logit_bias={5: 50}, min_p=0.2,
             temperature=0.7, seed=1, **run)
    generate(prompts, target, draft, **{**run, "k": None}, draft_tree=(2, 2, 4), temperature=0.9, seed=3)
    open_grammar = generate(prompts, target, draft, regex="[a-z]{20}", stream=True, **run)
    next(open_grammar)
    assert generate(prompts, target, draft, **run).token_ids == greedy
    assert generate(prompts, target, draft, temperature=0.9, seed=5, **run).token_ids == sampled
    other = tiny_model("llama", vocab=len(tokenizer), hidden=32, layers=1, seed=9, logit_scale=30.0)
    generate(prompts, other, noisy_copy(other), **run)  # a second target in the process
    assert generate(prompts, target, draft, **run).token_ids == greedy
    assert generate(prompts, target, noisy_copy(other), **run).token_ids == greedy  # another draft: same tokens
