"""What the models allow and what a call may depend on: a model cast to another dtype as from_pretrained
loads it (models.cast_model: the CLI's --dtype gives the library's bf16 pair bit for bit), a seeded tree
sample reproduced within one process (plan.tree_calibration), the cache a call asks for
(plan.loop_cache_len: exactly what plain decoding and the drafting steps write, checked at the boundary)
and the warning of an explicit max_seq_len past max_position_embeddings."""
from __future__ import annotations

import warnings

import pytest
import torch

import specdec_ext
from specdec_ext import cli
from specdec_ext.models import cast_model, load_models
from specdec_ext.plan import PRIOR_CALIBRATION, SHARED_CALIBRATION, loop_cache_len
from test_generate_utils import noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

ROTARY = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")


# ------------------------------------------------------------------------------------------ dtype
@pytest.fixture(scope="module")
def bundled_bf16():
    from specdec_ext.default_pair import load_default_pair
    return load_default_pair(dtype=torch.bfloat16)


def test_the_clis_bf16_models_are_the_librarys_bf16_pair_bit_for_bit(bundled_bf16):
    """specdec demo / serve --dtype bfloat16 cast the bundled fp32 pair (cli._in_dtype); the rotary
    frequencies (buffers) must stay fp32 as from_pretrained(dtype=bf16) keeps them, or every logit moves
    (a .to(dtype=bf16) gave -0.64398 for the first token's logprob where the library gives -0.64237)."""
    target16, draft16, tokenizer = bundled_bf16
    loaded = load_models()  # the bundled pair as the CLI loads it: fp32, cached for the process
    models = cli._in_dtype(loaded, "bfloat16")
    for cast, reference in ((models.target, target16), (models.draft, draft16)):
        buffers = dict(cast.named_buffers())
        assert all(buffers[name].dtype == torch.float32 for name in ROTARY)
        for (name, a), (_, b) in zip(cast.named_parameters(), reference.named_parameters()):
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
        for name, buffer in reference.named_buffers():
            assert torch.equal(buffers[name], buffer), name
    assert next(loaded.target.parameters()).dtype == torch.float32  # the cached pair is left as loaded
    assert loaded.target.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.tensor([tokenizer.encode("def fib(n):\n    return")])
    with torch.no_grad():
        assert torch.equal(models.target(ids).logits, target16(ids).logits)
    kw = dict(max_new_tokens=12, eos_token_id=False, logprobs=1, tokenizer=tokenizer)
    ours = specdec_ext.plain_generate("def fib(n):", target=models.target, **kw)
    library = specdec_ext.plain_generate("def fib(n):", target=target16, **kw)
    assert ours.token_ids == library.token_ids
    assert [t.logprob for t in ours.logprobs[0]] == [t.logprob for t in library.logprobs[0]]


def test_cast_model_keeps_buffers_tied_weights_and_fp32_modules():
    model = tiny_model("llama", max_positions=64)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many checkpoints are
    copy = cast_model(model, torch.bfloat16, copy=True)
    assert copy is not model and next(model.parameters()).dtype == torch.float32  # the original untouched
    assert copy.lm_head.weight is copy.model.embed_tokens.weight and copy.lm_head.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for b in copy.buffers())
    assert cast_model(copy, torch.bfloat16, copy=True) is copy  # nothing to change: the module itself
    model._keep_in_fp32_modules_strict = ["norm"]  # HF's flag: these stay fp32 in bf16 and fp16
    cast_model(model, torch.float16)  # in place, as nn.Module.to
    assert model.model.norm.weight.dtype == torch.float32
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.float16  # ("norm" is a whole name)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16


# ------------------------------------------------------------------------------------------ seeded trees
@pytest.mark.parametrize("draft", ["model", "heads"])
def test_a_seeded_tree_sample_is_reproduced_within_one_process_and_in_any_batch(draft):
    """The node calibration shared across calls learns from each of them, and one learnt within a call from
    every row's outcomes; a seeded sample at T > 0 ranks by the prior alone, so neither calls before it
    (greedy ones, which keep learning the shared table, included) nor the rows beside it change a row's
    tokens."""
    models = load_models()
    drafter = models.draft if draft == "model" else "heads"
    prompts = ["def fib(n):", "import os\n", "class Foo:\n    def __init__(self):\n        self.x = [1, 2, 3]\n", "x"]
    tree = (2, 3, 6) if draft == "model" else (3, 3, 8)
    kw = dict(tokenizer=models.tokenizer, draft_tree=tree, max_new_tokens=16, eos_token_id=False)

    def seeded():
        out = specdec_ext.generate(prompts, models.target, drafter, temperature=0.8, seed=7, **kw)
        assert out.plan.tree_calibration == PRIOR_CALIBRATION and "tree calibration" in out.plan.explain()
        return out.token_ids

    first = seeded()
    greedy = specdec_ext.generate(prompts, models.target, drafter, **kw)  # learns the shared table
    assert greedy.plan.tree_calibration == SHARED_CALIBRATION
    assert seeded() == first and seeded() == first
    alone = [specdec_ext.generate([p], models.target, drafter, temperature=0.8, seed=7, **kw).token_ids[0]
             for p in prompts]
    assert alone == first  # each row's tokens follow its prompt and seed only
    plain = specdec_ext.plain_generate(prompts, models.target, tokenizer=models.tokenizer, max_new_tokens=16,
                                       eos_token_id=False)
    assert greedy.token_ids == plain.token_ids  # the shared table changes the shape only, never the output


# ------------------------------------------------------------------------------------------ cache length
POSITIONS = 64


@pytest.fixture(scope="module")
def short_pair():
    target = tiny_model("llama", vocab=96, hidden=32, layers=1, logit_scale=3.0, max_positions=POSITIONS)
    return target, noisy_copy(target, noise=0.2)


def prompt(length):
    return [(7 * i + 3) % 96 for i in range(length)]


def test_loop_cache_len_is_what_the_loop_writes():
    assert loop_cache_len(2047, 1, 0) == 2047 and loop_cache_len(2040, 8, 0) == 2047  # the tester's cases
    assert loop_cache_len(5, 0, 0) == 5
    assert loop_cache_len(5, 16, 4) == 5 + 16 + 8


@pytest.mark.parametrize("runner", ["auto", "paged", "recompute"])
@pytest.mark.parametrize("new, sampled", [(1, False), (8, False), (8, True)])
def test_plain_decoding_fits_prompt_plus_new_tokens_minus_one(short_pair, runner, new, sampled):
    """Plain decoding writes prompt + max_new_tokens - 1 positions: the largest prompt that fits the
    model's max_position_embeddings runs, one token more is refused before any work."""
    target, _ = short_pair
    kw = dict(max_new_tokens=new, eos_token_id=False, runner=runner)
    if sampled:
        kw.update(temperature=0.9, seed=3)
    largest = POSITIONS - new + 1
    out = specdec_ext.plain_generate([prompt(largest)], target, **kw)
    assert len(out.token_ids[0]) == new and out.plan.max_seq_len == POSITIONS
    assert "the last is never fed" in dict(out.plan.reasons)["cache"]
    with pytest.raises(ValueError, match=rf"prompt 0 has {largest + 1} tokens; with max_new_tokens={new} and 0 "
                                         rf"draft slots it needs {POSITIONS + 1} cache positions but the cache "
                                         rf"holds {POSITIONS}"):
        specdec_ext.plain_generate([prompt(largest + 1)], target, **kw)
    with pytest.raises(ValueError, match=f"the cache holds {POSITIONS - 1}"):  # an explicit max_seq_len, the same
        specdec_ext.plain_generate([prompt(largest)], target, max_seq_len=POSITIONS - 1, **kw)


@pytest.mark.parametrize("k, runner", [(2, "auto"), (3, "paged")])
def test_speculative_decoding_fits_two_steps_of_drafts(short_pair, k, runner):
    """With drafts a row also writes up to k tentative tokens past its own (a finished row still takes
    part in each step): prompt + max_new_tokens + 2k. At the boundary the batch runs (rows finishing at
    different steps) with plain greedy's tokens; one token more is refused."""
    target, draft = short_pair
    new = 8
    largest = POSITIONS - new - 2 * k
    prompts = [prompt(largest), prompt(largest)[::-1], [5, 9] * (largest // 2)]
    kw = dict(max_new_tokens=new, eos_token_id=False, runner=runner)
    out = specdec_ext.generate(prompts, target, draft, k=k, **kw)
    assert out.plan.max_seq_len == POSITIONS
    assert out.token_ids == specdec_ext.plain_generate(prompts, target, **kw).token_ids
    with pytest.raises(ValueError, match=rf"with max_new_tokens={new} and {k} draft slots it needs "
                                         rf"{POSITIONS + 1} cache positions but the cache holds {POSITIONS}"):
        specdec_ext.generate([prompt(largest + 1)], target, draft, k=k, **kw)


def test_a_draft_with_fewer_positions_bounds_the_cache_unless_it_keeps_a_window(short_pair):
    """A draft model of 32 positions under a target of 64: its positions bound the cache, and the message names
    the draft's; with a declared context window (specdec_draft_window) it keeps its cache within the window, so
    only the target's positions count (a 40-token prompt was refused for the draft's 32)."""
    target, _ = short_pair
    draft = tiny_model("llama", vocab=96, hidden=32, layers=1, logit_scale=3.0, max_positions=32)
    long_prompt = prompt(40)
    with pytest.raises(ValueError, match="needs 45 cache positions but the cache holds 32 \\(the draft model's "
                                         "max_position_embeddings\\)"):
        specdec_ext.generate([long_prompt], target, draft, k=2, max_new_tokens=1, eos_token_id=False)
    draft.config.specdec_draft_window = 16
    out = specdec_ext.generate([long_prompt], target, draft, k=2, max_new_tokens=8, eos_token_id=False)
    assert out.token_ids == specdec_ext.plain_generate([long_prompt], target, max_new_tokens=8,
                                                       eos_token_id=False).token_ids


# ------------------------------------------------------------------------------------------ past the positions
def test_an_explicit_max_seq_len_past_max_position_embeddings_warns_once(short_pair):
    target, draft = short_pair
    with pytest.warns(UserWarning, match=rf"past the target model's max_position_embeddings={POSITIONS}") as record:
        out = specdec_ext.plain_generate([prompt(POSITIONS + 20)], target, max_new_tokens=4, eos_token_id=False,
                                         max_seq_len=4 * POSITIONS)
    assert len(out.token_ids[0]) == 4
    assert [str(w.message).count("max_position_embeddings") for w in record.list] == [1]  # once per call
    assert "max_seq_len=256 lets rows run to 87 positions" in str(record.list[0].message)
    with pytest.warns(UserWarning, match="max_position_embeddings"):  # 59 + 4 + 2 x 3 draft slots > 64
        specdec_ext.generate([prompt(POSITIONS - 5)], target, draft, k=3, max_new_tokens=4, eos_token_id=False,
                             max_seq_len=4 * POSITIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the model's positions: no warning
        specdec_ext.plain_generate([prompt(POSITIONS - 4)], target, max_new_tokens=4, eos_token_id=False,
                                   max_seq_len=4 * POSITIONS)


def test_a_position_table_is_a_hard_limit_even_with_max_seq_len():
    """A model that looks positions up in a table (GPT-2's wpe) cannot run past it: an explicit max_seq_len
    beyond it is refused before any work, naming the table (it raised IndexError mid-stream), where a rotary
    model runs with a warning (above); within the table the call runs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    ids = [[5, 17, 3, 99, 42]]
    with pytest.raises(ValueError, match=r"the cache holds 32 \(the target model's position table transformer.wpe, "
                                         r"of max_position_embeddings=32, which it cannot look past"):
        specdec_ext.generate(ids, gpt2, "ngram", k=4, max_new_tokens=40, max_seq_len=64, eos_token_id=False)
    with pytest.raises(ValueError, match="transformer.wpe"):
        specdec_ext.plain_generate(ids, gpt2, max_new_tokens=40, max_seq_len=64, eos_token_id=False)
    with pytest.raises(ValueError, match="transformer.wpe"):  # 5 + 20 + two steps of 4 drafts > 32
        specdec_ext.generate(ids, gpt2, "ngram", k=4, max_new_tokens=20, max_seq_len=64, eos_token_id=False)
    reference = gpt2.generate(torch.tensor(ids), max_new_tokens=20, do_sample=False)[0, 5:].tolist()
    out = specdec_ext.generate(ids, gpt2, "ngram", max_new_tokens=20, max_seq_len=64, eos_token_id=False)
    assert out.token_ids[0] == reference and "at most 3" in out.plan.explain()  # the default k fits the table
    assert specdec_ext.plain_generate(ids, gpt2, max_new_tokens=20, max_seq_len=64,
                                      eos_token_id=False).token_ids[0] == reference
