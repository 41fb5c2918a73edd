"""An outside sweep of the drafters (n-gram lookup, a draft with another tokenizer, Medusa heads, a draft
model) at their edges: the lookup's documented rule against an independent O(n) reference (100k tokens,
huge ids, ties), genuinely different offline-trained tokenizers (byte-level BPE, byte-fallback
SentencePiece-style BPE, Unigram, a char-level vocabulary) with emoji / CJK / whitespace-heavy text,
heads trees at their edges, and every drafter over batches 1..16 with EOS, stop strings and max_new_tokens 1.

Two defects the sweep found (a lowercasing draft tokenizer let through, the heads' default tree deeper than the heads)
are fixed; their tests say so."""
from __future__ import annotations

import random
import string

import pytest
import torch
import transformers

from specdec_ext import generate, plain_generate
from specdec_ext._C import SuffixAutomaton
from specdec_ext.drafters.ngram import NgramDrafter
from specdec_ext.metadata import SpecDecodeMetadata
from specdec_ext.sampling import SamplingParams
from specdec_ext.vocab_bridge import ROUND_TRIP_PROBES, TokenizerRoundTripError, check_round_trip
from sampling_stats import chi_square_p, exact_joint
from test_generate_utils import char_tokenizer, noisy_copy, tiny_model
from test_heads import random_heads
from test_ngram_drafter import ref_propose

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

PASS_P = 1e-4


# ============================================================================ the lookup's rule, independently
def z_reference(seq):
    """(L, e) of the documented rule by the Z-function of the reversed sequence (O(n)): the longest suffix
    of ``seq`` that also ends at some e < n - 1, and the EARLIEST such e; (0, -1) when none."""
    r = list(reversed(seq))
    n = len(r)
    z = [0] * n
    left = right = 0
    best, best_i = 0, -1
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and r[z[i]] == r[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
        if z[i] >= best and z[i] > 0:  # ties: the larger i is the earlier end e = n - 1 - i
            best, best_i = z[i], i
    return (best, n - 1 - best_i) if best > 0 else (0, -1)


def rule_propose(seq, m, min_match, overlap_copy=True):
    return ref_propose(seq, m, min_match, overlap_copy, match=z_reference)  # (its match from the Z-function)


def test_z_reference_agrees_with_hand_cases():
    assert z_reference([]) == (0, -1) and z_reference([3]) == (0, -1)
    assert z_reference([1, 2, 3, 1, 2]) == (2, 1)
    assert z_reference([7, 7, 7, 7]) == (3, 2)  # the overlapping earlier occurrence
    assert z_reference([1, 9, 1, 8, 1]) == (1, 0)  # a tie of one-token matches: the earliest (e = 0)
    assert rule_propose([1, 9, 1, 8, 1], 2, 1) == [9, 1]


def test_lookup_on_100k_tokens_with_huge_ids_follows_the_rule_at_every_checkpoint():
    """100k tokens (a few loops, random noise, ids near int64's end) extended in ragged chunks; at checkpoints
    the match, its earliest end and the proposals (overlap copy on and off, min_match 1..3) follow the
    documented rule; proposals only ever hold ids seen before."""
    rng = random.Random(11)
    big = 2 ** 62
    alphabet = [0, 1, 2, big - 1, big, 2 ** 63 - 1]
    seq = []
    while len(seq) < 100_000:
        kind = rng.random()
        if kind < 0.4:
            loop = [rng.choice(alphabet) for _ in range(rng.randrange(1, 9))]
            seq += loop * rng.randrange(1, 30)
        elif kind < 0.7:
            seq += [rng.choice(alphabet) for _ in range(rng.randrange(1, 60))]
        else:  # an earlier stretch again (edit-like)
            start = rng.randrange(max(len(seq), 1))
            seq += seq[start:start + rng.randrange(1, 200)]
    seq = seq[:100_000]
    seen = set(seq)
    automata = [SuffixAutomaton(min_match, overlap) for min_match in (1, 3) for overlap in (True, False)]
    pos = 0
    checkpoints = sorted({1, 2, 3, 50, 999, 4096, 65_537, 99_999, 100_000} | {rng.randrange(100_000) for _ in range(6)})
    for stop in checkpoints:
        for a in automata:
            a.extend(seq[pos:stop])
        pos = stop
        prefix = seq[:stop]
        length, end = z_reference(prefix)
        for a in automata:
            assert (a.match_length(), a.match_end()) == (length, end), stop
            for m in (1, 5, 17):
                got = a.propose(m)
                assert got == rule_propose(prefix, m, a.min_match, a.overlap_copy), (stop, m)
                assert set(got) <= seen


def test_ngram_drafter_on_a_100k_token_prompt_follows_the_rule_per_row():
    """The drafter (not the automaton alone): a 100k-token row, a 1-token row and an all-identical row, each
    proposing what the rule says, padded with 0 past num_draft, never an id the row has not seen."""
    rng = random.Random(3)
    long_row = [rng.randrange(50_000) for _ in range(60_000)]
    long_row += long_row[10_000:50_000]  # the suffix's longest match: 40k tokens back
    rows = [long_row, [7], [5] * 300]
    k = 6
    S = len(long_row) + 8
    meta = SpecDecodeMetadata.allocate(batch_size=3, slots=k, max_seq_len=S, sampling=SamplingParams(),
                                       seeds=torch.zeros(3, dtype=torch.int64))
    for b, row in enumerate(rows):
        meta.token_buffer[b, :len(row)] = torch.tensor(row)
        meta.seq_lens[b] = len(row)
    drafter = NgramDrafter(k, min_match=1)
    drafter.prefill(rows, meta)
    proposal = drafter.propose(meta)
    want = [rule_propose(row, k, 1) for row in rows]
    assert want[0] == long_row[50_000:50_006] and want[1] == [] and want[2] == [5] * 6
    assert proposal.num_draft.tolist() == [len(w) for w in want]
    assert proposal.token_ids.tolist() == [w + [0] * (k - len(w)) for w in want]
    assert proposal.longest == 6


# ============================================================================ generate(draft="ngram")
@pytest.fixture(scope="module")
def sharp_target():
    return tiny_model("llama", vocab=96, hidden=32, layers=1, logit_scale=4.0, max_positions=4096)


def _sweep_prompts(n, seed=0, vocab=96):
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.choice([1, 2, 3, 8, 31, 64])
        kind = rng.randrange(4)
        if kind == 0:
            prompts.append([rng.randrange(vocab) for _ in range(length)])
        elif kind == 1:
            prompts.append([vocab - 1] * length)  # all identical, the vocabulary's last id
        elif kind == 2:
            loop = [rng.randrange(vocab - 4, vocab) for _ in range(rng.randrange(1, 4))]  # ids near the end
            prompts.append((loop * length)[:length])
        else:
            prompts.append([0] * length)
    return prompts


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
def test_ngram_greedy_equals_plain_for_awkward_prompts_and_every_batch(sharp_target, batch):
    prompts = _sweep_prompts(batch, seed=batch)
    plain = plain_generate(prompts, sharp_target, max_new_tokens=24, eos_token_id=False)
    for k in (1, 4, 8):
        spec = generate(prompts, sharp_target, "ngram", k=k, max_new_tokens=24, eos_token_id=False)
        assert spec.token_ids == plain.token_ids, k
    one = generate(prompts, sharp_target, "ngram", k=3, max_new_tokens=1, eos_token_id=False)
    assert one.token_ids == [t[:1] for t in plain.token_ids]


def test_ngram_on_a_3000_token_periodic_prompt_equals_plain_and_speculates(sharp_target):
    rng = random.Random(5)
    loop = [rng.randrange(96) for _ in range(37)]
    prompts = [(loop * 90)[:3000], [rng.randrange(96) for _ in range(2999)]]
    plain = plain_generate(prompts, sharp_target, max_new_tokens=40, eos_token_id=False)
    spec = generate(prompts, sharp_target, "ngram", k=6, max_new_tokens=40, eos_token_id=False)
    assert spec.token_ids == plain.token_ids
    assert sum(spec.stats.reached) > 0


def test_ngram_seeded_samples_are_reproducible_and_batch_invariant(sharp_target):
    prompts = _sweep_prompts(6, seed=9)
    kw = dict(max_new_tokens=16, eos_token_id=False, temperature=0.7, top_p=0.9, k=3)
    batched = generate(prompts, sharp_target, "ngram", seed=list(range(100, 106)), **kw)
    again = generate(prompts, sharp_target, "ngram", seed=list(range(100, 106)), **kw)
    alone = [generate([p], sharp_target, "ngram", seed=[100 + i], **kw).token_ids[0] for i, p in enumerate(prompts)]
    assert batched.token_ids == again.token_ids == alone


def test_ngram_eos_and_stop_strings_inside_accepted_runs():
    """A char vocabulary and a loop the target copies: the EOS / stop string falls inside an accepted run."""
    tokenizer = char_tokenizer()
    target = tiny_model("llama", vocab=64, hidden=32, layers=1, logit_scale=4.0)
    prompts = ["abc abc abc", "x", "q=1;q=1;q=1;q"]
    base = plain_generate(prompts, target, tokenizer=tokenizer, max_new_tokens=30, eos_token_id=False)
    eos = base.token_ids[0][5]  # a token the first row emits mid-way
    stop_text = base.text[2][3:5]
    for kw in (dict(eos_token_id=eos), dict(stop=[stop_text], eos_token_id=False), dict(eos_token_id=False)):
        plain = plain_generate(prompts, target, tokenizer=tokenizer, max_new_tokens=30, **kw)
        spec = generate(prompts, target, "ngram", tokenizer=tokenizer, k=5, max_new_tokens=30, **kw)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.finish_reasons == plain.finish_reasons
    ids = [tokenizer(p)["input_ids"] for p in prompts] + [[2, 3, 4, 0], [0]]  # prompts that end with EOS
    ended = plain_generate(ids, target, tokenizer=tokenizer, max_new_tokens=8, eos_token_id=0)
    spec = generate(ids, target, "ngram", tokenizer=tokenizer, k=4, max_new_tokens=8, eos_token_id=0)
    assert spec.token_ids == ended.token_ids and spec.finish_reasons == ended.finish_reasons


def test_ngram_near_max_seq_len(sharp_target):
    """The cache just fits: an asked k is refused with the numbers, a k left to the plan shrinks (down to plain
    decoding), and the output is plain greedy's."""
    prompt = [[3, 4, 5, 3, 4, 5, 3]]
    plain = plain_generate(prompt, sharp_target, max_new_tokens=6, eos_token_id=False)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(prompt, sharp_target, "ngram", k=4, max_new_tokens=6, max_seq_len=16, eos_token_id=False)
    for limit in (13, 14, 15, 16, 17, 40):
        spec = generate(prompt, sharp_target, "ngram", max_new_tokens=6, max_seq_len=limit, eos_token_id=False)
        assert spec.token_ids == plain.token_ids, limit


# ============================================================================ heads
@pytest.fixture(scope="module")
def heads_target():
    return tiny_model("llama", vocab=96, hidden=64, layers=2, seed=0, logit_scale=3.0, max_positions=512)


@pytest.mark.parametrize("tree", [(1, 1, 1), (1, 4, 4), (4, 1, 4), (2, 2, 1), (3, 2, 100), (96, 1, 96)])
def test_heads_trees_at_the_edges_with_ragged_batches_and_eos(heads_target, tree):
    heads = random_heads(heads_target, 4)
    prompts = [p for p in _sweep_prompts(9, seed=4)]
    plain = plain_generate(prompts, heads_target, max_new_tokens=12, eos_token_id=False)
    spec = generate(prompts, heads_target, heads, draft_tree=tree, max_new_tokens=12, eos_token_id=False)
    assert spec.token_ids == plain.token_ids
    eos = plain.token_ids[0][3]
    plain = plain_generate(prompts, heads_target, max_new_tokens=12, eos_token_id=eos)
    spec = generate(prompts, heads_target, heads, draft_tree=tree, max_new_tokens=12, eos_token_id=eos)
    assert spec.token_ids == plain.token_ids and spec.finish_reasons == plain.finish_reasons


def test_heads_tree_deeper_than_the_heads_is_refused_naming_both(heads_target):
    with pytest.raises(ValueError, match="depth d = 3 exceeds the 2 heads"):
        generate([[1, 2]], heads_target, random_heads(heads_target, 2), draft_tree=(2, 3, 4), max_new_tokens=2)


def test_heads_fewer_than_the_default_trees_depth_draft_as_deep_as_they_reach(heads_target):
    """Was a defect: MedusaHeads with 2 heads and no draft_tree were refused with "draft tree depth 3 exceeds the
    2 heads", a tree the user never asked for (the default HEADS_TREE = (3, 3, 8)). Now the default tree is no
    deeper than the heads, and an asked tree deeper than them is refused naming draft_tree."""
    heads = random_heads(heads_target, 2)
    plain = plain_generate([[1, 2]], heads_target, max_new_tokens=6)
    result = generate([[1, 2]], heads_target, heads, max_new_tokens=6)
    assert result.token_ids == plain.token_ids and result.plan.tree == (3, 2, 8)
    with pytest.raises(ValueError, match=r"draft_tree=\(2, 3, 4\): depth d = 3 exceeds the 2 heads"):
        generate([[1, 2]], heads_target, heads, draft_tree=(2, 3, 4), max_new_tokens=2)


def test_bundled_heads_batches_and_trees_keep_the_bundled_greedy_output():
    import specdec_ext
    target, _, tokenizer = specdec_ext.load_default_pair()
    prompts = ["def fib(n):", "x", "import os\nimport sys\n", "    return", "\n\n\n"]
    plain = plain_generate(prompts, target, tokenizer=tokenizer, max_new_tokens=10)
    for tree in ((1, 1, 1), (1, 3, 3), (3, 3, 8)):
        spec = generate(prompts, target, "heads", tokenizer=tokenizer, draft_tree=tree, max_new_tokens=10)
        assert spec.token_ids == plain.token_ids, tree
    with pytest.raises(ValueError, match="exceeds the 3 heads"):
        generate(prompts[:1], target, "heads", tokenizer=tokenizer, draft_tree=(2, 4, 4), max_new_tokens=2)
    with pytest.raises(ValueError, match="bundled target"):
        generate([[1, 2]], tiny_model("llama", vocab=96), "heads", max_new_tokens=2)


# ============================================================================ a draft with another tokenizer
TEXT = ("the quick brown fox jumps over a lazy dog; " * 3 + "def add(a, b):\n    return a + b\n"
        + "hello, world! 123 two  spaces; x = [1, 2] # done\n"
        + "Der Bär läuft schnell. 東京は大きい都市です。 emoji 🙂🚀 ok\n"
        + "\tindented\n\n\nmany   spaces    here\n") * 4


def byte_level_bpe(vocab=400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                clean_up_tokenization_spaces=False)


def byte_fallback_bpe(vocab=400):
    """Llama-2 style: "▁" for spaces, one prepended, byte fallback, BOS added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False, limit_alphabet=120,
                                  initial_alphabet=list(string.ascii_letters + string.digits) + ["\u2581"])
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", clean_up_tokenization_spaces=False)


def unigram_metaspace(vocab=300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False, initial_alphabet=list(string.printable))
    tok.train_from_iterator([TEXT], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                                                pad_token="<pad>", clean_up_tokenization_spaces=False)


def wordpiece_lowercase(vocab=300):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
                                        show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                                sep_token="[SEP]", pad_token="[PAD]")


def bigram_model(tokenizer, text, scale=8.0):
    """A Llama whose next token is the successor of the last one in ``tokenizer``'s tokenisation of ``text``
    (one-hot embeddings, attention and MLP silenced): two such models over different tokenizers of the same
    text agree on the text, so a cross-tokenizer draft is accepted."""
    V = len(tokenizer)
    H = (V + 7) // 8 * 8
    model = tiny_model("llama", vocab=V, hidden=H, layers=1, max_positions=512)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.eye(V, H))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.get_output_embeddings().weight
        head.zero_()
        for a, b in zip(ids, ids[1:]):
            head[b, a] = scale
    return model.eval()


CYCLE = "the quick 東京 fox 🙂 jumps;  over\n\tlazy dog. "


@pytest.fixture(scope="module")
def tokenizers_and_models():
    toks = {"byte-level": byte_level_bpe(), "byte-fallback": byte_fallback_bpe(), "unigram": unigram_metaspace()}
    return {name: (tok, bigram_model(tok, CYCLE * 6)) for name, tok in toks.items()}


@pytest.mark.parametrize("target_name,draft_name", [("byte-level", "byte-fallback"), ("byte-fallback", "byte-level"),
                                                    ("unigram", "byte-level"), ("byte-level", "unigram"),
                                                    ("byte-fallback", "unigram")])
def test_cross_tokenizer_greedy_equals_plain_over_different_tokenizer_families(tokenizers_and_models, target_name,
                                                                               draft_name):
    (target_tok, target), (draft_tok, draft) = tokenizers_and_models[target_name], tokenizers_and_models[draft_name]
    prompts = ["the quick", CYCLE + "the quick 東京 fox 🙂", "jumps;  over\n\tlazy", "🚀🚀 東京は", "x"]
    emoji = target_tok("fox 🙂 jumps", add_special_tokens=False)["input_ids"]
    cut = [int(i) for i in emoji[:-1]]  # as token ids, maybe ending inside the emoji's bytes
    for batch in (prompts, [cut, cut[:2]]):
        plain = plain_generate(batch, target, tokenizer=target_tok, max_new_tokens=20, eos_token_id=False)
        for k in (1, 4):
            spec = generate(batch, target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, k=k,
                            max_new_tokens=20, eos_token_id=False)
            assert spec.plan.drafter == "cross-tokenizer"
            assert spec.token_ids == plain.token_ids, k
        one = generate(batch, target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, k=3, max_new_tokens=1,
                       eos_token_id=False)
        assert one.token_ids == [t[:1] for t in plain.token_ids]


def test_cross_tokenizer_byte_level_target_with_a_unigram_draft_drafts_and_is_accepted(tokenizers_and_models):
    """The pair that agrees on the text (byte-level target, Unigram draft): more than one token per pass."""
    (target_tok, target), (draft_tok, draft) = tokenizers_and_models["byte-level"], tokenizers_and_models["unigram"]
    spec = generate(["the quick"], target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, k=4,
                    max_new_tokens=30, eos_token_id=False)
    assert spec.stats.emitted / spec.stats.row_steps > 1.5


def test_cross_tokenizer_refuses_a_draft_that_does_not_round_trip_before_any_work(tokenizers_and_models):
    target_tok, target = tokenizers_and_models["byte-level"]
    wordpiece = wordpiece_lowercase()
    draft = tiny_model("llama", vocab=len(wordpiece), hidden=32)
    with pytest.raises(TokenizerRoundTripError, match=r"draft tokenizer: 'def add\(a, b\):\\n"):
        generate("the quick", target, draft, tokenizer=target_tok, draft_tokenizer=wordpiece, max_new_tokens=2)
    unigram_tok, unigram = tokenizers_and_models["unigram"]
    with pytest.raises(TokenizerRoundTripError, match="'  leading'"):  # Unigram's Metaspace drops one of two spaces
        generate("  leading", target, unigram, tokenizer=target_tok, draft_tokenizer=unigram_tok, max_new_tokens=2)


def lowercasing_copy(tokenizer_factory):
    from tokenizers import normalizers
    tokenizer = tokenizer_factory()
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    return tokenizer


def test_round_trip_probes_catch_a_lowercasing_tokenizer(tokenizers_and_models):
    """Was a defect: vocab_bridge.ROUND_TRIP_PROBES said it held "what a tokenizer that ... lowercases ... fails
    on", but every probe was lower case, so a draft tokenizer that lowercases all text passed check_round_trip.
    Now DRAFT_FIDELITY_PROBES (capitals, tabs) must round-trip through the draft wherever the target's do. (A
    lowercasing copy of the target's own vocabulary drafts by ids and never uses its text: that pair runs.)"""
    assert all(probe == probe.lower() for probe in ROUND_TRIP_PROBES)  # (the shared probes stay as they were)
    target_tok, target = tokenizers_and_models["byte-level"]
    lowercasing = lowercasing_copy(byte_level_bpe)
    assert lowercasing.decode(lowercasing("Hello")["input_ids"]) == "hello"
    with pytest.raises(TokenizerRoundTripError, match="draft tokenizer: 'Hello, World!.* -> 'hello, world!"):
        check_round_trip(target_tok, lowercasing)
    check_round_trip(target_tok, target_tok)


def _char_and_byte_level_pair():
    tokenizer = char_tokenizer()
    target = tiny_model("llama", vocab=64, hidden=32, layers=2, seed=3, logit_scale=3.0)
    draft_tok = byte_level_bpe(300)
    draft = tiny_model("llama", vocab=len(draft_tok), hidden=32, layers=1, seed=4, logit_scale=3.0)
    return target, tokenizer, draft, draft_tok


def test_cross_tokenizer_intersection_samples_follow_the_target_law():
    """Char-level target (61 tokens in a 64-wide head) and a byte-level BPE draft: at T = 1 the second and
    third new tokens (both draft positions of the first step) are distributed as plain sampling from the
    target (chi-square against the exact marginals); recovering a rejection from p instead of
    max(0, p - q) (the negative control) is caught on the same samples' scale."""
    from test_generate_sampling import residual_from_p_verifier
    target, tokenizer, draft, draft_tok = _char_and_byte_level_pair()
    prompt = "the quick"
    joint = exact_joint(target, tokenizer(prompt)["input_ids"])  # [V, V, V]
    marginals = (joint.sum((0, 2)), joint.sum((0, 1)))
    rows = 2500
    for verifier, good in ((None, True), (residual_from_p_verifier, False)):
        extra = {} if verifier is None else dict(verifier=verifier)
        spec = generate([prompt] * rows, target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tok,
                        temperature=1.0, seed=list(range(rows)), k=2, max_new_tokens=3, eos_token_id=False, **extra)
        assert spec.plan.cross_tokenizer == "intersection"
        assert all(len(t) == 3 for t in spec.token_ids)
        assert 0 < sum(spec.stats.accepted) < sum(spec.stats.reached)
        p_values = [chi_square_p([t[i:i + 1] for t in spec.token_ids], m) for i, m in ((1, marginals[0]),
                                                                                        (2, marginals[1]))]
        if good:
            assert min(p_values) > PASS_P, p_values
        else:
            assert min(p_values) < 1e-8, p_values


# ============================================================================ every drafter, batches 1..16
@pytest.fixture(scope="module")
def char_pair():
    tokenizer = char_tokenizer()
    target = tiny_model("llama", vocab=64, hidden=32, layers=2, seed=0, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.2), tokenizer


@pytest.mark.parametrize("drafter", ["ngram", "model", "tree", "heads", "cross"])
def test_every_drafter_batches_1_to_16_with_eos_stop_and_one_token(char_pair, drafter):
    target, draft, tokenizer = char_pair
    texts = SWEEP_TEXTS * 2
    options = dict(tokenizer=tokenizer, **_drafter_options(drafter, target, draft))
    reference = plain_generate(texts, target, tokenizer=tokenizer, max_new_tokens=12, eos_token_id=False)
    eos = reference.token_ids[0][4]
    stop = reference.text[3][2:4]
    for batch in (1, 3, 16):
        rows = texts[:batch]
        for kw in (dict(eos_token_id=eos), dict(stop=[stop], eos_token_id=False), dict(max_new_tokens=1)):
            kw.setdefault("max_new_tokens", 12)
            kw.setdefault("eos_token_id", False)
            plain = plain_generate(rows, target, tokenizer=tokenizer, **kw)
            spec = generate(rows, target, **options, **kw)
            assert spec.token_ids == plain.token_ids, (batch, kw)
            assert spec.text == plain.text and spec.finish_reasons == plain.finish_reasons, (batch, kw)


def _drafter_options(name, target, draft):
    if name == "ngram":
        return dict(draft="ngram", k=4)
    if name == "model":
        return dict(draft=draft, k=3)
    if name == "tree":
        return dict(draft=draft, draft_tree=(2, 2, 3))
    if name == "heads":
        return dict(draft=random_heads(target, 2, seed=5), draft_tree=(2, 2, 3))
    draft_tok = byte_level_bpe(300)
    return dict(draft=tiny_model("llama", vocab=len(draft_tok), hidden=32, seed=6, logit_scale=3.0),
                draft_tokenizer=draft_tok, k=3)


DRAFTERS = ["ngram", "model", "tree", "heads", "cross"]
SWEEP_TEXTS = ["abc abc abc", "x", "def f(a):\n  return a", "q=1;q=1;q=1;", "  spaces  ", "z" * 40, "a(b)[c]",
               "0123456789"]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_seeded_samples_do_not_depend_on_the_batch(char_pair, drafter):
    """A row's sample depends on its prompt and seed only: batched, alone, and in reversed batch order."""
    target, draft, tokenizer = char_pair
    options = _drafter_options(drafter, target, draft)
    kw = dict(tokenizer=tokenizer, max_new_tokens=12, eos_token_id=False, temperature=0.8, top_p=0.9, **options)
    seeds = list(range(40, 48))
    batched = generate(SWEEP_TEXTS, target, seed=seeds, **kw).token_ids
    alone = [generate([text], target, seed=[seed], **kw).token_ids[0] for text, seed in zip(SWEEP_TEXTS, seeds)]
    reversed_batch = generate(SWEEP_TEXTS[::-1], target, seed=seeds[::-1], **kw).token_ids[::-1]
    assert batched == alone == reversed_batch


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_greedy_under_processors_and_logprobs_equals_plain(char_pair, drafter):
    """Penalties (which the repeated tokens an n-gram drafts trigger), biases and min_p, with logprobs: the
    tokens and every logprob (with its top 3) are plain decoding's."""
    target, draft, tokenizer = char_pair
    options = _drafter_options(drafter, target, draft)
    for processors in (dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.6),
                       dict(logit_bias={31: 5.0, 22: -3.0}, min_p=0.1)):
        kw = dict(tokenizer=tokenizer, max_new_tokens=12, eos_token_id=False, logprobs=3, **processors)
        plain = plain_generate(SWEEP_TEXTS, target, **kw)
        spec = generate(SWEEP_TEXTS, target, **options, **kw)
        assert spec.token_ids == plain.token_ids, processors
        for got_row, want_row in zip(spec.logprobs, plain.logprobs):
            for got, want in zip(got_row, want_row):
                assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
                assert [t for t, _ in got.top] == [t for t, _ in want.top]


@pytest.mark.parametrize("target_name,draft_name", [("byte-level", "unigram"), ("byte-fallback", "byte-level"),
                                                    ("unigram", "byte-fallback")])
def test_cross_tokenizer_prompts_of_special_tokens_only(tokenizers_and_models, target_name, draft_name):
    """Prompts whose text is empty (only the target's special tokens): the draft starts from its filler token;
    greedy equals plain greedy and a seeded sample runs and repeats."""
    (target_tok, target), (draft_tok, draft) = tokenizers_and_models[target_name], tokenizers_and_models[draft_name]
    specials = sorted(set(target_tok.all_special_ids))
    prompts = [[s] for s in specials] + [specials * 2]
    kw = dict(tokenizer=target_tok, max_new_tokens=10, eos_token_id=False)
    plain = plain_generate(prompts, target, **kw)
    spec = generate(prompts, target, draft, draft_tokenizer=draft_tok, k=3, **kw)
    assert spec.token_ids == plain.token_ids
    sampled = [generate(prompts, target, draft, draft_tokenizer=draft_tok, k=3, temperature=1.0, seed=1, **kw).token_ids
               for _ in range(2)]
    assert sampled[0] == sampled[1] and all(len(t) == 10 for t in sampled[0])
