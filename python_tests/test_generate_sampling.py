"""generate() at T > 0: the first three tokens follow plain target sampling (chi-square against the
exact filtered target distribution), a broken verifier is caught by the same test, and seeded
generation is reproducible and independent of the batch. Also the drafter's filter and sampler
against the NumPy reference."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import reference
from specdec_ext import generate
from specdec_ext.step import lossless_verify
from specdec_ext.sampling import SamplingParams, filtered_probs, sample_inverse_cdf
from specdec_ext import ops
from sampling_stats import chi_square_p, exact_joint
from test_generate_utils import noisy_copy, tiny_model

TINY_VOCAB = 8
POSITIONS = 3
SAMPLES = 3000
PROMPT = [1, 4, 2, 6]
PASS_P = 1e-4  # a correct sampler fails this with probability 1e-4 (the runs are seeded: deterministic)
FAIL_P = 1e-8


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0)
    draft = tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0)
    return target, draft


def residual_from_p_verifier(meta, proposal, target_logits):
    """The classic bug: on a rejection the recovered token is drawn from p, not max(0, p - q)."""
    verdict = lossless_verify(meta, proposal, target_logits)
    B, k = proposal.token_ids.shape
    rows = torch.arange(B)
    n = verdict.num_accepted.long()
    rejected = n < proposal.num_draft.long()
    p = filtered_probs(target_logits[rows, n.clamp(max=k)], meta.sampling)  # [B, V]
    u = ops.philox_uniforms(meta.seed, meta.verify_offset, k + 1)[rows, proposal.num_draft.long()]  # (column num_draft)
    verdict.tokens[rows, n] = torch.where(rejected, sample_inverse_cdf(p, u), verdict.tokens[rows, n])
    return verdict


def sample_first_tokens(target, draft, verifier=lossless_verify, draft_confidence=0.0, **sampling):
    out = generate([PROMPT] * SAMPLES, target, draft, max_new_tokens=POSITIONS, k=2, seed=list(range(SAMPLES)),
                   verifier=verifier, cost_probe=False, draft_confidence=draft_confidence, **sampling)
    assert all(len(t) == POSITIONS for t in out.token_ids)
    return out


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_first_three_tokens_follow_plain_target_sampling(tiny_pair, temperature, top_p):
    target, draft = tiny_pair
    joint = exact_joint(target, PROMPT, temperature, top_p)
    out = sample_first_tokens(target, draft, temperature=temperature, top_p=top_p)
    assert 0.05 < out.stats.acceptance_rate < 0.95  # the test exercises both accepts and rejections
    assert chi_square_p(out.token_ids, joint) > PASS_P
    ragged = sample_first_tokens(target, draft, draft_confidence=0.5, temperature=temperature, top_p=top_p)
    assert ragged.stats.reached[1] < ragged.stats.reached[0]  # some rows drafted one token only
    assert chi_square_p(ragged.token_ids, joint) > PASS_P
    broken = sample_first_tokens(target, draft, verifier=residual_from_p_verifier, temperature=temperature,
                                 top_p=top_p)
    assert chi_square_p(broken.token_ids, joint) < FAIL_P


def test_seeded_generation_is_reproducible_and_independent_of_the_batch():
    target = tiny_model("llama", vocab=64, hidden=32, layers=2, seed=5, logit_scale=2.0)
    draft = noisy_copy(target, noise=0.5)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3], [10]]
    kw = dict(max_new_tokens=20, k=3, temperature=1.0, top_k=30, top_p=0.95, eos_token_id=False)
    alone = generate([prompts[1]], target, draft, seed=123, **kw).token_ids[0]
    again = generate([prompts[1]], target, draft, seed=123, **kw).token_ids[0]
    batched = generate(prompts, target, draft, seed=123, **kw).token_ids
    per_row = generate(prompts[::-1], target, draft, seed=[7, 123, 8], **kw).token_ids
    assert alone == again == batched[1] == per_row[1]
    other_seed = generate([prompts[1]], target, draft, seed=124, **kw).token_ids[0]
    assert other_seed != alone
    unseeded = [generate([prompts[1]], target, draft, **kw).token_ids[0] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_drafter_filter_matches_the_reference_filter():
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=(16, 50)) * 2, 1).astype(np.float32)  # rounding makes ties
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6), (0.0, 0, 1.0)]:
        got = filtered_probs(torch.from_numpy(logits), SamplingParams(temperature, top_k, top_p)).numpy()
        want = np.stack([reference.filtered_probs(l, temperature, top_k, top_p) for l in logits])
        np.testing.assert_allclose(got, want, atol=1e-5)
        u = rng.random(16).astype(np.float32)
        tokens = sample_inverse_cdf(torch.from_numpy(got), torch.from_numpy(u)).tolist()
        assert tokens == [reference.sample_inverse_cdf(g, float(x)) for g, x in zip(got, u)]


@pytest.mark.parametrize("runner,confidence", [("paged", 0.0), ("recompute", 0.0), ("paged", 0.3)])
def test_self_drafting_accepts_nearly_everything_at_t1(runner, confidence):
    """With the target as its own draft q equals p (up to float noise), so every draft is accepted:
    a drafter that fed the wrong tokens, rolled its cache back wrongly or filtered differently from
    the verifier would show up here as lost acceptance (it cannot show up in the output)."""
    target = tiny_model("llama", vocab=64, hidden=32, layers=2, seed=9, logit_scale=2.0)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3], [10]]
    out = generate(prompts, target, target, max_new_tokens=30, k=3, temperature=0.9, top_k=40, top_p=0.9, seed=1,
                   eos_token_id=False, runner=runner, draft_confidence=confidence)
    assert out.stats.acceptance_rate > 0.97
