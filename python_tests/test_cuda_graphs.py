"""CUDA-graph code path of the decode loop (specdec_ext/cuda_graphs.py).

On the CPU: bucketing and padding, StepGraph's control flow (eager when disabled; warm-up, one
capture, replays, and the logged fallback when a capture fails) with a fake CUDAGraph backend, and
the static-buffer step (StaticPagedRunner, device-only forward/commit/truncate) giving the same tokens
as the host-side runner, through generate() and through a loop of the decode step functions whose
steps are "replayed" by the fake backend. On CUDA (skipped elsewhere): real graph replay gives the
same tokens as eager mode.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specdec_ext import cuda_graphs, generate
from specdec_ext.cuda_graphs import DecodeSteps, StaticPagedRunner, StepGraph, bucket_size, pad_batch
from specdec_ext.decode import RowState, commit, draft, prefill, required_cache_len, verify, chain_verifier
from specdec_ext.drafters import ModelDrafter
from specdec_ext.metadata import SamplingParams, SpecDecodeMetadata
from specdec_ext.model_runner import PagedModelRunner
from test_generate_utils import noisy_copy, one_thread, tiny_model

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20]]
NEW = 12


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", hidden=48, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.3)


class NoHostSync(TorchFunctionMode):
    """Raises on the tensor calls that would read device values on the host (a sync, which a CUDA
    graph capture refuses): what a captured step must never do."""

    BANNED = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
              "tensor", "as_tensor", "from_numpy"}  # the last three: host data copied in (baked in a graph)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.BANNED:
            raise RuntimeError(f"host sync or host data inside a captured step: {name}")
        return func(*args, **(kwargs or {}))


class FakeBackend:
    """Stands in for torch.cuda on the CPU: warm-up runs fn, capture records it WITHOUT running it (as
    a real capture runs no kernel), replay runs the recorded fn under NoHostSync."""

    def __init__(self, fail_capture: bool = False):
        self.fail_capture = fail_capture
        self.events = []

    def warmup(self, fn):
        self.events.append("warmup")
        fn()

    def capture(self, fn):
        self.events.append("capture")
        if self.fail_capture:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return fn

    def replay(self, graph):
        self.events.append("replay")
        with NoHostSync():
            graph()


# ------------------------------------------------------------------------------ bucketing
def test_bucket_size():
    assert [bucket_size(b) for b in (1, 2, 3, 4, 5, 8, 9, 31, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 32, 64, 64]
    assert bucket_size(65) == 65  # past the largest bucket: its own size
    with pytest.raises(ValueError):
        bucket_size(0)


def test_pad_batch_adds_frozen_rows():
    seeds = torch.tensor([3, 4, 5])
    rows = [RowState() for _ in range(3)]
    prompts, padded_seeds, padded_rows = pad_batch(PROMPTS, seeds, rows, row_factory=RowState)
    assert len(prompts) == len(padded_rows) == padded_seeds.numel() == 4
    assert prompts[:3] == PROMPTS and prompts[3] == [PROMPTS[0][-1]]
    assert padded_seeds.tolist() == [3, 4, 5, 0]
    assert padded_rows[:3] == rows and not any(r.finished for r in rows)
    assert padded_rows[3].finished and padded_rows[3].finish_reason == "padding"
    same = pad_batch(PROMPTS[:2], seeds[:2], rows[:2], row_factory=RowState)
    assert len(same[0]) == 2  # already a bucket
    with pytest.raises(ValueError):
        pad_batch(PROMPTS, seeds, rows, row_factory=RowState, bucket=2)


def test_maybe_pad_only_for_static_runners(pair):
    target, _ = pair
    rows = [RowState() for _ in range(3)]
    plain = PagedModelRunner(target, max_batch_size=3, max_seq_len=32)
    assert len(cuda_graphs.maybe_pad(plain, PROMPTS, torch.zeros(3, dtype=torch.long), rows, row_factory=RowState)[0]) == 3
    static = StaticPagedRunner.factory()(target, max_batch_size=3, max_seq_len=32)
    assert static.max_batch_size == 4  # room for the padding row
    assert len(cuda_graphs.maybe_pad(static, PROMPTS, torch.zeros(3, dtype=torch.long), rows, row_factory=RowState)[0]) == 4


# ------------------------------------------------------------------------------ StepGraph control flow
def test_step_graph_disabled_runs_eagerly():
    calls = []
    graph = StepGraph(lambda: calls.append(1), name="t", enabled=False, backend=FakeBackend())
    for _ in range(4):
        graph()
    assert len(calls) == 4 and not graph.captured and graph.backend.events == []


def test_step_graph_warmup_capture_replay():
    calls = []
    backend = FakeBackend()
    graph = StepGraph(lambda: calls.append(1), name="t", warmup=2, backend=backend)
    for _ in range(5):
        graph()
    # every call did the step's work exactly once; the capture itself ran nothing
    assert len(calls) == 5
    assert backend.events == ["warmup", "warmup", "capture", "replay", "replay", "replay"]
    assert graph.captured and graph.replays == 3


def test_step_graph_capture_failure_falls_back_and_logs_once(caplog):
    calls = []
    cuda_graphs._logged.clear()
    with caplog.at_level(logging.INFO, logger="specdec_ext"):
        graphs = [StepGraph(lambda: calls.append(1), name="verify", backend=FakeBackend(fail_capture=True))
                  for _ in range(2)]
        for graph in graphs:
            for _ in range(3):
                graph()
    assert len(calls) == 6  # warm-up, the failed capture's step (run eagerly), then eager
    assert all(not g.captured and not g.enabled for g in graphs)
    assert "operation not permitted" in graphs[0].fallback_reason
    messages = [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()]
    assert len(messages) == 1 and "verify: capture failed" in messages[0]


def test_decode_steps_on_cpu_log_why_and_run_eagerly(pair, caplog):
    target, _ = pair
    meta = SpecDecodeMetadata.allocate(batch_size=1, k=0, max_seq_len=8, vocab_size=96, sampling=SamplingParams(),
                                       seeds=torch.zeros(1, dtype=torch.long), device=torch.device("cpu"))
    cuda_graphs._logged.clear()
    with caplog.at_level(logging.INFO, logger="specdec_ext"):
        steps = DecodeSteps(None, None, meta, chain_verifier, draft_step=draft, verify_step=verify,
                            commit_step=commit)
    assert steps.captured == {"draft": False, "verify": False, "commit": False}
    assert not any(g.enabled for g in (steps.draft, steps.verify, steps.commit))
    assert any("device is cpu" in r.getMessage() for r in caplog.records)


def test_graphs_env_switch(monkeypatch):
    monkeypatch.setenv(cuda_graphs.ENV_GRAPHS, "0")
    assert cuda_graphs.graphs_enabled("cuda") == (False, "SPECDEC_CUDA_GRAPHS=0")
    monkeypatch.delenv(cuda_graphs.ENV_GRAPHS)
    assert cuda_graphs.graphs_enabled("cpu")[0] is False
    assert cuda_graphs.static_runner_factory(PagedModelRunner, "cpu") is PagedModelRunner


def test_non_capturable_parts_are_named(pair):
    target, draft_model = pair
    assert "host bookkeeping" in cuda_graphs._capturable_runner(PagedModelRunner(target, max_batch_size=1, max_seq_len=16))
    assert cuda_graphs._capturable_drafter(None) is None

    class HostDrafter:
        deterministic = True
        runner = object()

    assert "proposes on the host" in cuda_graphs._capturable_drafter(HostDrafter())


# ------------------------------------------------------------------------------ static step == dynamic path
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_runner_generate_matches_the_paged_runner(pair, temperature):
    target, draft_model = pair
    kwargs = dict(max_new_tokens=NEW, k=3, temperature=temperature, seed=[1, 2, 3], cost_probe=True)
    dynamic = generate(PROMPTS, target, draft_model, **kwargs)
    static = generate(PROMPTS, target, draft_model, runner=StaticPagedRunner.factory(), **kwargs)
    assert static.token_ids == dynamic.token_ids
    assert static.stats.steps == dynamic.stats.steps


def run_loop(target_model, draft_model, prompts, *, k, sampling, seeds, device, factory, steps_kwargs, pad=True):
    """The decode loop of decode.py with DecodeSteps, fixed max_new_tokens (no EOS), padding to a bucket:
    what decode() does once the integration patch is applied. Returns (tokens per real row, steps)."""
    real = len(prompts)
    rows = [RowState() for _ in range(real)]
    S = required_cache_len(max(len(p) for p in prompts), NEW, k)
    target = factory(target_model, max_batch_size=real, max_seq_len=S)
    drafter = None if draft_model is None else ModelDrafter(draft_model, factory, k=k, vocab_size=96)
    seeds = seeds.to(device)
    if pad:
        prompts, seeds, rows = cuda_graphs.maybe_pad(target, prompts, seeds, rows, row_factory=RowState)
    B = len(prompts)
    meta = SpecDecodeMetadata.allocate(batch_size=B, k=k, max_seq_len=S, vocab_size=96, sampling=sampling,
                                       seeds=seeds, device=device)
    prefill(target, drafter, prompts, meta)
    first = meta.token_buffer.gather(1, meta.prompt_lens[:, None])[:, 0].tolist()
    out = [[first[b]] for b in range(real)]
    steps = DecodeSteps(target, drafter, meta, chain_verifier, draft_step=draft, verify_step=verify,
                        commit_step=commit, **steps_kwargs)
    step = 1
    while min(len(t) for t in out) < NEW:
        meta.active.copy_(torch.tensor([b < real and len(out[b]) < NEW for b in range(B)]))
        meta.set_step(step)
        steps.draft()
        steps.verify()
        accepted = meta.num_accepted.tolist()
        steps.commit()
        emitted = meta.output_tokens.tolist()
        for b in range(real):
            if len(out[b]) < NEW:
                out[b].extend(emitted[b][: accepted[b] + 1][: NEW - len(out[b])])
        step += 1
    steps.finish(target, drafter)
    return out, steps


@pytest.mark.parametrize("k, temperature", [(3, 0.0), (2, 1.0), (0, 1.0)])
def test_fake_graph_replay_of_static_steps_matches_generate(pair, k, temperature):
    """Static runners + padded batch + steps 'replayed' by the fake backend == generate() on the
    host-side runner (k = 0: plain decoding)."""
    target, draft_model = pair
    draft_model = draft_model if k else None
    seeds = torch.tensor([1, 2, 3])
    sampling = SamplingParams(temperature=temperature)
    backend = FakeBackend()
    out, steps = run_loop(target, draft_model, PROMPTS, k=k, sampling=sampling, seeds=seeds, device=torch.device("cpu"),
                          factory=StaticPagedRunner.factory(), steps_kwargs=dict(enabled=True, backend=backend))
    expected_captured = {"draft": k > 0, "verify": True, "commit": True}
    assert steps.captured == expected_captured
    assert backend.events.count("capture") == sum(expected_captured.values())
    if k:
        reference = generate(PROMPTS, target, draft_model, max_new_tokens=NEW, k=k, temperature=temperature,
                             seed=seeds.tolist(), eos_token_id=False).token_ids
    else:
        from specdec_ext.generate import plain_generate
        reference = plain_generate(PROMPTS, target, max_new_tokens=NEW, temperature=temperature,
                                   seed=seeds.tolist(), eos_token_id=False).token_ids
    assert out == reference


@pytest.mark.parametrize("temperature, stop", [(0.0, None), (1.0, [3])])
def test_generate_with_graphs_forced_on_a_fake_backend(pair, monkeypatch, temperature, stop):
    """generate() with the integration patch applied and graphs forced on (fake backend): padded batch,
    static runners, captured steps, the same tokens and stats as the host-side eager path."""
    import specdec_ext.decode as decode_module
    if not hasattr(decode_module, "cuda_graphs"):
        pytest.skip("the integration patch (DecodeSteps in decode.py) is not applied")
    target, draft_model = pair
    kwargs = dict(max_new_tokens=NEW, k=3, temperature=temperature, seed=[1, 2, 3], eos_token_id=stop or False)
    reference = generate(PROMPTS, target, draft_model, **kwargs)
    backend = FakeBackend()
    monkeypatch.setattr(cuda_graphs, "graphs_enabled", lambda device: (True, None))
    monkeypatch.setattr(cuda_graphs, "_CudaBackend", lambda: backend)
    result = generate(PROMPTS, target, draft_model, **kwargs)
    assert backend.events.count("capture") == 3 and "replay" in backend.events
    assert result.token_ids == reference.token_ids
    assert result.finish_reasons == reference.finish_reasons
    assert result.stats.new_tokens == reference.stats.new_tokens
    assert result.stats.batch_size == 3 and result.stats.steps == reference.stats.steps


def test_no_host_sync_guard_catches_the_host_side_runner(pair):
    """The guard of the fake replay does catch a step that reads the host (the plain paged runner)."""
    target, _ = pair
    runner = PagedModelRunner(target, max_batch_size=1, max_seq_len=16)
    runner.start([[1, 2]])
    with pytest.raises(RuntimeError, match="host sync or host data"), NoHostSync():
        runner.forward(torch.tensor([[3]]), torch.tensor([1]))


def test_static_runner_sync_host_restores_host_bookkeeping(pair):
    target, _ = pair
    runner = StaticPagedRunner.factory()(target, max_batch_size=2, max_seq_len=40)
    runner.start([[1, 2, 3], [4]])
    assert runner.static and runner.kv.num_free_pages == 0  # every row owns all its pages
    runner.forward(torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 1]))
    runner.commit(torch.tensor([2, 1]))
    assert runner.lengths.tolist() == [5, 2]
    runner.truncate(torch.tensor([4, 9]))  # never grows a row
    assert runner.lengths.tolist() == [4, 2]
    runner.sync_host()
    assert not runner.static and runner.kv.host_lengths()[:2] == [4, 2]
    runner.kv.check_invariants()


def test_static_runner_logits_match_the_paged_runner(pair):
    target, _ = pair
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    ids, counts = torch.tensor([[9, 10, 11], [12, 13, 14]]), torch.tensor([3, 2])
    plain = PagedModelRunner(target, max_batch_size=2, max_seq_len=40)
    static = StaticPagedRunner(PagedModelRunner(target, max_batch_size=2, max_seq_len=40))
    for runner in (plain, static):
        runner.start(prompts)
    a, b = plain.forward(ids, counts), static.forward(ids, counts)
    torch.testing.assert_close(b[0], a[0])
    torch.testing.assert_close(b[1, :2], a[1, :2])  # row 1's third column is padding


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k, temperature", [(3, 0.0), (3, 1.0), (0, 1.0)])
def test_cuda_graph_replay_equals_eager(pair, k, temperature):
    target, draft_model = (copy.deepcopy(m).to("cuda") for m in pair)  # the fixture stays on the CPU
    draft_model = draft_model if k else None
    seeds = torch.tensor([1, 2, 3])
    sampling = SamplingParams(temperature=temperature)
    kwargs = dict(k=k, sampling=sampling, seeds=seeds, device=torch.device("cuda"), factory=StaticPagedRunner.factory())
    graphed, steps = run_loop(target, draft_model, PROMPTS, steps_kwargs=dict(enabled=True), **kwargs)
    assert steps.captured == {"draft": k > 0, "verify": True, "commit": True}, [
        g.fallback_reason for g in (steps.draft, steps.verify, steps.commit)]
    eager, _ = run_loop(target, draft_model, PROMPTS, steps_kwargs=dict(enabled=False), **kwargs)
    assert graphed == eager
    host, _ = run_loop(target, draft_model, PROMPTS, steps_kwargs=dict(enabled=False), pad=False,
                       **{**kwargs, "factory": PagedModelRunner})
    assert graphed == host
