"""ops.greedy_chain and LeanLlamaRunner.greedy_chain: a greedy draft chain in one op call equals, bit for
bit, the one-token forward + argmax + commit steps it replaces (the tokens, both caches, the lengths) on
every instruction-set path, for bf16 / fp32 / fp16 weights, biases, rows at different lengths; the
vocabulary limit; a NaN logit chosen as torch.argmax chooses it; a feed (the committed tokens the draft
has not seen, ragged per row) equals forward + commit + argmax before the chain; errors raised before
anything is written; opcheck; the capabilities said before a runner exists; the model drafter takes the
chain, feed included (no draft forward of its own while decoding), and proposes what its step loop proposes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec_ext import generate, ops, plain_generate
from specdec_ext.runners import LeanLlamaRunner
from specdec_ext.runners.capabilities import RunnerCapabilities
from specdec_ext.runners.lean import lean_capabilities
from lean_forward_cases import ISAS
from test_lean_llama import VOCAB, tiny

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPE = dict(hidden_size=120, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2)
PROMPT_LENS = (5, 11, 1)


def _runners(model, max_seq_len=40, seed=0):
    """Two runners over the same prompts (rows at different lengths)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    pair = []
    for _ in range(2):
        runner = LeanLlamaRunner(model, max_batch_size=len(prompts), max_seq_len=max_seq_len)
        runner.start(prompts)
        pair.append(runner)
    return pair


def _step_by_step(runner, first, steps, limit):
    """What the drafter's step loop does: forward one token, argmax, commit; tokens [B, steps]."""
    tokens = [first]
    ones = torch.ones_like(first)
    for _ in range(1, steps):
        logits = runner.forward(tokens[-1][:, None])[:, 0]  # [B, V]
        runner.commit(ones)
        tokens.append(logits[:, :limit].argmax(-1))
    return torch.stack(tokens, 1)


def _first_tokens():
    return torch.tensor([3, 17, 60], dtype=torch.int64)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.bfloat16), ("llama_bias", torch.bfloat16),
                                        ("qwen2", torch.float32), ("mistral", torch.float16)])
def test_chain_equals_the_step_loop_bit_for_bit(arch, dtype, monkeypatch):
    model = tiny(arch, **SHAPE).to(dtype)
    for isa in ISAS:
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        chained, stepped = _runners(model)
        assert chained.chains_greedy
        steps, n = 6, 8
        tokens = torch.zeros((3, n), dtype=torch.int64)
        tokens[:, 0] = _first_tokens()
        chained.greedy_chain(tokens, steps)
        expected = _step_by_step(stepped, _first_tokens(), steps, VOCAB)
        assert torch.equal(tokens[:, :steps], expected), isa
        assert torch.all(tokens[:, steps:] == 0)  # past steps: untouched
        assert chained.lengths.tolist() == stepped.lengths.tolist() == [n_ + steps - 1 for n_ in PROMPT_LENS]
        assert torch.equal(chained.k_cache, stepped.k_cache) and torch.equal(chained.v_cache, stepped.v_cache), isa
        # and the pass after the chain sees the same cache
        last = tokens[:, steps - 1:steps]
        assert torch.equal(chained.forward(last), stepped.forward(last)), isa


FEED = torch.tensor([[8, 30, 30], [2, 41, 5], [19, 7, 7]], dtype=torch.int64)  # [B, W]; padding repeats
FEED_COUNTS = torch.tensor([1, 3, 2], dtype=torch.int64)  # [B]: each row's real columns


def _feed_then_step_by_step(runner, feed, counts, steps, limit):
    """What the drafter did before the feed joined the chain: forward the block, commit, argmax at each
    row's last fed token, then the step loop; tokens [B, steps]."""
    logits = runner.forward(feed, counts)  # [B, W, V]
    runner.commit(counts)
    first = logits[torch.arange(feed.shape[0]), counts - 1][:, :limit].argmax(-1)  # [B]
    return _step_by_step(runner, first, steps, limit)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.bfloat16), ("qwen2", torch.float32),
                                        ("mistral", torch.float16)])
@pytest.mark.parametrize("steps", [1, 5])
def test_a_feed_equals_forward_commit_and_argmax_before_the_chain(arch, dtype, steps, monkeypatch):
    model = tiny(arch, **SHAPE).to(dtype)
    limit = VOCAB - 7
    for isa in ISAS:
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        chained, stepped = _runners(model)
        tokens = torch.full((3, 6), -1, dtype=torch.int64)
        chained.greedy_chain(tokens, steps, vocab_limit=limit, feed=FEED, feed_counts=FEED_COUNTS)
        expected = _feed_then_step_by_step(stepped, FEED, FEED_COUNTS, steps, limit)
        assert torch.equal(tokens[:, :steps], expected), isa
        assert torch.all(tokens[:, steps:] == -1)
        fed = [n + c + steps - 1 for n, c in zip(PROMPT_LENS, FEED_COUNTS.tolist())]
        assert chained.lengths.tolist() == stepped.lengths.tolist() == fed
        assert torch.equal(chained.k_cache, stepped.k_cache) and torch.equal(chained.v_cache, stepped.v_cache), isa
        last = tokens[:, steps - 1:steps]
        assert torch.equal(chained.forward(last), stepped.forward(last)), isa


def test_a_feed_without_counts_feeds_every_column():
    model = tiny("llama", **SHAPE).to(torch.bfloat16)
    chained, stepped = _runners(model)
    tokens = torch.zeros((3, 4), dtype=torch.int64)
    chained.greedy_chain(tokens, 4, feed=FEED)
    full = torch.full((3,), FEED.shape[1], dtype=torch.int64)
    assert torch.equal(tokens, _feed_then_step_by_step(stepped, FEED, full, 4, VOCAB))
    assert chained.lengths.tolist() == [n + 3 + 3 for n in PROMPT_LENS]


def test_one_step_feeds_nothing():
    chained, _ = _runners(tiny("llama", **SHAPE).to(torch.bfloat16))
    before = chained.k_cache.clone()
    tokens = _first_tokens()[:, None].clone()
    chained.greedy_chain(tokens, 1)
    assert tokens[:, 0].tolist() == _first_tokens().tolist()
    assert chained.lengths.tolist() == list(PROMPT_LENS)
    assert torch.equal(chained.k_cache, before)


def test_vocab_limit_and_a_nan_logit():
    model = tiny("llama", **SHAPE).to(torch.bfloat16)
    limit = VOCAB // 3
    chained, stepped = _runners(model)
    tokens = torch.zeros((3, 5), dtype=torch.int64)
    tokens[:, 0] = _first_tokens()
    chained.greedy_chain(tokens, 5, vocab_limit=limit)
    assert torch.equal(tokens, _step_by_step(stepped, _first_tokens(), 5, limit))
    assert int(tokens[:, 1:].max()) < limit
    with torch.no_grad():
        model.lm_head.weight[limit + 2] = float("nan")  # every logit of that token NaN: torch.argmax picks it
    chained, stepped = _runners(model)
    tokens[:, 1:] = 0
    chained.greedy_chain(tokens, 4)
    assert tokens[:, 1:4].eq(limit + 2).all()
    assert torch.equal(tokens[:, :4], _step_by_step(stepped, _first_tokens(), 4, VOCAB))


def test_errors_leave_the_runner_as_it_was(monkeypatch):
    model = tiny("llama", **SHAPE).to(torch.bfloat16)
    runner, _ = _runners(model, max_seq_len=20)
    k_before, lengths = runner.k_cache.clone(), runner.lengths.tolist()
    tokens = torch.zeros((3, 6), dtype=torch.int64)
    tokens[:, 0] = _first_tokens()
    cases = [
        (dict(tokens=tokens[:2]), ValueError, "tokens must be \\[B, n\\] with B = 3"),
        (dict(steps=7), RuntimeError, "steps must be in \\[1, n\\] = \\[1, 6\\], got 7"),
        (dict(tokens=torch.zeros((3, 12), dtype=torch.int64), steps=11), ValueError,
         "row 1 would hold 21 tokens, more than max_seq_len=20"),
        (dict(vocab_limit=0), RuntimeError, "vocab_limit must be in \\[1, V_out\\]"),
        (dict(tokens=tokens.int()), RuntimeError, "tokens"),
    ]
    for change, error, message in cases:
        args = dict(tokens=tokens, steps=3, vocab_limit=None)
        args.update(change)
        with pytest.raises(error, match=message):
            runner.greedy_chain(args["tokens"], args["steps"], vocab_limit=args["vocab_limit"])
    bad = tokens.clone()
    bad[2, 0] = VOCAB + 5
    with pytest.raises(RuntimeError, match=f"tokens\\[2, 0\\] = {VOCAB + 5} is outside the embedding's"):
        runner.greedy_chain(bad, 3)
    state = _op_state(runner)
    near_the_end = torch.tensor([runner.capacity - 2, 0, 0])  # three slots from there: past the cache
    with pytest.raises(RuntimeError, match="start\\[0\\] = .* must be in \\[0, capacity - \\(steps - 1\\)\\]"):
        ops.greedy_chain(tokens.clone(), 4, *state, [torch.arange(3), near_the_end])
    long_tokens = torch.zeros((3, 8), dtype=torch.int64)
    feed_cases = [
        (dict(feed=FEED[:2]), ValueError, "feed must be \\[B, W\\] with B = 3 and W >= 1, got \\[2, 3\\]"),
        (dict(feed=FEED[:, :0]), ValueError, "W >= 1"),
        (dict(feed_counts=torch.tensor([1, 0, 2])), ValueError,
         "feed_counts\\[1\\] = 0 is outside \\[1, W\\] = \\[1, 3\\]"),
        (dict(feed_counts=torch.tensor([1, 4, 2])), ValueError, "feed_counts\\[1\\] = 4 is outside"),
        (dict(feed_counts=torch.tensor([1, 2])), ValueError, "feed_counts has 2 rows, the runner holds 3"),
        (dict(tokens=long_tokens, steps=8), ValueError, "row 1 would hold 21 tokens, more than max_seq_len=20"),
        (dict(feed=torch.where(FEED == 41, VOCAB + 1, FEED)), RuntimeError,
         f"feed\\[1, 1\\] = {VOCAB + 1} is outside the embedding's"),
    ]
    for change, error, message in feed_cases:
        args = dict(tokens=tokens, steps=3, feed=FEED, feed_counts=FEED_COUNTS)
        args.update(change)
        with pytest.raises(error, match=message):
            runner.greedy_chain(args["tokens"], args["steps"], feed=args["feed"], feed_counts=args["feed_counts"])
    start = torch.tensor(lengths)
    with pytest.raises(RuntimeError, match="feed and feed_counts come together"):
        ops.greedy_chain(tokens.clone(), 3, *state, [torch.arange(3), start, FEED])
    with pytest.raises(RuntimeError, match="greedy_chain: feed .*Long"):
        ops.greedy_chain(tokens.clone(), 3, *state, [torch.arange(3), start, FEED.int(), FEED_COUNTS])
    near_the_end = torch.tensor([0, runner.capacity - 2, 0])  # a feed of 3 columns from there: past the cache
    with pytest.raises(RuntimeError, match="start\\[1\\] = .* must be in \\[0, capacity - W\\]"):
        ops.greedy_chain(tokens.clone(), 1, *state, [torch.arange(3), near_the_end, FEED, FEED_COUNTS])
    near_the_end = torch.tensor([0, runner.capacity - 4, 0])  # the feed fits, the chain after its 3 does not
    with pytest.raises(RuntimeError, match="start\\[1\\] = .* \\(with its feed_counts\\) must be in"):
        ops.greedy_chain(tokens.clone(), 3, *state, [torch.arange(3), near_the_end, FEED, FEED_COUNTS])
    assert torch.equal(runner.k_cache, k_before) and runner.lengths.tolist() == lengths
    # not offered where it would not be the runner's own forward
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    torch_path, _ = _runners(model)
    assert not torch_path.chains_greedy
    with pytest.raises(ValueError, match="greedy_chain: needs the CPU kernels"):
        torch_path.greedy_chain(tokens, 3)
    monkeypatch.delenv("SPECDEC_CPU_KERNELS")
    hooked, _ = _runners(model)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: None)
    try:
        assert not hooked.chains_greedy
    finally:
        handle.remove()
    assert hooked.chains_greedy


def test_capabilities_say_whether_it_chains_before_the_runner_exists(monkeypatch):
    model = tiny("llama", **SHAPE).to(torch.bfloat16)
    runner, _ = _runners(model)
    chains, no_chains = (RunnerCapabilities(greedy_chain=on, chunked_prefill=True) for on in (True, False))
    assert lean_capabilities(model) == runner.capabilities == chains
    assert lean_capabilities(model, torch.float32).greedy_chain  # fp32 over bf16 weights: the kernels too
    assert not lean_capabilities(model, torch.float16).greedy_chain  # the torch path
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: None)
    try:
        assert lean_capabilities(model) == runner.capabilities == no_chains
    finally:
        handle.remove()
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    torch_path, _ = _runners(model)
    assert lean_capabilities(model) == torch_path.capabilities == no_chains


def _op_state(runner, weights=None):
    """ops.greedy_chain's weights, bf16_activations, rope and cache for the runner's model and cache."""
    return (weights or runner.weights, runner.bf16_activations, ops.rope_tables(runner.weights, runner.capacity),
            [runner.k_cache, runner.v_cache])


def test_greedy_chain_opcheck():
    runner, _ = _runners(tiny("llama_bias", **SHAPE).to(torch.bfloat16))
    # a head bias too (Llama's head has none)
    weights = dataclasses.replace(runner.weights, head=ops.Linear(runner.weights.head.weight, torch.randn(VOCAB)))
    tensors, scalars = weights.flat()
    tokens = torch.zeros((3, 4), dtype=torch.int64)
    tokens[:, 0] = _first_tokens()
    _, bf16, rope, cache = _op_state(runner)
    rows = [torch.arange(3), runner.lengths]
    args = (tokens, 4, tensors, scalars, bf16, rope, cache, rows, VOCAB)
    torch.library.opcheck(torch.ops.specdec_ext.greedy_chain.default, args)
    torch.library.opcheck(torch.ops.specdec_ext.greedy_chain.default, args + (True,))  # check_logits
    tokens[:, 0] = 0
    fed = (tokens, 4, tensors, scalars, bf16, rope, cache, rows + [FEED, FEED_COUNTS], VOCAB, False)
    torch.library.opcheck(torch.ops.specdec_ext.greedy_chain.default, fed)


def test_the_model_drafter_chains_and_proposes_what_its_loop_proposes(monkeypatch):
    target = tiny("llama", seed=1, **SHAPE).to(torch.bfloat16)
    draft = tiny("llama", seed=2, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                 num_key_value_heads=1).to(torch.bfloat16)
    prompts = [[5, 9, 2, 44, 7], [1, 2, 3]]
    calls = []
    chain = LeanLlamaRunner.greedy_chain
    monkeypatch.setattr(LeanLlamaRunner, "greedy_chain",
                        lambda self, *a, **kw: calls.append(a[1]) or chain(self, *a, **kw))
    plain = plain_generate(prompts, target, max_new_tokens=24, eos_token_id=False)
    calls.clear()  # (greedy plain decoding chains the target: test_plain_chains.py)
    draft_forwards = []
    forward = LeanLlamaRunner.forward
    monkeypatch.setattr(LeanLlamaRunner, "forward",
                        lambda self, *a, **kw: draft_forwards.append(self.model is draft) or forward(self, *a, **kw))
    chained = generate(prompts, target, draft, k=4, max_new_tokens=24, eos_token_id=False)
    assert calls and set(calls) == {4}
    assert draft_forwards and not any(draft_forwards)  # the target's passes only: the feed is in the chain
    # the draft's runner declares no greedy chains (the target's stay as the plan resolved them)
    declared = LeanLlamaRunner.capabilities
    monkeypatch.setattr(LeanLlamaRunner, "capabilities", property(
        lambda self: RunnerCapabilities() if self.model is draft else declared.fget(self)))
    calls.clear(), draft_forwards.clear()
    looped = generate(prompts, target, draft, k=4, max_new_tokens=24, eos_token_id=False)
    assert not calls and any(draft_forwards)  # the draft's step loop
    assert chained.token_ids == looped.token_ids == plain.token_ids
    for field in ("steps", "reached", "accepted"):
        assert getattr(chained.stats, field) == getattr(looped.stats, field), field


def test_the_op_refuses_to_pick_ids_past_the_embedding():
    """The chain feeds back the ids it picks: given a head wider than the embedding (the lean runner refuses such a
    model; the op is public) and no vocab_limit below the embedding's rows, ops.greedy_chain refuses up front. It
    read past the embedding's rows (csrc/cpu/lean_forward.cpp embed_rows) and drafted from that memory."""
    import dataclasses

    runner = _runners(tiny("llama", **SHAPE))[0]
    weights = runner.weights
    wider = torch.cat([weights.head.weight, weights.head.weight[:8]])  # [V + 8, d]
    runner.weights = dataclasses.replace(weights, head=dataclasses.replace(weights.head, weight=wider))
    tokens = torch.zeros((3, 4), dtype=torch.int64)
    tokens[:, 0] = _first_tokens()
    with pytest.raises(RuntimeError, match="embed holds V_in = .* rows \\(a head wider than the embedding\\)"):
        runner.greedy_chain(tokens, 4, vocab_limit=VOCAB + 8)
    runner.weights = weights
    runner.greedy_chain(tokens, 4, vocab_limit=VOCAB)  # (the same runner, its own head: runs)
