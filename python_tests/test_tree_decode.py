"""Draft trees from a draft model (generate(..., draft_tree=(b, d, N))): greedy equality with HF generate,
the exact target distribution at T = 1 (chi-square, with a verifier that skips the removal of rejected
candidates as the negative control), and tokens per target pass against the chain at equal verify budget."""
from __future__ import annotations


import pytest
import torch

from specdec_ext import generate, ops
from specdec_ext.drafters.calibration import reset_calibrations
from specdec_ext.drafters.tree_drafter import beam_widths, tree_num_nodes
from specdec_ext.metadata import Verdict
from specdec_ext.sampling import filtered_probs
from sampling_stats import chi_square_p, exact_joint
from test_generate_utils import check_eos_and_max_new_tokens, hf_greedy, noisy_copy, tiny_model

NEW = 24
PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30], [7, 7, 81, 13, 40]]  # ragged
TREES = [(2, 4, 16), (3, 3, 8)]

TINY_VOCAB = 8
POSITIONS = 3  # the prefill token, then the first tree step (root level and depth 2)
SAMPLES = 3000
PROMPT = [1, 4, 2, 6]
PASS_P = 1e-4
FAIL_P = 1e-8


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=96, hidden=64, layers=2, seed=0, logit_scale=3.0)
    return target, noisy_copy(target, noise=0.3)


@pytest.fixture(scope="module")
def references(pair):
    return [hf_greedy(pair[0], p, NEW) for p in PROMPTS]


def test_beam_widths_and_node_counts():
    assert beam_widths(2, 4, 16) == [2, 4, 8, 16] and tree_num_nodes(2, 4, 16) == 16
    assert beam_widths(3, 3, 8) == [3, 8, 8] and tree_num_nodes(3, 3, 8) == 8
    assert beam_widths(1, 4, 6) == [1, 1, 1, 1] and tree_num_nodes(1, 4, 6) == 4  # b = 1: a chain
    assert beam_widths(2, 1, 4) == [2] and tree_num_nodes(2, 1, 4) == 2
    for bad in [(0, 2, 4), (2, 0, 4), (2, 2, True)]:
        with pytest.raises(ValueError):
            beam_widths(*bad)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("runner", ["auto", "paged", "recompute"])  # auto: the lean runners (Llama)
def test_greedy_tree_matches_hf_generate_batch1_and_batch3(pair, references, tree, runner):
    target, draft = pair
    one = generate([PROMPTS[0]], target, draft, max_new_tokens=NEW, draft_tree=tree, runner=runner)
    assert one.token_ids == [references[0]]
    batch = generate(PROMPTS, target, draft, max_new_tokens=NEW, draft_tree=tree, runner=runner)
    assert batch.token_ids == references
    assert batch.stats.tokens_per_pass > 1.0  # the tree was used, not only bonus tokens
    b, d, n = batch.stats.tree  # the stats name the tree, not its node budget as a draft length "k=N"
    assert f"tree {b}x{d}, {n} nodes" in batch.stats.summary() and "k=" not in batch.stats.summary().splitlines()[0]
    assert batch.stats.as_dict()["tree"] == [b, d, n]
    # an unrelated draft and the target as its own draft give the same tokens
    other = tiny_model("llama", vocab=96, hidden=32, layers=1, seed=7)
    assert generate(PROMPTS, target, other, max_new_tokens=NEW, draft_tree=tree).token_ids == references
    self_draft = generate(PROMPTS, target, target, max_new_tokens=NEW, draft_tree=tree)
    assert self_draft.token_ids == references
    assert self_draft.stats.tokens_per_pass > 2.0
    # the draft's cache is right: its top-1 at the root is the target's argmax at every step
    assert self_draft.stats.accepted[0] == self_draft.stats.reached[0]


def test_eos_and_max_new_tokens_with_a_tree(pair, references):
    target, draft = pair
    check_eos_and_max_new_tokens(
        lambda new, eos: generate(PROMPTS, target, draft, max_new_tokens=new, draft_tree=(2, 4, 16),
                                  eos_token_id=eos), references, eos=references[1][5])


def test_draft_tree_argument_is_validated(pair):
    target, draft = pair
    for bad in [(2, 4), (0, 4, 16), (2, 4, 16.0), "2,4,16"]:
        with pytest.raises(ValueError, match="draft_tree"):
            generate([PROMPTS[0]], target, draft, max_new_tokens=4, draft_tree=bad)


# --------------------------------------------------------------------------- distribution at T = 1
@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0)
    draft = tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0)
    return target, draft


def python_tree_verifier(remove_rejected: bool):
    """tree_verify's rules in Python (row by row): with the proposal's probs (sampled candidates) accept x
    with min(1, p(x) / q_x(x)) and on rejection p <- max(0, p - q_x); without, accept x with p(x) and
    on rejection remove x from p. With remove_rejected=False it is the bug the tests must catch: a
    rejected candidate leaves p as it was (acceptance and the final draw use the unreduced p)."""

    def verifier(meta, proposal, target_logits):
        B, positions, _ = target_logits.shape
        N = positions - 1
        probs = filtered_probs(target_logits, meta.sampling).double()  # [B, N+1, V]
        q_rows = None if proposal.probs is None else proposal.probs.double()  # [B, N, V]
        u = ops.philox_uniforms(meta.seed, meta.verify_offset, N + 1).double()  # [B, N+1]
        parents, tokens = proposal.parents.tolist(), proposal.token_ids.tolist()
        meta.tree_path.fill_(-1)
        meta.output_tokens.fill_(-1)
        for b in range(B):
            cur, depth = -1, 0
            while True:
                p = probs[b, cur + 1].clone()
                moved = False
                for c in (i for i in range(N) if parents[b][i] == cur):
                    x = tokens[b][c]
                    q = None if q_rows is None else q_rows[b, c]
                    accept = u[b, c] * p.sum() < p[x] if q is None else u[b, c] * q[x] * p.sum() < p[x]
                    if accept:
                        meta.tree_path[b, depth] = c
                        meta.output_tokens[b, depth] = x
                        depth, cur, moved = depth + 1, c, True
                        break
                    if remove_rejected and q is None:
                        p[x] = 0.0
                    elif remove_rejected:
                        p = torch.clamp(p / p.sum() - q, min=0.0)
                if not moved:
                    cumulative = torch.cumsum(p, 0)
                    token = int(torch.searchsorted(cumulative, u[b, N] * cumulative[-1], right=True))
                    meta.output_tokens[b, depth] = min(token, p.shape[0] - 1)
                    meta.num_accepted[b] = depth
                    break
        return Verdict(meta.output_tokens, meta.num_accepted, meta.tree_path)

    return verifier


def sample_first_tokens(target, draft, tree, samples=SAMPLES, **kw):
    reset_calibrations()  # the same tree shapes whatever ran before (the learnt table is shared)
    out = generate([PROMPT] * samples, target, draft, max_new_tokens=POSITIONS, draft_tree=tree,
                   seed=list(range(samples)), temperature=1.0, cost_probe=False, **kw)
    assert all(len(t) == POSITIONS for t in out.token_ids)
    return out


@pytest.mark.parametrize("tree", [(2, 2, 4), (3, 2, 5)])
def test_first_tokens_follow_plain_target_sampling_at_t1(tiny_pair, tree):
    target, draft = tiny_pair
    joint = exact_joint(target, PROMPT)
    out = sample_first_tokens(target, draft, tree)
    reached, accepted = out.stats.reached, out.stats.accepted
    assert 0.05 < accepted[0] / reached[0] < 0.95  # accepts and rejections at the root
    assert accepted[1] > 0  # some rows accept a depth-2 node
    p_value = chi_square_p(out.token_ids, joint)
    print(f"\ntree {tree}: chi-square p = {p_value:.3g}, acceptance by depth {out.stats.acceptance_by_position[:2]}")
    assert p_value > PASS_P


def test_draws_past_a_one_token_q_and_fallback_come_from_the_tokens_left():
    """At a temperature near 0 the filtered q and the fallback are one token each: the next draws come from
    the tokens not drawn yet (they were 0 / 0 rows: NaN, which the verifier refused)."""
    from specdec_ext.drafters.tree_drafter import draw_without_replacement
    V = 8
    one_hot = torch.nn.functional.one_hot(torch.tensor([[3, 5]]), V).float()  # [B=1, F=2, V]
    _, tokens, rows = draw_without_replacement(one_hot, one_hot.clone(), torch.rand(1, 2, 3))
    assert torch.isfinite(rows).all() and torch.allclose(rows.sum(-1), torch.ones(1, 2, 3))
    assert tokens[0, :, 0].tolist() == [3, 5]
    for f in range(2):
        assert len(set(tokens[0, f].tolist())) == 3  # without replacement
        assert rows[0, f, 1, tokens[0, f, 0]] == 0 and torch.allclose(rows[0, f, 1].max(), torch.tensor(1 / (V - 1)))


@pytest.mark.parametrize("temperature", [1e-5, 1e-3])
def test_a_sampled_tree_near_temperature_zero_decodes_as_greedy(pair, references, temperature):
    """... up to the greedy path's first near-tie (top-2 logits within 0.01: a sample there is a coin toss)."""
    target, draft = pair
    out = generate([PROMPTS[0]], target, draft, max_new_tokens=NEW, draft_tree=(3, 2, 6), temperature=temperature,
                   seed=0)
    with torch.no_grad():
        logits = target(torch.tensor([PROMPTS[0] + references[0]])).logits[0, len(PROMPTS[0]) - 1:]  # [NEW + 1, V]
    top2 = logits.topk(2, dim=-1).values
    ties = (top2[:, 0] - top2[:, 1] < 0.01).nonzero()
    clear = NEW if len(ties) == 0 else int(ties[0])
    assert clear >= 8 and out.token_ids[0][:clear] == references[0][:clear]


def test_sampled_tree_kernel_equals_the_python_rule_draw_for_draw(tiny_pair):
    """At T > 0 the draft samples each node's children without replacement and tree_verify runs
    recursive rejection sampling with each node's own q row: with the same Philox draws the kernel
    and the Python rule give the same tokens."""
    target, draft = tiny_pair
    runs = []
    for verifier in (None, python_tree_verifier(True)):
        reset_calibrations()
        kw = {} if verifier is None else {"verifier": verifier}
        runs.append(generate([PROMPT] * 300, target, draft, max_new_tokens=6, draft_tree=(3, 2, 5),
                             seed=list(range(300)), temperature=0.9, top_p=0.95, cost_probe=False, **kw))
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.accepted[1] > 0  # depth-2 nodes were accepted


def test_sampled_tree_keeps_draws_without_looking_at_them(tiny_pair, monkeypatch):
    """Which sampled children a tree keeps must not depend on the drawn tokens. The control scores
    each draw by its own probability (so a likely draw survives the N-node cut more often); the
    kept candidates are then biased and the output distribution is wrong, which the chi-square sees."""
    import specdec_ext.drafters.tree_drafter as tree_drafter
    target, draft = tiny_pair
    joint = exact_joint(target, PROMPT)
    right = chi_square_p(sample_first_tokens(target, draft, (3, 2, 4), samples=12000).token_ids, joint)
    honest = tree_drafter.draw_without_replacement

    def peeking(q, fallback, uniforms):
        _, tokens, rows = honest(q, fallback, uniforms)
        return q.gather(-1, tokens).clamp(min=1e-30).log(), tokens, rows

    monkeypatch.setattr(tree_drafter, "draw_without_replacement", peeking)
    wrong = chi_square_p(sample_first_tokens(target, draft, (3, 2, 4), samples=12000).token_ids, joint)
    print(f"\nsampled tree: chi-square p = {right:.3g}; scoring draws by their own q: p = {wrong:.3g}")
    assert right > PASS_P and wrong < FAIL_P


def test_chi_square_catches_a_verifier_that_keeps_rejected_candidates(tiny_pair):
    target, draft = tiny_pair
    joint = exact_joint(target, PROMPT)
    right = sample_first_tokens(target, draft, (2, 2, 4), verifier=python_tree_verifier(True))
    wrong = sample_first_tokens(target, draft, (2, 2, 4), verifier=python_tree_verifier(False))
    p_right, p_wrong = chi_square_p(right.token_ids, joint), chi_square_p(wrong.token_ids, joint)
    print(f"\npython verifier with removal p = {p_right:.3g}, without removal p = {p_wrong:.3g}")
    assert p_right > PASS_P  # the Python rule is the kernel's rule: only the removal differs below
    assert p_wrong < FAIL_P


# --------------------------------------------------------------------------- tokens per target pass
def test_tree_tokens_per_pass_at_least_the_chains_at_equal_verify_budget(capsys):
    """Greedy, near-self draft (a noisy copy of the target): with N + 1 = k + 1 tokens per target pass,
    the tree's second candidates recover many of the chain's early rejections."""
    target = tiny_model("llama", vocab=64, hidden=32, layers=1, seed=0, logit_scale=3.0)
    prompts = [[1 + i, 2, 3 + i, 4, 5] for i in range(8)]
    rows = []
    for noise in (0.0, 0.3, 0.4):
        draft = target if noise == 0.0 else noisy_copy(target, noise)
        for k, tree in ((4, (2, 4, 4)), (6, (2, 6, 6))):
            assert tree_num_nodes(*tree) == k
            chain = generate(prompts, target, draft, max_new_tokens=40, k=k, cost_probe=False)
            treed = generate(prompts, target, draft, max_new_tokens=40, draft_tree=tree, cost_probe=False)
            assert treed.token_ids == chain.token_ids
            rows.append((noise, k, tree, chain.stats.tokens_per_pass, treed.stats.tokens_per_pass))
    with capsys.disabled():
        print("\nnoise  k  tree        chain tok/pass  tree tok/pass")
        for noise, k, tree, c, t in rows:
            print(f"{noise:5.1f}  {k}  {str(tree):10s}  {c:14.2f}  {t:13.2f}")
    for noise, k, tree, c, t in rows:
        if noise == 0.4:
            assert t >= c, (noise, k, tree, c, t)


# --------------------------------------------------------------------------- node calibration
def test_node_calibration_counts_reached_and_emitted_candidates():
    """Root children 0 (1st choice) and 1 (2nd choice), node 2 under node 0, node 3 under node 1.
    The target accepted node 0 then emitted token 9: nodes 0, 1, 2 were reached, node 3 was not; node 0
    was emitted, node 2 (token 9) too, node 1 not."""
    from specdec_ext.drafters.calibration import CALIBRATION_BINS, PRIOR_TRIALS, NodeCalibration
    calibration = NodeCalibration(2)
    trials, hits = calibration.trials.clone(), calibration.hits.clone()
    q = torch.tensor([[0.9, 0.05, 0.6, 0.3]])
    calibration.observe(q.log(), torch.tensor([[1, 1, 2, 2]]), torch.tensor([[0, 1, 0, 0]]),
                        tokens=torch.tensor([[5, 6, 9, 7]]), parents=torch.tensor([[-1, -1, 0, 1]]),
                        path=torch.tensor([[0, -1, -1, -1]], dtype=torch.int32),
                        num_accepted=torch.tensor([1], dtype=torch.int32),
                        emitted=torch.tensor([[5, 9, -1, -1, -1]]), active=torch.tensor([True]))
    bin_of = lambda p: min(int(p * CALIBRATION_BINS), CALIBRATION_BINS - 1)  # noqa: E731
    added_trials, added_hits = calibration.trials - trials, calibration.hits - hits
    expected_trials = torch.zeros_like(added_trials)
    expected_hits = torch.zeros_like(added_hits)
    for depth, rank, p, hit in ((1, 0, 0.9, 1), (1, 1, 0.05, 0), (2, 0, 0.6, 1)):
        expected_trials[depth - 1, rank, bin_of(p)] += 1
        expected_hits[depth - 1, rank, bin_of(p)] += hit
    torch.testing.assert_close(added_trials, expected_trials)
    torch.testing.assert_close(added_hits, expected_hits)
    # the learnt rate of a 1st choice at depth 1 near p = 0.9 moves from the prior towards 1
    rate = calibration.log_rate(0, torch.tensor([[0.9, 0.05]]).log()).exp()
    prior = (bin_of(0.9) + 0.5) / CALIBRATION_BINS
    assert rate[0, 0] == pytest.approx((prior * PRIOR_TRIALS + 1) / (PRIOR_TRIALS + 1), rel=1e-5)
    assert rate[0, 1] < (bin_of(0.05) + 0.5) / CALIBRATION_BINS  # a miss lowers the 2nd choice's rate


def test_calibration_is_shared_per_model_depth_and_temperature(pair):
    from specdec_ext.drafters.calibration import shared_calibration
    target, draft = pair
    first = shared_calibration(draft, 4, 0.0)
    assert shared_calibration(draft, 4, 0.0) is first
    assert shared_calibration(draft, 3, 0.0) is not first and shared_calibration(draft, 4, 1.0) is not first
    before = first.trials.sum().item()
    generate([PROMPTS[0]], target, draft, max_new_tokens=8, draft_tree=(2, 4, 16))
    assert first.trials.sum().item() > before  # the drafter learnt into the shared table
