"""Logits processors and logprobs inside speculative decoding (issue 28), end to end through generate():
greedy speculative output with processors equals plain decoding with the same processors (chains, the
n-gram drafter, trees) and differs from unprocessed output; greedy logprobs equal plain decoding's bit for
bit; structured output parses; the audit at T = 1 passes with each processor and with a grammar, and
fails when the penalty counts leave out the drafts before a position; bad input is refused by name."""
from __future__ import annotations

import json
import math

import pytest
import torch

from specdec_ext import audit, generate, plain_generate
from specdec_ext.audit import PlainProcessors, plain_samples, speculative_samples, two_sample_chi_square
from specdec_ext.processing import Processing, ProcessingState
from specdec_ext.sampling import SamplingParams
from test_generate_sampling import TINY_VOCAB
from sampling_stats import prefix_blind
from test_generate_utils import tiny_model

PROCESSORS = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={"11": 3.0},
                  min_p=0.05)
CODE_PROMPTS = ["def fibonacci(n):", "import numpy as np\nx = np."]
AUDIT_PROMPTS = [[1, 4, 2, 6], [3, 3, 5]]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def tiny_pair():
    return (tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0),
            tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0))


# ------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("draft, options", [(None, dict(k=4)), ("ngram", dict(k=4)), ("heads", {})],
                         ids=["draft-model", "ngram", "heads-tree"])
def test_greedy_with_processors_equals_plain_with_them(draft, options):
    kw = dict(max_new_tokens=40, **PROCESSORS)
    speculative = generate(CODE_PROMPTS, draft=draft, **options, **kw)
    plain = plain_generate(CODE_PROMPTS, **kw)
    unprocessed = plain_generate(CODE_PROMPTS, max_new_tokens=40)
    assert speculative.token_ids == plain.token_ids
    assert speculative.token_ids != unprocessed.token_ids  # the processors changed the output
    assert speculative.stats.tokens_per_pass > 1.0
    assert "processing" in speculative.plan.explain()


def test_greedy_logprobs_equal_plain_decoding_bit_for_bit():
    speculative = generate(CODE_PROMPTS, k=4, max_new_tokens=24, logprobs=5)
    plain = plain_generate(CODE_PROMPTS, max_new_tokens=24, logprobs=5)
    assert speculative.token_ids == plain.token_ids
    assert speculative.logprobs == plain.logprobs  # tokens, logprobs and the top 5, exactly
    for tokens, entries in zip(speculative.token_ids, speculative.logprobs):
        assert [e.token for e in entries] == tokens
        for e in entries:
            assert e.top[0][0] == e.token and e.top[0][1] == e.logprob  # greedy: the argmax is the top
            assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True) and len(e.top) == 5
            assert e.logprob <= 0.0


def test_more_logprobs_than_the_vocabulary_has_give_every_token(tiny_pair):
    target, draft = tiny_pair  # (TINY_VOCAB ids: fewer than the 20 asked for)
    out = generate([[1, 2, 3]], target, draft, k=2, max_new_tokens=4, logprobs=20)
    assert all(len(e.top) == TINY_VOCAB for e in out.logprobs[0])
    assert math.isclose(sum(math.exp(lp) for _, lp in out.logprobs[0][0].top), 1.0, rel_tol=1e-4)


def test_sampled_logprobs_are_the_processed_distribution_at_the_temperature():
    result = generate(CODE_PROMPTS[:1], k=4, max_new_tokens=16, temperature=0.7, seed=5, logprobs=3,
                      presence_penalty=1.0)
    entries = result.logprobs[0]
    assert [e.token for e in entries] == result.token_ids[0] and len(entries[0].top) == 3
    # the top three of a distribution: at most their total mass, each finite
    for e in entries:
        assert sum(math.exp(lp) for _, lp in e.top) <= 1.0 + 1e-5 and all(math.isfinite(lp) for _, lp in e.top)


def test_json_schema_output_parses_and_equals_plain_decoding_under_the_grammar():
    speculative = generate(CODE_PROMPTS, k=4, max_new_tokens=80, json_schema=SCHEMA)
    plain = plain_generate(CODE_PROMPTS, max_new_tokens=80, json_schema=SCHEMA)
    assert speculative.token_ids == plain.token_ids and speculative.finish_reasons == ["eos", "eos"]
    for text in speculative.text:
        value = json.loads(text)
        assert set(value) == {"name", "age", "tags"} and isinstance(value["age"], int)
        assert len(value["name"]) <= 12 and set(value["tags"]) <= {"a", "b", "c"} and len(value["tags"]) <= 3
    assert speculative.stats.tokens_per_pass > 1.5  # forced tokens (keys, punctuation) are accepted drafts


def test_a_regex_bounds_the_output_and_a_complete_match_ends_the_row():
    result = generate(CODE_PROMPTS, k=4, max_new_tokens=40, regex=r"[0-9]{3}-[a-z]{2}", eos_token_id=False)
    for text, reason in zip(result.text, result.finish_reasons):
        assert len(text) == 6 and text[3] == "-" and text[:3].isdigit() and text[4:].isalpha()
        assert reason == "stop"  # no EOS token: the complete match ends the row
    # a grammar complete before any token (llguidance's matcher is accepting but not yet stopped) ends "stop" too,
    # with nothing drawn; one that cannot complete without a token it disallows is the dead end
    empty = generate(CODE_PROMPTS, k=4, max_new_tokens=10, regex="", eos_token_id=False)
    assert empty.token_ids == [[], []] and empty.finish_reasons == ["stop", "stop"]
    optional = plain_generate(CODE_PROMPTS[:1], max_new_tokens=10, regex="a?", eos_token_id=False)
    assert optional.text == ["a"] and optional.finish_reasons == ["stop"]


# ------------------------------------------------------------------------------------------ the audit
@pytest.mark.parametrize("processors", [
    dict(presence_penalty=1.5, frequency_penalty=1.0), dict(repetition_penalty=1.8), dict(min_p=0.1),
    dict(logit_bias={"3": 2.5, "7": -100.0})], ids=["openai-penalties", "repetition", "min_p", "logit_bias"])
def test_the_audit_passes_at_t1_with_each_processor(tiny_pair, processors):
    target, draft = tiny_pair
    report = audit(target, draft, AUDIT_PROMPTS, temperature=1.0, positions=3, samples=1200, run_break_even=False,
                   verbose=False, processors=processors)
    assert report.passed, report.text()


def _repeat_test(target, draft, processors) -> float:
    """The p-value of a two-sample chi-square test on "the first 5 tokens repeat one", speculative (the
    audit's sampler) against plain sampling with the audit's own reference of the processors: the
    statistic a prefix-blind penalty moves (the audit's per-position and joint tests spread it thin)."""
    sampling = SamplingParams(1.0)
    spec = speculative_samples(target, draft, AUDIT_PROMPTS[0], 1000, 5, sampling, 0, dict(processors))
    plain = plain_samples(target, AUDIT_PROMPTS[0], 1000, 5, sampling, 0,
                          processors=PlainProcessors(Processing.of(**processors)))
    repeats = lambda samples: [len(set(s)) < len(s) for s in samples]  # noqa: E731
    return two_sample_chi_square(repeats(spec), repeats(plain))[2]


def test_a_distribution_test_catches_penalty_counts_without_the_draft_prefix(tiny_pair, monkeypatch):
    """The mutation: every column of a verify pass penalised with the committed counts only (as if each
    were the first), which is how a verifier that ignores its own drafts would process them."""
    target, draft = tiny_pair
    processors = dict(presence_penalty=2.0, frequency_penalty=2.0)
    assert _repeat_test(target, draft, processors) > 1e-3
    monkeypatch.setattr(ProcessingState, "apply", prefix_blind(ProcessingState.apply))
    assert _repeat_test(target, draft, processors) < 1e-6


def test_the_audit_passes_at_t1_under_a_grammar():
    report = audit(None, None, CODE_PROMPTS, temperature=1.0, positions=3, samples=300, run_break_even=False,
                   verbose=False, processors=dict(regex=r"(foo|bar|[0-9]+)(,[a-z]+)*"), max_prompts=1)
    assert report.passed, report.text()


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, words", [
    (dict(presence_penalty=2.5), "presence_penalty must lie in [-2, 2]"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must lie in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must lie in [1e-30, 1e+30]"),
    (dict(min_p=1.5), "min_p must lie in [0, 1]"),
    (dict(logit_bias={"x": 1.0}), "logit_bias key 'x' is not an integer token id"),
    (dict(logit_bias={99999: 1.0}), "logit_bias key 99999 is not a token id of the vocabulary [0, 8192)"),
    (dict(logit_bias={5: 200.0}), "logit_bias[5] must lie in [-100, 100]"),
    (dict(logprobs=21), "logprobs must be an int in [0, 20]"),
    (dict(regex="(ab"), "regex"),
    (dict(regex="a", json_schema={"type": "object"}), "at most one of json_schema, regex, grammar"),
])
def test_bad_processor_input_is_refused_by_name(kwargs, words):
    with pytest.raises(ValueError) as error:
        generate(CODE_PROMPTS[:1], k=2, max_new_tokens=4, **kwargs)
    assert words in str(error.value)


def test_specdec_generate_takes_the_processor_flags(capsys):
    from specdec_ext import cli

    schema = '{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": false}'
    assert cli.main(["generate", "point = ", "--max-new-tokens", "40", "--no-stream", "--json-schema", schema,
                     "--presence-penalty", "0.5", "--logit-bias", '{"11": 1.5}', "-k", "3"]) == 0
    text = capsys.readouterr().out.split("\n", 1)[1]
    assert set(json.loads(text)) == {"x"}
    with pytest.raises(SystemExit, match="--logit-bias is not valid JSON"):
        cli.main(["generate", "x", "--logit-bias", "{11: 2}"])
