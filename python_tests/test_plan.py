"""The decode plan (specdec_ext/plan.py): every choice made once with its reason, the checks made before
any work, ``explain`` in the API and the CLI; and the model loading around it (models.py): the
bundled pair loaded once per process, a bundled target passed as an object finds its tokenizer."""
from __future__ import annotations

import types

import pytest
import torch

import specdec_ext
from specdec_ext import cli, ops
from specdec_ext.models import load_pair
from specdec_ext.plan import FIXED_K, HEADS_TREE, make_plan
from specdec_ext.sampling import SamplingParams
from test_generate_utils import noisy_copy, tiny_model


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=64, hidden=32, layers=1, logit_scale=3.0)
    return target, noisy_copy(target, noise=0.2)


def test_explain_names_every_choice_with_its_reason(pair):
    target, draft = pair
    plan = make_plan(target, draft, drafter="model", prompt_lengths=[5, 3], max_new_tokens=16)
    text = plan.explain()
    choices = [line.split()[0] for line in text.splitlines()]
    assert choices == ["drafter", "target", "draft", "cuda", "batch", "cache", "capabilities", "sampling"]
    assert plan.adaptive and "k=auto" in text  # k=None: adaptive on the CPU
    assert "lean" in text and "device is cpu" in text and "greedy" in text
    assert plan.max_seq_len == 5 + 16 + 2 * plan.slots  # prompt + new + two steps of drafts (plan.loop_cache_len)
    seeded = make_plan(target, draft, drafter="model", prompt_lengths=[5], max_new_tokens=16,
                       sampling=SamplingParams(temperature=1.0), seeded=True)
    assert not seeded.adaptive and seeded.slots == FIXED_K and "seed reproduces" in seeded.explain()
    heads_like = make_plan(target, None, drafter="heads", prompt_lengths=[5], max_new_tokens=4)
    assert heads_like.tree == HEADS_TREE and "k does not apply" in heads_like.explain()
    assert heads_like.tree_calibration == "shared" and "learnt across this process's calls" in heads_like.explain()
    seeded_tree = make_plan(target, draft, drafter="model", prompt_lengths=[5], max_new_tokens=16, draft_tree=(2, 2, 4),
                            sampling=SamplingParams(temperature=1.0), seeded=True)
    assert seeded_tree.tree_calibration == "prior" and "so that the seed reproduces" in seeded_tree.explain()
    plain = make_plan(target, None, drafter="none", prompt_lengths=[5], max_new_tokens=4)
    assert plain.slots == 0 and "plain decoding" in plain.explain()


def test_the_target_runner_says_whether_its_forward_runs_on_the_cpu_kernels(pair, monkeypatch):
    target, draft = pair
    reason = lambda plan: dict(plan.reasons)["target runner"]
    plan = make_plan(target, draft, drafter="model", prompt_lengths=[5], max_new_tokens=4)
    assert plan.target_runner == "lean" and f"the CPU kernels (csrc/cpu, the {ops.cpu_isa()} path)" in reason(plan)
    monkeypatch.setenv("SPECDEC_CPU_ISA", "portable")
    plan = make_plan(target, draft, drafter="model", prompt_lengths=[5], max_new_tokens=4)
    assert "the CPU kernels (csrc/cpu, the portable path)" in reason(plan)
    monkeypatch.delenv("SPECDEC_CPU_ISA")
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    plan = make_plan(target, draft, drafter="model", prompt_lengths=[5], max_new_tokens=4)
    assert "a pure-torch forward (not the CPU kernels: SPECDEC_CPU_KERNELS=0)" in reason(plan)


@pytest.mark.parametrize("k", [None, "auto"])
def test_a_default_draft_length_fits_the_cache(pair, k):
    """A draft length left to the plan (k None or "auto") drafts what the cache leaves past the longest prompt and
    max_new_tokens (two steps of drafts: prompt + new + 2 x slots), and with no room for one draft the call decodes
    plain; an asked k is refused with the numbers (above). It was refused whenever the default k did not fit."""
    target, draft = pair
    kw = dict(drafter="model", prompt_lengths=[5, 9], k=k, max_seq_len=24)
    plan = make_plan(target, draft, max_new_tokens=9, **kw)  # 24 - 9 - 9 = 6: three slots
    assert (plan.drafter, plan.slots, plan.max_seq_len) == ("model", 3, 24)
    assert "at most 3 (not" in dict(plan.reasons)["draft length"]
    assert plan.adaptive and plan.controller.k_max == 3  # (greedy: k=None is k="auto")
    plan = make_plan(target, draft, max_new_tokens=14, **kw)  # 24 - 9 - 14 = 1: no room for a draft
    assert (plan.drafter, plan.slots, plan.adaptive, plan.max_seq_len) == ("none", 0, False, 22)
    assert "leave no room for drafts" in plan.explain()
    with pytest.raises(ValueError, match="needs 25 cache positions but the cache holds 24") as refused:
        make_plan(target, draft, max_new_tokens=17, **kw)  # the request itself does not fit: 9 + 17 - 1
    assert "leave k to the plan" not in str(refused.value)
    with pytest.raises(ValueError, match=r"needs 26 cache .* or leave k to the plan \(None or 'auto': up to 8 drafts "
                                         r"a step, fewer where the cache leaves fewer slots: 3 here\)"):
        make_plan(target, draft, max_new_tokens=9, **{**kw, "k": 4})  # an asked k is refused, with the way out


def test_generate_at_the_end_of_the_context_matches_plain_decoding(pair):
    """generate() with the default k where two steps of drafts pass the cache: the same tokens as plain decoding,
    drafting fewer tokens, then none."""
    target, draft = pair
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2]]
    for new, drafter in ((9, "model"), (14, "none")):
        result = specdec_ext.generate(prompts, target, draft, max_new_tokens=new, max_seq_len=24, eos_token_id=False)
        plain = specdec_ext.plain_generate(prompts, target, max_new_tokens=new, max_seq_len=24, eos_token_id=False)
        assert result.plan.drafter == drafter and result.token_ids == plain.token_ids
        assert all(len(t) == new for t in result.token_ids)


def test_bad_choices_are_refused_before_any_work(pair):
    target, draft = pair
    kw = dict(prompt_lengths=[5], max_new_tokens=8)
    cases = [
        (dict(drafter="model", runner="fast"), "runner must be 'auto' or one of"),
        (dict(drafter="ngram", draft_tree=(2, 2, 4)), "not the n-gram drafter"),
        (dict(drafter="none", draft_tree=(2, 2, 4)), "plain decoding drafts nothing"),
        (dict(drafter="model", draft_tree=(2, 0, 4)), r"draft_tree must be a tuple \(b, d, N\)"),
        (dict(drafter="model", k=0), "k \\(draft tokens per step\\) must be"),
        (dict(drafter="model", draft_confidence=1.0), "draft_confidence must be a number in"),
        (dict(drafter="model", k=4, max_seq_len=20), "needs 21 cache positions but the cache holds 20"),
        (dict(drafter="model", draft_tree=(2, 2, 4), max_seq_len=20), "needs 21 cache positions but the cache holds 20"),
        (dict(drafter="heads", runner="recompute"), "needs the paged or lean runner"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            make_plan(target, draft if extra["drafter"] == "model" else None, **{**kw, **extra})
    gpt = tiny_model("gpt_neox", vocab=64, hidden=32, layers=1)
    with pytest.raises(ValueError, match="runner='lean' cannot run the target model"):
        make_plan(gpt, None, drafter="none", runner="lean", **kw)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        make_plan(target, None, drafter="none", prompt_lengths=[5], max_new_tokens=-1)


def test_a_draft_not_loaded_or_on_another_device_is_refused(pair):
    target, _ = pair
    draft = noisy_copy(target, 0.1).to(torch.device("meta"))
    with pytest.raises(ValueError, match="the draft model's weights are on the meta device"):  # (not "on meta")
        make_plan(target, draft, drafter="model", prompt_lengths=[5], max_new_tokens=4)

    elsewhere = torch.nn.Module()  # (a CPU torch makes no tensor on another device: a module that says it has one)
    elsewhere.parameters = lambda recurse=True: iter([types.SimpleNamespace(device=torch.device("cuda", 0))])
    with pytest.raises(ValueError, match="the draft is on cuda:0, the target on cpu: use one device"):
        make_plan(target, elsewhere, drafter="model", prompt_lengths=[5], max_new_tokens=4)


def test_generate_returns_its_plan_and_explains_it_on_stderr(pair, capsys):
    target, draft = pair
    result = specdec_ext.generate([[1, 2, 3]], target, draft, max_new_tokens=4, k=2, explain=True)
    err = capsys.readouterr().err
    assert result.plan.slots == 2 and not result.plan.adaptive
    assert result.plan.explain() in err and "model chain, k=2: as asked" in err


def test_cli_generate_explain_prints_the_plan(capsys):
    assert cli.main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--explain", "--no-stream",
                     "--draft", "ngram"]) == 0
    err = capsys.readouterr().err
    assert "ngram chain, k=auto" in err and "target runner" in err and "cuda graphs" in err


def test_the_bundled_pair_is_loaded_once_and_its_target_finds_its_tokenizer():
    first, second = load_pair(), load_pair()
    assert first[0] is second[0] and first[1] is second[1] and first[2] is second[2]
    fresh_target = specdec_ext.load_default_pair()[0]  # a new object loaded from the bundled directory
    assert fresh_target is not first[0]
    result = specdec_ext.generate("def add(a, b):", fresh_target, "ngram", max_new_tokens=6)
    assert isinstance(result.text[0], str) and len(result.token_ids[0]) == 6


def test_the_plan_resolves_the_runners_capabilities_before_they_are_built(pair):
    """Capabilities in the open (issue 26): the lean runner on the CPU kernels chains greedily, unless
    heads hook the target's head; the paged runner in host mode has device steps; explain() says so, and
    the built runners have what the plan says."""
    from specdec_ext.build import build
    from specdec_ext.models import Models
    from specdec_ext.runners import RunnerCapabilities
    target, draft = pair
    plan = make_plan(target, draft, drafter="model", prompt_lengths=[5], max_new_tokens=8, runner="lean")
    assert plan.target_capabilities == RunnerCapabilities(greedy_chain=True, chunked_prefill=True)
    assert plan.draft_capabilities == RunnerCapabilities(greedy_chain=True, chunked_prefill=True)
    assert "greedy chains" in dict(plan.reasons)["capabilities"]
    runner, drafter = build(plan, Models(target, "model", draft=draft))
    assert runner.capabilities == plan.target_capabilities
    paged = make_plan(target, None, drafter="none", prompt_lengths=[5], max_new_tokens=8, runner="paged")
    assert paged.target_capabilities == RunnerCapabilities(device_steps=True) and paged.draft_capabilities is None
    assert "device steps" in dict(paged.reasons)["capabilities"]


def test_a_server_is_planned_without_a_fake_workload(pair):
    """plan_server: a fixed k, max_rows slots of max_seq_len positions, host-mode runners; refused: heads,
    a max_seq_len with no room for a token."""
    from specdec_ext.plan import plan_server
    target, draft = pair
    plan = plan_server(target, draft, drafter="model", k=3, runner="auto", max_rows=4, max_seq_len=64)
    assert (plan.slots, plan.adaptive, plan.batch_size, plan.max_seq_len, plan.static_shapes) == (3, False, 4, 64, False)
    assert "k=3" in dict(plan.reasons)["drafter"] and "4 slots of 64 positions" in plan.explain()
    with pytest.raises(ValueError, match="heads drafter proposes trees"):
        plan_server(target, None, drafter="heads", k=3, runner="auto", max_rows=4, max_seq_len=64)
    with pytest.raises(ValueError, match="leaves no room for a token"):
        plan_server(target, draft, drafter="model", k=3, runner="auto", max_rows=4, max_seq_len=5)


def test_a_server_plans_k_by_load_and_chunked_prefill_where_the_runner_can(pair):
    """plan_server (issue 30): k=None is the draft length by load (adaptive, k_max slots), an int fixes it;
    the lean runner prefills in chunks (default DEFAULT_PREFILL_CHUNK, 0: whole prompts), the paged runner
    cannot and an explicit chunk there is refused; explain() says each."""
    from specdec_ext.plan import DEFAULT_PREFILL_CHUNK, plan_server
    from specdec_ext.adaptive import DEFAULT_K_MAX
    target, draft = pair
    plan = plan_server(target, draft, drafter="model", k=None, runner="lean", max_rows=4, max_seq_len=128)
    assert (plan.slots, plan.adaptive, plan.prefill_chunk) == (DEFAULT_K_MAX, True, DEFAULT_PREFILL_CHUNK)
    assert "k by load" in dict(plan.reasons)["drafter"] and "in chunks" in dict(plan.reasons)["prefill"]
    whole = plan_server(target, draft, drafter="model", k=None, runner="lean", max_rows=4, max_seq_len=128,
                        prefill_chunk=0)
    assert whole.prefill_chunk == 0 and "whole prompts" in dict(whole.reasons)["prefill"]
    paged = plan_server(target, None, drafter="none", k=None, runner="paged", max_rows=4, max_seq_len=128)
    assert (paged.slots, paged.adaptive, paged.prefill_chunk) == (0, False, 0)
    assert "paged runner prefills whole prompts" in dict(paged.reasons)["prefill"]
    with pytest.raises(ValueError, match="chunked prefill needs a target runner with extend_rows"):
        plan_server(target, None, drafter="none", k=None, runner="paged", max_rows=4, max_seq_len=128, prefill_chunk=64)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 0"):
        plan_server(target, draft, drafter="model", k=None, runner="lean", max_rows=4, max_seq_len=128, prefill_chunk=-1)
    with pytest.raises(ValueError, match="k \\(draft tokens per step\\) must be an int >= 1"):
        plan_server(target, draft, drafter="model", k=0, runner="lean", max_rows=4, max_seq_len=128)


def _plan_for(target, draft="ngram", **request):
    request = {"drafter": "ngram" if draft == "ngram" else "model", "prompt_lengths": [4], "max_new_tokens": 8,
               **request}
    return make_plan(target, None if isinstance(draft, str) else draft, **request)


def test_models_that_cannot_give_their_own_output_are_refused_by_name():
    import transformers
    meta = tiny_model("llama").to("meta")
    with pytest.raises(ValueError, match="target model's weights are on the meta device"):
        _plan_for(meta)
    training = tiny_model("gpt_neox").train()
    training.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"target model is in training mode with dropout .*model.eval\(\)"):
        _plan_for(training)
    assert _plan_for(tiny_model("llama").train()).target_runner == "lean"  # (no dropout: deterministic)
    wide = tiny_model("gpt_neox").to(torch.float64)
    with pytest.raises(ValueError, match="target model is torch.float64: the paged runner's cache holds"):
        _plan_for(wide)
    assert _plan_for(tiny_model("llama").to(torch.float64)).target_runner == "lean"
    chunked = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, attention_chunk_size=8,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    assert _plan_for(chunked, prompt_lengths=[2], max_new_tokens=2, k=1).target_runner == "paged"  # (one chunk)
    with pytest.raises(ValueError, match=r"chunked attention \(attention_chunk_size=8\) over rows of 14 positions"):
        _plan_for(chunked, k=1)


def _longrope_llama():
    """A tiny Llama with longrope factors that switch at position 16."""
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                         "long_factor": [2.0] * 4, "original_max_position_embeddings": 16})
    return transformers.LlamaForCausalLM(config).eval()


def test_a_longrope_target_that_would_switch_factors_inside_the_generation_is_refused():
    target = _longrope_llama()
    with pytest.raises(ValueError, match="longrope rope switches to its long factors past "
                                         "original_max_position_embeddings=16, inside this generation"):
        _plan_for(target, prompt_lengths=[10], max_new_tokens=8, k=2)
    assert _plan_for(target, prompt_lengths=[4], max_new_tokens=8, k=2).target_runner == "paged"  # 16 positions
    assert _plan_for(target, prompt_lengths=[20], max_new_tokens=8, k=2).target_runner == "paged"  # long throughout
    assert _plan_for(target, draft="none", drafter="none", prompt_lengths=[10], max_new_tokens=8).target_runner == "paged"
    # a batch whose longest row sets the others' factors: refused for plain decoding too (rows of equal length
    # cross the limit together)
    with pytest.raises(ValueError, match="its prompts differ in length .3-20 tokens.: in one batch the longest row"):
        _plan_for(target, draft="none", drafter="none", prompt_lengths=[3, 20], max_new_tokens=4)
    assert _plan_for(target, draft="none", drafter="none", prompt_lengths=[10, 10], max_new_tokens=8).slots == 0
    assert _plan_for(target, draft="none", drafter="none", prompt_lengths=[17, 20], max_new_tokens=8).slots == 0


def test_a_dynamic_rope_target_is_refused_where_its_frequencies_would_follow_the_drafts_or_the_batch():
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=16, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    target = transformers.LlamaForCausalLM(config).eval()
    with pytest.warns(UserWarning, match="past the"), pytest.raises(
            ValueError, match="dynamic rope recomputes its frequencies .* past max_position_embeddings=16"):
        _plan_for(target, prompt_lengths=[10], max_new_tokens=8, k=2, max_seq_len=64)
    with pytest.warns(UserWarning, match="past the"), pytest.raises(ValueError, match="its prompts differ in length"):
        _plan_for(target, draft="none", drafter="none", prompt_lengths=[3, 10], max_new_tokens=8, max_seq_len=64)
    assert _plan_for(target, prompt_lengths=[4], max_new_tokens=4, k=2).slots == 2  # within the limit throughout
    # past the limit from the start: every verify pass recomputes them (longrope would stay on its long factors)
    with pytest.warns(UserWarning, match="past the"), pytest.raises(ValueError, match="dynamic rope"):
        _plan_for(target, prompt_lengths=[17], max_new_tokens=4, k=2, max_seq_len=64)


def test_a_server_whose_rows_could_change_each_others_rotary_frequencies_is_refused():
    """A server's rows share every forward: past a longrope or dynamic-NTK limit one row would set the others'
    frequencies. Refused at start-up unless max_seq_len stays within the limit."""
    from specdec_ext.plan import plan_server
    target = _longrope_llama()
    kw = dict(drafter="none", k=None, runner="auto", max_rows=4)
    with pytest.raises(ValueError, match="longrope rope switches .* Serve with max_seq_len <= 16"):
        plan_server(target, None, max_seq_len=64, **kw)
    assert plan_server(target, None, max_seq_len=16, **kw).max_seq_len == 16


def test_a_model_that_accelerate_offloads_is_not_taken_for_one_not_loaded():
    """accelerate's offloading leaves the offloaded weights on the meta device and loads them for each forward
    (its ``_hf_hook``): such a model runs, as HF runs it; a weight on meta without such a hook is refused."""
    import tempfile
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("llama", vocab=96, hidden=32, layers=2)
    prompt = [5, 17, 3, 44, 9]
    expected = specdec_ext.plain_generate([prompt], model, max_new_tokens=6, eos_token_id=False).token_ids
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = accelerate.dispatch_model(model, device_map, main_device="cpu", offload_dir=tempfile.mkdtemp())
    assert any(p.is_meta for p in offloaded.parameters())
    out = specdec_ext.generate([prompt], offloaded, "ngram", k=2, runner="paged", max_new_tokens=6, eos_token_id=False)
    assert out.token_ids == expected
