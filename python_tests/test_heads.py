"""Medusa-style heads on the target (specdec_ext/heads.py, drafters/heads_drafter.py, draft="heads"):
the module and its files, the hidden state the heads read at every step, greedy equality with HF
generate, the exact target distribution at T = 1 (chi-square with a broken verifier as the control),
the bundled heads, and every bad input."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from specdec_ext import generate
from specdec_ext.drafters.calibration import reset_calibrations
from specdec_ext.drafters.heads_drafter import HeadsDrafter
from specdec_ext.heads import HeadsMismatchError, MedusaHeads, lm_head_of, load_heads
from test_generate_utils import check_eos_and_max_new_tokens, hf_greedy, tiny_model
from sampling_stats import chi_square_p, exact_joint
from test_tree_decode import FAIL_P, PASS_P, POSITIONS, PROMPT, SAMPLES, TINY_VOCAB, python_tree_verifier

NEW = 24
PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30], [7, 7, 81, 13, 40]]  # ragged
TREES = [(2, 3, 6), (3, 2, 5), (1, 3, 3)]


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


def random_heads(model, num_heads=3, scale=0.5, seed=0) -> MedusaHeads:
    """Heads with random (not identity) blocks, so the proposals vary with the hidden state."""
    weight = lm_head_of(model).weight
    heads = MedusaHeads(weight.shape[1], num_heads, weight.shape[0])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.copy_(torch.randn(block.linear.weight.shape, generator=generator) * scale)
    return heads.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab=96, hidden=64, layers=2, seed=0, logit_scale=3.0)


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, NEW) for p in PROMPTS]


# ------------------------------------------------------------------------------ module and files
def test_fresh_heads_are_the_identity_and_round_trip_through_files(target, tmp_path):
    fresh = MedusaHeads(64, 2, 96)
    hidden = torch.randn(5, 64)
    lm_head = lm_head_of(target)
    logits = fresh(hidden, lm_head)
    assert logits.shape == (5, 2, 96)
    torch.testing.assert_close(logits[:, 1], lm_head(hidden))  # W = 0: head i predicts token t+1
    heads = random_heads(target)
    heads.save(str(tmp_path), dtype=torch.float32)
    config = json.load(open(tmp_path / "config.json"))
    assert config["num_heads"] == 3 and config["hidden_size"] == 64 and config["vocab_size"] == 96
    loaded = load_heads(str(tmp_path))
    assert not any(p.requires_grad for p in loaded.parameters())
    torch.testing.assert_close(loaded(hidden, lm_head), heads(hidden, lm_head))
    with pytest.raises(FileNotFoundError, match="heads.safetensors"):
        os.remove(tmp_path / "heads.safetensors")
        load_heads(str(tmp_path))


def test_heads_for_another_target_are_refused(target):
    with pytest.raises(HeadsMismatchError, match="hidden states of size 32"):
        generate([PROMPTS[0]], target, MedusaHeads(32, 3, 96), max_new_tokens=4)
    with pytest.raises(HeadsMismatchError, match="vocabulary of 100"):
        generate([PROMPTS[0]], target, MedusaHeads(64, 3, 100), max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the 2 heads"):
        generate([PROMPTS[0]], target, MedusaHeads(64, 2, 96), max_new_tokens=4, draft_tree=(2, 3, 6))
    with pytest.raises(ValueError, match="bundled target"):
        generate([PROMPTS[0]], target, "heads", max_new_tokens=4)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        MedusaHeads(64, 0, 96)
    with pytest.raises(ValueError, match="needs the paged or lean runner"):
        generate([PROMPTS[0]], target, MedusaHeads(64, 3, 96), max_new_tokens=4, runner="recompute")


# ------------------------------------------------------------------------------ the hidden state
class RecordingHeadsDrafter(HeadsDrafter):
    """Records (committed tokens, the hidden state the heads read) at every propose."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def propose(self, meta, budget=None):
        lengths, active = meta.seq_lens.tolist(), meta.active.tolist()
        for b, n in enumerate(lengths):
            if active[b]:  # (a finished row is frozen: its state is no longer kept up to date)
                self.records.append((meta.token_buffer[b, :n].tolist(), self._hidden[b].clone()))
        return super().propose(meta, budget)


def test_heads_read_the_hidden_state_that_scored_the_pending_token(target, monkeypatch):
    """At every step h must be the LM head's input at the token before the pending one, as a plain
    HF forward over the committed tokens computes it (this checks commit's column arithmetic)."""
    build_module = sys.modules["specdec_ext.build"]
    made = []

    def recording(*args, **kwargs):
        made.append(RecordingHeadsDrafter(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(build_module, "HeadsDrafter", recording)
    generate(PROMPTS, target, random_heads(target), max_new_tokens=NEW, draft_tree=(2, 3, 6))
    records = made[0].records
    assert len(records) >= 3 * 5
    lm_head = lm_head_of(target)
    seen = []
    handle = lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        for tokens, hidden in records:
            seen.clear()
            with torch.no_grad():
                target(torch.tensor([tokens]))
            torch.testing.assert_close(hidden, seen[0][0, len(tokens) - 2], atol=1e-4, rtol=1e-4)
    finally:
        handle.remove()
    assert not lm_head._forward_pre_hooks  # the drafter removed its hook when the loop ended


# ------------------------------------------------------------------------------ greedy and sampling
@pytest.mark.parametrize("runner", ["auto", "paged"])  # auto: the lean target runner calls the hooked LM head
@pytest.mark.parametrize("tree", TREES)
def test_greedy_heads_match_hf_generate_batch1_and_batch3(target, references, tree, runner):
    heads = random_heads(target)
    one = generate([PROMPTS[0]], target, heads, max_new_tokens=NEW, draft_tree=tree, runner=runner)
    assert one.token_ids == [references[0]]
    batch = generate(PROMPTS, target, heads, max_new_tokens=NEW, draft_tree=tree, runner=runner)
    assert batch.token_ids == references
    assert batch.stats.k == tree_nodes(tree)


def test_heads_stop_at_eos_and_max_new_tokens(target, references):
    heads = random_heads(target)
    check_eos_and_max_new_tokens(
        lambda new, eos: generate(PROMPTS, target, heads, max_new_tokens=new, draft_tree=(2, 3, 6),
                                  eos_token_id=eos), references, eos=references[1][5])


def tree_nodes(tree):
    from specdec_ext.drafters.tree_drafter import tree_num_nodes
    return tree_num_nodes(*tree)


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0)


def sample_first_tokens(target, heads, tree, **kw):
    reset_calibrations()
    out = generate([PROMPT] * SAMPLES, target, heads, max_new_tokens=POSITIONS, draft_tree=tree,
                   seed=list(range(SAMPLES)), temperature=1.0, cost_probe=False, **kw)
    assert all(len(t) == POSITIONS for t in out.token_ids)
    return out


def test_heads_first_tokens_follow_plain_target_sampling_at_t1(tiny_target):
    joint = exact_joint(tiny_target, PROMPT)
    heads = random_heads(tiny_target, num_heads=2, scale=1.0, seed=5)
    out = sample_first_tokens(tiny_target, heads, (2, 2, 4))
    reached, accepted = out.stats.reached, out.stats.accepted
    assert 0.05 < accepted[0] / reached[0] < 0.95  # accepts and rejections at depth 1
    p_value = chi_square_p(out.token_ids, joint)
    print(f"\nheads tree (2, 2, 4): chi-square p = {p_value:.3g}, acceptance {out.stats.acceptance_by_position[:2]}")
    assert p_value > PASS_P
    wrong = sample_first_tokens(tiny_target, heads, (2, 2, 4), verifier=python_tree_verifier(False))
    assert chi_square_p(wrong.token_ids, joint) < FAIL_P


# ------------------------------------------------------------------------------ the bundled heads
def test_bundled_heads_keep_the_bundled_targets_greedy_output():
    from specdec_ext.default_pair import load_default_heads, load_default_pair
    from specdec_ext.generate import plain_generate
    target, _, tokenizer = load_default_pair(dtype=torch.float32)
    heads = load_default_heads()
    heads.check_target(target)
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
    plain = plain_generate([prompt], target, tokenizer=tokenizer, max_new_tokens=40, eos_token_id=False)
    spec = generate([prompt], target, heads, tokenizer=tokenizer, max_new_tokens=40, eos_token_id=False)
    assert spec.token_ids == plain.token_ids
    by_name = generate([prompt], target, "heads", tokenizer=tokenizer, max_new_tokens=8, eos_token_id=False)
    assert by_name.token_ids[0] == plain.token_ids[0][:8] and by_name.stats.k == 8  # the bundled target, loaded
    assert generate([prompt], None, "heads", max_new_tokens=4, eos_token_id=False).stats.k == 8  # or by default
    assert spec.stats.tokens_per_pass > 1.3  # trained heads: most steps accept a candidate


def test_threads_sharing_a_target_with_heads_on_it_each_get_their_own_output():
    """generate(..., "heads") hooks the target's LM head, which other threads' calls on the same target share:
    each thread's heads read only its own passes, and a plain or draft-model call beside them keeps its greedy
    chains (they failed with an IndexError, and with "the plan resolved greedy_chain=True")."""
    import threading

    from specdec_ext.default_pair import load_default_pair
    from specdec_ext.generate import plain_generate

    target, draft, tokenizer = load_default_pair(dtype=torch.bfloat16)
    kw = dict(tokenizer=tokenizer, max_new_tokens=24, eos_token_id=False)
    jobs = {"heads a": lambda: generate("def fib(n):", target, "heads", **kw),
            "heads b": lambda: generate("import os\n", target, "heads", **kw),
            "plain": lambda: plain_generate("x = [", target, **kw),
            "model": lambda: generate("class A:", target, draft, **kw)}
    alone = {name: job().token_ids for name, job in jobs.items()}
    results = {name: [] for name in jobs}

    def repeat(name):
        for _ in range(3):
            try:
                results[name].append(jobs[name]().token_ids)
            except Exception as error:  # (a failure is an outcome to compare, not a crash of the thread)
                results[name].append(repr(error))

    threads = [threading.Thread(target=repeat, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {name: [tokens] * 3 for name, tokens in alone.items()}
    assert not lm_head_of(target)._forward_pre_hooks  # every heads drafter removed its hook


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_heads_and_sampled_trees_match_the_cpu(target, references):
    """On CUDA the heads drafter (the LM-head hook, the tree forward, commit_tree) gives the CPU's greedy
    tokens, and a sampled draft-model tree at T > 0 gives a valid, seeded, reproducible sample."""
    import copy
    cuda_target = copy.deepcopy(target).cuda()
    heads = random_heads(target)
    on_gpu = generate(PROMPTS, cuda_target, copy.deepcopy(heads).cuda(), max_new_tokens=NEW, draft_tree=(2, 3, 6))
    assert on_gpu.token_ids == references
    draft = copy.deepcopy(cuda_target)
    runs = []
    for _ in range(2):
        reset_calibrations()  # the same tree shapes: the same seeded sample
        runs.append(generate(PROMPTS, cuda_target, draft, max_new_tokens=NEW, draft_tree=(3, 2, 5),
                             temperature=0.8, seed=7))
    assert all(len(t) == NEW for t in runs[0].token_ids)
    assert runs[0].stats.tokens_per_pass > 1.5  # the target as its own draft: most candidates accepted
    assert runs[1].token_ids == runs[0].token_ids
