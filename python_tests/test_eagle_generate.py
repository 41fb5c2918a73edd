"""generate(..., draft=EagleDrafterSpec) end to end (the plan's drafter "eagle"; issue 27's integration):
greedy equal to plain greedy on each runner and as a tree, the plan's lines, the audit at T = 1, and a head
made for another target refused before any work."""
from __future__ import annotations

import pytest

import specdec_ext
from eagle_utils import random_head, tiny_target
from specdec_ext.eagle import EagleDrafterSpec, EagleMismatchError, save_eagle
from test_generate_utils import hf_greedy

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30]]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, draft_vocab=48)


@pytest.mark.parametrize("runner,kw", [("auto", dict(k=4)), ("auto", dict(draft_tree=(2, 3, 6))),
                                       ("paged", dict(k=3)), ("recompute", dict(k=2)), ("auto", dict())])
def test_generate_with_an_eagle_head_is_plain_greedy(target, head, runner, kw):
    result = specdec_ext.generate(PROMPTS, target, EagleDrafterSpec(head), max_new_tokens=16, runner=runner, **kw)
    assert result.token_ids == [hf_greedy(target, p, 16) for p in PROMPTS]
    plan = result.plan
    assert plan.drafter == "eagle" and plan.hidden_taps == (2, 3, 3) and plan.target_capabilities.hidden_taps
    assert "hidden taps" in plan.explain() and not plan.cuda_graphs


def test_a_checkpoint_directory_is_a_draft(target, head, tmp_path):
    save_eagle(head, str(tmp_path))
    out = specdec_ext.generate(PROMPTS, target, str(tmp_path), max_new_tokens=8, k=3)
    assert out.plan.drafter == "eagle" and out.token_ids == [hf_greedy(target, p, 8) for p in PROMPTS]


def test_the_audit_passes_at_t1(target, head):
    report = specdec_ext.audit(target, EagleDrafterSpec(head), [PROMPTS[0]], positions=2, samples=400,
                               run_break_even=False, verbose=False, progress=False)
    assert report.passed, report.text()


def test_a_head_for_another_target_is_refused(head):
    with pytest.raises(EagleMismatchError, match="size 64, this target's are 96"):
        specdec_ext.generate(PROMPTS, tiny_target("llama", hidden=96), EagleDrafterSpec(head), max_new_tokens=4)
    with pytest.raises(ValueError, match="draft='eagle' uses the bundled EAGLE-3 head, trained for the bundled target"):
        specdec_ext.generate(PROMPTS, tiny_target("llama"), "eagle", max_new_tokens=4)


def test_an_int8_checkpoint_loads_within_half_a_step_and_drafts_losslessly(target, head, tmp_path):
    """save_eagle(int8=True): each 2-D weight int8 with a scale per row (NumPy: |w - q * s| <= s / 2), the
    rest exact; generate with it is still plain greedy."""
    import numpy as np
    from specdec_ext.eagle import load_eagle

    save_eagle(head, str(tmp_path), int8=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.int8.safetensors"]
    loaded = load_eagle(str(tmp_path), target)
    original = head.state_dict()
    for name, tensor in loaded.state_dict().items():
        w = original[name].float().numpy()
        if original[name].dim() == 2 and name != "embed_tokens.weight":
            step = np.abs(w).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(tensor.numpy() - w) <= step / 2 + 1e-7), name
            assert not np.array_equal(tensor.numpy(), w)  # rounded, not copied
        else:
            np.testing.assert_array_equal(tensor.float().numpy(), w, err_msg=name)
    out = specdec_ext.generate(PROMPTS, target, str(tmp_path), max_new_tokens=12, k=3)
    assert out.token_ids == [hf_greedy(target, p, 12) for p in PROMPTS]


def test_an_eagle_head_under_logits_processors_is_plain_decoding_with_them(target, head):
    kw = dict(max_new_tokens=16, presence_penalty=1.0, repetition_penalty=1.3, logit_bias={7: 3.0})
    speculative = specdec_ext.generate(PROMPTS, target, EagleDrafterSpec(head), k=3, **kw)
    assert speculative.token_ids == specdec_ext.plain_generate(PROMPTS, target, **kw).token_ids
