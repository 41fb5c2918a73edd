"""Concurrent and interrupted callers of generate() / plain_generate() in one process, as a real application
has them: a web app calling generate() from worker threads on the same loaded models (and stepping a stream
from a thread pool, as Starlette's StreamingResponse does with a sync iterator), an asyncio-style server
interleaving several streams on one thread, a notebook user pressing Ctrl-C or breaking out of a stream, a
long-lived process making hundreds of short calls, a model deleted and another made at its id().

Each caller must get exactly what the same call gives alone (greedy: token for token; a seeded sample with a
fixed k: token for token), with no exception, deadlock or cross-talk, and nothing may accumulate: hooks on the
models, packed weight copies, resident memory, time per call.

Six of the tests below failed when this file was written, each a bug since fixed (their docstrings say what
broke and where the fix is).
"""
from __future__ import annotations

import _thread
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from specdec_ext import adaptive, generate, ops
from specdec_ext.default_pair import load_default_pair
from specdec_ext.generate import plain_generate
from specdec_ext.runners import PagedModelRunner
from specdec_ext.runners.lean import LeanLlamaRunner
from specdec_ext.step import lossless_verify
from serve_utils import slow_target
from test_generate_utils import CHAR_VOCAB, char_tokenizer, hf_greedy, noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

PROMPTS = ["def fib(n):", "import os\n", "class A:", "x = [1, 2, 3]\nx = [1, 2"]
JOIN_TIMEOUT_S = 120.0  # a thread still alive after this is a deadlock


# ------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def pair():
    """The bundled pair in bf16 (its stored dtype), loaded for this module alone."""
    return load_default_pair(dtype=torch.bfloat16)


@pytest.fixture
def fresh_pair():
    """A copy of the bundled pair for one test (what a failing test leaves on its models stays there)."""
    return load_default_pair(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tiny():
    """Tiny random models over the character tokenizer: a Llama pair (lean runner) and a GPT-NeoX pair
    (paged runner)."""
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0)
    neox = tiny_model("gpt_neox", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0, seed=3)
    return dict(target=target, draft=noisy_copy(target, noise=0.3), neox=neox, neox_draft=noisy_copy(neox, noise=0.3),
                tokenizer=char_tokenizer())


def hooks_on(model) -> int:
    """Forward hooks and pre-hooks on any module of ``model``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def outcome(result):
    """What a call must reproduce: its tokens (and its text, logprobs where present)."""
    logprobs = None if result.logprobs is None else [[(lp.token, lp.logprob, lp.top) for lp in row]
                                                      for row in result.logprobs]
    return result.token_ids, result.text, result.finish_reasons, logprobs


def drain(stream):
    """A stream consumed to its end: the result, checked against the pieces it yielded."""
    pieces = list(stream)
    result = stream.result
    assert result is not None
    if result.text is not None:
        assert ["".join(p for p in pieces if p.index == b) for b in range(len(result.text))] == result.text
    return result


def run_in_threads(jobs, reps: int):
    """Every job in its own thread, ``reps`` times, all started together. -> {name: [outcome or error]}."""
    results = {name: [] for name in jobs}
    barrier = threading.Barrier(len(jobs))

    def repeat(name):
        barrier.wait()
        for _ in range(reps):
            try:
                results[name].append(outcome(jobs[name]()))
            except Exception:  # (an outcome to compare: a thread's exception would otherwise vanish)
                results[name].append("".join(traceback.format_exc()))

    threads = [threading.Thread(target=repeat, args=(name,), daemon=True) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
    assert not [t for t in threads if t.is_alive()], "deadlock: a generate() thread did not finish"
    return results


def check_together_equals_alone(jobs, reps: int):
    alone = {name: outcome(job()) for name, job in jobs.items()}
    together = run_in_threads(jobs, reps)
    errors = {name: [r for r in runs if isinstance(r, str)] for name, runs in together.items()}
    assert not any(errors.values()), "\n".join(f"{name}: " + runs[0].strip().splitlines()[-1]
                                               for name, runs in errors.items() if runs)
    wrong = [name for name, runs in together.items() if any(r != alone[name] for r in runs)]
    assert not wrong, f"these callers got other output in threads than alone: {wrong}"


# ------------------------------------------------------------------------------------- 1. threads
def test_threads_sharing_the_bundled_pair_each_get_their_solo_output(pair):
    """Every kind of call at once on the same target and draft objects (adaptive k's shared costs, the packed
    weights, the heads' hook, the runners): each gets what it gets alone, token for token."""
    target, draft, tok = pair
    kw = dict(tokenizer=tok, eos_token_id=False)
    jobs = {
        "greedy k=None (auto), B=2": lambda: generate(PROMPTS[:2], target, draft, max_new_tokens=32, **kw),
        "greedy k='auto', B=1": lambda: generate(PROMPTS[2:3], target, draft, max_new_tokens=40, k="auto", **kw),
        "greedy k=3, B=4": lambda: generate(PROMPTS, target, draft, max_new_tokens=20, k=3, **kw),
        "seeded sample k=4": lambda: generate(PROMPTS[:2], target, draft, max_new_tokens=24, k=4, temperature=0.8,
                                              top_p=0.9, seed=7, **kw),
        "ngram": lambda: generate(PROMPTS[3:], target, "ngram", max_new_tokens=20, k=4, **kw),
        "stream": lambda: drain(generate(PROMPTS[:3], target, draft, max_new_tokens=30, stream=True, **kw)),
        "stop strings": lambda: generate(PROMPTS[:2], target, draft, max_new_tokens=40, stop=["\n\n", "return"], **kw),
        "plain greedy": lambda: plain_generate(PROMPTS[1:3], target, max_new_tokens=24, **kw),
        "plain seeded sample": lambda: plain_generate(PROMPTS[:1], target, max_new_tokens=24, temperature=1.0, seed=3,
                                                      **kw),
        "tree": lambda: generate(PROMPTS[:2], target, draft, max_new_tokens=24, draft_tree=(2, 3, 6), **kw),
        "heads": lambda: generate(PROMPTS[2:3], target, "heads", max_new_tokens=24, **kw),
        "eagle (lean)": lambda: generate(PROMPTS[:2], target, "eagle", max_new_tokens=24, k=3, **kw),
        "paged runner": lambda: generate(PROMPTS[:2], target, draft, max_new_tokens=16, k=2, runner="paged", **kw),
        "processors + logprobs": lambda: generate(PROMPTS[:1], target, draft, max_new_tokens=20, k=3, temperature=0.8,
                                                  seed=5, presence_penalty=0.5, repetition_penalty=1.2, min_p=0.05,
                                                  logprobs=2, **kw),
        "draft as target (roles swapped)": lambda: generate(PROMPTS[:2], draft, target, max_new_tokens=20, k=2, **kw),
        "draft alone": lambda: plain_generate(PROMPTS[:2], draft, max_new_tokens=20, stream=False, **kw),
    }
    check_together_equals_alone(jobs, reps=2)
    assert hooks_on(target) == 0 and hooks_on(draft) == 0  # every heads drafter removed its hook


def test_threads_on_tiny_models_across_runners_and_architectures(tiny):
    """The same with tiny models (many more steps per second, so more interleavings): the lean, paged and
    recompute runners, a GPT-NeoX pair, seeded samples, trees, stop strings and streams."""
    t, d, nx, nd, tok = tiny["target"], tiny["draft"], tiny["neox"], tiny["neox_draft"], tiny["tokenizer"]
    kw = dict(tokenizer=tok, eos_token_id=False)
    jobs = {
        "auto": lambda: generate(PROMPTS[:2], t, d, max_new_tokens=40, k="auto", **kw),
        "k=3": lambda: generate(PROMPTS, t, d, max_new_tokens=30, k=3, **kw),
        "seeded sample": lambda: generate(PROMPTS[1:3], t, d, max_new_tokens=30, k=2, temperature=0.9, seed=11, **kw),
        "ngram auto": lambda: generate(PROMPTS[3:], t, "ngram", max_new_tokens=30, **kw),
        "stream": lambda: drain(generate(PROMPTS[:3], t, d, max_new_tokens=25, stream=True, **kw)),
        "stop": lambda: generate(PROMPTS, t, d, max_new_tokens=40, stop=["a", "e "], **kw),
        "plain": lambda: plain_generate(PROMPTS, t, max_new_tokens=20, **kw),
        "tree": lambda: generate(PROMPTS[:2], t, d, max_new_tokens=25, draft_tree=(2, 3, 5), **kw),
        "seeded sampled tree": lambda: generate(PROMPTS[:2], t, d, max_new_tokens=25, draft_tree=(2, 3, 5),
                                                temperature=0.8, seed=4, **kw),
        "paged": lambda: generate(PROMPTS, t, d, max_new_tokens=20, k=2, runner="paged", **kw),
        "recompute": lambda: generate(PROMPTS[:2], t, d, max_new_tokens=20, k="auto", runner="recompute", **kw),
        "neox auto": lambda: generate(PROMPTS, nx, nd, max_new_tokens=20, k="auto", **kw),
        "neox seeded sample": lambda: generate(PROMPTS[:2], nx, nd, max_new_tokens=20, k=3, temperature=0.7, seed=2,
                                               **kw),
        "neox plain": lambda: plain_generate(PROMPTS[:3], nx, max_new_tokens=20, **kw),
        "target as its own draft": lambda: generate(PROMPTS[:2], t, t, max_new_tokens=20, k=3, **kw),
    }
    check_together_equals_alone(jobs, reps=4)


def test_eagle_on_the_paged_runner_beside_other_callers_of_the_target(fresh_pair):
    """An EAGLE-3 generation on the paged runner (the default on CUDA, where CUDA graphs run) beside another
    thread's forwards of the same target gives its solo output.

    It crashed ("Sizes of tensors must match" / "shape mismatch"), or drafted from another caller's hidden states:
    the tap hooks on the shared decoder layers kept one ``active`` flag and one ``captured`` dict per runner, and
    fired on every thread's forward. Now their state is per thread (runners/taps.py, ``LayerInputHooks.capturing``)."""
    target, draft, tok = fresh_pair
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=24)
    jobs = {
        "eagle, paged, B=1": lambda: generate(PROMPTS[:1], target, "eagle", k=3, runner="paged", **kw),
        "eagle, paged, B=3": lambda: generate(PROMPTS[1:], target, "eagle", k=2, runner="paged", **kw),
        "plain, paged, B=2": lambda: plain_generate(PROMPTS[2:], target, runner="paged", **kw),
    }
    check_together_equals_alone(jobs, reps=4)


# ------------------------------------------------------------------------------------- streams and threads
STREAM_DRAFTS = ["model", "ngram", "eagle", "plain", "heads"]


def _stream(target, draft, tok, kind, **kw):
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=32, **kw)
    if kind == "plain":
        return plain_generate(PROMPTS[:2], target, **kw)
    drafter = {"model": draft, "ngram": "ngram", "eagle": "eagle", "heads": "heads"}[kind]
    return generate(PROMPTS[:2], target, drafter, **({"k": 3} if kind == "eagle" else {}), **kw)


@pytest.mark.parametrize("kind", STREAM_DRAFTS)
def test_a_stream_made_on_one_thread_can_be_consumed_on_others(fresh_pair, kind):
    """A web app makes the stream in its request handler and iterates it elsewhere: on one worker thread, or
    one next() at a time on a thread pool (Starlette's StreamingResponse runs a sync iterator through
    iterate_in_threadpool), possibly after a first next() on the making thread. Each gives the solo output.

    With heads it raised "the target's prefill did not pass through its LM head on this thread", or a shape error
    from a stale hidden state: the heads' LM-head capture kept the passes of the thread that built the drafter.
    Now it keeps those of the thread resuming the loop (``Drafter.running`` around each resumption, generate.py
    ``_real_rows``; runners/head_hooks.py)."""
    target, draft, tok = fresh_pair
    alone = outcome(_stream(target, draft, tok, kind))
    failures = []
    with ThreadPoolExecutor(3) as pool:
        # (1) made here, consumed whole on another thread
        stream = _stream(target, draft, tok, kind, stream=True)
        got = pool.submit(lambda: outcome(drain(stream)))
        try:
            if got.result(timeout=JOIN_TIMEOUT_S) != alone:
                failures.append("consumed on a worker thread: other output")
        except Exception as error:
            failures.append(f"consumed on a worker thread: {error!r}")
        # (2) each next() on the pool; (3) the first next() here, the others on the pool
        for first_here in (False, True):
            stream = _stream(target, draft, tok, kind, stream=True)
            pieces = iter(stream)
            try:
                if first_here:
                    next(pieces)
                while pool.submit(next, pieces, None).result(timeout=JOIN_TIMEOUT_S) is not None:
                    pass
                if outcome(stream.result) != alone:
                    failures.append(f"stepped on a pool (first next() here: {first_here}): other output")
            except Exception as error:
                failures.append(f"stepped on a pool (first next() here: {first_here}): {error!r}")
            del pieces, stream
    gc.collect()
    assert not failures, failures
    assert hooks_on(target) == 0


@pytest.mark.parametrize("kind", ["model", "heads"])
def test_a_stream_closed_from_another_thread_mid_step_stops_its_consumer(fresh_pair, kind):
    """A server cancels a generation from its own thread while a worker is inside the stream's next(): the
    worker's loop ends without an error after at most the step it was in, ``result`` stays None, no hook stays
    on the target, and the next call is exact.

    close() called the generator's close() while another thread was running it: "ValueError: generator already
    executing" for the canceller, and the generation went on. Now close() waits for that next() to return and
    closes after it (``GenerationStream.close``)."""
    target, draft, tok = fresh_pair
    alone = outcome(_stream(target, draft, tok, kind))
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=400)
    drafter = draft if kind == "model" else kind
    with slow_target(target, 0.02):  # the worker spends its time inside next()
        stream = generate(PROMPTS[:2], target, drafter, stream=True, **kw)
        first, pieces, errors = threading.Event(), [], []

        def consume():
            try:
                for piece in stream:
                    pieces.append(piece)
                    first.set()
            except BaseException as error:  # noqa: BLE001 (whatever reaches the consumer is the failure)
                errors.append(error)
            first.set()

        worker = threading.Thread(target=consume)
        worker.start()
        assert first.wait(JOIN_TIMEOUT_S)
        stream.close()
        worker.join(JOIN_TIMEOUT_S)
        assert not worker.is_alive(), "the consumer did not stop"
    assert not errors and stream.result is None
    assert 0 < sum(len(p.token_ids) for p in pieces) < 2 * 400
    gc.collect()
    assert hooks_on(target) == 0
    assert outcome(_stream(target, draft, tok, kind)) == alone


@pytest.mark.parametrize("with_heads", [False, True], ids=["without heads", "with heads"])
def test_streams_interleaved_on_one_thread_each_give_their_solo_output(fresh_pair, with_heads):
    """An asyncio server (or a notebook) holds several streams open on ONE thread and steps them in turn:
    each gives what it gives alone.

    With heads the greedy plain stream raised "greedy_chain: needs the CPU kernels and a head without hooks": a
    capture counted for every generation on its thread. Now only while its own generation runs
    (``Drafter.running``)."""
    target, draft, tok = fresh_pair
    kinds = ["plain", "model", "ngram", "eagle"] + (["heads"] if with_heads else [])
    alone = {kind: outcome(_stream(target, draft, tok, kind)) for kind in kinds}
    streams = {kind: _stream(target, draft, tok, kind, stream=True) for kind in kinds}
    iterators = {kind: iter(stream) for kind, stream in streams.items()}
    open_ = list(kinds)
    try:
        while open_:
            for kind in list(open_):
                if next(iterators[kind], None) is None:
                    open_.remove(kind)
    except Exception as error:
        pytest.fail(f"stepping {kind!r} beside {[k for k in kinds if k != kind]} on one thread: {error!r}")
    assert {kind: outcome(stream.result) for kind, stream in streams.items()} == alone


def test_a_heads_stream_dropped_before_its_first_piece_removes_its_hook(fresh_pair):
    """A request cancelled before its stream yielded anything (the client went away) drops a stream that was
    never iterated: nothing of it may stay on the target.

    Every such heads stream left its LM-head pre-hook on the target for good (20 streams: 20 hooks), removed only
    by the loop's end, which an unstarted generator never reaches. Now a finalizer of the drafter removes it too
    (drafters/heads_drafter.py)."""
    target, draft, tok = fresh_pair
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=16)
    for _ in range(20):
        stream = generate(PROMPTS[:1], target, "heads", stream=True, **kw)
        del stream
    gc.collect()
    left = len(target.lm_head._forward_pre_hooks)
    plain = plain_generate(PROMPTS[:1], target, **kw)
    assert (left, plain.plan.target_capabilities.greedy_chain) == (0, True), (
        f"{left} hooks left on the LM head by dropped streams; greedy chains planned: "
        f"{plain.plan.target_capabilities.greedy_chain}")


@pytest.mark.parametrize("how", ["break", "exception"])
def test_a_stream_resumed_after_leaving_its_loop_yields_every_token(pair, how):
    """A consumer leaves its ``for piece in stream`` loop (``break``, or an exception it handles) and later
    iterates the same stream again: the pieces of both loops together hold every row's text and tokens.

    The tokens of the other rows of the step the consumer left in were lost: each ``for`` made a fresh generator,
    and leaving the loop closed it inside a step. Now the stream is its own iterator (``GenerationStream.__next__``,
    one generator for its life, and ``close()``)."""
    target, draft, tok = pair
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=40, k=3)
    alone = generate(PROMPTS[:3], target, draft, **kw)
    stream = generate(PROMPTS[:3], target, draft, stream=True, **kw)
    texts, tokens = [[] for _ in range(3)], [[] for _ in range(3)]
    try:
        for piece in stream:
            texts[piece.index].append(str(piece))
            tokens[piece.index] += piece.token_ids
            if how == "break":
                break
            raise ValueError("the consumer's own error")
    except ValueError:
        pass
    for piece in stream:
        texts[piece.index].append(str(piece))
        tokens[piece.index] += piece.token_ids
    assert outcome(stream.result) == outcome(alone)
    assert ["".join(t) for t in texts] == alone.text
    assert tokens == alone.token_ids, "tokens lost between the two loops"


# ------------------------------------------------------------------------------------- abandoned streams
def test_abandoned_streams_leave_nothing_behind_and_later_calls_are_exact(pair):
    """Streams of every drafter left half-way (iterator closed, ``break``, an exception in the consumer,
    dropped after one piece), many times: later calls on the same models are exact, no hook stays on them,
    the packed weight copies and the resident memory do not grow, and the runners they built are freed."""
    target, draft, tok = pair
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=48)
    makers = {
        "auto": lambda **o: generate(PROMPTS[:2], target, draft, **o, **kw),
        "seeded sample": lambda **o: generate(PROMPTS[:2], target, draft, k=2, temperature=0.7, seed=1, **o, **kw),
        "ngram": lambda **o: generate(PROMPTS[3:], target, "ngram", **o, **kw),
        "tree": lambda **o: generate(PROMPTS[:2], target, draft, draft_tree=(2, 2, 4), **o, **kw),
        "heads": lambda **o: generate(PROMPTS[:1], target, "heads", **o, **kw),
        "eagle": lambda **o: generate(PROMPTS[:2], target, "eagle", k=3, **o, **kw),
        "eagle, paged": lambda **o: generate(PROMPTS[:1], target, "eagle", k=3, runner="paged", **o, **kw),
        "plain": lambda **o: plain_generate(PROMPTS[:2], target, **o, **kw),
        "paged": lambda **o: generate(PROMPTS[:2], target, draft, k=2, runner="paged", **o, **kw),
    }
    alone = {name: outcome(make()) for name, make in makers.items()}

    def abandon(make, how):
        stream = make(stream=True)
        if how == "close":
            pieces = iter(stream)
            next(pieces), next(pieces)
            pieces.close()
        elif how == "break":
            for i, _ in enumerate(stream):
                if i == 2:
                    break
        elif how == "exception":
            try:
                for _ in stream:
                    raise RuntimeError("the consumer's own error")
            except RuntimeError:
                pass
        else:  # "drop": one piece, then the stream goes
            next(iter(stream))

    hows = ("close", "break", "exception", "drop")
    for name, make in makers.items():  # (a first round: whatever is made once per process is made)
        abandon(make, hows[0])
    gc.collect()
    rss, packed = rss_mb(), ops.packed_weight_bytes()
    runners = lambda: {id(o) for o in gc.get_objects() if type(o) in (LeanLlamaRunner, PagedModelRunner)}  # noqa: E731
    before = runners()  # (other tests' module fixtures may hold some)
    for round_ in range(3):
        for i, (name, make) in enumerate(makers.items()):
            abandon(make, hows[(i + round_) % len(hows)])
    gc.collect()  # (the paged runner's tap hooks go with the runner, which a reference cycle holds until then)
    assert hooks_on(target) == 0 and hooks_on(draft) == 0, "a hook stayed on the models"
    assert ops.packed_weight_bytes() == packed
    assert rss_mb() - rss < 40, f"resident memory grew by {rss_mb() - rss:.0f} MB over 27 abandoned streams"
    assert not runners() - before, "a runner outlived its stream"
    assert {name: outcome(make()) for name, make in makers.items()} == alone


@pytest.mark.parametrize("draft,options", [
    ("model", dict(k=3)), ("model", dict()), ("model", dict(temperature=0.8, seed=1)), ("model", dict(stream=True)),
    ("model", dict(draft_tree=(2, 2, 4))), ("heads", dict()), ("eagle", dict(k=3)), ("eagle", dict(k=3, runner="paged")),
    ("ngram", dict())], ids=["k3", "auto", "sampled", "stream", "tree", "heads", "eagle", "eagle-paged", "ngram"])
def test_a_finished_generation_frees_its_runners_without_a_collection_pass(pair, draft, options):
    """The runners (and on a GPU their KV caches) go when the call returns, not at the next cyclic collection:
    the step's parts were closures over the object that held them, a reference cycle through the metadata,
    the drafter and both runners."""
    target, draft_model, tok = pair
    drafter = draft_model if draft == "model" else draft

    def run():
        out = generate(PROMPTS[:1], target, drafter, tokenizer=tok, max_new_tokens=8, **options)
        return list(out) if options.get("stream") else out

    run()
    gc.collect()
    alive = lambda: [o for o in gc.get_objects() if type(o) in (LeanLlamaRunner, PagedModelRunner)]  # noqa: E731
    before = {id(o) for o in alive()}
    gc.disable()
    try:
        run()
        left = [type(o).__name__ for o in alive() if id(o) not in before]
    finally:
        gc.enable()
    assert not left, f"runners alive after the call, until a collection pass: {left}"


# ------------------------------------------------------------------------------------- interrupts
def test_keyboard_interrupt_inside_the_loop_then_fresh_calls_are_exact(pair):
    """Ctrl-C in the middle of a generation (raised from inside the decode loop at a chosen step, and from a
    stream's consumer loop): the KeyboardInterrupt reaches the caller, nothing stays hooked on the models, and
    the next calls give exactly the solo output."""
    target, draft, tok = pair
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=40)
    drafts = {"model": dict(draft=draft, k=3), "auto": dict(draft=draft), "heads": dict(draft="heads"),
              "eagle": dict(draft="eagle", k=3), "tree": dict(draft=draft, draft_tree=(2, 2, 4)),
              "seeded sample": dict(draft=draft, k=3, temperature=0.9, seed=2)}
    alone = {name: outcome(generate(PROMPTS[:2], target, **d, **kw)) for name, d in drafts.items()}
    for index, (name, d) in enumerate(drafts.items()):
        for at in (1 + 3 * (index % 2),):  # (the first verify pass, or a later one)
            calls = [0]

            def verifier(meta, proposal, logits):
                calls[0] += 1
                if calls[0] == at:
                    raise KeyboardInterrupt
                return lossless_verify(meta, proposal, logits)

            if name != "auto":  # (k="auto" may switch speculation off here: plain passes call no verifier)
                with pytest.raises(KeyboardInterrupt):
                    generate(PROMPTS[:2], target, verifier=verifier, **d, **kw)
            with pytest.raises(KeyboardInterrupt):
                for i, _ in enumerate(generate(PROMPTS[:2], target, stream=True, **d, **kw)):
                    if i == at:
                        raise KeyboardInterrupt
            assert outcome(generate(PROMPTS[:2], target, **d, **kw)) == alone[name], name
    gc.collect()
    assert hooks_on(target) == 0 and hooks_on(draft) == 0


def test_real_ctrl_c_at_random_moments_then_fresh_calls_are_exact(pair):
    """A SIGINT-like interrupt of the main thread (``_thread.interrupt_main`` from a timer) at random moments of
    calls of every kind: then the same calls and others give exactly their solo output."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("interrupt_main interrupts the main thread: the test must run on it")
    target, draft, tok = pair
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=48)
    jobs = {
        "auto": lambda: generate(PROMPTS[:2], target, draft, **kw),
        "k=3": lambda: generate(PROMPTS[:2], target, draft, k=3, **kw),
        "seeded sample": lambda: generate(PROMPTS[:2], target, draft, k=3, temperature=0.8, seed=5, **kw),
        "heads": lambda: generate(PROMPTS[:2], target, "heads", **kw),
        "eagle, paged": lambda: generate(PROMPTS[:2], target, "eagle", k=3, runner="paged", **kw),
        "tree": lambda: generate(PROMPTS[:2], target, draft, draft_tree=(2, 3, 6), **kw),
        "ngram": lambda: generate(PROMPTS[2:], target, "ngram", **kw),
        "plain": lambda: plain_generate(PROMPTS[:2], target, **kw),
        "stream": lambda: drain(generate(PROMPTS[:2], target, draft, stream=True, **kw)),
    }
    alone, seconds = {}, {}
    for name, job in jobs.items():
        alone[name] = outcome(job())
        started = time.perf_counter()  # (a warm call's time: the first may probe costs)
        job()
        seconds[name] = time.perf_counter() - started
    rng = random.Random(0)
    # (Python's own SIGINT handler, which a shell's background job may have set to "ignore" before Python started)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupted, wrong = _interrupt_at_random(jobs, alone, seconds, rng)
    finally:
        signal.signal(signal.SIGINT, handler)
    gc.collect()
    assert interrupted > 0
    assert not wrong, wrong
    assert hooks_on(target) == 0


def _interrupt_at_random(jobs, alone, seconds, rng):
    interrupted, wrong = 0, []
    for _ in range(2):
        for name, job in jobs.items():
            timer = threading.Timer(rng.uniform(0.0, 0.7 * seconds[name]), _thread.interrupt_main)
            timer.start()
            try:
                try:
                    job()
                finally:
                    timer.cancel()
                    timer.join()
                time.sleep(0.01)  # (an interrupt that fired as the call returned lands here)
            except KeyboardInterrupt:
                interrupted += 1
            for other, other_job in rng.sample(list(jobs.items()), 1):
                if outcome(other_job()) != alone[other]:
                    wrong.append((other, "after interrupting", name))
    return interrupted, wrong


# ------------------------------------------------------------------------------------- many calls
def test_hundreds_of_short_calls_stay_exact_without_growth(pair):
    """200 short calls alternating every option: each equals its first run, and nothing grows (resident memory,
    packed weights, adaptive k's shared tables, hooks)."""
    target, draft, tok = pair
    kw = dict(tokenizer=tok, eos_token_id=False)
    options = [
        lambda: generate(PROMPTS[:1], target, draft, max_new_tokens=8, **kw),
        lambda: generate(PROMPTS[:2], target, draft, max_new_tokens=6, k=3, **kw),
        lambda: generate(PROMPTS[:3], target, draft, max_new_tokens=5, k=2, temperature=0.7, seed=3, **kw),
        lambda: generate(PROMPTS[3:], target, "ngram", max_new_tokens=8, **kw),
        lambda: plain_generate(PROMPTS[:2], target, max_new_tokens=6, **kw),
        lambda: generate(PROMPTS[:1], target, draft, max_new_tokens=8, stop=["\n"], **kw),
        lambda: generate(PROMPTS[:2], target, draft, max_new_tokens=8, draft_tree=(2, 2, 4), **kw),
        lambda: drain(generate(PROMPTS, target, draft, max_new_tokens=6, stream=True, **kw)),
        lambda: generate(PROMPTS[:1], target, "heads", max_new_tokens=8, **kw),
        lambda: generate(PROMPTS[:1], target, "eagle", max_new_tokens=8, k=2, **kw),
    ]
    first = [outcome(option()) for option in options]
    for option in options:  # (warm: every shared table and packed copy made)
        option()
    gc.collect()
    rss, packed = rss_mb(), ops.packed_weight_bytes()
    shared = {key: len(table) for key, table in adaptive._SHARED.items() if key is target}
    wrong = []
    for round_ in range(20):
        for i, option in enumerate(options):
            if outcome(option()) != first[i]:
                wrong.append((round_, i))
    gc.collect()
    assert not wrong, f"(round, option) that differed from the first run: {wrong}"
    assert ops.packed_weight_bytes() == packed
    assert {key: len(table) for key, table in adaptive._SHARED.items() if key is target} == shared
    assert hooks_on(target) == 0 and hooks_on(draft) == 0
    assert rss_mb() - rss < 30, f"resident memory grew by {rss_mb() - rss:.0f} MB over 200 calls"


# ------------------------------------------------------------------------------------- model identity
def test_one_model_object_as_both_target_and_draft(pair, tiny):
    """generate(prompts, m, m): the same module as target and draft (two runners over one set of weights), on
    every runner, greedy and seeded, also while another thread uses it as a plain target."""
    target, _, tok = pair
    kw = dict(tokenizer=tok, eos_token_id=False, max_new_tokens=24)
    for runner in ("auto", "paged", "recompute"):
        plain = plain_generate(PROMPTS[:2], target, runner=runner, **kw).token_ids
        for k in ("auto", 3):
            out = generate(PROMPTS[:2], target, target, k=k, runner=runner, **kw)
            assert out.token_ids == plain, (runner, k)
            if k == 3:
                assert out.stats.acceptance_rate == 1.0  # the draft is the target
    t, tiny_tok = tiny["target"], tiny["tokenizer"]
    jobs = {
        "t as both, greedy": lambda: generate(PROMPTS, t, t, max_new_tokens=20, k=3, tokenizer=tiny_tok),
        "t as both, seeded": lambda: generate(PROMPTS[:2], t, t, max_new_tokens=20, k=2, temperature=0.9, seed=1,
                                              tokenizer=tiny_tok),
        "t plain": lambda: plain_generate(PROMPTS, t, max_new_tokens=20, tokenizer=tiny_tok),
    }
    check_together_equals_alone(jobs, reps=3)
    assert generate(PROMPTS, t, t, max_new_tokens=20, k=3, tokenizer=tiny_tok).token_ids == \
        plain_generate(PROMPTS, t, max_new_tokens=20, tokenizer=tiny_tok).token_ids


def _remake_at(old_id: int, cls, config):
    """A new ``cls(config)`` whose object sits at ``old_id`` (the freed slot of a deleted model): objects are
    allocated until one lands there (CPython reuses freed slots of the size class), then initialised."""
    held = []
    for _ in range(100000):
        model = cls.__new__(cls)
        if id(model) == old_id:
            del held
            model.__init__(config)
            return model.eval()
        held.append(model)
    return None


def test_a_model_made_at_the_id_of_a_deleted_one_gets_nothing_of_it():
    """A target and a draft deleted between calls and new ones (other weights) made at the same id(): the
    library holds no reference to a deleted model, drops what it remembered of it (adaptive k's draft
    memory), and the new models decode exactly (greedy: HF's tokens; a seeded sample: that of an equal copy at
    another id), as do their packed weights, though their storage may reuse the old one's addresses."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    target = tiny_model("llama", hidden=64, logit_scale=4.0, seed=0)
    draft = noisy_copy(target, seed=1)
    for trial in range(3):
        reference = [hf_greedy(target, p, 16) for p in prompts]
        twin = noisy_copy(draft, noise=0.0)  # an equal draft at another id
        assert generate(prompts, target, draft, max_new_tokens=16, eos_token_id=False).token_ids == reference
        sampled = generate(prompts, target, draft, max_new_tokens=16, k=2, temperature=1.0, seed=3,
                           eos_token_id=False).token_ids
        assert sampled == generate(prompts, target, twin, max_new_tokens=16, k=2, temperature=1.0, seed=3,
                                   eos_token_id=False).token_ids
        stream = generate(prompts, target, draft, max_new_tokens=16, k="auto", stream=True, eos_token_id=False)
        next(iter(stream))
        del stream, twin
        gc.collect()  # (the calls' own garbage, which holds the models until a collection)
        draft_key = ("model", id(draft))
        assert any(key[0] == "drafter" and key[-1] == draft_key for key in adaptive._SHARED[target])

        # the draft goes, and a new one (other weights) is made at its id
        draft_id, draft_ref, config = id(draft), weakref.ref(draft), draft.config
        del draft
        assert draft_ref() is None, "the library still holds a deleted draft model"
        assert not any(key[0] == "drafter" and key[-1] == draft_key for key in adaptive._SHARED[target])
        draft = _remake_at(draft_id, transformers.LlamaForCausalLM, config)
        assert draft is not None
        draft.load_state_dict(noisy_copy(target, seed=10 + trial, noise=0.1 + 0.3 * trial).state_dict())
        twin = noisy_copy(draft, noise=0.0)
        assert generate(prompts, target, draft, max_new_tokens=16, eos_token_id=False).token_ids == reference
        assert generate(prompts, target, draft, max_new_tokens=16, k=2, temperature=1.0, seed=3,
                        eos_token_id=False).token_ids == \
            generate(prompts, target, twin, max_new_tokens=16, k=2, temperature=1.0, seed=3,
                     eos_token_id=False).token_ids

        # the target goes, and a new one (other weights) is made at its id
        target_id, target_ref, config = id(target), weakref.ref(target), target.config
        del target, twin
        gc.collect()
        assert target_ref() is None, "the library still holds a deleted target model"
        target = _remake_at(target_id, transformers.LlamaForCausalLM, config)
        assert target is not None
        target.load_state_dict(tiny_model("llama", hidden=64, logit_scale=4.0, seed=20 + trial).state_dict())
        reference = [hf_greedy(target, p, 16) for p in prompts]
        assert plain_generate(prompts, target, max_new_tokens=16, eos_token_id=False).token_ids == reference
        assert generate(prompts, target, draft, max_new_tokens=16, eos_token_id=False).token_ids == reference


# ------------------------------------------------------------------------------------- the bundled pair's first load
def test_concurrent_first_calls_load_the_bundled_pair_once(tmp_path):
    """README: "Without target= the bundled pair is used, loaded once per process". Four threads making their
    first generate(prompts) at once (a server's workers at start-up) must load it once and agree.

    Each of them loaded its own copy (lru_cache does not hold back concurrent callers of a missing key); now a
    lock does (models.py ``_bundled_pair``). (A fresh process: load_default_pair is wrapped to count the loads,
    and to take 0.3 s more, as from a slow disk.)"""
    script = textwrap.dedent("""
        import threading, time
        import torch
        import specdec_ext.default_pair as default_pair
        from specdec_ext import generate

        loads = []
        real = default_pair.load_default_pair

        def counted(*args, **kwargs):
            loads.append(1)
            time.sleep(0.3)
            return real(*args, **kwargs)

        default_pair.load_default_pair = counted
        barrier, out = threading.Barrier(4), {}

        def call(i):
            barrier.wait()
            out[i] = generate(["def fib(n):"], max_new_tokens=6, k=2).token_ids

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({str(v) for v in out.values()}) == 1, out
        print("LOADS", len(loads))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loads = int(done.stdout.split("LOADS")[-1])
    assert loads == 1, f"the bundled pair was loaded {loads} times by 4 concurrent first calls"
