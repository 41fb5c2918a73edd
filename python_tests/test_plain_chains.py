"""Greedy plain decoding on the CPU kernels runs as greedy chains (decode.plain_chains: PLAIN_CHAIN_TOKENS
one-token passes per greedy_chain call, the stops checked between calls): the same tokens, finish
reasons, text and step counts as the step loop, whatever the stops (length, EOS mid-chain, stop strings),
the batch (rows finishing at different passes) and streaming; invalid target logits raise as
chain_verify raises; sampling, a hooked head or the torch forward keep the step loop."""
from __future__ import annotations

import pytest
import torch

from specdec_ext import decode, plain_generate
from specdec_ext.runners import LeanLlamaRunner
from test_lean_llama import VOCAB, tiny

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 9, 2, 44, 7], [1, 2, 3], [17, 4, 60, 60, 8, 30, 2]]
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def _model(seed=1):
    return tiny("llama", seed=seed, **SHAPE).to(torch.bfloat16)


def _count_chains(monkeypatch):
    """Counts the target's checked greedy_chain calls (the plain chains')."""
    calls = []
    chain = LeanLlamaRunner.greedy_chain

    def counted(self, tokens, steps, vocab_limit=None, check_logits=False):
        calls.append((steps, check_logits))
        return chain(self, tokens, steps, vocab_limit, check_logits)

    monkeypatch.setattr(LeanLlamaRunner, "greedy_chain", counted)
    return calls


def _both(monkeypatch, model, prompts, **kw):
    """(the chained result, the step loop's result) of plain_generate(prompts, model, **kw)."""
    calls = _count_chains(monkeypatch)
    chained = plain_generate(prompts, model, **kw)
    assert bool(calls) == (kw["max_new_tokens"] > 1)  # (one token: the prefill's, no pass after it)
    assert all(check for _, check in calls)
    assert max((steps for steps, _ in calls), default=0) <= decode.PLAIN_CHAIN_TOKENS + 1
    with monkeypatch.context() as m:
        m.setattr(decode, "chains_plain", lambda *args: False)
        stepped = plain_generate(prompts, model, **kw)
    return chained, stepped


def _same(chained, stepped):
    assert chained.token_ids == stepped.token_ids
    assert chained.finish_reasons == stepped.finish_reasons
    assert chained.stats.steps == stepped.stats.steps
    assert chained.stats.new_tokens == stepped.stats.new_tokens
    assert chained.stats.row_steps == stepped.stats.row_steps


@pytest.mark.parametrize("max_new_tokens", [1, 2, 8, 9, 17, 30])
def test_chains_give_the_step_loops_tokens_and_counts(max_new_tokens, monkeypatch):
    chained, stepped = _both(monkeypatch, _model(), PROMPTS, max_new_tokens=max_new_tokens, eos_token_id=False)
    _same(chained, stepped)
    assert all(len(t) == max_new_tokens for t in chained.token_ids)
    assert chained.stats.steps == max_new_tokens - 1  # one pass per token after the prefill's


def test_rows_stopping_mid_chain_at_eos(monkeypatch):
    model = _model()
    free = plain_generate(PROMPTS, model, max_new_tokens=24, eos_token_id=False)
    # an EOS that row 0 meets at its 4th token (inside the first chain) and the others later or never
    eos = free.token_ids[0][3]
    chained, stepped = _both(monkeypatch, model, PROMPTS, max_new_tokens=24, eos_token_id=eos)
    _same(chained, stepped)
    assert chained.finish_reasons[0] == "eos" and chained.token_ids[0][-1] == eos
    assert len(chained.token_ids[0]) == free.token_ids[0].index(eos) + 1


def test_stop_strings_and_streaming(monkeypatch):
    default_pair = pytest.importorskip("specdec_ext.default_pair")
    target, _, tokenizer = default_pair.load_default_pair(dtype=torch.bfloat16)
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self"]
    free = plain_generate(prompts, target, tokenizer=tokenizer, max_new_tokens=40, eos_token_id=False)
    stop = free.text[1][5:9]  # text that row 1 produces a few tokens in
    chained, stepped = _both(monkeypatch, target, prompts, tokenizer=tokenizer, max_new_tokens=40, stop=stop)
    _same(chained, stepped)
    assert chained.text == stepped.text and chained.finish_reasons[1] == "stop"
    stream = plain_generate(prompts, target, tokenizer=tokenizer, max_new_tokens=40, stop=stop, stream=True)
    pieces = [""] * len(prompts)
    for piece in stream:
        pieces[piece.index] += piece
    assert pieces == chained.text and stream.result.token_ids == chained.token_ids


def test_invalid_target_logits_raise_as_the_verifier_does(monkeypatch):
    model = _model()
    first = plain_generate([PROMPTS[1]], model, max_new_tokens=1).token_ids[0][0]
    with torch.no_grad():
        model.model.embed_tokens.weight[first] = float("nan")  # the first generated token's pass: NaN logits
    _count_chains(monkeypatch)
    with pytest.raises(ValueError, match="target_logits: row 0 has a NaN or \\+inf logit"):
        plain_generate([PROMPTS[1]], model, max_new_tokens=5)
    with monkeypatch.context() as m:
        m.setattr(decode, "chains_plain", lambda *args: False)
        with pytest.raises(ValueError, match="target_logits: row 0 has a NaN or \\+inf logit"):
            plain_generate([PROMPTS[1]], model, max_new_tokens=5)


def test_sampling_a_hooked_head_and_the_torch_forward_keep_the_step_loop(monkeypatch):
    model = _model()
    calls = _count_chains(monkeypatch)
    a = plain_generate(PROMPTS, model, max_new_tokens=6, temperature=0.8, seed=3)
    b = plain_generate(PROMPTS, model, max_new_tokens=6, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids and not calls
    handle = model.lm_head.register_forward_hook(lambda module, args, out: None)
    try:
        hooked = plain_generate(PROMPTS, model, max_new_tokens=6, eos_token_id=False)
    finally:
        handle.remove()
    assert not calls
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    plain_generate(PROMPTS, model, max_new_tokens=6, eos_token_id=False)
    assert not calls
    monkeypatch.delenv("SPECDEC_CPU_KERNELS")
    chained = plain_generate(PROMPTS, model, max_new_tokens=6, eos_token_id=False)
    assert calls and chained.token_ids == hooked.token_ids


def test_the_op_checks_logits_only_when_asked():
    model = _model()
    with torch.no_grad():
        model.lm_head.weight[VOCAB - 1] = float("nan")
    runner = LeanLlamaRunner(model, max_batch_size=1, max_seq_len=32)
    runner.start([PROMPTS[0]])
    tokens = torch.zeros((1, 4), dtype=torch.int64)
    tokens[0, 0] = 3
    runner.greedy_chain(tokens, 3)  # unchecked: torch.argmax's answer, the NaN's index
    assert tokens[0, 1:3].tolist() == [VOCAB - 1, VOCAB - 1]
    lengths = runner.lengths.tolist()
    with pytest.raises(ValueError, match="greedy_chain: target_logits: row 0 has a NaN"):
        runner.greedy_chain(tokens, 3, check_logits=True)
    assert runner.lengths.tolist() == lengths
