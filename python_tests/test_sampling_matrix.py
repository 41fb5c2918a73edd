"""generate()'s promise, tested from the outside over a matrix of options: the first new tokens are
distributed EXACTLY as plain sampling from the (processed, filtered) target, whatever the drafter.

The exact law is computed here by enumeration (one HF forward of the tiny target over every continuation,
then the chain rule prefix by prefix) with this file's own float64 NumPy reference of the processors and
the filter, written from generate()'s docstring (logit_bias, then HF's repetition penalty over prompt +
generated tokens, then OpenAI's frequency / presence penalties over the generated tokens, [the grammar
mask,] then min_p at the temperature, then temperature, top-k, top-p), applied per position with the
history before it. Nothing of the library's sampling / processing code is used for the law. generate()
samples many rows in one batch, one seed per row (deterministic); a pooled chi-square test compares them
with the law of tokens 1-3 (and, in the five-token cases, with the law of tokens 4-5).

The matrix: the filter (top_k, min_p, top_p, T from 0.3 to inf), the processors, draft models near,
far from and equal to the target (chains k=1..4 and k=None, draft_confidence, per-row budgets and adaptive
k's controller, trees), the n-gram drafter, Medusa heads, EAGLE-3 heads (chain, tree, a draft-vocabulary
subset), the lean / paged / recompute runners, a GPT-NeoX pair, prompts of different lengths in one
batch, EOS, streaming with logprobs, and structured output (a regex over the bundled tokenizer; an EAGLE-3
head proposing from its grammar-masked logits, and one whose vocabulary the grammar excludes whole).

Every case also checks that it exercises the accept / reject machinery (acceptance strictly between 0
and 1, low for the far draft, near 1 for a draft equal to the target), and the power checks show that a
broken verifier, penalties blind to the drafts before a position, and a reference blind to the generated
history are rejected by the same statistic.
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

import specdec_ext
from specdec_ext import generate
from specdec_ext.adaptive import AdaptiveK
from specdec_ext.drafters.calibration import reset_calibrations
from specdec_ext.eagle import EagleConfig, EagleDrafterSpec, Eagle3Model
from specdec_ext.heads import MedusaHeads
from specdec_ext.processing import ProcessingState
from test_generate_sampling import residual_from_p_verifier
from sampling_stats import prefix_blind
from test_generate_utils import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

V = 8  # tiny vocabulary: the law of 3 tokens has V^3 = 512 cells
POSITIONS = 3
SAMPLES = 3000
PROMPT = [1, 4, 2, 6]
REPEATING_PROMPT = [1, 4, 2, 6, 1, 4, 2, 5, 3, 0, 7]  # every token occurs: the n-gram drafter always proposes
RAGGED_PROMPTS = [[1, 4, 2, 6], [3], [5, 5, 2, 7, 1, 0, 3, 5]]  # different lengths, one batch
SHARPNESS = 8.0  # the tiny models' logit scale: laws far from uniform, so that a wrong law shows
PASS_P = 1e-4  # a correct sampler fails this with probability 1e-4 per case (seeded: deterministic)
FAIL_P = 1e-8  # what the deliberately broken variants must fall below
MIN_EXPECTED = 5.0  # chi-square cells expecting fewer samples are pooled
CUT_MARGIN = 1e-5  # the law's top-p / min_p cuts must be this far from a float32 coin toss (relative)
GREEDY_T = 1e-5  # temperatures below this are greedy (generate()'s docstring: 0 = greedy)


# ------------------------------------------------------------------------------------------ reference
def processed_logits(raw: np.ndarray, prompt: Sequence[int], history: Sequence[int], opts: Dict) -> np.ndarray:
    """The processors of generate()'s docstring on one position's raw target logits, float64:
    logit_bias (additive), repetition_penalty (HF: a token seen in prompt or history has its logit
    divided by r where > 0, multiplied where <= 0), frequency (per occurrence) and presence (once)
    penalties over the generated history."""
    logits = np.array(raw, dtype=np.float64)
    for token, bias in (opts.get("logit_bias") or {}).items():
        logits[int(token)] += float(bias)
    r = float(opts.get("repetition_penalty", 1.0))
    if r != 1.0:
        seen = np.zeros(len(logits), dtype=bool)
        seen[list(prompt) + list(history)] = True
        logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
    counts = np.bincount(np.asarray(history, dtype=np.int64), minlength=len(logits)).astype(np.float64)
    logits -= float(opts.get("frequency_penalty", 0.0)) * counts
    logits -= float(opts.get("presence_penalty", 0.0)) * (counts > 0)
    return logits


def sampling_law(logits: np.ndarray, opts: Dict) -> np.ndarray:
    """P(next token) from processed logits: greedy below GREEDY_T; else weights exp((l - max) / T) (T = inf:
    1 for every finite logit), min_p (keep w >= min_p x the largest, finite T), top-k (the k largest logits),
    top-p (the smallest prefix by logit whose mass reaches top_p x the mass left), renormalised. Asserts
    that no cut lies within CUT_MARGIN of a float32 coin toss (the case would then be fragile)."""
    T = float(opts.get("temperature", 0.0))
    top_k, top_p, min_p = int(opts.get("top_k", 0)), float(opts.get("top_p", 1.0)), float(opts.get("min_p", 0.0))
    n = len(logits)
    if T < GREEDY_T:
        law = np.zeros(n)
        law[int(np.argmax(logits))] = 1.0
        return law
    if math.isinf(T):
        weights = np.isfinite(logits).astype(np.float64)
    else:
        weights = np.exp((logits - logits.max()) / T)
    keep = weights > 0
    if min_p > 0 and math.isfinite(T):
        ratio = weights / weights.max()
        below_top = ratio < 1.0  # (the top token is always kept)
        assert np.all(np.abs(ratio - min_p)[below_top] > CUT_MARGIN * min_p), "min_p cut too close to a token"
        keep &= ratio >= min_p
    order = np.argsort(-logits, kind="stable")
    order = order[keep[order]]
    if 0 < top_k < n:
        assert len(set(logits[order[: top_k + 1]].tolist())) == min(top_k + 1, len(order)), "a tie at the top-k cut"
        order = order[:top_k]
    if top_p < 1.0:
        mass = np.cumsum(weights[order])
        target = top_p * mass[-1]
        cut = int(np.argmax(mass >= target))
        before = mass[cut - 1] if cut else -np.inf  # (a tiny top_p keeps the top token)
        assert min(mass[cut] - target, target - before) > CUT_MARGIN * mass[-1], "top_p cut too close to a token"
        order = order[: cut + 1]
    law = np.zeros(n)
    law[order] = weights[order]
    return law / law.sum()


def exact_law(target, prompt: Sequence[int], opts: Dict, positions: int = POSITIONS,
              count_history: bool = True) -> np.ndarray:
    """P(first ``positions`` new tokens = (t1, .., tP)) [V] * P under plain sampling from the processed,
    filtered target: one HF forward over every (P-1)-token continuation (causal: the logits at a position
    depend on the tokens before it only), then the chain rule prefix by prefix. ``count_history=False`` is a
    deliberately wrong law (the penalties never see the generated tokens), for a power check."""
    continuations = list(itertools.product(range(V), repeat=positions - 1))
    ids = torch.tensor([list(prompt) + list(c) for c in continuations])
    with torch.no_grad():
        raw = target(ids).logits.double().numpy()  # [V^(P-1), n + P - 1, V]
    n = len(prompt)
    law = np.ones(())
    for j in range(positions):
        step = np.zeros((V,) * (j + 1))
        for prefix in itertools.product(range(V), repeat=j):
            if law[prefix] == 0.0:
                continue
            row = int(np.ravel_multi_index(prefix + (0,) * (positions - 1 - j), (V,) * (positions - 1)))
            logits = processed_logits(raw[row, n - 1 + j], prompt, prefix if count_history else (), opts)
            step[prefix] = law[prefix] * sampling_law(logits, opts)
        law = step
    assert abs(law.sum() - 1.0) < 1e-9
    return law


def with_eos(law: np.ndarray, eos: int) -> np.ndarray:
    """The law of the returned tokens when a row ends at its first ``eos`` (inclusive): the positions after
    it hold the symbol V (no token), [V + 1] * P."""
    out = np.zeros((V + 1,) * law.ndim)
    for tokens in itertools.product(range(V), repeat=law.ndim):
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        out[tokens[:cut] + (V,) * (len(tokens) - cut)] += law[tokens]
    return out


def p_value(samples: Sequence[Sequence[int]], law: np.ndarray) -> float:
    """Pooled chi-square p-value of token tuples against ``law``; a sample outside the law's support fails
    at once (that is no statistical question), a one-cell law needs every sample in it."""
    counts = np.zeros(law.size)
    for s in samples:
        assert len(s) == law.ndim, f"a sample has {len(s)} tokens, not {law.ndim}"
        counts[np.ravel_multi_index(tuple(s), law.shape)] += 1
    impossible = counts[law.ravel() == 0].sum()
    assert impossible == 0, f"{int(impossible)} samples have probability 0 under the exact law"
    expected = law.ravel() * len(samples)
    big = expected >= MIN_EXPECTED
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    if (law > 0).sum() == 1:
        return 1.0  # (every sample is the one possible tuple)
    assert keep.sum() >= 2, "too few samples for this law: pooling left one cell"
    return float(scipy_stats.chisquare(observed[keep], expected[keep]).pvalue)


# ------------------------------------------------------------------------------------------ models
@pytest.fixture(scope="module")
def models():
    """Targets by name, and drafts by name: (target name, draft) pairs."""
    target = tiny_model("llama", vocab=V, hidden=32, layers=1, seed=3, logit_scale=SHARPNESS)
    near = tiny_model("llama", vocab=V, hidden=32, layers=1, seed=4, logit_scale=SHARPNESS)
    far = copy.deepcopy(target)  # the target's LM head negated and sharpened: q sits on the target's least likely
    with torch.no_grad():
        far.get_output_embeddings().weight.mul_(-10.0)
    heads = MedusaHeads(32, 3, V)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.copy_(torch.randn(block.linear.weight.shape, generator=generator))
    torch.manual_seed(1)
    eagle = Eagle3Model(EagleConfig.for_target(target, layer_ids=(0, 0, 0))).eval().requires_grad_(False)
    torch.manual_seed(2)
    eagle_subset = Eagle3Model(EagleConfig.for_target(target, layer_ids=(0, 0, 0), draft_vocab_size=5))
    eagle_subset.set_draft_vocab(torch.tensor([0, 2, 3, 5, 6]))  # q is 0 on tokens 1, 4, 7
    neox = tiny_model("gpt_neox", vocab=V, hidden=32, layers=1, seed=3, logit_scale=SHARPNESS)
    neox_draft = tiny_model("gpt_neox", vocab=V, hidden=32, layers=1, seed=4, logit_scale=SHARPNESS)
    targets = {"llama": target, "neox": neox}
    drafts = {"near": ("llama", near), "far": ("llama", far.eval()), "self": ("llama", target),
              "ngram": ("llama", "ngram"), "heads": ("llama", heads.eval()),
              "eagle": ("llama", EagleDrafterSpec(eagle)),
              "eagle-subset": ("llama", EagleDrafterSpec(eagle_subset.eval().requires_grad_(False))),
              "neox-near": ("neox", neox_draft)}
    return targets, drafts


class RowBudgets(AdaptiveK):
    """A scripted adaptive k: row b drafts (b + step) % (k_max + 1) tokens a step (0 too), so one pass mixes
    every draft length and rows that skip; deterministic (no timings)."""

    def __init__(self, k_max: int):
        super().__init__(k_max)
        self.calls = 0

    def plan(self, active, remaining=None, prefill=0, context=None):
        self.calls += 1
        return [(b + self.calls) % (self.k_max + 1) if a else 0 for b, a in enumerate(active)]


# ------------------------------------------------------------------------------------------ the matrix
@dataclass
class Case:
    id: str
    draft: str  # a key of the models fixture's drafts (which names its target)
    opts: Dict  # sampling filter and processors (generate() keywords and the law's)
    run: Dict = field(default_factory=dict)  # further generate() keywords (k, draft_tree, runner, ...)
    acceptance: str = "mid"  # "mid": strictly inside (0, 1); "high": a draft equal to the target; "low"; "any"
    prompts: Tuple[Tuple[int, ...], ...] = (tuple(PROMPT),)
    positions: int = POSITIONS  # 5: the first three tokens' law and the law of tokens 4 and 5
    eos: Optional[int] = None  # a row ends at this token (the law of the returned tokens, shorter rows padded)
    samples: int = SAMPLES  # rows per prompt


PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.7, repetition_penalty=1.6)
STRONG = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=3.0)
BIAS = {2: -100.0, 5: 3.0}  # token 2 banned (at moderate T), token 5 boosted
RAGGED = tuple(map(tuple, RAGGED_PROMPTS))
RAGGED_SAMPLES = 2000  # rows per prompt of the ragged batches
ALL = dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02, logit_bias={"2": -100.0, "7": 1.5}, **PENALTIES)

CASES = [
    # the filter, a draft-model chain (k=2 unless said)
    Case("topk1-T1", "near", dict(temperature=1.0, top_k=1), acceptance="any"),
    Case("topk2-T1", "near", dict(temperature=1.0, top_k=2)),
    Case("topk3-T0.3", "near", dict(temperature=0.3, top_k=3)),
    Case("topk3-T2.5-k4", "near", dict(temperature=2.5, top_k=3), dict(k=4)),
    Case("topk3-T1e4", "near", dict(temperature=1e4, top_k=3)),
    Case("topk3-Tinf", "near", dict(temperature=math.inf, top_k=3)),
    Case("minp0.1-T1", "near", dict(temperature=1.0, min_p=0.1)),
    Case("minp0.2-T2.5-k3", "near", dict(temperature=2.5, min_p=0.2), dict(k=3)),
    Case("topp0.3-T1", "near", dict(temperature=1.0, top_p=0.3)),
    Case("topp0.5-T0.6-k1", "near", dict(temperature=0.6, top_p=0.5), dict(k=1)),
    Case("topp0.55-T1e4", "near", dict(temperature=1e4, top_p=0.55)),
    Case("topk4-topp0.6-minp-T2.5", "near", dict(temperature=2.5, top_k=4, top_p=0.6, min_p=0.05)),
    # the processors: they depend on the prompt and on the history before each position
    Case("repetition1.8", "near", dict(temperature=1.0, repetition_penalty=1.8), dict(k=3)),
    Case("repetition0.5", "near", dict(temperature=1.0, repetition_penalty=0.5), dict(k=3)),
    Case("repetition1e30-T1e4", "near", dict(temperature=1e4, repetition_penalty=1e30), dict(k=3)),
    Case("presence1.5-k1", "near", dict(temperature=1.0, presence_penalty=1.5), dict(k=1)),
    Case("frequency2-presence-1-k4", "near", dict(temperature=1.0, frequency_penalty=2.0, presence_penalty=-1.0),
         dict(k=4)),
    Case("openai-negative", "near", dict(temperature=1.0, frequency_penalty=-2.0, presence_penalty=-2.0), dict(k=3)),
    Case("bias-ban-boost", "near", dict(temperature=1.0, logit_bias=BIAS), dict(k=3)),
    Case("bias+100-repetition50", "near", dict(temperature=1.0, logit_bias={3: 100.0}, repetition_penalty=50.0),
         dict(k=3)),
    Case("bias-ban-T2.5-topk3", "near", dict(temperature=2.5, top_k=3, logit_bias={0: -100.0, 7: -100.0}), dict(k=2)),
    Case("everything-T0.8", "near", dict(ALL), dict(k=3)),
    Case("greedy-processed", "near", dict(temperature=0.0, **STRONG), dict(k=3), acceptance="any"),
    # drafts far from and equal to the target
    Case("far-T1", "far", dict(temperature=1.0), dict(k=3), acceptance="low"),
    Case("far-penalties", "far", dict(temperature=1.0, **STRONG), dict(k=2), acceptance="low"),
    Case("self-T1", "self", dict(temperature=1.0), dict(k=3), acceptance="high"),
    Case("self-everything", "self", dict(ALL), dict(k=3), acceptance="high"),
    # ragged drafting: draft_confidence, scripted per-row budgets (adaptive k's path), other runners
    Case("confidence-penalties", "near", dict(temperature=1.0, **PENALTIES), dict(k=3, draft_confidence=0.5)),
    Case("row-budgets-penalties", "near", dict(temperature=1.0, **STRONG), dict(k="budgets")),
    # adaptive k's own controller: its choices follow measured times (not seeded), so this case's samples vary
    # from run to run; a correct sampler still fails it with probability PASS_P only. (k="auto" as it comes
    # never drafts on these tiny models, where a draft pass costs as much as a target pass.)
    Case("auto-explore-penalties", "near", dict(temperature=1.0, **STRONG), dict(k="explore"), positions=5),
    Case("k-default-seeded", "near", dict(temperature=1.0, **PENALTIES), {}),  # k=None: a fixed k=4 when seeded
    Case("paged-penalties", "near", dict(temperature=1.2, top_k=5, **PENALTIES), dict(k=3, runner="paged")),
    Case("recompute-minp-bias", "near", dict(temperature=0.7, min_p=0.05, logit_bias=BIAS),
         dict(k=2, runner="recompute")),
    # the n-gram drafter: deterministic proposals (q one-hot)
    Case("ngram-T1", "ngram", dict(temperature=1.0), dict(k=3), prompts=(tuple(REPEATING_PROMPT),)),
    Case("ngram-topk2-T2.5", "ngram", dict(temperature=2.5, top_k=2), dict(k=2), prompts=(tuple(REPEATING_PROMPT),)),
    Case("ngram-ban-penalties", "ngram", dict(temperature=1.0, logit_bias={4: -100.0, 6: 2.0}, **STRONG), dict(k=4),
         prompts=(tuple(REPEATING_PROMPT),)),
    # draft-model trees (sampled children, recursive rejection sampling)
    Case("tree(2,2,3)-T1", "near", dict(temperature=1.0), dict(draft_tree=(2, 2, 3))),
    Case("tree(3,2,6)-topk2", "near", dict(temperature=1.0, top_k=2), dict(draft_tree=(3, 2, 6))),
    Case("tree(2,3,5)-penalties", "near", dict(temperature=1.0, **STRONG), dict(draft_tree=(2, 3, 5))),
    Case("tree(1,3,3)-topp-bias", "near", dict(temperature=0.7, top_p=0.8, logit_bias=BIAS),
         dict(draft_tree=(1, 3, 3))),
    Case("tree(2,2,4)-Tinf-topk3", "near", dict(temperature=math.inf, top_k=3), dict(draft_tree=(2, 2, 4))),
    # Medusa heads on the target (deterministic candidates in a tree)
    Case("heads(2,2,4)-T1", "heads", dict(temperature=1.0), dict(draft_tree=(2, 2, 4))),
    Case("heads(3,2,5)-penalties-bias", "heads", dict(temperature=0.7, logit_bias=BIAS, **PENALTIES),
         dict(draft_tree=(3, 2, 5))),
    # an EAGLE-3 head (random weights) on the target's hidden states: chain and tree
    Case("eagle-k3-topk4", "eagle", dict(temperature=1.0, top_k=4), dict(k=3)),
    Case("eagle-tree(2,2,4)-penalties", "eagle", dict(temperature=1.0, **STRONG), dict(draft_tree=(2, 2, 4))),
    # one batch of prompts of different lengths: a law per prompt (the repetition penalty reads each prompt)
    Case("ragged-prompts-penalties", "near", dict(temperature=1.0, **STRONG), dict(k=3), prompts=RAGGED,
         samples=RAGGED_SAMPLES),
    Case("ragged-prompts-ngram", "ngram", dict(temperature=1.0, repetition_penalty=2.0, logit_bias=BIAS), dict(k=3),
         prompts=RAGGED, samples=RAGGED_SAMPLES),
    Case("ragged-prompts-tree(2,2,4)", "near", dict(temperature=1.0, **PENALTIES), dict(draft_tree=(2, 2, 4)),
         prompts=RAGGED, samples=RAGGED_SAMPLES),
    Case("ragged-prompts-heads(2,2,4)", "heads", dict(temperature=0.8, top_k=6), dict(draft_tree=(2, 2, 4)),
         prompts=RAGGED, samples=RAGGED_SAMPLES),
    Case("ragged-prompts-eagle-k3", "eagle", dict(temperature=1.0, **PENALTIES), dict(k=3), prompts=RAGGED,
         samples=RAGGED_SAMPLES),
    Case("ragged-prompts-eagle-tree(2,2,3)", "eagle", dict(temperature=1.0), dict(draft_tree=(2, 2, 3)),
         prompts=RAGGED, samples=RAGGED_SAMPLES),
    # an EAGLE head drafting from a subset of the vocabulary (q = 0 elsewhere)
    Case("eagle-subset-k3-Tinf-topk4", "eagle-subset", dict(temperature=math.inf, top_k=4), dict(k=3)),
    Case("eagle-subset-tree(3,2,5)-topk2", "eagle-subset", dict(temperature=1.0, top_k=2), dict(draft_tree=(3, 2, 5))),
    # a GPT-NeoX pair (the paged runner)
    Case("neox-k3-penalties", "neox-near", dict(temperature=1.0, **PENALTIES), dict(k=3)),
    Case("neox-tree(2,2,4)-minp", "neox-near", dict(temperature=1.5, min_p=0.1), dict(draft_tree=(2, 2, 4))),
    # EOS ends rows inside accepted runs; streaming and logprobs change nothing
    Case("eos3-k3-penalties", "near", dict(temperature=1.0, **PENALTIES), dict(k=3), eos=3),
    Case("stream-logprobs-tree", "near", dict(temperature=1.0, **STRONG), dict(draft_tree=(2, 2, 3), stream=True,
                                                                               logprobs=2)),
    # five tokens: the first three's law and the law of tokens 4-5 (more verify steps, penalties on longer histories)
    Case("long-k2-penalties", "near", dict(temperature=1.0, **STRONG), dict(k=2), positions=5),
    Case("long-far-everything-k4", "far", dict(ALL), dict(k=4), acceptance="low", positions=5),
    Case("long-ngram-penalties", "ngram", dict(temperature=1.0, **STRONG), dict(k=3), positions=5,
         prompts=(tuple(REPEATING_PROMPT),)),
    Case("long-row-budgets-bias", "near", dict(temperature=1.0, logit_bias=BIAS, **PENALTIES), dict(k="budgets"),
         positions=5),
    Case("long-tree(2,2,3)-penalties", "near", dict(temperature=1.0, **STRONG), dict(draft_tree=(2, 2, 3)),
         positions=5),
    Case("long-heads(2,3,5)-penalties", "heads", dict(temperature=1.0, **PENALTIES), dict(draft_tree=(2, 3, 5)),
         positions=5),
    Case("long-eagle-k2-penalties", "eagle", dict(temperature=1.0, **STRONG), dict(k=2), positions=5),
]


def sample(models, case: Case, verifier=None):
    """generate() over ``samples`` rows per prompt (one batch, seed = row index). Returns (result, target, the
    rows of each prompt, each padded with the symbol V after an EOS)."""
    targets, drafts = models
    target_name, draft = drafts[case.draft]
    target = targets[target_name]
    run = dict(case.run)
    if run.get("k") == "budgets":
        run["k"] = RowBudgets(3)
    elif run.get("k") == "explore":  # the real controller, made to explore 3 drafts every step it plans 0
        run["k"] = AdaptiveK(4, explore_every=1, explore_k=3)
    if verifier is not None:
        run["verifier"] = verifier
    reset_calibrations()  # (seeded samples rank trees by the prior anyway)
    samples = case.samples
    prompts = [list(p) for p in case.prompts for _ in range(samples)]
    out = generate(prompts, target, draft, max_new_tokens=case.positions, seed=list(range(len(prompts))),
                   eos_token_id=False if case.eos is None else case.eos, cost_probe=False, **case.opts, **run)
    if run.get("stream"):
        pieces = list(out)
        out = out.result
        assert sum(len(piece.token_ids) for piece in pieces) == sum(map(len, out.token_ids))
    rows = []
    for tokens, reason in zip(out.token_ids, out.finish_reasons):
        if case.eos is None or case.eos not in tokens:
            assert len(tokens) == case.positions and reason == "length"
        else:  # ends at its first EOS, inclusive
            assert reason == "eos" and tokens.index(case.eos) == len(tokens) - 1
        rows.append(list(tokens) + [V] * (case.positions - len(tokens)))
    return out, target, [rows[i * samples:(i + 1) * samples] for i in range(len(case.prompts))]


def check_acceptance(out, kind: str) -> float:
    """The case exercised what it is meant to: drafts reached, accepted and rejected."""
    reached, accepted = sum(out.stats.reached), sum(out.stats.accepted)
    assert reached > 0, "no draft was verified"
    rate = accepted / reached
    if kind == "mid":
        assert 0.02 < rate < 0.98, rate
    elif kind == "low":
        assert 0.0 < rate < 0.35, rate
    elif kind == "high":
        assert rate > 0.97, rate
    elif kind == "none":  # q has no mass where p has any: every draft is rejected
        assert rate == 0.0, rate
    return rate


def check_law(case: Case, target, prompt, rows, rate: float = float("nan")) -> None:
    law = exact_law(target, prompt, case.opts, case.positions)
    if case.eos is not None:
        law = with_eos(law, case.eos)
    checks = [("tokens 1-3", law.sum(axis=tuple(range(3, law.ndim))), [r[:3] for r in rows])]
    if case.positions > 3:
        checks.append((f"tokens 4-{case.positions}", law.sum(axis=(0, 1, 2)), [r[3:] for r in rows]))
    for what, marginal, samples in checks:
        p = p_value(samples, marginal)
        print(f"\n{case.id} {list(prompt)} {what}: acceptance {rate:.3f}, law support {int((marginal > 0).sum())} "
              f"cells (max {marginal.max():.3f}), chi-square p = {p:.3g}")
        assert p > PASS_P, f"prompt {list(prompt)}, {what}: chi-square p = {p:.3g}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_first_tokens_follow_the_exact_law(models, case):
    out, target, per_prompt = sample(models, case)
    rate = check_acceptance(out, case.acceptance)
    for prompt, rows in zip(case.prompts, per_prompt):
        check_law(case, target, prompt, rows, rate)


# ------------------------------------------------------------------------------------------ structured output
GRAMMAR_REGEX = "[abc]{3}"  # three characters a, b or c: one to three tokens of the bundled tokenizer
GRAMMAR_SAMPLES = 1000  # (the grammar's masks are filled on the host, row by row: slower per row)


@pytest.fixture(scope="module")
def grammar_models():
    """The bundled tokenizer (llguidance needs a real one) over tiny random models of its vocabulary."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(Path(specdec_ext.__file__).parent / "default_pair" / "tokenizer"))
    vocab = len(tokenizer)
    target = tiny_model("llama", vocab=vocab, hidden=32, layers=1, seed=3, logit_scale=30.0)
    draft = tiny_model("llama", vocab=vocab, hidden=32, layers=1, seed=4, logit_scale=30.0)
    torch.manual_seed(6)
    eagle = Eagle3Model(EagleConfig.for_target(target, layer_ids=(0, 0, 0))).eval().requires_grad_(False)
    # a head whose vocabulary holds no token the grammar allows: its processed q is empty, it drafts unprocessed
    abc = [i for i in range(vocab) if tokenizer.decode([i]) and set(tokenizer.decode([i])) <= set("abc")]
    others = torch.tensor([i for i in range(vocab) if i not in set(abc)][:64])
    torch.manual_seed(7)
    excluded = Eagle3Model(EagleConfig.for_target(target, layer_ids=(0, 0, 0), draft_vocab_size=len(others)))
    excluded.set_draft_vocab(others)
    drafts = {"near": draft, "self": target, "eagle": EagleDrafterSpec(eagle),
              "eagle-excluded": EagleDrafterSpec(excluded.eval().requires_grad_(False))}
    return tokenizer, target, drafts


def grammar_law(target, tokenizer, prompt: List[int], opts: Dict, max_new: int) -> Dict[Tuple[int, ...], float]:
    """The law of the returned tokens under GRAMMAR_REGEX, by this file's own reading of the regex: a token is
    allowed where its text is made of a, b, c and the text stays within 3 characters; the row ends once the
    text has 3 (or at max_new tokens). The grammar mask comes after the penalties, before min_p and the filter."""
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    abc = {i: t for i, t in texts.items() if t and set(t) <= set("abc")}
    law: Dict[Tuple[int, ...], float] = {}

    def walk(tokens: List[int], text: str, prob: float) -> None:
        if len(text) == 3 or len(tokens) == max_new:
            law[tuple(tokens)] = law.get(tuple(tokens), 0.0) + prob
            return
        with torch.no_grad():
            raw = target(torch.tensor([prompt + tokens])).logits[0, -1].double().numpy()
        allowed = np.zeros(len(raw), dtype=bool)
        allowed[[i for i, t in abc.items() if len(text) + len(t) <= 3]] = True
        logits = np.where(allowed, processed_logits(raw, prompt, tokens, opts), -np.inf)
        law_here = sampling_law(logits, opts)
        for token in np.nonzero(law_here)[0]:
            walk(tokens + [int(token)], text + abc[int(token)], prob * law_here[token])

    walk([], "", 1.0)
    return law


@pytest.mark.parametrize("draft_kind,opts,acceptance,run", [
    ("near", dict(temperature=1.0, top_k=6, logit_bias={65: -100.0}, **PENALTIES), "mid", dict(k=3)),  # 65 = "a"
    ("self", dict(temperature=0.8, **STRONG), "high", dict(k=3)),  # the draft's masks equal the verifier's: q = p
    # an EAGLE-3 head proposes from its processed logits too (unprocessed, its random q over 8192 ids put almost
    # nothing on the few the grammar allows)
    ("eagle", dict(temperature=1.0, **PENALTIES), "mid", dict(k=3)),
    ("eagle-excluded", dict(temperature=1.0), "none", dict(k=3)),
    # trees: each node's children from its processed q (unprocessed, a (2,2,3) tree accepted nothing)
    ("near", dict(temperature=1.0, **PENALTIES), "mid", dict(draft_tree=(2, 2, 4))),
    ("eagle", dict(temperature=1.0), "mid", dict(draft_tree=(2, 2, 4))),
    ("eagle-excluded", dict(temperature=1.0), "none", dict(draft_tree=(2, 2, 3))),
], ids=["near-k3-penalties-ban", "self-k3-penalties", "eagle-k3-penalties", "eagle-k3-vocabulary-excluded",
        "near-tree(2,2,4)-penalties", "eagle-tree(2,2,4)", "eagle-tree(2,2,3)-vocabulary-excluded"])
def test_structured_output_follows_the_masked_law(grammar_models, draft_kind, opts, acceptance, run):
    tokenizer, target, drafts = grammar_models
    draft = drafts[draft_kind]
    prompt = tokenizer("x = ")["input_ids"]
    reset_calibrations()  # (seeded samples rank trees by the prior anyway)
    out = generate([prompt] * GRAMMAR_SAMPLES, target, draft, tokenizer=tokenizer, regex=GRAMMAR_REGEX,
                   max_new_tokens=3, seed=list(range(GRAMMAR_SAMPLES)), eos_token_id=False, cost_probe=False,
                   **run, **opts)
    rate = check_acceptance(out, acceptance)
    assert all(set(text) <= set("abc") and len(text) == 3 for text in out.text)
    law = grammar_law(target, tokenizer, prompt, opts, 3)
    cells = {tokens: i for i, tokens in enumerate(law)}
    impossible = [t for t in out.token_ids if tuple(t) not in cells]
    assert not impossible, f"samples outside the law's support: {impossible[:5]}"
    as_cells = [[cells[tuple(t)]] for t in out.token_ids]  # (one coordinate per sequence)
    p = p_value(as_cells, np.array(list(law.values())))
    print(f"\ngrammar {draft_kind}: acceptance {rate:.3f}, {len(law)} sequences, chi-square p = {p:.3g}")
    assert p > PASS_P


# ------------------------------------------------------------------------------------------ batches
@pytest.mark.parametrize("draft_name,run", [
    ("near", dict(draft_tree=(2, 2, 4))), ("heads", dict(draft_tree=(2, 2, 4))), ("eagle", dict(draft_tree=(2, 2, 3))),
    ("ngram", dict(k=3)), ("near", dict(k=3, draft_confidence=0.5))], ids=["tree", "heads", "eagle-tree", "ngram",
                                                                          "confidence"])
def test_a_rows_sample_depends_on_its_prompt_and_seed_only(models, draft_name, run):
    """The docstring's promise behind one-seed-per-row sampling: a row's tokens are the same alone, in a ragged
    batch and in the batch reversed (processors on, so the per-row counts and prompt masks must not leak)."""
    targets, drafts = models
    target_name, draft = drafts[draft_name]
    target = targets[target_name]
    prompts = RAGGED_PROMPTS + [REPEATING_PROMPT]
    seeds = [11, 12, 13, 14]
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=6, eos_token_id=False, cost_probe=False,
              logit_bias={2: -100.0}, **PENALTIES, **run)
    batched = generate(prompts, target, draft, seed=seeds, **kw).token_ids
    reversed_ = generate(prompts[::-1], target, draft, seed=seeds[::-1], **kw).token_ids[::-1]
    alone = [generate([p], target, draft, seed=s, **kw).token_ids[0] for p, s in zip(prompts, seeds)]
    assert batched == alone == reversed_


# ------------------------------------------------------------------------------------------ power
def test_a_broken_verifier_fails_the_same_check(models):
    """The classic bug (the recovered token drawn from p, not norm(max(0, p - q))) on a processed case."""
    case = Case("broken", "near", dict(temperature=1.0, top_k=5, **PENALTIES), dict(k=2))
    _, target, (rows,) = sample(models, case, verifier=residual_from_p_verifier)
    assert p_value(rows, exact_law(target, PROMPT, case.opts)) < FAIL_P


def test_penalties_blind_to_the_drafts_before_a_position_fail_the_same_check(models, monkeypatch):
    """Every column of a verify pass processed with the committed counts only, as if it were the first."""
    case = Case("prefix-blind", "self", dict(temperature=1.0, **STRONG), dict(k=3))
    monkeypatch.setattr(ProcessingState, "apply", prefix_blind(ProcessingState.apply))
    _, target, (rows,) = sample(models, case)
    assert p_value(rows, exact_law(target, PROMPT, case.opts)) < FAIL_P


def test_a_law_blind_to_the_generated_history_is_rejected(models):
    """The reference's per-position history matters: the same samples reject a law whose penalties never
    see the generated tokens (so the processor cases test per-position application, not just the prompt)."""
    case = Case("history", "near", dict(temperature=1.0, **STRONG), dict(k=3))
    _, target, (rows,) = sample(models, case)
    assert p_value(rows, exact_law(target, PROMPT, case.opts)) > PASS_P
    assert p_value(rows, exact_law(target, PROMPT, case.opts, count_history=False)) < FAIL_P
