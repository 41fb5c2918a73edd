"""The lookup drafter: specdec_ext._C.SuffixAutomaton against a brute-force reference (random
sequences over small alphabets, incremental extends of random chunk sizes, edge cases, bad inputs),
then NgramDrafter on hand-made metadata and through the decode loop: greedy output equal to HF greedy
generation, and at T = 1 the first tokens distributed as plain target sampling (chi-square, with a
broken verifier as the negative control)."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_ext._C import SuffixAutomaton
from specdec_ext.decode import LoopConfig, decode
from specdec_ext.step import StepOptions, lossless_verify, verify_width
from specdec_ext.drafters import Drafter, NgramDrafter
from specdec_ext.metadata import SpecDecodeMetadata, Verdict
from specdec_ext.plan import required_cache_len
from specdec_ext.runners import make_runner
from specdec_ext.sampling import SamplingParams
from specdec_ext.stats import GenerationStats
from specdec_ext.stops import RowState, StopCriteria
from sampling_stats import chi_square_p, exact_joint
from test_generate_sampling import residual_from_p_verifier
from test_generate_utils import hf_greedy, tiny_model


# ------------------------------------------------------------------------------------ reference
def ref_match(seq):
    """(L, e): the longest suffix of seq that also ends at some e < len(seq) - 1, and its EARLIEST
    such end; (0, -1) when none. Brute force over strings (tokens -> characters, str.find)."""
    alphabet = {t: chr(0x100 + i) for i, t in enumerate(dict.fromkeys(seq))}
    text = "".join(alphabet[t] for t in seq)
    n = len(seq)
    for length in range(n - 1, 0, -1):
        start = text.find(text[n - length:], 0, n - 1)  # occurrences inside seq[:n-1]: end <= n-2
        if start >= 0:
            return length, start + length - 1
    return 0, -1


def ref_propose(seq, max_tokens, min_match=2, overlap_copy=True, match=None):
    """The lookup's proposal from the match ``match(seq)`` -> (length, end) (default ``ref_match``): the
    continuation of the match's end, copied on past the sequence's end (an overlap) when ``overlap_copy``."""
    length, end = (match or ref_match)(seq)
    if max_tokens == 0 or length < min_match:
        return []
    extended, out = list(seq), []
    for j in range(max_tokens):
        index = end + 1 + j
        if index >= len(seq) and not overlap_copy:
            break
        out.append(extended[index])
        extended.append(extended[index])
    return out


def check_against_reference(automaton, seq, max_tokens_list=(0, 1, 2, 3, 5, 9)):
    assert len(automaton) == len(seq)
    length, end = ref_match(seq)
    assert (automaton.match_length(), automaton.match_end()) == (length, end), seq
    for m in max_tokens_list:
        assert automaton.propose(m) == ref_propose(seq, m, automaton.min_match, automaton.overlap_copy), (seq, m)


# ------------------------------------------------------------------------------------ automaton
def test_reference_on_hand_computed_cases():
    assert ref_match([]) == (0, -1) and ref_match([4]) == (0, -1)
    assert ref_match([1, 2, 3, 1, 2]) == (2, 1)
    assert ref_match([7, 7, 7, 7]) == (3, 2)
    assert ref_match([1, 2, 1, 3, 1, 2]) == (2, 1)  # "1 2" first ends at 1
    assert ref_match([5, 1, 9, 1, 5, 1]) == (2, 1)  # "5 1" at 0..1 (the later "9 1"/"1" ignored)
    assert ref_propose([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # overlapping copy, period 3
    assert ref_propose([1, 2, 3, 1, 2], 5, overlap_copy=False) == [3, 1, 2]
    assert ref_propose([1, 2, 3, 4], 5, min_match=1) == []


@pytest.mark.parametrize("min_match,overlap_copy", [(1, True), (2, True), (3, False), (2, False)])
def test_random_sequences_with_incremental_extends(min_match, overlap_copy):
    rng = random.Random(1000 * min_match + overlap_copy)
    for trial in range(60):
        alphabet = rng.choice([1, 2, 3, 4, 8])
        tokens = rng.sample(range(0, 50_000), alphabet)  # arbitrary (large) ids: the alphabet is not 0..V-1
        automaton = SuffixAutomaton(min_match, overlap_copy)
        seq = []
        check_against_reference(automaton, seq)
        target_len = rng.randint(1, 90)
        while len(seq) < target_len:
            chunk = [rng.choice(tokens) for _ in range(rng.choice([0, 1, 1, 2, 3, 5, 8]))]
            automaton.extend(chunk)
            seq += chunk
            check_against_reference(automaton, seq)
        assert automaton.tokens() == seq
        assert automaton.num_states <= max(1, 2 * len(seq))  # at most 2n - 1 states plus the root


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.lists(st.integers(0, 2), max_size=6), max_size=12),
       min_match=st.integers(1, 3), overlap_copy=st.booleans(), max_tokens=st.integers(0, 7))
def test_hypothesis_chunks(chunks, min_match, overlap_copy, max_tokens):
    automaton = SuffixAutomaton(min_match=min_match, overlap_copy=overlap_copy)
    seq = []
    for chunk in chunks:
        automaton.extend(chunk)
        seq += chunk
        assert automaton.match_length() == ref_match(seq)[0]
        assert automaton.propose(max_tokens) == ref_propose(seq, max_tokens, min_match, overlap_copy)


def test_empty_and_one_token():
    automaton = SuffixAutomaton()
    assert len(automaton) == 0 and automaton.match_length() == 0 and automaton.match_end() == -1
    assert automaton.propose(4) == [] and automaton.propose(0) == []
    automaton.extend([])
    assert len(automaton) == 0
    automaton.extend([42])
    assert len(automaton) == 1 and automaton.match_length() == 0 and automaton.propose(4) == []
    one = SuffixAutomaton(min_match=1)
    one.extend([42])
    assert one.propose(4) == []
    one.extend([42])  # "42 42": the suffix "42" occurred at 0
    assert (one.match_length(), one.match_end()) == (1, 0)
    assert one.propose(3) == [42, 42, 42]


@pytest.mark.parametrize("n", range(1, 8))
def test_all_same_token(n):
    for min_match, overlap_copy in itertools.product([1, 2], [True, False]):
        automaton = SuffixAutomaton(min_match, overlap_copy)
        automaton.extend([3] * n)
        assert automaton.match_length() == n - 1 and automaton.match_end() == (n - 2 if n > 1 else -1)
        proposes = n - 1 >= min_match
        assert automaton.propose(5) == ([3] * (5 if overlap_copy else 1) if proposes else [])
        check_against_reference(automaton, [3] * n)


def test_max_tokens_zero_negative_and_beyond_the_history():
    automaton = SuffixAutomaton(min_match=2, overlap_copy=False)
    automaton.extend([9, 1, 2, 8, 7, 6, 1, 2])  # "1 2" first ends at 2: 5 tokens of history follow
    assert automaton.propose(0) == []  # max_tokens 0 is an empty proposal
    assert automaton.propose(3) == [8, 7, 6]
    assert automaton.propose(100) == [8, 7, 6, 1, 2]  # capped by the history
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        automaton.propose(-1)
    periodic = SuffixAutomaton()  # overlap_copy: the copy continues through the proposal itself
    periodic.extend([9, 1, 2, 8, 7, 6, 1, 2])
    assert periodic.propose(12) == [8, 7, 6, 1, 2, 8, 7, 6, 1, 2, 8, 7]


def test_earliest_occurrence_is_used():
    automaton = SuffixAutomaton(min_match=2)
    automaton.extend([1, 2, 3, 0, 1, 2, 4, 0, 1, 2])  # "0 1 2" occurs at 3..5 only: continue with 4
    assert (automaton.match_length(), automaton.match_end()) == (3, 5)
    assert automaton.propose(2) == [4, 0]
    automaton.extend([5, 1, 2])  # only "1 2" repeats now: earliest at 0..1, continue with 3
    assert (automaton.match_length(), automaton.match_end()) == (2, 1)
    assert automaton.propose(3) == [3, 0, 1]


def test_extend_accepts_sequences_and_tensors_and_rejects_bad_input():
    seq = [5, 6, 5, 6, 5]
    want = SuffixAutomaton()
    want.extend(seq)
    for tokens in (tuple(seq), torch.tensor(seq), torch.tensor(seq, dtype=torch.int32), np.array(seq),
                   torch.tensor([0] + seq)[1:]):
        got = SuffixAutomaton()
        got.extend(tokens)
        assert got.tokens() == seq and got.propose(4) == want.propose(4)
    automaton = SuffixAutomaton()
    automaton.extend([1, 2])
    with pytest.raises(ValueError, match="token ids must be >= 0, got -1 at index 1"):
        automaton.extend([3, -1, 4])
    assert automaton.tokens() == [1, 2]  # nothing of a bad chunk is appended
    for bad in (5, "ab", [1.5], torch.zeros(2, 2, dtype=torch.int64), torch.zeros(3)):
        with pytest.raises(TypeError):
            automaton.extend(bad)
    with pytest.raises(ValueError, match="min_match must be >= 1"):
        SuffixAutomaton(min_match=0)
    assert "min_match=2" in repr(automaton)
    automaton.clear()
    assert len(automaton) == 0 and automaton.propose(3) == []


def test_long_sequence_is_linear_and_matches_the_reference_at_the_end():
    rng = random.Random(7)
    seq = [rng.randrange(6) for _ in range(3000)] + list(range(100, 140)) * 3
    automaton = SuffixAutomaton()
    for i in range(0, len(seq), 7):
        automaton.extend(seq[i:i + 7])
    assert automaton.num_states < 2 * len(seq)
    check_against_reference(automaton, seq, (0, 4, 50))
    assert automaton.propose(4) == [100, 101, 102, 103]  # the 40-token loop, continued


# ------------------------------------------------------------------------------------ drafter
def _meta(rows, k, S=32, sampling=SamplingParams()):
    B = len(rows)
    meta = SpecDecodeMetadata.allocate(batch_size=B, slots=k, max_seq_len=S, sampling=sampling,
                                       seeds=torch.zeros(B, dtype=torch.int64))
    for b, row in enumerate(rows):
        meta.token_buffer[b, :len(row)] = torch.tensor(row)
        meta.seq_lens[b] = len(row)
    return meta


def test_drafter_prefill_propose_commit_ragged_rows():
    rows = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 7, 7, 7]]
    k = 3
    meta = _meta(rows, k, sampling=SamplingParams(temperature=1.0))
    drafter = NgramDrafter(k, min_match=2)
    assert isinstance(drafter, Drafter)
    drafter.prefill([r[:-1] for r in rows], meta)
    proposal = drafter.propose(meta)
    assert proposal.probs is None  # deterministic: chain_verify takes q one-hot
    assert proposal.num_draft.tolist() == [3, 0, 3]
    assert proposal.token_ids.tolist() == [[3, 1, 2], [0, 0, 0], [7, 7, 7]]
    assert proposal.longest == 3 and verify_width(proposal) == 4  # the counts narrow the verify pass
    # a step commits 3 tokens to row 0, 1 token to row 1, none to row 2 (frozen)
    committed = [[3, 1, 2], [4], []]
    for b, new in enumerate(committed):
        n = int(meta.seq_lens[b])
        meta.token_buffer[b, n:n + len(new)] = torch.tensor(new, dtype=torch.int64)
        meta.seq_lens[b] = n + len(new)
    verdict = Verdict(meta.output_tokens, meta.num_accepted)
    drafter.commit(meta, verdict)
    full = [r + c for r, c in zip(rows, committed)]
    assert [a.tokens() for a in drafter.automata] == full
    proposal = drafter.propose(meta)
    want = [ref_propose(r, k) for r in full]
    assert want == [[3, 1, 2], [], [7, 7, 7]]  # row 1 "4 5 6 4": a 1-token match, below min_match 2
    assert proposal.num_draft.tolist() == [3, 0, 3]
    assert proposal.token_ids.tolist() == [[3, 1, 2], [0, 0, 0], [7, 7, 7]]
    assert drafter.propose(meta, budget=[1, 1, 0]).token_ids.tolist() == [[3, 0, 0], [0, 0, 0], [0, 0, 0]]
    loose = NgramDrafter(k, min_match=1)
    loose.prefill([], meta)
    proposal = loose.propose(meta)
    assert proposal.num_draft.tolist() == [3, 3, 3] and proposal.token_ids[1].tolist() == [5, 6, 4]
    # a step that commits more than k + 1 tokens (commit skipped once) falls back to a slice
    meta.token_buffer[1, 4:10] = torch.tensor([5, 6, 4, 5, 6, 4])
    meta.seq_lens[1] = 10
    loose.commit(meta, verdict)
    assert loose.automata[1].tokens() == [4, 5, 6, 4, 5, 6, 4, 5, 6, 4]
    meta.seq_lens[1] = 3
    with pytest.raises(RuntimeError, match="never rolled back"):
        loose.commit(meta, verdict)


def test_drafter_bad_arguments():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="k"):
            NgramDrafter(bad)
    with pytest.raises(ValueError, match="min_match"):
        NgramDrafter(2, min_match=0)
    with pytest.raises(ValueError, match="k=2"):
        NgramDrafter(2).prefill([[1]], _meta([[1, 2]], k=3))


# ------------------------------------------------------------------------------------ decode loop
pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


def run_ngram(target, prompts, *, k, new, sampling=SamplingParams(), seeds=None, min_match=2,
              verifier=lossless_verify):
    """The decode loop with an NgramDrafter over the lean runner -> (tokens per row, stats)."""
    B = len(prompts)
    seeds = torch.zeros(B, dtype=torch.int64) if seeds is None else seeds
    needed = required_cache_len(max(len(p) for p in prompts), new, k)
    runner = make_runner("lean", target, max_batch_size=B, max_seq_len=needed)
    rows = [RowState() for _ in prompts]
    stats = GenerationStats(k=k, batch_size=B)
    config = LoopConfig(slots=k, sampling=sampling, max_seq_len=needed, cost_probe=False,
                        greedy_chains=runner.capabilities.greedy_chain, step=StepOptions(verifier=verifier))
    for _ in decode(runner, NgramDrafter(k, min_match=min_match), prompts, seeds, StopCriteria(max_new_tokens=new),
                    config, stats=stats, rows=rows):
        pass
    return [r.tokens for r in rows], stats


GREEDY_PROMPTS = [[5, 6, 7, 8] * 4, [11, 12, 13, 11, 12, 13, 11], [20, 21, 20, 21, 20, 21, 22, 23], [30, 31, 32]]
GREEDY_NEW = 32


@pytest.fixture(scope="module")
def greedy_target():
    return tiny_model("llama", vocab=96, hidden=48, layers=2, logit_scale=4.0, seed=0)


@pytest.fixture(scope="module")
def greedy_references(greedy_target):
    return [hf_greedy(greedy_target, p, GREEDY_NEW) for p in GREEDY_PROMPTS]


@pytest.mark.parametrize("k,min_match", [(1, 2), (4, 2), (6, 1)])
def test_greedy_decode_with_ngram_equals_hf_greedy(greedy_target, greedy_references, k, min_match):
    tokens, stats = run_ngram(greedy_target, GREEDY_PROMPTS, k=k, new=GREEDY_NEW, min_match=min_match)
    assert tokens == greedy_references
    assert sum(stats.reached) > 0 and sum(stats.accepted) > 0  # the drafter proposed and was right sometimes
    assert stats.tokens_per_pass > 1.0
    one, _ = run_ngram(greedy_target, GREEDY_PROMPTS[1:2], k=k, new=GREEDY_NEW, min_match=min_match)
    assert one == greedy_references[1:2]


TINY_VOCAB = 8
SAMPLE_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]  # every token repeats: every row drafts
SAMPLE_ROWS = 3000  # one batched decode call: rows are independent (Philox keyed by each row's seed)
SAMPLE_POSITIONS = 3  # token 1 from the prefill, tokens 2-3 from step 1 (both draft positions)
PASS_P = 1e-4  # a correct sampler fails with probability 1e-4 (the runs are seeded: deterministic)
FAIL_P = 1e-8


def test_sampling_first_tokens_follow_plain_target_sampling():
    target = tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=2, seed=3, logit_scale=3.0)
    joint = exact_joint(target, SAMPLE_PROMPT)
    kw = dict(k=2, new=SAMPLE_POSITIONS, sampling=SamplingParams(temperature=1.0), min_match=1,
              seeds=torch.arange(SAMPLE_ROWS, dtype=torch.int64))
    tokens, stats = run_ngram(target, [SAMPLE_PROMPT] * SAMPLE_ROWS, **kw)
    assert all(len(t) == SAMPLE_POSITIONS for t in tokens)
    assert stats.reached[0] >= SAMPLE_ROWS and stats.reached[1] > 100  # every row drafts at step 1
    assert 0.05 < stats.acceptance_rate < 0.95  # both accepts and rejections are exercised
    assert chi_square_p(tokens, joint) > PASS_P
    broken, _ = run_ngram(target, [SAMPLE_PROMPT] * SAMPLE_ROWS, verifier=residual_from_p_verifier, **kw)
    assert chi_square_p(broken, joint) < FAIL_P
