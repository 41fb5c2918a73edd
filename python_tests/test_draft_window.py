"""A draft model's context window (drafters/model_drafter.py, ``context_window``): a draft trained on W-token
sequences keeps each row's cache within W tokens, prefilled with the last W // 2 committed tokens at the
start and again whenever a row's cache could pass W; proposals are what a drafter prefilled with those
tokens alone would make, and generate() and the server still give the target's greedy tokens.
"""
from __future__ import annotations

import pytest
import torch

from specdec_ext import generate, plain_generate
from specdec_ext.drafters import ModelDrafter
from specdec_ext.drafters.model_drafter import DRAFT_WINDOW_ATTRIBUTE, MAX_DRAFT_FEED, draft_window_of, window_for
from specdec_ext.metadata import Verdict
from specdec_ext.runners import make_runner
from test_adaptive import one_row_meta
from test_generate_utils import noisy_copy, one_thread, tiny_model

K = 4
WINDOW = 24  # keeps 12


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=64, hidden=32, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, 0.2)


def _drafter(draft_model, window=WINDOW, k=K):
    return ModelDrafter(draft_model, lambda **kw: make_runner("lean", draft_model, **kw), k=k, vocab_size=64,
                        context_window=window)


def _meta(tokens):
    """One row holding ``tokens`` committed (the last one pending)."""
    return one_row_meta(tokens, slots=K, max_seq_len=200)


def _commit_all(meta, drafter, proposal, bonus):
    """Verification accepts every draft and adds ``bonus``: K + 1 tokens committed."""
    kept = [*proposal.token_ids[0].tolist(), bonus]
    meta.num_kept.fill_(len(kept))
    n = int(meta.seq_lens[0])
    meta.token_buffer[0, n: n + len(kept)] = torch.tensor(kept)
    meta.seq_lens[0] += len(kept)
    drafter.commit(meta, Verdict(meta.output_tokens, torch.tensor([K], dtype=torch.int32)))


def _committed(meta):
    return meta.token_buffer[0, : int(meta.seq_lens[0])].tolist()


def test_the_prefill_keeps_the_last_half_of_the_window_and_proposes_as_a_drafter_given_it_alone(pair):
    _, draft = pair
    tokens = [(7 * i + 3) % 60 + 1 for i in range(41)]  # 40 fed at the prefill, the 41st pending
    windowed, meta = _drafter(draft), _meta(tokens)
    windowed.prefill([tokens[:40]], meta)
    keep = WINDOW // 2
    assert windowed.runner.lengths.tolist() == [keep] and windowed._offsets.tolist()[0] == 40 - keep
    alone, alone_meta = _drafter(draft, window=None), _meta(tokens[40 - keep:])
    alone.prefill([tokens[40 - keep: 40]], alone_meta)
    assert torch.equal(windowed.propose(meta).token_ids, alone.propose(alone_meta).token_ids)


@pytest.mark.parametrize("plain_every", [0, 2])
def test_a_row_near_the_window_is_prefilled_again_and_never_holds_more(pair, plain_every):
    """Fully accepted steps add K + 1 tokens each (and, with ``plain_every``, four skipped plain steps before
    every such step: catch-ups that stay within the window): the cache stays within the window
    throughout, is prefilled again (its offset moves) several times, and each proposal equals that of a
    drafter prefilled with the tokens the windowed cache holds."""
    _, draft = pair
    tokens = [(5 * i + 1) % 63 + 1 for i in range(9)]
    drafter, meta = _drafter(draft), _meta(tokens)
    drafter.prefill([tokens[:-1]], meta)
    offsets = set()
    for step in range(14):
        if plain_every and step % plain_every == 1:
            for plain in range(4):
                drafter.skip(meta)
                meta.token_buffer[0, meta.seq_lens[0]] = (plain * 13 + step) % 60 + 1
                meta.seq_lens[0] += 1
        proposal = drafter.propose(meta)
        assert drafter.runner.lengths.tolist()[0] <= WINDOW
        offset = drafter._offsets.tolist()[0]
        offsets.add(offset)
        committed = _committed(meta)
        alone, alone_meta = _drafter(draft, window=None), _meta(committed[offset:])
        alone.prefill([committed[offset:-1]], alone_meta)
        assert torch.equal(proposal.token_ids, alone.propose(alone_meta).token_ids), step
        _commit_all(meta, drafter, proposal, bonus=(step * 11) % 60 + 1)
        assert drafter.runner.lengths.tolist()[0] <= WINDOW
    assert len(offsets) >= 3 and min(offsets) == 0


def test_catch_up_after_a_long_plain_stretch_prefills_the_window_instead_of_the_arrears(pair):
    """Skipped steps that committed more than the window: the next proposal's cache holds the window's last
    half plus the step's tokens (not the arrears), and it proposes what a drafter given those tokens does."""
    _, draft = pair
    tokens = [(3 * i + 2) % 61 + 1 for i in range(10)]
    drafter, meta = _drafter(draft), _meta(tokens)
    drafter.prefill([tokens[:-1]], meta)
    for step in range(40):  # plain steps: one token each, the drafter told to skip
        drafter.skip(meta)
        meta.token_buffer[0, meta.seq_lens[0]] = (step * 7) % 60 + 1
        meta.seq_lens[0] += 1
    appended = []
    append = drafter._append
    drafter._append = lambda rows, chunks, *rest: (appended.append(chunks), append(rows, chunks, *rest))
    proposal = drafter.propose(meta).token_ids.clone()
    assert appended == []  # the arrears were never fed
    committed, offset = _committed(meta), drafter._offsets.tolist()[0]
    assert offset == len(committed) - 1 - WINDOW // 2
    assert drafter.runner.lengths.tolist()[0] == WINDOW // 2 + K  # the window, the pending token, K - 1 drafts
    alone, alone_meta = _drafter(draft, window=None), _meta(committed[offset:])
    alone.prefill([committed[offset:-1]], alone_meta)
    assert torch.equal(proposal, alone.propose(alone_meta).token_ids)


def test_the_cost_probes_do_not_re_window_and_are_undone(pair):
    """Between ``checkpoint`` and its undo (adaptive k's cost probes) a proposal past the window does not
    re-window; the undo restores the cache, and the next proposal re-windows the row and proposes what a
    drafter given the window proposes."""
    _, draft = pair
    tokens = [(5 * i + 4) % 63 + 1 for i in range(30)]
    drafter, meta = _drafter(draft), _meta(tokens)
    drafter.prefill([tokens[:12]], meta)  # the cache holds 12 of the 29 committed tokens: arrears
    drafter._skipped = True  # (as after skipped steps: the next proposal catches up)
    undo = drafter.checkpoint()
    drafter.propose(meta)
    assert drafter._offsets.tolist() == [0] and drafter.runner.lengths.tolist()[0] > WINDOW // 2
    undo()
    assert drafter.runner.lengths.tolist() == [12]
    drafter._skipped = True
    proposal = drafter.propose(meta).token_ids.clone()
    offset = drafter._offsets.tolist()[0]
    assert offset == 29 - WINDOW // 2
    alone, alone_meta = _drafter(draft, window=None), _meta(tokens[offset:])
    alone.prefill([tokens[offset:-1]], alone_meta)
    assert torch.equal(proposal, alone.propose(alone_meta).token_ids)


LONG_PROMPTS = [[(5 * i + 1) % 63 + 1 for i in range(40)], [9, 8, 7] * 9]


def _windowed_draft(draft, monkeypatch) -> list:
    """The draft declares a 16-token window for the test; returns the list to which every commit appends
    the longest draft cache it left."""
    monkeypatch.setattr(draft.config, DRAFT_WINDOW_ATTRIBUTE, 16, raising=False)
    longest = []
    commit = ModelDrafter.commit

    def recording_commit(self, meta, verdict):
        commit(self, meta, verdict)
        longest.append(max(self.runner.lengths.tolist()))

    monkeypatch.setattr(ModelDrafter, "commit", recording_commit)
    return longest


@pytest.mark.parametrize("k", [K, "auto"])
def test_generate_with_a_windowed_draft_gives_the_target_greedy_tokens(pair, monkeypatch, k):
    """Long prompts and generations through a draft that declares a 16-token window (k = 4: the window is
    max(16, 2 (k + 2)) = 16), fixed k and k="auto" (its looks and catch-ups): plain greedy's tokens, and the
    draft cache never held more than the window."""
    target, draft = pair
    longest = _windowed_draft(draft, monkeypatch)
    with one_thread():
        want = plain_generate(LONG_PROMPTS, target, max_new_tokens=80, eos_token_id=False).token_ids
        got = generate(LONG_PROMPTS, target, draft, max_new_tokens=80, k=k, eos_token_id=False)
    assert got.token_ids == want
    if k == K:
        assert longest and max(longest) <= 16


def test_sampling_with_a_windowed_draft_reproduces_its_seed_and_stays_in_the_window(pair, monkeypatch):
    """Sampled rows (T = 1, fixed k, a seed) draft through the eager feed-and-sample path: the same seed
    gives the same tokens twice, every token is in the vocabulary, and the draft cache stayed within the
    16-token window while the rows grew to 100 tokens."""
    target, draft = pair
    longest = _windowed_draft(draft, monkeypatch)
    with one_thread():
        runs = [generate(LONG_PROMPTS, target, draft, max_new_tokens=60, k=K, temperature=1.0, seed=7,
                         eos_token_id=False).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(row) == 60 and all(0 <= t < 64 for t in row) for row in runs[0])
    assert longest and max(longest) <= 16


def test_looks_catch_ups_and_steps_of_adaptive_k_keep_the_window(pair, monkeypatch):
    """adaptive k forced through plain segments, an exploration and then speculation (test_adaptive's
    LookThenSpeculate) over rows longer than a 16-token window: the catch-ups and steps re-window the rows
    and keep them within the window, and the tokens are plain greedy's."""
    from test_adaptive import LookThenSpeculate, run_decode
    target, draft = pair
    where = []
    rewindow = ModelDrafter._rewindow

    def recording_rewindow(self, meta, rows, *lists):
        left = rewindow(self, meta, rows, *lists)
        if len(left) < len(rows):
            where.append(len(rows) - len(left))
        return left

    monkeypatch.setattr(ModelDrafter, "_rewindow", recording_rewindow)
    prompts = [[(5 * i + 1) % 63 + 1 for i in range(52)], [9, 8, 7] * 15]
    with one_thread():
        want = plain_generate(prompts, target, max_new_tokens=60, eos_token_id=False).token_ids
        drafter = _drafter(draft, window=16)
        rows, stats = run_decode(target, drafter, prompts, LookThenSpeculate(4, switch_on=6, look_at=3), 60)
    assert [r.tokens for r in rows] == want
    assert len(where) >= 3
    assert max(drafter.runner.lengths.tolist()) <= 16 and stats.draft_time > 0


def test_a_greedy_look_past_the_window_reads_what_a_drafter_given_the_window_reads(pair):
    """adaptive k's look (``ModelDrafter.look``) after a plain stretch longer than the window: the row is
    prefilled again with the window's last half before the shown tokens, and the look's matches equal
    those of a drafter prefilled with just those tokens."""
    _, draft = pair
    tokens = [(3 * i + 2) % 61 + 1 for i in range(10)]
    drafter, meta = _drafter(draft), _meta(tokens)
    drafter.prefill([tokens[:-1]], meta)
    for step in range(40):
        drafter.skip(meta)
        meta.token_buffer[0, meta.seq_lens[0]] = (step * 7) % 60 + 1
        meta.seq_lens[0] += 1
    shown = 8
    matches = drafter.look(meta, [shown])
    committed, offset = _committed(meta), drafter._offsets.tolist()[0]
    assert offset == len(committed) - 1 - WINDOW // 2 and drafter.runner.lengths.tolist() == [WINDOW // 2]
    alone, alone_meta = _drafter(draft, window=None), _meta(committed[offset:])
    alone.prefill([committed[offset: -1 - shown]], alone_meta)
    assert matches == alone.look(alone_meta, [shown]) and len(matches[0]) == shown


def test_a_server_row_joins_with_the_window_and_gives_plain_greedy_tokens(monkeypatch):
    """Served requests with long prompts through a draft that declares a window: each row's draft cache
    starts from its prompt's last tokens, and every request's tokens equal plain greedy decoding's."""
    from serve_utils import tiny_pair
    from test_serve_load import _engine, _request, _run
    target, draft, tokenizer = tiny_pair()
    monkeypatch.setattr(draft.config, DRAFT_WINDOW_ATTRIBUTE, 24, raising=False)
    prompts = ["def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2, "import os\nimport sys\n" * 4, "x = 1\n"]
    with one_thread():
        engine = _engine((target, draft, tokenizer), max_rows=2)
        assert engine.batcher.drafter.context_window == 24
        got = _run(engine, [_request(tokenizer, p, max_new=40) for p in prompts])
        for prompt, tokens in zip(prompts, got):
            want = plain_generate([prompt], target, max_new_tokens=40, eos_token_id=False, tokenizer=tokenizer)
            assert tokens == want.token_ids[0], prompt


def test_the_whole_prefill_of_a_windowed_draft_counts_its_window_alone(pair):
    """What adaptive k charges a switch on (DrafterPrefill.pending): the window's last half of a long row."""
    _, draft = pair
    assert _drafter(draft).prefill_tokens([100, 5]) == WINDOW // 2 + 5
    assert _drafter(draft, window=None).prefill_tokens([100, 5]) == 105


def test_the_window_is_declared_by_the_draft_config_and_checked(pair):
    _, draft = pair
    assert draft_window_of(torch.nn.Linear(2, 2)) is None
    draft.config.specdec_draft_window = 1
    try:
        with pytest.raises(ValueError, match="specdec_draft_window must be an int >= 2"):
            draft_window_of(draft)
        draft.config.specdec_draft_window = "256"
        with pytest.raises(ValueError, match="got '256'"):
            draft_window_of(draft)
        draft.config.specdec_draft_window = 256
        assert draft_window_of(draft) == 256
    finally:
        del draft.config.specdec_draft_window
    assert draft_window_of(draft) is None
    with pytest.raises(ValueError, match="context_window must be None or an int >= 2"):
        _drafter(draft, window=0)
    assert window_for(4, k=8) == 2 * (8 + MAX_DRAFT_FEED)  # too small for k: a step's room twice


def test_the_bundled_draft_declares_the_context_it_was_trained_on():
    from specdec_ext.default_pair import load_default_pair, trained_context
    _, draft, _ = load_default_pair()
    assert trained_context() == 256
    assert draft_window_of(draft) == 256
