"""Continuous batching's row-level pieces: start_rows / free_rows of the lean, paged and recompute runners and
of the model and ngram drafters, the metadata's row views and per-row Philox steps, per-row draft filters."""
from __future__ import annotations

import pytest
import torch

from specdec_ext.drafters import NgramDrafter
from specdec_ext.metadata import SpecDecodeMetadata
from specdec_ext.runners import LeanLlamaRunner, PagedModelRunner, RecomputeRunner, make_runner
from specdec_ext.runners.lean import PREFILL_GROUP_TOKENS, PREFILL_PADDING_SLACK, prefill_groups
from specdec_ext.sampling import SamplingParams
from test_generate_utils import tiny_model

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34]]
RUNNERS = ("lean", "paged", "recompute")


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", hidden=48, layers=2, logit_scale=4.0)


def _runner(kind, model, rows=6, seq=64):
    return make_runner(kind, model, max_batch_size=rows, max_seq_len=seq)


@pytest.mark.parametrize("kind", RUNNERS)
def test_start_rows_matches_a_fresh_start_and_leaves_other_rows_alone(model, kind):
    fresh = _runner(kind, model)
    expected = fresh.start(PROMPTS)  # [4, V]
    first = expected.argmax(-1)  # [4]: each row's next token
    runner = _runner(kind, model)
    torch.testing.assert_close(runner.start_rows([0, 2], [PROMPTS[0], PROMPTS[2]]), expected[[0, 2]],
                               rtol=1e-5, atol=1e-5)
    assert runner.batch_size == 3 and runner.lengths.tolist() == [3, 0, 1]  # row 1 is free, inside the width
    # rows 0 and 2 take a step; then rows 3 and 1 join, and rows 0 and 2 keep their caches
    runner.forward(torch.tensor([[first[0]], [0], [first[2]]]), torch.tensor([1, 0, 1]))
    runner.commit(torch.tensor([1, 0, 1]))
    torch.testing.assert_close(runner.start_rows([3, 1], [PROMPTS[3], PROMPTS[1]]), expected[[3, 1]],
                               rtol=1e-5, atol=1e-5)
    assert runner.lengths.tolist() == [4, 9, 2, 5]
    fresh.forward(torch.tensor([[first[0]], [0], [first[2]], [0]]), torch.tensor([1, 0, 1, 0]))
    fresh.commit(torch.tensor([1, 0, 1, 0]))
    following = torch.tensor([[1], [first[1]], [2], [first[3]]])  # [4, 1]
    torch.testing.assert_close(runner.forward(following), fresh.forward(following), rtol=1e-4, atol=1e-4)


def test_prefill_groups_bound_each_forwards_padding_and_tokens():
    """Ragged prompts are prefilled in groups of similar lengths: every prompt in exactly one group, a
    group's forward (members x its longest) within (1 + slack) x the tokens it holds and within
    PREFILL_GROUP_TOKENS unless it is one prompt; equal short prompts share one forward."""
    lengths = [300, 20, 290, 18, 700, 5, 16, 250, 19, 17]
    groups = prefill_groups(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        if len(group) > 1:
            assert len(group) * longest <= PREFILL_GROUP_TOKENS
            assert len(group) * longest <= (1 + PREFILL_PADDING_SLACK) * sum(lengths[i] for i in group)
    assert [4] in groups and [0] in groups  # 700 alone; 300 with 290 would be 600 tokens
    assert sorted(next(g for g in groups if 1 in g)) == [1, 3, 6, 8, 9]  # 16-20 together, 5 not
    assert prefill_groups([8] * 10) == [list(range(10))]
    assert prefill_groups([]) == []


def test_lean_prefill_in_groups_is_bit_for_bit_each_prompt_alone(model):
    """A ragged start (several forwards, prefill_groups) gives every row the logits and the cache it gets
    prefilled alone, bit for bit: the next step's logits are equal too."""
    lengths = [40, 3, 37, 9, 2]
    prompts = [[(7 * b + 3 * t) % 60 + 2 for t in range(n)] for b, n in enumerate(lengths)]
    assert 1 < len(prefill_groups(lengths)) < len(lengths)
    runner = LeanLlamaRunner(model, max_batch_size=5, max_seq_len=64)
    logits = runner.start(prompts)  # [5, V]
    following = runner.forward(torch.tensor([[9]] * 5))  # [5, 1, V]
    for b, prompt in enumerate(prompts):
        alone = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=64)
        assert torch.equal(alone.start([prompt])[0], logits[b]), b
        assert torch.equal(alone.forward(torch.tensor([[9]]))[0], following[b]), b
    rows = LeanLlamaRunner(model, max_batch_size=6, max_seq_len=64)
    rows.start_rows([5, 1, 0, 3, 2], prompts)
    assert rows.lengths.tolist() == [37, 3, 2, 9, 0, 40]
    assert torch.equal(rows.forward(torch.tensor([[9]] * 6), torch.tensor([1, 1, 1, 1, 0, 1]))[5, 0], following[0, 0])


@pytest.mark.parametrize("kind", RUNNERS)
def test_free_rows_shrinks_the_batch_and_the_slot_is_reusable(model, kind):
    runner = _runner(kind, model)
    runner.start_rows([0, 1, 2], PROMPTS[:3])
    runner.free_rows([2])
    assert runner.batch_size == 2
    runner.free_rows([0])
    assert runner.batch_size == 2 and runner.lengths.tolist() == [0, 9]  # row 0 is free inside the width
    again = runner.start_rows([0], [PROMPTS[3]])
    reference = _runner(kind, model).start([PROMPTS[3]])
    torch.testing.assert_close(again, reference, rtol=1e-5, atol=1e-5)
    runner.free_rows([0, 1])
    assert runner.batch_size == 0


@pytest.mark.parametrize("kind", RUNNERS)
def test_hold_rows_spans_rows_as_free_ones_without_a_forward(model, kind):
    """hold_rows (a drafter's placeholder for a row it starts later): the rows count as in use, so the
    batch spans them, with empty caches like a free row inside the width, and nothing runs the model; the
    other rows' logits are unchanged, and a held row is freed and started as any other."""
    runner, alone = _runner(kind, model), _runner(kind, model)
    runner.start_rows([0], [PROMPTS[0]])
    alone.start_rows([0], [PROMPTS[0]])
    forwards = ("_prefill", "_last_logits", "_model", "_run")
    saved = {name: getattr(runner, name) for name in forwards if hasattr(runner, name)}

    def no_forward(*args, **kwargs):
        raise AssertionError("hold_rows ran the model")

    for name in saved:
        setattr(runner, name, no_forward)
    runner.hold_rows([3, 2])
    for name, fn in saved.items():
        setattr(runner, name, fn)
    assert runner.batch_size == 4 and runner.lengths.tolist() == [3, 0, 0, 0]
    with pytest.raises(ValueError, match="row 2 is in use"):
        runner.start_rows([2], [PROMPTS[1]])
    with pytest.raises(ValueError, match="row 0 is in use"):
        runner.hold_rows([0])
    step = torch.tensor([[7], [0], [0], [0]])
    held = runner.forward(step, torch.tensor([1, 0, 1, 1]))  # held rows forward their token, as free ones do
    torch.testing.assert_close(held[0], alone.forward(step[:1], torch.tensor([1]))[0], rtol=1e-5, atol=1e-5)
    runner.commit(torch.tensor([1, 0, 0, 0]))
    runner.free_rows([3])
    assert runner.batch_size == 3
    torch.testing.assert_close(runner.start_rows([3], [PROMPTS[3]]), _runner(kind, model).start([PROMPTS[3]]),
                               rtol=1e-5, atol=1e-5)
    runner.free_rows([2])
    torch.testing.assert_close(runner.start_rows([2], [PROMPTS[2]]), _runner(kind, model).start([PROMPTS[2]]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", RUNNERS)
def test_row_errors_name_the_row(model, kind):
    runner = _runner(kind, model, rows=3)
    runner.start_rows([1], [PROMPTS[0]])
    with pytest.raises(ValueError, match="row 1 is in use"):
        runner.start_rows([1], [PROMPTS[1]])
    with pytest.raises(ValueError, match="row 5 is outside"):
        runner.start_rows([5], [PROMPTS[1]])
    with pytest.raises(ValueError, match="2 rows for 1 prompts"):
        runner.start_rows([0, 2], [PROMPTS[1]])
    with pytest.raises(ValueError, match="row 0 is not in use"):
        runner.free_rows([0])
    with pytest.raises(ValueError, match="repeat"):
        runner.free_rows([1, 1])
    assert runner.batch_size == 2  # nothing changed


def test_paged_free_rows_returns_every_page_and_start_rows_is_all_or_nothing(model):
    runner = PagedModelRunner(model, max_batch_size=4, max_seq_len=64, page_size=4, num_pages=6)
    runner.start_rows([0, 1], [PROMPTS[1], PROMPTS[0]])  # 3 + 1 pages
    assert runner.kv.num_free_pages == 2
    with pytest.raises(ValueError, match="page pool is full"):
        runner.start_rows([2], [PROMPTS[1]])  # 3 pages: nothing allocated, row 2 stays free
    assert runner.kv.num_free_pages == 2 and runner.batch_size == 2
    runner.free_rows([0])
    assert runner.kv.num_free_pages == 5
    runner.kv.check_invariants()
    runner.start_rows([2], [PROMPTS[1]])
    runner.free_rows([1, 2])
    assert runner.kv.num_free_pages == 6 and runner.batch_size == 0
    runner.kv.check_invariants()


def test_paged_static_shapes_refuses_start_rows(model):
    runner = PagedModelRunner(model, max_batch_size=2, max_seq_len=16, static_shapes=True)
    with pytest.raises(ValueError, match="host mode"):
        runner.start_rows([0], [PROMPTS[0]])


def test_start_after_start_rows_resets_the_rows(model):
    for runner in (LeanLlamaRunner(model, max_batch_size=4, max_seq_len=32),
                   RecomputeRunner(model, max_batch_size=4, max_seq_len=32)):
        runner.start_rows([3], [PROMPTS[0]])
        runner.start(PROMPTS[:2])
        assert runner.batch_size == 2
        runner.start_rows([2], [PROMPTS[2]])  # rows 0, 1 in use from start, 2 joins
        assert runner.lengths.tolist() == [3, 9, 1]


# ------------------------------------------------------------------------------------------ metadata
def _meta(batch=4, slots=3):
    return SpecDecodeMetadata.allocate(batch_size=batch, slots=slots, max_seq_len=32, sampling=SamplingParams(),
                                       seeds=torch.arange(batch, dtype=torch.int64))


def test_rows_is_a_view_and_select_a_copy():
    meta = _meta()
    meta.set_row_sampling([SamplingParams(float(b)) for b in range(4)])
    view = meta.rows(2)
    assert view.batch_size == 2 and view.no_drafts.token_ids.shape == (2, 3)
    view.seq_lens.fill_(7)
    assert meta.seq_lens.tolist() == [7, 7, 0, 0]
    assert [p.temperature for p in view.row_sampling] == [0.0, 1.0]
    picked = meta.select(torch.tensor([3, 1]))
    assert picked.seed.tolist() == [3, 1] and [p.temperature for p in picked.row_sampling] == [3.0, 1.0]
    picked.seed.fill_(9)
    assert meta.seed.tolist() == [0, 1, 2, 3]


def test_rows_keeps_the_verify_scratch_and_select_leaves_it_out():
    """A step's view shares the server's verify_logits (no allocation per step); a joining rows' copy
    (decode.join_rows) does not copy it: it is a pass's scratch, [B, n+1, V]."""
    meta = _meta()
    meta.reserve_verify_logits(11)
    view = meta.rows(2)
    assert view.verify_logits.shape == (2, 4, 11)
    assert view.verify_logits.data_ptr() == meta.verify_logits.data_ptr()
    picked = meta.select(torch.tensor([3, 1]))
    assert picked.verify_logits is None and meta.verify_logits.shape == (4, 4, 11)
    assert picked.target_input.shape == (2, 4)  # (the row state is still copied)


def test_set_row_steps_gives_each_row_its_own_philox_counters():
    meta = _meta()
    meta.set_row_steps(torch.tensor([0, 1, 5, 2]))
    for row, step in enumerate([0, 1, 5, 2]):
        single = _meta(batch=1)
        single.set_step(step)
        assert meta.verify_offset[row] == single.verify_offset[0]
        assert meta.draft_offset[row] == single.draft_offset[0]


def test_all_greedy_reads_each_rows_filter():
    meta = _meta()
    assert meta.all_greedy
    meta.set_row_sampling([SamplingParams()] * 3 + [SamplingParams(0.7)])
    assert not meta.all_greedy
    assert meta.rows(3).all_greedy


# ------------------------------------------------------------------------------------------ drafters
def test_ngram_drafter_rows_join_and_leave():
    meta = _meta(batch=3, slots=3)
    meta.set_row_sampling([SamplingParams()] * 3)
    drafter = NgramDrafter(3)
    meta.token_buffer[1, :6] = torch.tensor([1, 2, 3, 1, 2, 3])
    meta.seq_lens[1] = 6
    meta.seq_lens[[0, 2]] = 1
    drafter.start_rows([1], [[1, 2, 3, 1, 2]], meta)
    proposal = drafter.propose(meta.rows(2))
    assert proposal.num_draft.tolist() == [0, 3] and proposal.token_ids[1].tolist() == [1, 2, 3]
    drafter.free_rows([1])
    assert drafter.propose(meta.rows(2)).num_draft.tolist() == [0, 0]
