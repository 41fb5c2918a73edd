"""CUDA graphs by batch-size bucket in continuous batching (serve/batcher.py ``graphs=True``, the paged
runner's ``reserve_step``).

On the CPU the graphs are the fake backend of fake_graphs.py: a capture records the step without running
it, and every replay runs it under a guard that refuses host syncs and host data. Requests join and leave
while others run, across buckets 1, 2, 4 and a capped 6; every request's tokens must equal those of the
eager batcher (itself tested against generate() alone in test_serve_engine.py), each (bucket, filter)
key is captured once and then only replayed, and every page goes back to the pools. On CUDA (skipped
elsewhere) the same run with real graphs.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from specdec_ext import cuda_graphs, plan as plan_module
from specdec_ext.drafters import ModelDrafter, NgramDrafter
from specdec_ext.models import Models
from specdec_ext.runners import PagedModelRunner, PoolFullError, make_runner
from specdec_ext.runners.checks import output_vocab_size
from specdec_ext.processing import Processing
from specdec_ext.sampling import SamplingParams
from specdec_ext.serve.batcher import ContinuousBatcher, Scheduling
from specdec_ext.serve.build import EngineOptions, build_engine
from specdec_ext.plan import graph_draft_lengths
from specdec_ext.serve.draft_length import DraftChoice, LoadGatedK
from specdec_ext.serve.request import GenerationRequest
from specdec_ext.stops import StopCriteria
from fake_graphs import FakeBackend
from serve_utils import tiny_pair

K = 3
MAX_ROWS = 6  # buckets 1, 2, 4, then 8 capped at 6
SEQ = 128


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _batcher(pair, device, *, graphs: bool, backend=None, drafter: str = "model",
             draft_length: LoadGatedK = None, context_window=None) -> ContinuousBatcher:
    target, draft, _ = pair
    target, draft = target.to(device), draft.to(device)
    runner = PagedModelRunner(target, max_batch_size=MAX_ROWS, max_seq_len=SEQ)
    model_drafter = None
    if drafter == "model":
        def draft_runner(*, max_batch_size, max_seq_len):
            return PagedModelRunner(draft, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
        model_drafter = ModelDrafter(draft, draft_runner, k=K, vocab_size=output_vocab_size(target),
                                     context_window=context_window)
    return ContinuousBatcher(runner, model_drafter, max_rows=MAX_ROWS, slots=K if drafter == "model" else 0,
                             max_seq_len=SEQ, graphs=graphs, graph_backend=backend,
                             scheduling=Scheduling(draft_length=draft_length))


PROMPTS = [[5, 6, 7, 8], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37],
           [40], [41, 42, 43, 44, 45, 46], [7, 7, 7, 7, 7], [30, 31, 32]]
# (admitted before step, filter, max_new_tokens): greedy alone first, then sampled rows with and without
# top-k / top-p, a slot freed and reused, five rows at once (bucket 8 capped at MAX_ROWS = 6)
SCHEDULE = [(0, SamplingParams(), 40), (3, SamplingParams(), 30), (5, SamplingParams(0.9), 9),
            (5, SamplingParams(0.8, 5, 0.9), 24), (8, SamplingParams(1.2, 0, 0.7), 20),
            (8, SamplingParams(float("inf"), 4), 12), (16, SamplingParams(0.7), 10)]


def _run(batcher: ContinuousBatcher, schedule=SCHEDULE, extras=None, logprobs=None) -> Dict[int, List[int]]:
    """Admit the schedule's requests at their steps, step until every request has ended; tokens by request.
    ``extras[i]``: more GenerationRequest fields of request i; ``logprobs`` (a dict) gets each request's."""
    tokens: Dict[int, List[int]] = {i: [] for i in range(len(schedule))}
    ended: Dict[int, str] = {}
    extras = extras or {}

    def sink_of(i):
        def sink(event):
            tokens[i].extend(event.tokens)
            if logprobs is not None and event.logprobs:
                logprobs.setdefault(i, []).extend(event.logprobs)
            if event.finished:
                ended[i] = event.finish_reason
        return sink

    step = 0
    while len(ended) < len(schedule):
        joining = [(GenerationRequest(list(PROMPTS[i]), params, 1000 + i, StopCriteria(max_new, []), **extras.get(i, {})),
                    sink_of(i), 0.0)
                   for i, (at, params, max_new) in enumerate(schedule) if at == step]
        if joining:
            batcher.admit(joining)
        batcher.step()
        step += 1
        assert step < 200, "the batcher did not finish"
    assert set(ended.values()) == {"length"}, ended
    for i, (_, _, max_new) in enumerate(schedule):
        assert len(tokens[i]) == max_new, (i, len(tokens[i]))
    return tokens


def _pools_are_free(batcher: ContinuousBatcher) -> None:
    assert batcher.budget.used == 0 and not batcher.running
    runners = [batcher.target] + ([batcher.drafter.runner] if batcher.drafter is not None else [])
    for runner in runners:
        assert runner.kv.num_free_pages == runner.kv.num_pages
        assert runner.kv.host_lengths() == [0] * MAX_ROWS and runner.kv.lengths.tolist() == [0] * MAX_ROWS


@pytest.mark.parametrize("drafter", ["model", "none"])
def test_bucketed_graph_steps_give_the_eager_tokens(pair, drafter):
    eager = _batcher(pair, "cpu", graphs=False, drafter=drafter)
    expected = _run(eager)
    _pools_are_free(eager)
    assert eager.graphs_captured == 0

    backend = FakeBackend()
    graphs = _batcher(pair, "cpu", graphs=True, backend=backend, drafter=drafter)
    assert _run(graphs) == expected
    _pools_are_free(graphs)
    widths = {key[0] for key in graphs._steps}
    assert widths == {1, 2, 4, 6}, widths  # bucket_size(5) = 8, capped at max_rows
    filters = {key[1:3] for key in graphs._steps}
    assert (True, False) in filters and (False, True) in filters  # all greedy; sampled with truncation
    per_key = 3 if drafter == "model" else 2  # draft, verify, commit (no draft step without a drafter)
    # each key was captured once (a key used only for its warm-up step has no capture yet)
    assert backend.events.count("capture") == graphs.graphs_captured <= per_key * len(graphs._steps)
    assert graphs.graphs_captured >= per_key * 3
    assert backend.events.count("replay") > 4 * backend.events.count("capture")


def test_rows_with_other_seeds_and_temperatures_replay_the_same_capture(pair):
    """Rows with different seeds and filters of the same kind share one capture: the per-row values are
    read from the metadata's tensors at every replay."""
    schedule = [(0, SamplingParams(0.9), 16), (0, SamplingParams(1.1), 16), (2, SamplingParams(0.5), 12)]
    eager = _run(_batcher(pair, "cpu", graphs=False), schedule)
    backend = FakeBackend()
    batcher = _batcher(pair, "cpu", graphs=True, backend=backend)
    assert _run(batcher, schedule) == eager
    assert {key[1:] for key in batcher._steps} == {(False, False, False, K)} and (4, False, False, False, K) in batcher._steps
    assert backend.events.count("capture") == batcher.graphs_captured <= 3 * len(batcher._steps)
    assert backend.events.count("replay") > backend.events.count("capture")  # replays after each capture


def test_rows_with_processors_or_logprobs_step_eagerly_beside_replayed_steps(pair):
    """Under graphs, a step holding a row with logits processors or logprobs runs its parts eagerly: a
    capture made without them would replay without them. Two greedy rows capture the width-2 step; a
    greedy row with a logit bias and a repetition penalty then takes the freed slot (the same width and
    filter), later a row asking for logprobs: the tokens and logprobs equal the eager batcher's, and the
    plain rows' steps keep replaying their captures."""
    schedule = [(0, SamplingParams(), 100), (0, SamplingParams(), 24), (16, SamplingParams(), 12),
                (20, SamplingParams(0.8), 10)]
    extras = {2: dict(processing=Processing.of(logit_bias={7: 4.0}, repetition_penalty=1.3)),
              3: dict(top_logprobs=2)}
    want_logprobs: Dict[int, list] = {}
    eager = _run(_batcher(pair, "cpu", graphs=False), schedule, extras, want_logprobs)
    backend = FakeBackend()
    batcher = _batcher(pair, "cpu", graphs=True, backend=backend)
    used = []  # per step: (a row with processors or logprobs in it, the stepper runs eagerly)
    stepper_for = batcher._stepper_for

    def recording_stepper_for(width, k):
        stepper = stepper_for(width, k)
        host_rows = any(row is not None and (row.request.processing is not None or row.request.top_logprobs)
                        for row in batcher.rows[:width])
        used.append((host_rows, not stepper.parts.graphs))
        return stepper

    batcher._stepper_for = recording_stepper_for
    got_logprobs: Dict[int, list] = {}
    assert _run(batcher, schedule, extras, got_logprobs) == eager
    # (the fake backend re-runs a step's Python at replay, so only this shows what a real replay would skip)
    assert any(host for host, _ in used) and all(eager_step for host, eager_step in used if host)
    assert got_logprobs == want_logprobs and len(got_logprobs[3]) == 10
    eager_keys = [key for key in batcher._steps if key[3]]
    assert eager_keys and all(not batcher._steps[key].parts.graphs for key in eager_keys)
    assert any(not key[3] for key in batcher._steps) and backend.events.count("replay") > 0
    _pools_are_free(batcher)


class ScriptedK(LoadGatedK):
    """A LoadGatedK whose steps draft a fixed cycle of lengths (the measured choice is timing-dependent):
    runs of plain steps of every length between drafting steps of every K."""

    CYCLE = [3, 0, 1, 0, 0, 2, 0, 0, 0, 3, 3, 1, 2, 0, 2]

    def __init__(self):
        super().__init__(K, rows=MAX_ROWS, pinned_k=K, lengths=graph_draft_lengths(K, K))
        self.chosen = []

    def choose(self, width, running, seeded, *, pending_tokens=0, uniform=False, steps_left=None, after_prefill=False):
        k = self.CYCLE[len(self.chosen) % len(self.CYCLE)]
        self.chosen.append(k)
        budget = [k] * width if uniform else [k if b in running else 0 for b in range(width)]
        return DraftChoice(k, "scripted", budget)


def test_draft_lengths_by_load_replay_one_capture_per_length(pair):
    """Under graphs the server's draft length still follows the load: each length is a key of its own (a
    capture per bucket, filter and length), and after plain steps the drafter takes in what they committed
    before the captured draft pass (drafter.catch_up: its feed is as wide as after a drafting step; without
    it the fake backend sees a replay feed other shapes than its capture). Every request's tokens, greedy
    and sampled, equal the eager batcher's over the same lengths."""
    eager = _run(_batcher(pair, "cpu", graphs=False, draft_length=ScriptedK()))
    backend = FakeBackend()
    scripted = ScriptedK()
    batcher = _batcher(pair, "cpu", graphs=True, backend=backend, draft_length=scripted)
    assert _run(batcher) == eager
    assert {key[-1] for key in batcher._steps} == {0, 1, 2, 3}
    plain = [key for key in batcher._steps if key[-1] == 0]
    assert all(not batcher._steps[key].parts.captured["draft"] for key in plain)  # skip() stays on the host
    assert any(batcher._steps[key].parts.captured["verify"] for key in plain)
    assert backend.events.count("capture") == batcher.graphs_captured and backend.events.count("replay") > 0
    _pools_are_free(batcher)


def test_a_device_step_reserves_the_pages_of_its_own_draft_length(pair):
    """Under graphs each step reserves what its draft length can write, not the server's k_max: the target
    k + 1 positions per row, the draft model's runner nothing on a plain step (it does not run; its
    reserve and the read-back after it were a speculative server's extra host work with every step
    plain), and k drafts on a drafting step."""
    batcher = _batcher(pair, "cpu", graphs=True, backend=FakeBackend(), draft_length=ScriptedK())
    reserved = []
    target_reserve, draft_reserve = batcher.target.reserve_step, batcher.drafter.reserve_step
    batcher.target.reserve_step = lambda width, tokens: reserved.append(("target", tokens)) or target_reserve(width, tokens)
    batcher.drafter.reserve_step = lambda width, drafts: reserved.append(("draft", drafts)) or draft_reserve(width, drafts)
    logged, step = [], batcher.step

    def logging_step():
        reserved.clear()
        step()
        if reserved:
            logged.append((batcher.step_log[-1].k, list(reserved)))

    batcher.step = logging_step
    _run(batcher)
    assert {k for k, _ in logged} == {0, 1, 2, 3}
    for k, calls in logged:
        assert calls == ([("target", k + 1), ("draft", k)] if k else [("target", 1)]), (k, calls)
    _pools_are_free(batcher)


def test_measured_draft_lengths_under_graphs_keep_greedy_tokens(pair):
    """The real controller under graphs (its calibration runs every captured length, then it chooses from
    measured costs): greedy tokens equal the fixed-k eager batcher's, and seeded sampled rows draft the
    pinned length in every step they run (their tokens do not depend on the load)."""
    schedule = [(0, SamplingParams(), 40), (3, SamplingParams(), 30), (5, SamplingParams(), 9),
                (8, SamplingParams(), 20), (16, SamplingParams(), 10)]
    expected = _run(_batcher(pair, "cpu", graphs=False), schedule)
    controller = LoadGatedK(K, rows=MAX_ROWS, pinned_k=2, lengths=graph_draft_lengths(K, 2))
    controller.start_calibration()
    batcher = _batcher(pair, "cpu", graphs=True, backend=FakeBackend(), draft_length=controller)
    assert _run(batcher, schedule) == expected
    assert {record.k for record in batcher.step_log} >= {0, 1, 2, 3}
    _pools_are_free(batcher)
    seeded_schedule = [(0, SamplingParams(0.9), 24), (2, SamplingParams(), 30)]
    extras = {0: dict(seeded=True)}
    alone = _run(_batcher(pair, "cpu", graphs=False, draft_length=LoadGatedK(K, rows=MAX_ROWS, pinned_k=2)),
                 seeded_schedule[:1], extras)
    controller = LoadGatedK(K, rows=MAX_ROWS, pinned_k=2, lengths=graph_draft_lengths(K, 2))
    batcher = _batcher(pair, "cpu", graphs=True, backend=FakeBackend(), draft_length=controller)
    together = _run(batcher, seeded_schedule, extras)
    assert together[0] == alone[0]
    assert {record.k for record in batcher.step_log if 0 in record.emitted} == {2}


def test_a_windowed_draft_under_graphs_gives_the_eager_tokens(pair, monkeypatch):
    """A draft with a 16-token context window (drafters/model_drafter.py) under graphs, fixed k and k by
    load: greedy tokens equal the whole-context eager batcher's, every page is freed, and with k by load
    the catch-ups between device steps re-window rows (the captured steps read the moved offsets)."""
    schedule = [(0, SamplingParams(), 40), (3, SamplingParams(), 30), (5, SamplingParams(), 9),
                (8, SamplingParams(), 20), (16, SamplingParams(), 10)]
    expected = _run(_batcher(pair, "cpu", graphs=False), schedule)
    rewindowed = []
    rewindow = ModelDrafter._rewindow

    def counting_rewindow(self, meta, rows, *lists):
        left = rewindow(self, meta, rows, *lists)
        rewindowed.append(len(rows) - len(left))
        return left

    monkeypatch.setattr(ModelDrafter, "_rewindow", counting_rewindow)
    fixed = _batcher(pair, "cpu", graphs=True, backend=FakeBackend(), context_window=16)
    assert _run(fixed, schedule) == expected and fixed.graphs_captured > 0
    _pools_are_free(fixed)
    rewindowed.clear()
    # (scripted lengths: a measured choice may draft on every step on a slower machine, with no catch-up)
    by_load = _batcher(pair, "cpu", graphs=True, backend=FakeBackend(), draft_length=ScriptedK(), context_window=16)
    assert _run(by_load, schedule) == expected
    assert sum(rewindowed) > 0 and {record.k for record in by_load.step_log} >= {0, 2}
    _pools_are_free(by_load)


def _eagle_batchers(device):
    """(target, make(graphs, backend=None) -> a batcher over a tiny target and a random EAGLE-3 head on
    ``device``, its draft length scripted by ScriptedK)."""
    from eagle_utils import random_head, tiny_target
    from specdec_ext.eagle import EagleDrafter

    target = tiny_target("llama")
    head = random_head(target, draft_vocab=48)
    target, head = target.to(device), head.to(device)

    def make(graphs, backend=None):
        runner = PagedModelRunner(target, max_batch_size=MAX_ROWS, max_seq_len=SEQ, hidden_taps=head.config.layer_ids)
        drafter = EagleDrafter(runner, head, k=K, fixed_shapes=graphs)
        return ContinuousBatcher(runner, drafter, max_rows=MAX_ROWS, slots=K, max_seq_len=SEQ, graphs=graphs,
                                 graph_backend=backend, scheduling=Scheduling(draft_length=ScriptedK()))

    return target, make


@pytest.mark.parametrize("sampled", [False, True])
def test_eagle_chains_replay_their_captures_with_draft_lengths_by_load(monkeypatch, sampled):
    """An EAGLE-3 head under graphs (EagleDrafter(fixed_shapes=True), device steps): rows that join and
    plain steps are fed by catch_up between steps, each captured propose feeds k + 1 positions; every
    request's tokens equal the eager batcher's (fixed_shapes off) over the same scripted lengths. The CPU
    kernels are off so that the head runs the torch path a GPU runs (the fake backend refuses their host
    copies)."""
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    target, make = _eagle_batchers("cpu")
    schedule = SCHEDULE if sampled else [(at, SamplingParams(), n) for at, _, n in SCHEDULE]
    eager = _run(make(False), schedule)
    backend = FakeBackend()
    graphs = make(True, backend)
    assert _run(graphs, schedule) == eager
    assert {key[-1] for key in graphs._steps} == {0, 1, 2, 3}
    assert backend.events.count("capture") == graphs.graphs_captured > 0 and backend.events.count("replay") > 0
    if not sampled:
        assert eager == _run(_batcher((target, target, None), "cpu", graphs=False, drafter="none"), schedule)


def test_the_server_plan_under_graphs_chooses_k_by_load_among_the_captured_lengths(pair, monkeypatch):
    """With graphs on (forced, fake backend), `specdec serve`'s plan keeps the draft length by load: the
    engine's controller chooses among plan.graph_draft_lengths, its calibration steps through each of
    them on captured steps, and the explanation names them."""
    target, draft, tokenizer = pair
    backend = FakeBackend()
    monkeypatch.setattr(plan_module, "graphs_available", lambda device: (True, None))
    monkeypatch.setattr(cuda_graphs, "_CudaBackend", lambda: backend)
    engine = build_engine(Models(target, "model", draft=draft, tokenizer=tokenizer),
                          EngineOptions(max_seq_len=4 * SEQ, max_rows=4))  # room for the calibration request
    batcher = engine.batcher
    assert batcher.graphs and batcher.draft_length is not None
    assert batcher.draft_length.lengths == (0, 1, 2, 4, 8) == plan_module.graph_draft_lengths(8, plan_module.FIXED_K)
    assert "one of 0, 1, 2, 4, 8 (the captured lengths)" in engine.description
    assert engine.calibrate(PROMPTS[2]) > 0
    assert {key[-1] for key in batcher._steps} == {0, 1, 2, 4, 8}
    assert batcher.graphs_captured > 0 and "replay" in backend.events
    plan = plan_module.plan_server(target, draft, drafter="model", k=None, runner="auto", max_rows=4, max_seq_len=SEQ)
    assert plan.cuda_graphs and plan.adaptive and "0, 1, 2, 4, 8 (the lengths CUDA graphs capture)" in plan.explain()


def test_reserve_step_gives_pages_for_one_step_and_sync_host_takes_them_back(pair):
    target = pair[0]
    runner = PagedModelRunner(target, max_batch_size=4, max_seq_len=64, page_size=4)
    runner.start_rows([0, 2], [[1, 2, 3], [4, 5, 6, 7, 8]])
    assert runner.batch_size == 3
    with pytest.raises(ValueError, match="width 2 must cover the rows in use"):
        runner.reserve_step(2, 4)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        runner.reserve_step(4, 0)
    runner.reserve_step(4, 4)  # row 0: 3 + 4 = 7 positions (2 pages), row 2: 9 (3 pages), rows 1, 3: none
    assert [len(runner.kv.pages(r)) for r in range(4)] == [2, 0, 3, 0] and runner.batch_size == 4
    ids = torch.tensor([[9, 9, 9, 9]] * 4)
    runner.forward(ids, torch.tensor([4, 1, 4, 1]))
    runner.commit(torch.tensor([2, 0, 4, 0]))
    runner.sync_host()
    assert runner.kv.host_lengths() == [5, 0, 9, 0] and runner.batch_size == 3
    assert [len(runner.kv.pages(r)) for r in range(4)] == [2, 0, 3, 0]
    runner.free_rows([2])
    assert runner.batch_size == 1 and runner.kv.num_free_pages == runner.kv.num_pages - 2
    full = PagedModelRunner(target, max_batch_size=2, max_seq_len=64, page_size=4, num_pages=3)
    full.start_rows([0], [[1, 2, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(PoolFullError):
        full.reserve_step(1, 8)
    static = PagedModelRunner(target, max_batch_size=1, max_seq_len=16, static_shapes=True)
    with pytest.raises(ValueError, match="already gives every row all its pages"):
        static.reserve_step(1, 1)


def test_graphs_are_refused_where_a_step_needs_the_host(pair):
    target = pair[0]
    lean = make_runner("lean", target, max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match="need the paged target runner"):
        ContinuousBatcher(lean, None, max_rows=2, slots=0, max_seq_len=32, graphs=True)
    paged = PagedModelRunner(target, max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match="NgramDrafter proposes on the host"):
        ContinuousBatcher(paged, NgramDrafter(K), max_rows=2, slots=K, max_seq_len=32, graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real CUDA graphs)")
@pytest.mark.parametrize("drafter", ["model", "none"])
def test_real_cuda_graphs_give_the_eager_tokens(pair, drafter):
    expected = _run(_batcher(pair, "cuda", graphs=False, drafter=drafter))
    batcher = _batcher(pair, "cuda", graphs=True, drafter=drafter)
    assert _run(batcher) == expected
    assert batcher.graphs_captured > 0
    _pools_are_free(batcher)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real CUDA graphs)")
def test_real_cuda_graphs_with_draft_lengths_by_load_give_the_eager_tokens(pair):
    """The scripted lengths (plain stretches between drafting steps) on real graphs: a replay runs what
    its capture recorded, so a draft feed as wide as the skipped steps would show here."""
    expected = _run(_batcher(pair, "cuda", graphs=False, draft_length=ScriptedK()))
    batcher = _batcher(pair, "cuda", graphs=True, draft_length=ScriptedK())
    assert _run(batcher) == expected
    assert {key[-1] for key in batcher._steps} == {0, 1, 2, 3} and batcher.graphs_captured > 0
    _pools_are_free(batcher)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real CUDA graphs)")
def test_real_cuda_graphs_with_an_eagle_head_give_the_eager_tokens():
    """The EAGLE-3 chains of the test above on real graphs: the same tokens as eager steps on the GPU."""
    _, make = _eagle_batchers("cuda")
    expected = _run(make(False))
    batcher = make(True)
    assert _run(batcher) == expected and batcher.graphs_captured > 0
