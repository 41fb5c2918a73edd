"""generate(): greedy equality with HF generate, EOS / max tokens / stop strings, streaming, stats,
the recompute oracle against the paged runner, and every bad-input path."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import specdec_ext
from specdec_ext import VocabularyMismatchError, generate
from specdec_ext.models import check_vocabularies
from specdec_ext.runners import PagedModelRunner, RecomputeRunner
from specdec_ext.stats import expected_tokens_per_pass, predicted_speedup
from test_generate_utils import ARCHS, CHAR_VOCAB, char_tokenizer, hf_greedy, noisy_copy, tiny_model

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34]]
NEW = 24


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    target = tiny_model(request.param, hidden=48, layers=2, logit_scale=4.0)
    return request.param, target, noisy_copy(target, noise=0.3)


@pytest.fixture(scope="module")
def references(pair):
    _, target, _ = pair
    return [hf_greedy(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("runner", ["auto", "paged"])  # auto: the lean target runner for Llama
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_matches_hf_generate_batch1_and_batch4(pair, references, k, runner):
    _, target, draft = pair
    one = generate([PROMPTS[1]], target, draft, max_new_tokens=NEW, k=k, runner=runner)
    assert one.token_ids == [references[1]]
    batch = generate(PROMPTS, target, draft, max_new_tokens=NEW, k=k, runner=runner)
    assert batch.token_ids == references
    assert all(len(t) == NEW for t in batch.token_ids)  # max_new_tokens is exact
    assert batch.finish_reasons == ["length"] * len(PROMPTS)
    stats = batch.stats
    assert 1.0 <= stats.tokens_per_pass <= k + 1
    assert 0.0 < stats.acceptance_rate < 1.0  # the noisy draft is neither perfect nor useless
    assert stats.new_tokens == NEW * len(PROMPTS)


def test_greedy_with_an_unrelated_draft_and_the_target_as_its_own_draft(pair, references):
    arch, target, _ = pair
    other = tiny_model(arch, hidden=32, layers=1, seed=7)  # a different, smaller model
    assert generate(PROMPTS, target, other, max_new_tokens=NEW, k=3).token_ids == references
    self_draft = generate(PROMPTS, target, target, max_new_tokens=NEW, k=4)
    assert self_draft.token_ids == references
    assert self_draft.stats.acceptance_rate == 1.0
    assert self_draft.stats.acceptance_by_position == [1.0] * 4


def test_eos_inside_an_accepted_run_ends_the_row_there(pair, references):
    _, target, draft = pair
    row = references[1]
    eos = row[7]
    cut = row.index(eos) + 1
    result = generate(PROMPTS, target, draft, max_new_tokens=NEW, k=6, eos_token_id=eos)
    assert result.token_ids[1] == row[:cut]
    assert result.finish_reasons[1] == "eos"
    assert hf_greedy(target, PROMPTS[1], NEW, eos_token_id=eos) == row[:cut]
    for b, ref in enumerate(references):  # every row ends at its own first EOS (or at NEW tokens)
        expected = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert result.token_ids[b] == expected
    # with the target as its own draft the EOS lands inside a fully accepted run of 7 tokens
    assert generate(PROMPTS, target, target, max_new_tokens=NEW, k=6, eos_token_id=eos).token_ids == result.token_ids


@pytest.mark.parametrize("max_new", [0, 1, 2, 5])
def test_max_new_tokens_is_exact(pair, references, max_new):
    _, target, draft = pair
    result = generate(PROMPTS, target, target, max_new_tokens=max_new, k=4)
    assert result.token_ids == [r[:max_new] for r in references]


def test_auto_runner_picks_the_lean_target_for_llama(pair):
    from specdec_ext.build import build
    from specdec_ext.models import Models
    from specdec_ext.plan import make_plan
    from specdec_ext.runners import LeanLlamaRunner
    arch, target, draft = pair
    plan = make_plan(target, draft, drafter="model", prompt_lengths=[4, 2], max_new_tokens=8, k=2)
    assert plan.target_runner == ("lean" if arch == "llama" else "paged")
    runner, _ = build(plan, Models(target, "model", draft=draft))
    assert isinstance(runner, LeanLlamaRunner if arch == "llama" else PagedModelRunner)
    assert runner.dtype == next(target.parameters()).dtype  # the target computes in its own dtype
    paged = make_plan(target, draft, drafter="model", prompt_lengths=[4, 2], max_new_tokens=8, k=2, runner="paged")
    assert paged.target_runner == paged.draft_runner == "paged"
    assert isinstance(build(paged, Models(target, "model", draft=draft))[0], PagedModelRunner)


def test_paged_runner_and_recompute_oracle_agree(pair):
    _, target, draft = pair
    kw = dict(max_new_tokens=16, k=3, temperature=1.0, top_k=20, seed=11)
    paged = generate(PROMPTS, target, draft, runner="paged", **kw)
    oracle = generate(PROMPTS, target, draft, runner="recompute", **kw)
    assert paged.token_ids == oracle.token_ids


def test_recompute_runner_logits_match_the_paged_runner(pair):
    _, target, _ = pair
    runners = [cls(target, max_batch_size=3, max_seq_len=40) for cls in (RecomputeRunner, PagedModelRunner)]
    prompts = [[1, 2, 3, 4], [5], [6, 7, 8, 9, 10, 11]]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        outs = [r.start(prompts) for r in runners]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
        for step in range(4):
            ids = torch.randint(0, 96, (3, 4), generator=g)
            num = torch.tensor([4, 2, 3])
            outs = [r.forward(ids, num) for r in runners]
            for b in range(3):
                torch.testing.assert_close(outs[0][b, : num[b]], outs[1][b, : num[b]], atol=1e-4, rtol=1e-4)
            keep = torch.tensor([step % 3, 1, 3])
            for r in runners:
                r.commit(keep)
        assert runners[0].lengths.tolist() == runners[1].lengths.tolist()
        for r in runners:
            r.truncate(torch.tensor([5, 1, 8]))
        outs = [r.forward(torch.tensor([[3], [4], [5]])) for r in runners]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_recompute_runner_tree_forward_scores_each_node_after_its_root_path():
    target = tiny_model("llama")
    runner = RecomputeRunner(target, max_batch_size=1, max_seq_len=32)
    with torch.no_grad():
        runner.start([[1, 2, 3]])
        # token 0 = 9; node 0 (token 1 = 10) child of the root; node 1 (token 2 = 11) child of node 0;
        # node 2 (token 3 = 12) child of the root
        logits = runner.forward(torch.tensor([[9, 10, 11, 12]]), tree_parents=torch.tensor([[-1, 0, -1]], dtype=torch.int32))
        plain = target(torch.tensor([[1, 2, 3, 9, 10, 11]])).logits[0].float()
        torch.testing.assert_close(logits[0, :3], plain[3:6], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[0, 3], target(torch.tensor([[1, 2, 3, 9, 12]])).logits[0, -1].float(),
                                   atol=1e-5, rtol=1e-5)
        runner.commit_tree(torch.tensor([[2, -1, -1]]), torch.tensor([1]))
        assert runner.tokens(0) == [1, 2, 3, 9, 12]


# ---------------------------------------------------------------------------------- text and stops
@pytest.fixture(scope="module")
def text_pair():
    tokenizer = char_tokenizer()
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.3), tokenizer


def test_text_prompts_stop_strings_and_streaming(text_pair):
    target, draft, tokenizer = text_pair
    prompts = ["def f(x):\n", "import os\nimport "]
    plain = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=40, k=3, eos_token_id=False)
    assert plain.text == [tokenizer.decode(t, skip_special_tokens=True) for t in plain.token_ids]
    text = plain.text[0]
    stop = text[10:12]  # a stop string that occurs in the greedy continuation
    first = text.find(stop)
    stopped = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=40, k=3, eos_token_id=False,
                       stop=[stop, "never@@"])
    assert stopped.text[0] == text[:first]
    assert stopped.finish_reasons[0] == "stop"
    assert tokenizer.decode(stopped.token_ids[0]) == text[: first + len(stop)]  # ends at the completing token
    assert plain.token_ids[0][: len(stopped.token_ids[0])] == stopped.token_ids[0]

    stream = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=40, k=3, eos_token_id=False,
                      stream=True)
    pieces = {0: [], 1: []}
    for piece in stream:
        assert isinstance(piece, str)
        pieces[piece.index].append(str(piece))
    assert ["".join(pieces[b]) for b in (0, 1)] == plain.text
    assert len(pieces[0]) > 1  # it streamed, step by step
    assert stream.result.token_ids == plain.token_ids

    stopped_stream = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=40, k=3, eos_token_id=False,
                              stop=[stop, "never@@"], stream=True)
    shown = {0: "", 1: ""}
    for piece in stopped_stream:
        shown[piece.index] += piece
        assert stop not in shown[piece.index]  # a stop string is never shown, not even in part at the end
    assert [shown[0], shown[1]] == stopped_stream.result.text == stopped.text


def test_single_string_prompt_and_token_tensor_prompt(text_pair):
    target, draft, tokenizer = text_pair
    a = generate("x = ", target, draft, tokenizer=tokenizer, max_new_tokens=8, k=2)
    ids = tokenizer("x = ")["input_ids"]
    b = generate(torch.tensor(ids), target, draft, tokenizer=tokenizer, max_new_tokens=8, k=2)
    c = generate(ids, target, draft, max_new_tokens=8, k=2)  # token ids, no tokenizer: no text
    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 1
    assert c.text is None and a.text == b.text


def test_models_load_from_local_paths(text_pair, tmp_path):
    target, draft, tokenizer = text_pair
    target.save_pretrained(tmp_path / "t")
    tokenizer.save_pretrained(tmp_path / "t")
    draft.save_pretrained(tmp_path / "d")
    tokenizer.save_pretrained(tmp_path / "d")
    from_paths = generate("def g", str(tmp_path / "t"), str(tmp_path / "d"), max_new_tokens=6, k=2)
    loaded = generate("def g", target, draft, tokenizer=tokenizer, max_new_tokens=6, k=2)
    assert from_paths.token_ids == loaded.token_ids and from_paths.text == loaded.text


# ---------------------------------------------------------------------------------- stats
def test_the_cost_models_plain_step_is_k_autos_measurement_where_it_runs(pair, monkeypatch):
    """k="auto" measures a plain step itself (its V(1)): the stats take it instead of timing three more target
    passes for the caller to wait for; a fixed k probes, once per PLAIN_STEP_REUSE_S for a target and batch
    size (every call used to pay the three passes)."""
    import weakref

    from specdec_ext import probes as probes_module
    from specdec_ext.adaptive import AdaptiveK

    _, target, draft = pair
    probes, measured = [], []
    probe, plain_step_time = probes_module.probe_target_step, AdaptiveK.plain_step_time
    monkeypatch.setattr(probes_module, "probe_target_step", lambda *args: probes.append(1) or probe(*args))
    monkeypatch.setattr(AdaptiveK, "plain_step_time", lambda self: measured.append(plain_step_time(self)) or measured[-1])
    monkeypatch.setattr(probes_module, "_PLAIN_STEPS", weakref.WeakKeyDictionary())  # (no earlier test's probe)
    stats = generate(PROMPTS, target, draft, max_new_tokens=NEW).stats  # k="auto"
    assert probes == [] and measured[0] and stats.target_step_time == measured[0]
    first = generate(PROMPTS, target, draft, max_new_tokens=NEW, k=3).stats.target_step_time
    assert first and probes == [1]
    assert generate(PROMPTS, target, draft, max_new_tokens=NEW, k=2).stats.target_step_time == first
    assert probes == [1]  # the recent probe served
    assert generate(PROMPTS[:1], target, draft, max_new_tokens=NEW, k=3).stats.target_step_time and probes == [1, 1]
    monkeypatch.setattr(probes_module, "PLAIN_STEP_REUSE_S", 0.0)  # too old: measured again
    assert generate(PROMPTS, target, draft, max_new_tokens=NEW, k=3).stats.target_step_time and probes == [1, 1, 1]


def test_stats_and_cost_model(pair):
    _, target, draft = pair
    stats = generate(PROMPTS, target, draft, max_new_tokens=NEW, k=3).stats
    assert len(stats.acceptance_by_position) == 3
    assert stats.reached[0] == stats.row_steps
    assert stats.emitted == stats.row_steps + sum(stats.accepted)  # tokens per pass = mean accepted + 1
    assert stats.draft_time > 0 and stats.verify_time > 0 and stats.tokens_per_second > 0 and stats.tpot > 0
    assert stats.target_step_time and stats.draft_cost > 0 and stats.verify_cost > 0
    assert stats.predicted_speedup == pytest.approx(
        predicted_speedup(stats.acceptance_rate, 3, stats.draft_cost, stats.verify_cost))
    assert "tokens per pass" in stats.summary()
    assert set(stats.as_dict()) >= {"tokens_per_pass", "acceptance_by_position", "tpot_s", "predicted_speedup"}
    assert expected_tokens_per_pass(0.7, 5) == pytest.approx((1 - 0.7 ** 6) / 0.3)
    assert expected_tokens_per_pass(1.0, 4) == 5 and expected_tokens_per_pass(0.0, 4) == 1


def test_summary_writes_a_dash_where_nothing_was_measured(pair):
    _, target, draft = pair
    stats = generate(PROMPTS[:1], target, draft, max_new_tokens=2, k=8).stats  # one step: positions 2.. unreached
    assert any(math.isnan(a) for a in stats.acceptance_by_position)
    text = stats.summary()
    assert "nan" not in text.lower() and "by position [" in text and ", -" in text
    auto = generate(PROMPTS[:1], target, draft, max_new_tokens=8, k="auto").stats  # (steps draft 0..8 each)
    assert math.isnan(auto.predicted_speedup) and math.isnan(auto.draft_cost)
    assert "k=auto (k_max 8)" in auto.summary() and "k varies per step" in auto.summary()
    assert str(auto) == auto.summary() and repr(auto).startswith("GenerationStats(")  # (print(result.stats))
    assert predicted_speedup(0.7, 5, 0.02, 1.0) == pytest.approx(2.94 / 1.1, rel=1e-2)
    one = generate(PROMPTS[:1], target, draft, max_new_tokens=1, k=4).stats  # the prefill's token: no pass after it
    assert one.steps == 0 and "tokens per pass -" in one.summary() and "nan" not in one.summary().lower()


# ---------------------------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors(text_pair):
    target, draft, tokenizer = text_pair
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate("", target, draft, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate([[1, 2], []], target, draft)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate([], target, draft)
    with pytest.raises(ValueError, match="k .* must be an int >= 1"):
        generate([[1, 2]], target, draft, k=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        generate([[1, 2]], target, draft, max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        generate([[1, 2]], target, draft, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        generate([[1, 2]], target, draft, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"outside \[0, 64\)"):
        generate([[1, 200]], target, draft)
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens.*cache holds 256"):
        generate([[1, 2], [3] * 300], target, draft, max_new_tokens=4)
    with pytest.raises(ValueError, match="cache holds 20"):
        generate([[1] * 10], target, draft, max_new_tokens=8, k=4, max_seq_len=20)
    with pytest.raises(ValueError, match="both target= and draft="):
        generate([[1, 2]], target, None)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        generate("abc", target, draft)
    with pytest.raises(ValueError, match="seed"):
        generate([[1], [2]], target, draft, seed=[1, 2, 3])


def test_vocabulary_mismatch_names_the_first_mismatching_tokens(text_pair):
    target, draft, tokenizer = text_pair
    swapped = char_tokenizer(chars=list("bacdefghijklmnopqrstuvwxyz0123456789 .,:;()[]=+-*/\n_'\"#<>!?"))
    with pytest.raises(VocabularyMismatchError, match=r"id 2: target 'a' vs draft 'b'.*id 3: target 'b' vs draft 'a'"):
        check_vocabularies(target, draft, tokenizer, swapped)
    # generate() drafts through text with a tokenizer that differs (issue 29; python_tests/test_cross_tokenizer.py)
    crossed = generate("abc", target, draft, tokenizer=tokenizer, draft_tokenizer=swapped, max_new_tokens=6, k=2)
    assert crossed.plan.drafter == "cross-tokenizer"
    assert crossed.token_ids == generate("abc", target, draft, tokenizer=tokenizer, max_new_tokens=6, k=2).token_ids
    small = tiny_model("llama", vocab=40)  # scores fewer tokens than the tokenizer has
    with pytest.raises(VocabularyMismatchError, match="draft model scores 40 tokens but the tokenizer has 61"):
        generate("abc", target, small, tokenizer=tokenizer, draft_tokenizer=tokenizer)
    padded = tiny_model("llama", vocab=80)  # padded embeddings are fine
    out = generate("abc", target, padded, tokenizer=tokenizer, draft_tokenizer=tokenizer, max_new_tokens=4, k=2)
    assert len(out.token_ids[0]) == 4
    with pytest.raises(VocabularyMismatchError, match="target scores 64 tokens"):
        generate([[1, 2]], target, tiny_model("llama", vocab=40))  # no tokenizers: sizes must agree
    with pytest.raises(VocabularyMismatchError, match=r"first ids only one of them has: 62, 63$"):
        generate([[1, 2]], target, tiny_model("llama", vocab=62))  # (no ids past the larger vocabulary)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])  # the lean draft runner and the paged one
def test_a_target_padding_id_past_the_draft_embedding_is_fed_to_the_draft_as_another_id(text_pair, arch):
    """A target scoring more ids than the draft embeds (padding, allowed) may emit one of them: the draft is fed
    runners.in_range.OUT_OF_RANGE_FEED there (it crashed mid-generation); the output stays the target's."""
    target, _, tokenizer = text_pair  # (the tokenizer has 61 ids, the target scores 64)
    loud = copy.deepcopy(target)
    with torch.no_grad():
        loud.get_output_embeddings().weight[61:] *= 40.0  # the padding ids win now and then
    draft = tiny_model(arch, vocab=62, seed=3)  # embeds 62 ids: 62 and 63 are past it
    plain = specdec_ext.plain_generate([[5, 9, 14, 2]], loud, max_new_tokens=24, eos_token_id=False)
    assert any(t >= 62 for t in plain.token_ids[0])
    for k in (1, 4, "auto"):
        out = generate([[5, 9, 14, 2]], loud, draft, tokenizer=tokenizer, draft_tokenizer=tokenizer, k=k,
                       max_new_tokens=24, eos_token_id=False)
        assert out.token_ids == plain.token_ids, k
    sampled = generate([[5, 9, 14, 2]] * 4, loud, draft, tokenizer=tokenizer, draft_tokenizer=tokenizer, k=3,
                       max_new_tokens=24, eos_token_id=False, temperature=1.0, seed=0)
    assert any(t >= 62 for row in sampled.token_ids for t in row)


def test_generation_config_settings_that_generate_does_not_read_are_named_in_a_warning(pair):
    _, target, _ = pair
    model = copy.deepcopy(target)
    model.generation_config.repetition_penalty = 1.5
    model.generation_config.do_sample = True
    with pytest.warns(UserWarning, match=r"generation_config sets do_sample=True, repetition_penalty=1.5, which "
                                         r"generate\(\) does not read"):
        generate([[1, 2, 3]], model, "ngram", max_new_tokens=2)


def test_numpy_and_torch_integers_are_ints_for_counts_and_prompts(pair):
    import numpy as np
    _, target, draft = pair
    expected = generate(PROMPTS[:2], target, draft, max_new_tokens=4, k=2).token_ids
    array = np.array([PROMPTS[0][:3], PROMPTS[1][:3]], dtype=np.int32)
    assert generate(array, target, draft, max_new_tokens=np.int64(4), k=np.int64(2)).token_ids == \
        generate([p[:3] for p in PROMPTS[:2]], target, draft, max_new_tokens=4, k=2).token_ids
    assert generate(PROMPTS[:2], target, draft, max_new_tokens=torch.tensor(4), k=torch.tensor(2)).token_ids == expected
    assert len(generate(PROMPTS[:1], target, draft, max_new_tokens=3, draft_tree=(np.int64(2), 2, 4)).token_ids[0]) == 3
    assert generate(PROMPTS[:1], target, draft, max_new_tokens=3, k=2, temperature=0.7, top_k=np.int64(5),
                    seed=1).token_ids == generate(PROMPTS[:1], target, draft, max_new_tokens=3, k=2, temperature=0.7,
                                                  top_k=5, seed=1).token_ids
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got 4.0"):
        generate(PROMPTS[:1], target, draft, max_new_tokens=4.0)


def test_exports():
    assert specdec_ext.generate is generate
    assert callable(specdec_ext.audit) and callable(specdec_ext.load_pair)


def test_plain_generate_is_the_k0_baseline(pair, references):
    from specdec_ext.generate import plain_generate

    _, target, _ = pair
    plain = plain_generate(PROMPTS, target, max_new_tokens=NEW)
    assert plain.token_ids == references
    assert plain.stats.tokens_per_pass == 1.0 and plain.stats.draft_time < plain.stats.verify_time


@pytest.mark.parametrize("runner", ["paged", "recompute"])
def test_rows_finishing_at_different_steps_stay_frozen_within_the_cache(pair, runner):
    _, target, draft = pair
    prompts = PROMPTS + [[40 + i for i in range(12)], [1, 2]]
    out = generate(prompts, target, draft, max_new_tokens=5, k=6, temperature=1.0, seed=list(range(6)),
                   eos_token_id=[3, 4, 5, 6, 7], runner=runner)
    for tokens, reason in zip(out.token_ids, out.finish_reasons):
        assert 1 <= len(tokens) <= 5
        assert reason == ("eos" if tokens[-1] in (3, 4, 5, 6, 7) else "length")
        assert not any(t in (3, 4, 5, 6, 7) for t in tokens[:-1])


def test_confidence_stopped_drafts_are_ragged_and_still_exact(pair, references):
    _, target, draft = pair
    out = generate(PROMPTS, target, draft, max_new_tokens=NEW, k=4, draft_confidence=0.6)
    assert out.token_ids == references
    assert out.stats.reached[0] > out.stats.reached[3]  # some rows stopped drafting early
    with pytest.raises(ValueError, match="draft_confidence"):
        generate(PROMPTS, target, draft, draft_confidence=1.5)


def test_concurrent_callers_in_threads_get_their_own_results(pair):
    """Two threads decoding at once over paged runners (each paged forward's step is per thread) and
    the lean runner: each gets what it gets alone."""
    import threading

    _, target, draft = pair
    jobs = [dict(prompts=PROMPTS, k=3, runner="paged"), dict(prompts=PROMPTS[::-1], k=2, runner="paged"),
            dict(prompts=PROMPTS[:1], k=4, runner="auto")]
    alone = [generate(j["prompts"], target, draft, max_new_tokens=16, k=j["k"], runner=j["runner"]).token_ids
             for j in jobs]
    together = [None] * len(jobs)
    errors = []

    def run(i):
        try:
            j = jobs[i]
            together[i] = generate(j["prompts"], target, draft, max_new_tokens=16, k=j["k"],
                                   runner=j["runner"]).token_ids
        except Exception as error:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert together == alone
