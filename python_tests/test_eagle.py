"""The EAGLE-3 drafter (specdec_ext/eagle/; issue 27, item 2): greedy output equal to plain greedy (chains
and EAGLE-2 trees, lean, paged and recompute targets, a reduced draft vocabulary; the bundled target), the
drafts equal a naive full-recompute EAGLE-3 after scripted acceptances and rollbacks, the exact target
distribution at T = 1 (chi-square against the exact joint and the audit's two-sample test, with a broken
verifier as the control), q zero off the draft vocabulary, adaptive k's skip, and the bad inputs."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

from eagle_utils import eagle_generate, random_head, tiny_target
from sampling_stats import chi_square_p, exact_joint
from specdec_ext.decode import LoopConfig, decode
from specdec_ext.drafters.tree_drafter import beam_widths, grow_tree, tree_num_nodes
from specdec_ext.eagle import EagleDrafter, EagleMismatchError
from specdec_ext.metadata import Verdict
from specdec_ext.plan import required_cache_len
from specdec_ext.runners import make_runner
from specdec_ext.sampling import SamplingParams
from specdec_ext.step import StepOptions, lossless_verify
from specdec_ext.stops import RowState, StopCriteria
from test_generate_utils import hf_greedy

pytestmark = pytest.mark.usefixtures("single_thread")
audit_module = importlib.import_module("specdec_ext.audit")  # (the package exports the audit() function by that name)

NEW = 20
PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30], [7, 7, 81, 13, 40]]  # ragged


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, draft_vocab=48)


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, NEW) for p in PROMPTS]


# ------------------------------------------------------------------------------ greedy == plain greedy
@pytest.mark.parametrize("runner,shape", [("lean", dict(k=4)), ("lean", dict(tree=(2, 3, 6))),
                                          ("lean", dict(k=1)), ("recompute", dict(k=3)),
                                          ("recompute", dict(tree=(3, 2, 5))), ("paged", dict(k=3)),
                                          ("paged", dict(tree=(2, 3, 6)))])
def test_greedy_output_equals_plain_greedy(target, head, references, runner, shape):
    assert eagle_generate(target, head, PROMPTS, NEW, runner=runner, **shape) == references
    for b, prompt in enumerate(PROMPTS):  # batch 1 too
        assert eagle_generate(target, head, [prompt], NEW, runner=runner, **shape) == [references[b]]


def test_greedy_with_adaptive_k_skips(target, head, references):
    from specdec_ext.adaptive import AdaptiveK
    out = eagle_generate(target, head, PROMPTS, NEW, k=6, adaptive=AdaptiveK(k_max=6))
    assert out == references


# ------------------------------------------------------------------------------ drafts == naive EAGLE-3
def naive_out(head, target64, tokens, extra=()):
    """Naive EAGLE-3 (float64, no cache): the draft layer's outputs over the committed tokens [x_0 .. x_L]
    (x_L pending) plus the drafted ``extra`` tokens, each fed with the previous output as its feature."""
    L = len(tokens) - 1
    with torch.no_grad():
        hidden = target64(input_ids=torch.tensor([tokens[:L]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i][0] for i in head.config.layer_ids], dim=-1)  # [L, n * H]
        g = head.fc(feats)  # [L, h]
        seq = list(tokens[1:]) + list(extra)
        for i in range(len(extra) + 1):
            n = L + i
            ids = torch.tensor([seq[:n]])
            q, k, v, residual = head.project(ids, g[None], torch.arange(n)[None])
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            attn = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=head.config.head_dim ** -0.5,
                enable_gqa=head.config.num_key_value_heads != head.config.num_attention_heads)
            out = head.finish(attn, residual)[0]  # [n, h]
            g = torch.cat([g, out[-1:]])
    return out[-1]


def naive_chain(head, target64, tokens, k):
    drafts = []
    for _ in range(k):
        logits = head.head(naive_out(head, target64, tokens, drafts))
        drafts.append(int(head.target_ids[logits.argmax()]))
    return drafts


def naive_tree(head, target64, tokens, tree):
    """EAGLE-2's expansion (grow_tree) with every frontier node's output recomputed along its path."""
    b, d, n = tree

    def frontier_logprobs(level, toks, parents, frontier):
        if level == 0:
            outs = [naive_out(head, target64, tokens)]
        else:
            outs = []
            for i in frontier[0].tolist():
                path = []
                while i >= 0:
                    path.append(int(toks[0, i]))
                    i = int(parents[0, i])
                outs.append(naive_out(head, target64, tokens, path[::-1]))
        logits = head.to_target_logits(head.head(torch.stack(outs)))[None]
        return torch.log_softmax(logits, dim=-1)

    return grow_tree(frontier_logprobs, beam_widths(b, d, n), b, tree_num_nodes(b, d, n))


def scripted_verifier(accepts):
    """Accept ``accepts[step % len]`` drafts of every row (a chain) or the path of first children (a tree),
    then a token of its own: the loop's rollbacks without a target opinion."""
    state = {"step": 0}

    def verifier(meta, proposal, target_logits):
        a = accepts[state["step"] % len(accepts)]
        state["step"] += 1
        meta.output_tokens.fill_(-1)
        for row in range(meta.batch_size):
            ids = proposal.token_ids[row].tolist()
            if proposal.parents is None:
                path = list(range(min(a, len(ids))))
            else:
                parents, path, cur = proposal.parents[row].tolist(), [], -1
                while len(path) < a:
                    child = next((i for i in range(len(ids)) if parents[i] == cur), None)
                    if child is None:
                        break
                    path.append(child)
                    cur = child
                meta.tree_path[row].fill_(-1)
                meta.tree_path[row, : len(path)] = torch.tensor(path, dtype=torch.int32)
            meta.output_tokens[row, : len(path)] = torch.tensor([ids[i] for i in path], dtype=torch.int64)
            meta.output_tokens[row, len(path)] = (ids[path[-1]] + 7 if path else 3) % 96
            meta.num_accepted[row] = len(path)
        return Verdict(meta.output_tokens, meta.num_accepted, None if proposal.parents is None else meta.tree_path)

    return verifier


def record_drafts(target, head, shape, accepts, steps=6):
    """(committed tokens incl. the pending one, the proposal) of every step of a scripted loop."""
    S = required_cache_len(max(len(p) for p in PROMPTS), 40, 16)
    runner = make_runner("lean", target, max_batch_size=3, max_seq_len=S, hidden_taps=head.config.layer_ids)
    drafter = EagleDrafter(runner, head, **shape)
    seen = []
    original = drafter.propose

    def spy(meta, budget=None):
        proposal = original(meta, budget)
        committed = [meta.token_buffer[b, : int(meta.seq_lens[b])].tolist() for b in range(meta.batch_size)]
        seen.append((committed, proposal.token_ids.clone(), None if proposal.parents is None else
                     proposal.parents.clone()))
        return proposal

    drafter.propose = spy
    config = LoopConfig(slots=drafter.slots, sampling=SamplingParams(), max_seq_len=S, cost_probe=False,
                        step=StepOptions(verifier=scripted_verifier(accepts)))
    rows = [RowState() for _ in PROMPTS]
    loop = decode(runner, drafter, PROMPTS, torch.zeros(3, dtype=torch.int64), StopCriteria(steps * 4), config,
                  rows=rows)
    for i, _ in enumerate(loop):
        if i > steps:
            break
    return seen


def rounded_to(head, dtype):
    """A copy of ``head`` whose matrices are rounded to ``dtype`` (what the kernels read) and kept in fp32."""
    out = copy.deepcopy(head)
    with torch.no_grad():
        for module in out.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.to(dtype).float())
    return out


# the head's chain passes on the CPU kernels (matrices read in fp32, or in bf16: the default), or in torch
@pytest.mark.parametrize("kernels,kernel_dtype", [("1", torch.float32), ("1", torch.bfloat16), ("0", None)])
def test_chain_drafts_equal_naive_eagle3_after_rollbacks(target, head, kernels, kernel_dtype, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", kernels)
    head = copy.deepcopy(head)
    reference = head if kernel_dtype is None else rounded_to(head, kernel_dtype)
    head.kernel_dtype = kernel_dtype or head.kernel_dtype
    target64, head64 = copy.deepcopy(target).double(), copy.deepcopy(reference).double()
    seen = record_drafts(target, head, dict(k=3), accepts=[0, 3, 1, 2, 0])
    assert len(seen) >= 5
    for committed, drafts, _ in seen:
        for b, tokens in enumerate(committed):
            assert drafts[b].tolist() == naive_chain(head64, target64, tokens, 3), (b, tokens)


def test_the_kernels_read_the_matrices_in_the_kernel_dtype(target, head):
    """bf16 kernels compute the head with its matrices rounded to bf16 (fp32 activations and sums): their
    draft logits match the rounded head's torch logits, not the fp32 head's; fp32 kernels match the latter."""
    out = torch.randn(6, head.config.hidden_size)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        head.kernel_dtype = dtype
        logits[dtype] = head.head(out)
    head.kernel_dtype = torch.bfloat16
    with torch.no_grad():
        exact = head.lm_head(head.norm(out))
        rounded = rounded_to(head, torch.bfloat16).lm_head(head.norm(out))
    assert torch.allclose(logits[torch.float32], exact, atol=1e-5)
    assert torch.allclose(logits[torch.bfloat16], rounded, atol=1e-5)
    assert (logits[torch.bfloat16] - exact).abs().max() > 1e-3


def test_tree_drafts_equal_naive_eagle2_expansion(target, head):
    target64, head64 = copy.deepcopy(target).double(), copy.deepcopy(head).double()
    tree = (2, 3, 5)
    seen = record_drafts(target, head, dict(tree=tree), accepts=[2, 0, 3, 1], steps=4)
    for committed, drafts, parents in seen:
        for b, tokens in enumerate(committed):
            expected = naive_tree(head64, target64, tokens, tree)
            assert drafts[b].tolist() == expected.tokens[0].tolist(), (b, tokens)
            assert parents[b].tolist() == expected.parents[0].tolist()


def test_seeded_samples_do_not_depend_on_the_batch(target, head):
    """The head's chain passes run on the batch-invariant CPU kernels: a seeded row samples the same tokens
    alone and in a batch (the project's randomness contract)."""
    sampling = SamplingParams(0.8, top_k=20)
    batch = eagle_generate(target, head, PROMPTS, NEW, k=3, sampling=sampling, seeds=[11, 12, 13])
    for b, prompt in enumerate(PROMPTS):
        assert eagle_generate(target, head, [prompt], NEW, k=3, sampling=sampling, seeds=[11 + b]) == [batch[b]]


# ------------------------------------------------------------------------------ T = 1: the target's distribution
TINY_VOCAB, PROMPT, SAMPLES = 8, [1, 4, 2, 6], 3000


@pytest.fixture(scope="module")
def tiny():
    model = tiny_target("llama", vocab=TINY_VOCAB, hidden=32, layers=6, seed=3, logit_scale=1.0)
    return model, random_head(model, draft_vocab=5, seed=4, scale=3.0)


def sample(model, head, verifier=lossless_verify, samples=SAMPLES, **shape):
    """``samples`` seeded rows of 3 tokens at T = 1 (the prefill's token, then one step of drafts)."""
    S = required_cache_len(len(PROMPT), 3, 8)
    runner = make_runner("lean", model, max_batch_size=samples, max_seq_len=S, hidden_taps=head.config.layer_ids)
    drafter = EagleDrafter(runner, head, **shape)
    config = LoopConfig(slots=drafter.slots, sampling=SamplingParams(1.0), max_seq_len=S, cost_probe=False,
                        step=StepOptions(verifier=verifier))
    rows = [RowState() for _ in range(samples)]
    for _ in decode(runner, drafter, [PROMPT] * samples, torch.arange(samples), StopCriteria(3), config, rows=rows):
        pass
    return [r.tokens for r in rows]


def uniform_q(meta, proposal, target_logits):
    """A broken verifier: the drafts' q taken as uniform, not the one they were drawn from (accepted with
    min(1, V p(x)): nearly always, so the output follows the draft)."""
    proposal = copy.copy(proposal)
    proposal.probs = torch.full_like(proposal.probs, 1.0 / proposal.probs.shape[-1])
    return lossless_verify(meta, proposal, target_logits)


@pytest.mark.parametrize("shape", [dict(k=2), dict(tree=(2, 2, 3))])
def test_sampling_at_t1_is_the_target_distribution(tiny, shape):
    model, head = tiny
    joint = exact_joint(model, PROMPT)
    samples = sample(model, head, **shape)
    assert chi_square_p(samples, joint) > 1e-4
    if "k" in shape:
        assert chi_square_p(sample(model, head, verifier=uniform_q, **shape), joint) < 1e-8


def test_the_audit_passes_at_t1_for_chains(tiny):
    """audit.py's two-sample tests (per position and joint, Bonferroni) against its plain sampler."""
    model, head = tiny
    sampling = SamplingParams(1.0)
    spec = [tuple(s) for s in sample(model, head, k=2, samples=2000)]
    plain = audit_module.plain_samples(model, PROMPT, 2000, 3, sampling, seed=0)
    tests = [audit_module._test(0, str(p + 1), [s[p] for s in spec], [s[p] for s in plain]) for p in range(3)]
    tests.append(audit_module._test(0, "joint", spec, plain))
    report = audit_module.AuditReport(sampling, tests, audit_module.DEFAULT_ALPHA)
    assert report.passed, report.text()


def test_q_is_the_filtered_draft_distribution_zero_off_the_draft_vocabulary(tiny):
    model, head = tiny
    S = required_cache_len(len(PROMPT), 3, 8)
    runner = make_runner("lean", model, max_batch_size=2, max_seq_len=S, hidden_taps=head.config.layer_ids)
    drafter = EagleDrafter(runner, head, k=3)
    captured = []

    def verifier(meta, proposal, logits):
        captured.append((proposal.token_ids.clone(), proposal.probs.clone()))
        return lossless_verify(meta, proposal, logits)

    config = LoopConfig(slots=3, sampling=SamplingParams(0.7, top_k=3), max_seq_len=S, cost_probe=False,
                        step=StepOptions(verifier=verifier))
    for _ in decode(runner, drafter, [PROMPT] * 2, torch.arange(2), StopCriteria(3), config):
        pass
    tokens, probs = captured[0]
    off = ~head.t2d
    assert torch.all(probs[..., off] == 0)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    assert torch.all((probs > 0).sum(-1) <= 3)  # top-k 3
    assert torch.all(probs.gather(2, tokens[:, :, None]) > 0)  # each token drawn from its q


# ------------------------------------------------------------------------------ bad inputs
def test_a_head_for_another_target_or_an_untapped_runner_is_refused(target, head):
    untapped = make_runner("lean", target, max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="hidden_taps"):
        EagleDrafter(untapped, head)
    other = make_runner("lean", target, max_batch_size=1, max_seq_len=32, hidden_taps=(1, 2, 3))
    with pytest.raises(ValueError, match=r"taps layers \(1, 2, 3\).*trained on layers \(2, 3, 3\)"):
        EagleDrafter(other, head)
    wide = tiny_target("llama", hidden=96)
    runner = make_runner("lean", wide, max_batch_size=1, max_seq_len=32, hidden_taps=head.config.layer_ids)
    with pytest.raises(EagleMismatchError, match="size 64, this target's are 96"):
        EagleDrafter(runner, head)
    tapped = make_runner("lean", target, max_batch_size=1, max_seq_len=32, hidden_taps=head.config.layer_ids)
    with pytest.raises(ValueError, match="k must be an int"):
        EagleDrafter(tapped, head, k=0)


# ------------------------------------------------------------------------------ the bundled target
def test_bundled_target_with_a_random_head_is_plain_greedy():
    """The bundled bf16 target (6 layers, d = 512) on its CPU kernels with a randomly initialised EAGLE head
    (default layers (2, 3, 3), a 1024-token draft vocabulary): losslessness needs no good draft."""
    import specdec_ext
    target, _, tokenizer = specdec_ext.load_default_pair()
    head = random_head(target, draft_vocab=1024, seed=0, intermediate_size=512)
    assert head.config.layer_ids == (2, 3, 3)
    prompts = [tokenizer.encode("def fib(n):\n"), tokenizer.encode("import os\nimport")]
    plain = specdec_ext.plain_generate(prompts, target, max_new_tokens=24, eos_token_id=False).token_ids
    assert eagle_generate(target, head, prompts, 24, k=4) == plain
    assert eagle_generate(target, head, prompts, 24, tree=(2, 3, 6)) == plain


def test_the_bundled_head_keeps_the_bundled_targets_output_and_drafts():
    """draft="eagle": the shipped head (int8 storage, default_pair/eagle/) on the bundled target, chain and
    tree, greedy equal to plain greedy; trained, it drafts tokens the target accepts (a random head of the
    same shape stays near one token per pass)."""
    import os
    import specdec_ext
    from specdec_ext.default_pair import EAGLE_DIR
    from specdec_ext.eagle.checkpoints import INT8_WEIGHTS
    assert os.path.isfile(os.path.join(EAGLE_DIR, INT8_WEIGHTS))
    target, _, tokenizer = specdec_ext.load_default_pair()
    prompts = [tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n"),
               tokenizer.encode("import os\nimport sys\n\n\ndef main():\n")]
    plain = specdec_ext.plain_generate(prompts, max_new_tokens=32, eos_token_id=False).token_ids
    chain = specdec_ext.generate(prompts, draft="eagle", k=4, max_new_tokens=32, eos_token_id=False)
    tree = specdec_ext.generate(prompts, draft="eagle", draft_tree=(3, 3, 8), max_new_tokens=32, eos_token_id=False)
    assert chain.token_ids == plain and tree.token_ids == plain
    assert chain.plan.drafter == "eagle" and chain.plan.hidden_taps == (1, 3, 5)
    assert chain.stats.emitted / chain.stats.row_steps > 1.5
