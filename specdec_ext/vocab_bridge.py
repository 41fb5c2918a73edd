"""The bridge between a draft's tokenizer and the target's when they differ (issue 29): text both ways,
the boundary re-alignment of a draft's text into target tokens, and the intersection of the vocabularies.

Two uses (drafters/cross_tokenizer.py runs them):

* greedy-through-text: the draft's tokens are decoded to text and the text re-encoded with the target's
  tokenizer (``target_continuation``); the committed text is re-encoded with the draft's
  (``draft_ids``). Needs only that both tokenizers round-trip text (``check_round_trip``).
* intersection (sampling): the tokens both vocabularies spell the same way; the draft's logits are
  moved onto the target's ids there (``to_target_logits``), -inf elsewhere, so its filtered distribution
  is a true q over the target's vocabulary. Needs at least ``MIN_INTERSECTION`` such tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

# Texts every pair of tokenizers must round-trip (decode(encode(text)) == text) before a draft with another
# tokenizer runs; generate() adds the text prompts. Plain ASCII code and prose: what a tokenizer that drops
# spaces, lowercases or maps characters to <unk> fails on. None starts with a space: SentencePiece-style
# tokenizers (Llama 2, Mistral) drop one there, which only touches the first token of a prompt.
ROUND_TRIP_PROBES = (
    "def add(a, b):\n    return a + b\n",
    "hello, world! 123",
    "two  spaces; x = [1, 2] # done",
)
# Texts with capitals and tabs: the draft must round-trip each one the target does (a lowercasing or tab-dropping
# draft; all-lower-case probes and prompts let one through). A target that cannot spell them (a test's character
# vocabulary) never emits them, and is not refused for it.
DRAFT_FIDELITY_PROBES = ("Hello, World!\tDone", "class Point:\n\tX = A1\n")
MIN_INTERSECTION = 32  # shared tokens below this leave a sampled draft too little to propose from
BOUNDARY_LOOKBEHIND = 3  # committed target tokens re-encoded with a draft's text (the last may merge with it)
# Word-start markers that spell a leading space: byte-level BPE's and SentencePiece's (one key for both).
SPACE_MARKERS = ("\u0120", "\u2581")


class TokenizerRoundTripError(ValueError):
    """A tokenizer does not give back the text it encoded: text cannot carry a draft's proposals."""


def _encode(tokenizer, text: str, special: bool) -> List[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def check_round_trip(target_tokenizer, draft_tokenizer, texts: Sequence[str] = ROUND_TRIP_PROBES) -> None:
    """Raise TokenizerRoundTripError naming every (tokenizer, text) whose decode(encode(text)) != text: each of
    ``texts`` for both, each of ``DRAFT_FIDELITY_PROBES`` that the target round-trips for the draft."""
    def back(tokenizer, text: str) -> str:
        return _decode(tokenizer, _encode(tokenizer, text, special=False))

    failures = []
    for role, tokenizer in (("target", target_tokenizer), ("draft", draft_tokenizer)):
        for text in texts:
            if back(tokenizer, text) != text:
                failures.append(f"{role} tokenizer: {text!r} -> {back(tokenizer, text)!r}")
    fidelity = [text for text in DRAFT_FIDELITY_PROBES if back(target_tokenizer, text) == text]
    for text in fidelity:
        if back(draft_tokenizer, text) != text:
            failures.append(f"draft tokenizer: {text!r} -> {back(draft_tokenizer, text)!r} (the target's round-trips)")
    if failures:
        tried = ", ".join(repr(t) for t in list(texts) + fidelity)
        raise TokenizerRoundTripError(
            "a draft with another tokenizer needs both tokenizers to decode back the text they encode; "
            f"tried {tried}; failed: " + "; ".join(failures))


def spelling(token: str) -> str:
    """A vocabulary entry's key for the intersection: word-start markers as one character."""
    for marker in SPACE_MARKERS[1:]:
        token = token.replace(marker, SPACE_MARKERS[0])
    return token


def _by_spelling(tokenizer, size: int) -> Dict[str, int]:
    """spelling -> id for ids < size; a spelling two entries share is left out (it names no one token)."""
    seen: Dict[str, int] = {}
    ambiguous = set()
    for token, index in tokenizer.get_vocab().items():
        if index >= size:
            continue
        key = spelling(token)
        if key in seen:
            ambiguous.add(key)
        seen[key] = index
    return {key: index for key, index in seen.items() if key not in ambiguous}


@dataclass
class VocabularyBridge:
    """Two tokenizers and the intersection of their vocabularies (see the module docstring)."""

    target_tokenizer: object
    draft_tokenizer: object
    target_vocab_size: int  # the target model's logits
    draft_vocab_size: int  # the draft tokenizer's real tokens the draft model scores
    shared_target_ids: torch.Tensor  # [I] int64: the intersection, in the target's ids
    shared_draft_ids: torch.Tensor  # [I] int64: the same tokens in the draft's ids

    @classmethod
    def build(cls, target_tokenizer, draft_tokenizer, target_vocab_size: int, draft_vocab_size: int
              ) -> "VocabularyBridge":
        """Check the round trip (raises TokenizerRoundTripError) and compute the intersection."""
        check_round_trip(target_tokenizer, draft_tokenizer)
        draft_size = min(draft_vocab_size, len(draft_tokenizer))
        target_keys = _by_spelling(target_tokenizer, target_vocab_size)
        draft_keys = _by_spelling(draft_tokenizer, draft_size)
        shared = sorted(set(target_keys) & set(draft_keys), key=lambda key: target_keys[key])
        return cls(target_tokenizer, draft_tokenizer, target_vocab_size, draft_size,
                   torch.tensor([target_keys[key] for key in shared], dtype=torch.int64),
                   torch.tensor([draft_keys[key] for key in shared], dtype=torch.int64))

    @property
    def intersection_size(self) -> int:
        return int(self.shared_target_ids.numel())

    def check_intersection(self) -> None:
        if self.intersection_size < MIN_INTERSECTION:
            raise ValueError(
                f"sampling with a draft of another tokenizer drafts from the tokens both vocabularies spell the "
                f"same way; these share only {self.intersection_size} (at least {MIN_INTERSECTION} needed): "
                "use greedy decoding (temperature=0, drafting through text) or a draft with a closer vocabulary")

    # ------------------------------------------------------------------ text
    def target_text(self, target_ids: Sequence[int]) -> str:
        return _decode(self.target_tokenizer, target_ids)

    def draft_text(self, draft_ids: Sequence[int]) -> str:
        return _decode(self.draft_tokenizer, draft_ids)

    def draft_ids(self, text: str) -> List[int]:
        """The draft's own tokens of ``text`` (its special tokens, e.g. BOS, as its tokenizer adds them)."""
        return _encode(self.draft_tokenizer, text, special=True)

    def target_continuation(self, committed: Sequence[int], text: str) -> List[int]:
        """Target tokens that follow ``committed`` (target ids) and spell ``text``, tokenised as the target
        tokenizer would tokenise the whole: the last committed tokens are re-encoded together with
        ``text`` (appended text may merge into them, e.g. "hel" + "lo"); where they survive, the tokens
        after them are the continuation. A tokenizer that marks the start of a text (SentencePiece's
        prepended "▁") does not give those tokens back from a piece of text, so then the whole committed
        text is re-encoded with ``text`` the same way. Where the committed tokens do not survive even so,
        they cannot change, and the text is encoded on its own (the target may reject the first tokens)."""
        if not text:
            return []
        lookbehind = min(BOUNDARY_LOOKBEHIND, len(committed))
        anchor = list(committed[len(committed) - lookbehind:])
        committed_text = self.target_text(committed)
        anchor_text = committed_text[len(self.target_text(committed[: len(committed) - lookbehind])):]
        joined = _encode(self.target_tokenizer, anchor_text + text, special=False)
        if joined[:lookbehind] == anchor:
            return joined[lookbehind:]
        special = set(self.target_tokenizer.all_special_ids)
        plain = [t for t in committed if t not in special]
        whole = _encode(self.target_tokenizer, committed_text + text, special=False)
        if whole[: len(plain)] == plain:
            return whole[len(plain):]
        return _encode(self.target_tokenizer, text, special=False)

    # ------------------------------------------------------------------ the intersection
    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V_d] -> [B, V] over the target's ids: the shared tokens' logits, -inf elsewhere
        (so softmax over them is the draft's distribution restricted to the intersection, renormalised)."""
        out = torch.full((draft_logits.shape[0], self.target_vocab_size), -float("inf"), dtype=torch.float32,
                         device=draft_logits.device)
        out[:, self.shared_target_ids.to(out.device)] = draft_logits[:, self.shared_draft_ids.to(out.device)].float()
        return out

    def target_to_draft(self, device: torch.device) -> torch.Tensor:
        """[V] int64: a shared target id's draft id, -1 elsewhere."""
        lookup = torch.full((self.target_vocab_size,), -1, dtype=torch.int64)
        lookup[self.shared_target_ids] = self.shared_draft_ids
        return lookup.to(device)
