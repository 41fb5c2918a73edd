"""A draft with another tokenizer than the target's (issue 29): greedy-through-text equals plain greedy
(ragged batches, EOS and stop strings inside accepted runs, adaptive k) with more than one token per pass,
and only with the boundary re-aligned; the intersection mode passes the audit at T = 1; refusals."""
from __future__ import annotations

import string

import pytest
import torch
import transformers

from specdec_ext import audit, generate, plain_generate
from specdec_ext import vocab_bridge
from specdec_ext.adaptive import AdaptiveK
from specdec_ext.models import load_models
from specdec_ext.step import lossless_verify
from specdec_ext.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdec_ext.vocab_bridge import TokenizerRoundTripError, VocabularyBridge
from test_generate_utils import char_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

# Both tokenizers are trained on this text. Words without repeated pieces: the target's tokenizer (125
# tokens) splits some of them, the draft's (140) keeps each whole, and in each tokenisation every token of
# the cycle has one successor, so a bigram model over it continues the cycle deterministically.
CYCLE = "the quick brown fox jumps over a lazy dog; "
CORPUS = [CYCLE * 4] + list(vocab_bridge.ROUND_TRIP_PROBES)
TARGET_VOCAB, DRAFT_VOCAB = 125, 140
HIDDEN = 160  # >= both vocabularies: a token is a one-hot hidden state
# ragged: prompts of different lengths, each ending at a word boundary of the cycle
MIN_TOKENS_PER_PASS = 3.9  # at k = 4 (5 at most): measured 4.14 (deterministic); 3.73 without the tail re-drafted
PROMPTS = [CYCLE + "the quick", CYCLE * 2 + "the quick brown fox jumps", "the quick brown fox jumps over a"]


def bpe_tokenizer(vocab_size: int, sentencepiece_style: bool = False) -> transformers.PreTrainedTokenizerFast:
    """A BPE tokenizer trained on CORPUS: printable ASCII, words with their leading space, exact decoding;
    ``sentencepiece_style``: spaces as "▁" and one prepended to a text (Metaspace, as Llama 2's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    alphabet = list(string.printable)
    if sentencepiece_style:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet.append("\u2581")
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[A-Za-z]+| ?[0-9]+| ?[^A-Za-z0-9\s]+|\s+"),
                                                       behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<unk>"],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>",
                                                clean_up_tokenization_spaces=False)


def bigram_model(tokenizer, text: str, scale: float = 1.0, max_positions: int = 256):
    """A Llama whose next token depends on the last one only: the successor of each token in ``tokenizer``'s
    tokenisation of ``text`` (attention and MLP write nothing, embeddings are one-hot, the head maps each
    token to its successor); tokens ``text`` does not have predict token 0 (<eos>)."""
    vocab = len(tokenizer)
    model = tiny_model("llama", vocab=vocab, hidden=HIDDEN, layers=1, max_positions=max_positions)
    ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.eye(vocab, HIDDEN))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.get_output_embeddings().weight  # [V, HIDDEN]
        head.zero_()
        for token, successor in zip(ids, ids[1:]):
            head[successor, token] = scale
    return model.eval()


@pytest.fixture(scope="module")
def bigram_pair():
    target_tokenizer, draft_tokenizer = bpe_tokenizer(TARGET_VOCAB), bpe_tokenizer(DRAFT_VOCAB)
    text = CYCLE * 8
    return (bigram_model(target_tokenizer, text), bigram_model(draft_tokenizer, text), target_tokenizer,
            draft_tokenizer)


def run_pair(pair, prompts=PROMPTS, **kw):
    target, draft, tokenizer, draft_tokenizer = pair
    kw.setdefault("max_new_tokens", 40)
    spec = generate(prompts, target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, **kw)
    plain_kw = {key: value for key, value in kw.items() if key not in ("k", "cost_probe")}
    plain = plain_generate(prompts, target, tokenizer=tokenizer, **plain_kw)
    return spec, plain


def tokens_per_pass(result) -> float:
    return result.stats.emitted / result.stats.row_steps


def test_greedy_through_text_equals_plain_greedy_on_a_ragged_batch(bigram_pair):
    spec, plain = run_pair(bigram_pair, k=4)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert [text[:6] for text in spec.text] == [" brown", " over ", " lazy "]  # the cycle goes on
    assert tokens_per_pass(spec) > MIN_TOKENS_PER_PASS, tokens_per_pass(spec)
    assert spec.plan.cross_tokenizer == "greedy-through-text"
    assert "greedy-through-text" in spec.plan.explain()


def test_without_the_boundary_realignment_acceptance_collapses(bigram_pair, monkeypatch):
    """The mutation: the draft is fed the newly committed text appended in its own tokens (no roll back to
    its tokenisation of the whole, no tail re-drafted) and the draft's text is encoded alone (no look-behind
    at the committed target tokens). Output stays lossless; the acceptance this module asserts is lost."""
    target_tokenizer = bigram_pair[2]

    def appended_context(self, row, text):
        previous, previous_text = self.contexts[row], self.context_texts[row]
        if previous and text.startswith(previous_text):
            piece = text[len(previous_text):]
            appended = self.bridge.draft_tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            tokens = previous + appended
        else:
            tokens = self.bridge.draft_ids(text)
        self.contexts[row], self.context_texts[row], self.tails[row] = tokens, text, ""
        return tokens

    monkeypatch.setattr(CrossTokenizerDrafter, "draft_context", appended_context)
    monkeypatch.setattr(VocabularyBridge, "target_continuation",
                        lambda self, committed, text: target_tokenizer(text, add_special_tokens=False)["input_ids"])
    spec, plain = run_pair(bigram_pair, k=4)
    assert spec.token_ids == plain.token_ids
    assert tokens_per_pass(spec) < MIN_TOKENS_PER_PASS, tokens_per_pass(spec)  # measured: 2.4 (4.14 re-aligned)


def test_a_sentencepiece_style_target_needs_the_realignment_at_its_boundary(bigram_pair):
    """A target tokenizer that prepends "▁" to a text (130 tokens: " quick" is "▁qu" "ick") encodes a
    draft's text on its own unlike after the committed tokens ("▁" + " fox" is "▁", "▁fo"), so the
    proposal is re-encoded with the committed text: measured 3.57 tokens per pass at k = 4, 2.78 with the
    text encoded alone (the mutation)."""
    target_tokenizer, draft_tokenizer = bpe_tokenizer(130, sentencepiece_style=True), bigram_pair[3]
    pair = (bigram_model(target_tokenizer, CYCLE * 8), bigram_pair[1], target_tokenizer, draft_tokenizer)
    spec, plain = run_pair(pair, k=4)
    assert spec.token_ids == plain.token_ids
    assert tokens_per_pass(spec) > 3.3, tokens_per_pass(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VocabularyBridge, "target_continuation",
                      lambda self, committed, text: target_tokenizer(text, add_special_tokens=False)["input_ids"])
        alone, _ = run_pair(pair, k=4)
    assert alone.token_ids == plain.token_ids and tokens_per_pass(alone) < 3.0, tokens_per_pass(alone)


def test_eos_and_stop_strings_inside_accepted_runs(bigram_pair):
    target_tokenizer = bigram_pair[2]
    eos = target_tokenizer.convert_tokens_to_ids("az")  # inside " lazy": reached mid-run of accepted drafts
    spec, plain = run_pair(bigram_pair, k=4, eos_token_id=eos)
    assert spec.token_ids == plain.token_ids and spec.finish_reasons == plain.finish_reasons == ["eos"] * 3
    assert all(tokens[-1] == eos and eos not in tokens[:-1] for tokens in spec.token_ids)
    spec, plain = run_pair(bigram_pair, k=4, stop=["fox j"])
    assert spec.text == plain.text and spec.finish_reasons == plain.finish_reasons
    assert spec.finish_reasons == ["stop"] * 3 and "fox j" not in "".join(spec.text)


def test_adaptive_k_skips_and_equals_plain_greedy(bigram_pair):
    """k="auto": on this pair a 1-layer target's pass costs less than the drafter's host work, so adaptive k
    switches speculation off (the drafter skips; measured: every step plain); its explorations every other
    step still draft, through the skipped stretches, and are accepted."""
    spec, plain = run_pair(bigram_pair, k="auto", max_new_tokens=60)
    assert spec.token_ids == plain.token_ids and spec.plan.adaptive
    spec, plain = run_pair(bigram_pair, k=AdaptiveK(4, explore_every=2), max_new_tokens=60)
    assert spec.token_ids == plain.token_ids
    summary = spec.stats.adaptive
    assert summary["speculation_off_steps"] > 0 and summary["steps_by_width"].get(2, 0) > 0, summary
    assert summary["acceptance_by_position"][0] > 0.9, summary  # measured 0.985


def test_a_row_whose_text_outgrows_the_draft_stops_drafting(bigram_pair):
    """A draft with 40 positions: the longest prompt's text outgrows it (its tokens in draft tokens and the
    drafts), so that row stops drafting while the others go on; the output is still plain greedy."""
    target, _, tokenizer, draft_tokenizer = bigram_pair
    short_draft = bigram_model(draft_tokenizer, CYCLE * 8, max_positions=40)
    spec, plain = run_pair((target, short_draft, tokenizer, draft_tokenizer), k=4)
    assert spec.token_ids == plain.token_ids
    unbounded, _ = run_pair(bigram_pair, k=4)
    assert 1.0 < tokens_per_pass(spec) < tokens_per_pass(unbounded) - 0.5  # measured 3.1 and 4.1


def test_a_first_draft_token_that_leaves_the_committed_text_is_replaced_by_the_held_token(bigram_pair):
    """_keep_to_the_tail: the draft re-drafts the held-back tail; a first token whose text neither continues
    the tail nor is a start of it would make the row propose nothing, so the held token is fed instead
    (on the bundled pair with a permuted-vocabulary draft: 4.03 -> 4.59 tokens per pass at k = 4)."""
    target, draft, tokenizer, draft_tokenizer = bigram_pair
    bridge = VocabularyBridge.build(tokenizer, draft_tokenizer, TARGET_VOCAB, DRAFT_VOCAB)
    drafter = CrossTokenizerDrafter(draft, None, k=4, bridge=bridge, mode="greedy-through-text")
    ids = draft_tokenizer.convert_tokens_to_ids
    context = draft_tokenizer("the fox")["input_ids"]
    drafter.contexts = [context] * 4
    drafter.tails = [" q", " q", "", " quick"]
    drafter.held_tokens = [ids(" q"), ids(" q"), 0, ids(" quick")]
    first = torch.tensor([ids(" quick"), ids(" brown"), ids(" brown"), ids(" q")])
    kept = drafter._keep_to_the_tail(first, [True] * 4).tolist()
    # continues the tail; leaves it (replaced); no tail; a start of the tail
    assert kept == [ids(" quick"), ids(" q"), ids(" brown"), ids(" q")]


def test_target_continuation_keeps_the_committed_tokens_and_spells_the_text(bigram_pair):
    bridge = VocabularyBridge.build(bigram_pair[2], bigram_pair[3], TARGET_VOCAB, DRAFT_VOCAB)
    encode = lambda text: bigram_pair[2](text)["input_ids"]  # noqa: E731
    # the boundary survives: the continuation is the target's own tokenisation of the whole
    assert bridge.target_continuation(encode("the q"), "uick brown") == encode("the quick brown")[2:]
    # the text merges into the last committed token (" b" + "r" is not how the target splits " brown"): the
    # committed tokens stay, and the continuation still spells the text after them
    committed = encode("the quick br")
    continuation = bridge.target_continuation(committed, "own fox")
    assert bridge.target_text(committed + continuation) == "the quick brown fox"


def test_the_intersection_moves_the_draft_distribution_onto_target_ids(bigram_pair):
    target, draft, target_tokenizer, draft_tokenizer = bigram_pair
    models = load_models(target, draft, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
    assert models.drafter == "cross-tokenizer"
    bridge = models.bridge
    shared = set(target_tokenizer.get_vocab()) & set(draft_tokenizer.get_vocab())
    assert bridge.intersection_size == len(shared) >= len(string.printable)
    draft_logits = torch.randn(2, DRAFT_VOCAB, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(bridge.to_target_logits(draft_logits), -1)  # [2, V]
    names = target_tokenizer.convert_ids_to_tokens(list(range(TARGET_VOCAB)))
    outside = torch.tensor([name not in shared for name in names])
    assert torch.all(q[:, outside] == 0)
    for name in ("the", " q", ";"):  # the draft's own probabilities, renormalised over the shared tokens
        draft_id, target_id = draft_tokenizer.convert_tokens_to_ids(name), target_tokenizer.convert_tokens_to_ids(name)
        in_shared = draft_logits[:, bridge.shared_draft_ids].logsumexp(-1)
        torch.testing.assert_close(q[:, target_id].log(), draft_logits[:, draft_id] - in_shared)


def test_sampling_through_the_intersection_passes_the_audit_at_t1():
    """Random tiny models over the two tokenizers (spread-out distributions): speculative samples at T = 1
    are distributed as the target's (audit.py's chi-square per position and joint)."""
    target_tokenizer, draft_tokenizer = bpe_tokenizer(TARGET_VOCAB), bpe_tokenizer(DRAFT_VOCAB)
    target = tiny_model("llama", vocab=TARGET_VOCAB, hidden=32, seed=3, logit_scale=6.0)
    draft = tiny_model("llama", vocab=DRAFT_VOCAB, hidden=32, seed=4, logit_scale=6.0)
    report = audit(target, draft, ["the quick"], temperature=1.0, positions=2, samples=1500, run_break_even=False,
                   verbose=False, progress=False, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
    assert report.passed, report.text()
    bridge = VocabularyBridge.build(target_tokenizer, draft_tokenizer, TARGET_VOCAB, DRAFT_VOCAB)
    shared = torch.zeros(TARGET_VOCAB, dtype=torch.bool)
    shared[bridge.shared_target_ids] = True
    proposals = []

    def checking_verifier(meta, proposal, logits):
        """Each proposed token lies in the intersection, drawn from a q that is a distribution there."""
        for b, count in enumerate(proposal.num_draft.tolist()):
            for i in range(count):
                q, token = proposal.probs[b, i], int(proposal.token_ids[b, i])
                assert shared[token] and q[token] > 0 and not q[~shared].any()
                torch.testing.assert_close(q.sum(), torch.tensor(1.0))
                proposals.append(token)
        return lossless_verify(meta, proposal, logits)

    result = generate(["the quick", "def add(a, b):\n"], target, draft, tokenizer=target_tokenizer,
                      draft_tokenizer=draft_tokenizer, temperature=1.0, seed=0, k=3, max_new_tokens=12,
                      eos_token_id=False, verifier=checking_verifier)
    assert result.plan.cross_tokenizer == "intersection" and len(proposals) > 10
    assert f"{bridge.intersection_size} tokens spelt the same" in result.plan.explain()
    assert sum(result.stats.accepted) > 0  # the intersection's drafts do get accepted


def test_sampling_through_the_intersection_under_processors_passes_the_audit():
    """With penalties and biases the intersection's q is processed as the target's p will be (the drafts
    counted before each position), and the samples are still distributed as the processed target's."""
    target_tokenizer, draft_tokenizer = bpe_tokenizer(TARGET_VOCAB), bpe_tokenizer(DRAFT_VOCAB)
    target = tiny_model("llama", vocab=TARGET_VOCAB, hidden=32, seed=3, logit_scale=6.0)
    draft = tiny_model("llama", vocab=DRAFT_VOCAB, hidden=32, seed=4, logit_scale=6.0)
    bridge = VocabularyBridge.build(target_tokenizer, draft_tokenizer, TARGET_VOCAB, DRAFT_VOCAB)
    banned = [int(t) for t in bridge.shared_target_ids[:20]]
    processors = dict(presence_penalty=1.5, repetition_penalty=1.4, logit_bias={t: -100.0 for t in banned})
    report = audit(target, draft, ["the quick"], temperature=1.0, positions=2, samples=1500, run_break_even=False,
                   verbose=False, progress=False, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer,
                   processors=processors)
    assert report.passed, report.text()
    proposed = []

    def recording_verifier(meta, proposal, logits):
        for b, count in enumerate(proposal.num_draft.tolist()):
            proposed.extend(int(t) for t in proposal.token_ids[b, :count])
            assert float(proposal.probs[b, :count][:, banned].sum()) < 1e-30 * max(count, 1)  # bans reach q
        return lossless_verify(meta, proposal, logits)

    generate(["the quick", "def add(a, b):\n"], target, draft, tokenizer=target_tokenizer,
             draft_tokenizer=draft_tokenizer, temperature=1.0, seed=0, k=3, max_new_tokens=12, eos_token_id=False,
             verifier=recording_verifier, **processors)
    assert len(proposed) > 10 and not set(proposed) & set(banned)


def bridge_size(target_tokenizer, draft_tokenizer) -> int:
    return VocabularyBridge.build(target_tokenizer, draft_tokenizer, TARGET_VOCAB, DRAFT_VOCAB).intersection_size


def test_refused_before_any_work(bigram_pair, monkeypatch):
    target, draft, tokenizer, draft_tokenizer = bigram_pair
    lossy = char_tokenizer(chars=list("abcdefghijklmnopqrstuvwxyz ;"))  # no digits, brackets, newlines
    with pytest.raises(TokenizerRoundTripError, match=r"tried 'def add.*draft tokenizer: 'def add\(a, b\)"):
        generate("the quick", target, draft, tokenizer=tokenizer, draft_tokenizer=lossy)
    with pytest.raises(TokenizerRoundTripError, match="Émile"):  # a text prompt is probed too
        generate("Émile", target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    monkeypatch.setattr(vocab_bridge, "MIN_INTERSECTION", 10_000)
    size = bridge_size(tokenizer, draft_tokenizer)
    with pytest.raises(ValueError, match=f"share only {size} \\(at least 10000 needed\\)"):
        generate("the quick", target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, temperature=1.0)
    greedy = generate("the quick", target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                      max_new_tokens=4)  # greedy drafts through text: the intersection does not matter
    assert len(greedy.token_ids[0]) == 4
    with pytest.raises(ValueError, match="draft_tree needs a draft sharing"):
        generate("the quick", target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, draft_tree=(2, 2, 3))


def _saved_pair(bigram_pair, tmp_path) -> list:
    """The pair saved under tmp_path; the CLI flags that name it."""
    target, draft, tokenizer, draft_tokenizer = bigram_pair
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    draft_tokenizer.save_pretrained(tmp_path / "draft-tokenizer")
    return ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
            "--draft-tokenizer", str(tmp_path / "draft-tokenizer")]


def test_cli_generate_with_a_draft_tokenizer(bigram_pair, tmp_path, capsys):
    from specdec_ext import cli

    code = cli.main(["generate", PROMPTS[0], *_saved_pair(bigram_pair, tmp_path), "--max-new-tokens", "12", "-k", "4",
                     "--no-stream", "--explain"])
    assert code == 0
    captured = capsys.readouterr()
    assert " brown fox jumps" in captured.out
    assert "greedy-through-text" in captured.err


def test_a_draft_tokenizer_given_as_its_directory(bigram_pair, tmp_path):
    target, draft, tokenizer, draft_tokenizer = bigram_pair
    _saved_pair(bigram_pair, tmp_path)
    by_object = generate(PROMPTS[0], target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                         max_new_tokens=8, k=3)
    by_path = generate(PROMPTS[0], target, draft, tokenizer=tokenizer, draft_tokenizer=tmp_path / "draft-tokenizer",
                       max_new_tokens=8, k=3)
    assert by_path.token_ids == by_object.token_ids and by_path.plan.drafter == "cross-tokenizer"
    with pytest.raises(ValueError, match="draft_tokenizer='/nonexistent': no such directory"):
        generate(PROMPTS[0], target, draft, tokenizer=tokenizer, draft_tokenizer="/nonexistent", max_new_tokens=2)


def test_cli_audit_with_a_draft_tokenizer(bigram_pair, tmp_path, capsys):
    """`specdec audit --draft-tokenizer`: the intersection mode audited from the command line."""
    from specdec_ext import cli

    code = cli.main(["audit", PROMPTS[0], *_saved_pair(bigram_pair, tmp_path), "--positions", "2", "--samples", "200",
                     "--max-prompts", "1", "--no-break-even", "--quiet", "--temperature", "4"])  # (T=1: one category)
    assert code == 0
    assert "PASS" in capsys.readouterr().out.upper()


# ---------------------------------------------------------------------------------------------- serving
def _serve(pair, requests, **options):
    """The requests through the serving engine over the pair (two at first, the rest as the first ends):
    each one's tokens, and the engine."""
    from specdec_ext.models import load_models
    from specdec_ext.serve.build import EngineOptions, build_engine
    from serve_utils import serve_staggered

    target, draft, tokenizer, draft_tokenizer = pair
    models = load_models(target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    assert models.drafter == "cross-tokenizer"
    engine = build_engine(models, EngineOptions(max_seq_len=192, **options))
    return serve_staggered(engine, requests), engine


def _requests(tokenizer, prompts, max_new, sampling=None, seeds=None):
    from specdec_ext.sampling import SamplingParams
    from specdec_ext.serve.request import GenerationRequest
    from specdec_ext.stops import StopCriteria
    sampling = sampling or SamplingParams()
    return [GenerationRequest(tokenizer(p)["input_ids"], sampling, 0 if seeds is None else seeds[i],
                              StopCriteria(max_new, [], []), seeded=seeds is not None) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("options", [dict(k=4, max_rows=2), dict(max_rows=3, prefill_chunk=8),
                                     dict(k=3, max_rows=3, runner="paged")])
def test_served_greedy_requests_draft_through_text_and_equal_plain_greedy(bigram_pair, options):
    prompts = PROMPTS + ["the lazy dog; the quick", CYCLE * 3]
    tokenizer = bigram_pair[2]
    served, engine = _serve(bigram_pair, _requests(tokenizer, prompts, 24), **options)
    plain = plain_generate(prompts, bigram_pair[0], tokenizer=tokenizer, max_new_tokens=24, eos_token_id=False)
    assert served == plain.token_ids
    assert engine.plan.cross_tokenizer == "by step" and "by step" in engine.plan.explain()
    if "k" in options:  # (k by load may switch speculation off here: the draft's host work costs more)
        emitted = sum(sum(record.emitted.values()) for record in engine.batcher.step_log)
        rows = sum(len(record.emitted) for record in engine.batcher.step_log)
        assert emitted / rows > 2.0  # drafts are accepted: the draft runs on each joining row's own text


def test_served_seeded_samples_return_what_generate_gives_each_alone(bigram_pair):
    """Spread-out random models (as the audit's): a served seeded sample drafts from the intersection (its
    q decides acceptance and the residual), and returns the tokens generate() gives it alone."""
    from specdec_ext.sampling import SamplingParams
    tokenizer, draft_tokenizer = bigram_pair[2], bigram_pair[3]
    target = tiny_model("llama", vocab=TARGET_VOCAB, hidden=32, seed=3, logit_scale=6.0)
    draft = tiny_model("llama", vocab=DRAFT_VOCAB, hidden=32, seed=4, logit_scale=6.0)
    sampling = SamplingParams(1.0)
    requests = _requests(tokenizer, PROMPTS, 16, sampling, seeds=[5, 6, 7])
    served, _ = _serve((target, draft, tokenizer, draft_tokenizer), requests, k=3, max_rows=2)
    alone = [generate([p], target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, k=3,
                      max_new_tokens=16, temperature=1.0, seed=5 + i, eos_token_id=False).token_ids[0]
             for i, p in enumerate(PROMPTS)]
    assert served == alone
