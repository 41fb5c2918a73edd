"""generate() and plain_generate() at the edges of their arguments: a value the kernels' int32 / float32
cannot hold is taken for its meaning where it has one (a top_k beyond int32 is no top-k filter, a tiny
positive top_p keeps the top token) and refused before any work otherwise, with a ValueError that names
the argument and what it accepts; so are a processing field out of range that would leave its processor
off, a seed, stop or EOS id of the wrong kind, a logit_bias key that is not a canonical decimal and a
prompt that is not valid text."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_ext import generate, plain_generate
from specdec_ext.sampling import INT32_MAX, SamplingParams
from test_generate_utils import CHAR_VOCAB, char_tokenizer, noisy_copy, tiny_model

PROMPT = [[5, 6, 7]]
NEW = 6


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.3), char_tokenizer()


def _tokens(pair, run, prompt=PROMPT, **options):
    target, draft, tokenizer = pair
    if run is generate:
        return generate(prompt, target, draft, k=2, tokenizer=tokenizer, max_new_tokens=NEW, **options).token_ids
    return plain_generate(prompt, target, tokenizer=tokenizer, max_new_tokens=NEW, **options).token_ids


RUNS = pytest.mark.parametrize("run", [generate, plain_generate], ids=["generate", "plain_generate"])


# ---------------------------------------------------------------------------------- taken for their meaning
@RUNS
def test_a_top_k_beyond_int32_is_no_top_k_filter(pair, run):
    assert SamplingParams(1.0, 2 ** 40).top_k == INT32_MAX  # what the kernels' int32 holds
    unfiltered = _tokens(pair, run, temperature=1.0, top_k=0, seed=3)
    for top_k in (2 ** 31, 2 ** 40):
        assert _tokens(pair, run, temperature=1.0, top_k=top_k, seed=3) == unfiltered
    assert _tokens(pair, run, top_k=2 ** 31) == _tokens(pair, run)  # greedy


@RUNS
def test_a_top_p_too_small_for_float32_keeps_the_top_token(pair, run):
    greedy = _tokens(pair, run)
    assert _tokens(pair, run, temperature=1.0, top_p=1e-300, seed=3) == greedy
    assert _tokens(pair, run, temperature=1.0, top_p=1e-45, seed=4) == greedy


# ---------------------------------------------------------------------------------- refused, named
OUT_OF_RANGE = [
    ("temperature above float32", dict(temperature=1e39), r"temperature must be >= 0 .* at most 3.403e\+38"),
    ("temperature 1e308", dict(temperature=1e308), r"temperature must be >= 0 .* at most 3.403e\+38"),
    ("temperature None", dict(temperature=None), "temperature must be a number, got None"),
    ("temperature as text", dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
    ("repetition_penalty 1e308", dict(repetition_penalty=1e308), r"repetition_penalty must lie in \[1e-30, 1e\+30\]"),
    ("repetition_penalty 1e-308", dict(repetition_penalty=1e-308), r"repetition_penalty must lie in \[1e-30, 1e\+30\]"),
    ("repetition_penalty 1e-50", dict(repetition_penalty=1e-50), r"repetition_penalty must lie in \[1e-30, 1e\+30\]"),
    ("min_p below 0", dict(min_p=-0.1), r"min_p must lie in \[0, 1\]"),  # would leave min_p off
    ("min_p nan", dict(min_p=float("nan")), r"min_p must lie in \[0, 1\]"),
    ("seed fractional", dict(seed=1.5), r"seed must be an int in \[-2\^63, 2\^63\).*got 1.5"),
    ("seed as text", dict(seed="abc"), r"seed must be an int .*got 'abc'"),
    ("seed beyond int64", dict(seed=2 ** 70), r"seed must be an int in \[-2\^63, 2\^63\)"),
    ("a list of seeds holding a float", dict(seed=[2.0]), r"seed must be an int .*got \[2.0\]"),
    ("stop an int", dict(stop=5), "stop must be a non-empty string or a list of them, got 5"),
    ("eos_token_id past the vocabulary", dict(eos_token_id=99999),
     r"eos_token_id: \[99999\] outside the target's vocabulary \[0, 64\)"),
    ("eos_token_id negative", dict(eos_token_id=[2, -1]), r"eos_token_id: \[-1\] outside the target's vocabulary"),
    ("eos_token_id as text", dict(eos_token_id="2"), "eos_token_id must be a token id"),
    ("a logit_bias key with a space", dict(logit_bias={" 11": 1.0}), "logit_bias key ' 11' is not an integer token id"),
    ("logit_bias a list", dict(logit_bias=[1, 2]), r"logit_bias must be a mapping of token id -> bias .*got list"),
    ("a logit_bias key in Arabic-Indic digits", dict(logit_bias={"١١": 1.0}), "is not an integer token id"),
    ("a logit_bias key with a leading zero", dict(logit_bias={"011": 1.0}), "logit_bias key '011' is not an integer"),
    ("a stop string with a lone surrogate", dict(stop=["ok", "\ud800"]), r"stop string '\\ud800' is not valid text"),
    ("logprobs above 20", dict(logprobs=21), r"^logprobs must be an int in \[0, 20\], got 21"),
    ("max_seq_len fractional", dict(max_seq_len=100.5), r"max_seq_len must be an int >= 1 or None, got 100.5"),
    ("max_seq_len as text", dict(max_seq_len="100"), r"max_seq_len must be an int >= 1 or None, got '100'"),
    ("max_seq_len True", dict(max_seq_len=True), r"max_seq_len must be an int >= 1 or None, got True"),
    ("max_seq_len negative", dict(max_seq_len=-5), r"max_seq_len must be an int >= 1 or None, got -5"),
    ("a 0-d tensor prompt", dict(prompt=torch.tensor(5)), r"prompts as a tensor must be \[T\] or \[B, T\]"),
    ("a prompt tensor on the meta device", dict(prompt=torch.tensor([[1, 2]], device="meta")),
     "prompts as a tensor are on the meta device"),
    ("one prompt of a list on the meta device", dict(prompt=[[1, 2], torch.tensor([3], device="meta")]),
     "prompt 1 is a tensor on the meta device"),
]


@RUNS
@pytest.mark.parametrize("options, words", [case[1:] for case in OUT_OF_RANGE], ids=[case[0] for case in OUT_OF_RANGE])
def test_a_value_out_of_range_raises_a_value_error_naming_the_argument(pair, run, options, words):
    with pytest.raises(ValueError, match=words):
        _tokens(pair, run, **options)


@RUNS
def test_a_prompt_with_a_lone_surrogate_is_not_valid_text(pair, run):
    with pytest.raises(ValueError, match=r"prompt 1 is not valid text: character 1 is '\\ud800', a lone surrogate"):
        _tokens(pair, run, prompt=["abc", "x\ud800y"])


@pytest.mark.parametrize("options, words", [
    (dict(draft_confidence="a"), r"draft_confidence must be a number in \[0, 1\), got 'a'"),
    (dict(draft_confidence=None), r"draft_confidence must be a number in \[0, 1\), got None"),
], ids=["draft_confidence as text", "draft_confidence None"])
def test_a_draft_option_of_the_wrong_kind_is_named(pair, options, words):
    with pytest.raises(ValueError, match=words):
        _tokens(pair, generate, **options)


@pytest.mark.parametrize("run, name, value", [(generate, "stream", "no"), (plain_generate, "stream", "no"),
                                             (generate, "explain", "yes"), (plain_generate, "explain", 1),
                                             (generate, "cost_probe", 1)])
def test_a_flag_is_true_or_false(pair, run, name, value):
    """stream="no" is truthy: it returned a stream nobody asked for."""
    with pytest.raises(TypeError, match=f"{name} must be True or False, got {value!r}"):
        _tokens(pair, run, **{name: value})


@RUNS
def test_token_ids_may_be_numpy_or_torch_integers(pair, run):
    expected = _tokens(pair, run, prompt=[[5, 6, 7]])
    for prompt in ([[np.int64(5), np.int32(6), 7]], [np.array([5, 6, 7])], [torch.tensor([5, 6, 7])],
                   [[torch.tensor(5), 6, 7]], np.array([5, 6, 7]).tolist()):
        assert _tokens(pair, run, prompt=prompt) == expected
    with pytest.raises(TypeError, match="prompt 0 must be a string or a list of int token ids"):
        _tokens(pair, run, prompt=[[np.float64(5.0), 6]])


def test_a_draft_or_tokenizer_of_the_wrong_kind_is_named(pair):
    target, draft, tokenizer = pair
    with pytest.raises(TypeError, match="the draft must be a model id or local path, a loaded model, 'ngram'.*got int 5"):
        generate(PROMPT, target, 5, max_new_tokens=2)
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer .*got int 5"):
        generate(PROMPT, target, draft, tokenizer=5, max_new_tokens=2)
