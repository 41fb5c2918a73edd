"""CrossTokenizerDrafter: a draft model with another tokenizer than the target's (issue 29).

The draft reads and writes its own tokens; text (vocab_bridge.py) carries them to the target. Per step:

1. re-align: each row's committed target tokens are decoded to text and the text encoded in draft tokens
   (``draft_context``). The draft cache keeps the longest prefix it shares with that encoding and is fed
   the rest. This is the boundary re-alignment: the draft's last proposals may have been accepted only in
   part (a target token can end inside a draft token), and appended text can re-tokenise the end of what
   was there ("hel" + "lo" is one token "hello", not two), so the cache is rolled back to the draft's own
   tokenisation of exactly the committed text rather than kept as proposed. Greedy, the last draft token
   of that tokenisation is dropped too (its text, the row's ``tail``, may be a word the target has
   committed only in part, which the draft never saw as a token of its own): the draft re-drafts it, and
   its text must start with the tail; where the draft's first choice would leave the committed text, the
   held-back token is fed instead (``_keep_to_the_tail``).
2. draft, in one of two modes (the plan's ``cross_tokenizer``):
   * greedy-through-text (greedy rows): k + 1 greedy draft tokens (the first usually re-drafts the tail);
     their text after the tail is re-encoded with the target's tokenizer after the committed tokens
     (``VocabularyBridge.target_continuation``: the last committed tokens are re-encoded with it, so the
     proposal is the target's own tokenisation of the joined text) and up to k target tokens are
     proposed, q None (deterministic). Greedy output is the target's whatever is proposed.
   * intersection (sampling): the draft's logits are moved onto the target's ids of the tokens both
     vocabularies spell the same way (-inf elsewhere), filtered like the target's, and a target token is
     sampled from that q by Philox inverse CDF; q is returned as the proposal's probs and the draft is fed
     the same token in its own ids. chain_verify then gets the exact q each token was drawn from, so the
     output is distributed as the target's.
3. commit: nothing; the next step's re-alignment reads what was committed.

Serving (mode ``by step``): rows join and leave (``start_rows``: the draft's tokens of the prompt's text into
the row's cache; ``free_rows``), and each step runs greedy-through-text when all its rows are greedy,
else the intersection for every row (a greedy row's q is then its argmax's one-hot: still lossless).
Re-aligning from the committed text every step is what makes switching between steps safe.

Host work per step: one read of the committed tokens, a decode and an encode of each row's text (linear in
its length), the draft forwards; proposals are copied to the device once.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .. import ops
from ..metadata import Proposal, SpecDecodeMetadata, Verdict
from ..processing import ProcessingState
from ..vocab_bridge import VocabularyBridge
from .base import Drafter
from .model_drafter import RunnerFactory, active_processing, draft_uniforms, sample_draft

GREEDY_THROUGH_TEXT = "greedy-through-text"
INTERSECTION = "intersection"
BY_STEP = "by step"  # serving: greedy-through-text for a step whose rows are all greedy, else intersection
CROSS_TOKENIZER_MODES = (GREEDY_THROUGH_TEXT, INTERSECTION, BY_STEP)
DRAFT_POSITIONS_PER_TARGET = 4  # draft cache positions per target position (a finer draft tokenizer's text)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CrossTokenizerDrafter(Drafter):
    """A HF draft model with its own tokenizer, bridged to the target's (see the module docstring)."""

    def __init__(self, model, runner_factory: RunnerFactory, *, k: int, bridge: VocabularyBridge, mode: str,
                 max_draft_positions: Optional[int] = None):
        if mode not in CROSS_TOKENIZER_MODES:
            raise ValueError(f"mode must be one of {CROSS_TOKENIZER_MODES}, got {mode!r}")
        self.model = model
        self.runner_factory = runner_factory
        self.slots = int(k)
        self.bridge = bridge
        self.mode = mode
        self.step_mode = INTERSECTION if mode == BY_STEP else mode  # this step's (``by step``: set per propose)
        self.runner = None
        self.fed: List[List[int]] = []  # per row: the draft tokens in the draft cache (host mirror)
        self.contexts: List[List[int]] = []  # per row: the draft tokens of its committed text at the last step
        self.context_texts: List[str] = []  # per row: that text
        self.tails: List[str] = []  # per row: committed text after the context (greedy: its last draft token's)
        self.held_tokens: List[int] = []  # per row: the draft token held back as the tail
        self.max_draft_positions = max_draft_positions  # the draft model's position limit (None: none)
        self.max_draft_len = 0  # draft cache positions per row (set with the runner)
        self.lookup: Optional[torch.Tensor] = None  # [V]: a shared target id's draft id (intersection mode)
        self.token_ids: Optional[torch.Tensor] = None  # the proposal buffers [B, k], [B], [B, k, V] (prefill)
        self.num_draft: Optional[torch.Tensor] = None
        self.probs: Optional[torch.Tensor] = None
        self._committed: List[List[int]] = []  # per row: its committed target tokens (read each step)

    # ------------------------------------------------------------------ lifecycle
    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """The draft's own tokens of each row's committed text into its cache (``prompts`` are the
        target's tokens; the text of token_buffer is what counts)."""
        self._allocate(meta)
        texts = self._committed_texts(meta)
        self.fed = [self._fitted(self.draft_context(b, text)) for b, text in enumerate(texts)]
        self.runner.start(self.fed)

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """Continuous batching: rows join with the draft's tokens of their prompts' text (``meta`` covers
        every slot; the runner and the per-row state are made once)."""
        if self.runner is None or len(self.fed) != meta.token_buffer.shape[0]:
            self._allocate(meta)
        rows = [int(row) for row in rows]
        for row, prompt in zip(rows, prompts):
            self.fed[row] = self._fitted(self.draft_context(row, self.bridge.target_text(list(prompt))))
        self.runner.start_rows(rows, [self.fed[row] for row in rows])

    def hold_rows(self, rows: Sequence[int], meta: SpecDecodeMetadata) -> None:
        """(``Drafter.hold_rows``) The draft runner spans ``rows`` with empty caches, no draft forward; each
        is a free row inside the batch (fed its one filler token)."""
        if self.runner is None or len(self.fed) != meta.token_buffer.shape[0]:
            self._allocate(meta)
        rows = [int(row) for row in rows]
        self.runner.hold_rows(rows)
        for row in rows:
            self.fed[row] = [self._filler_token()]

    def free_rows(self, rows: Sequence[int]) -> None:
        if self.runner is None:  # (no row has joined the draft yet: a server's first row ended at its prefill)
            return
        self.runner.free_rows([int(row) for row in rows])
        for row in rows:
            self.fed[int(row)] = [self._filler_token()]  # a free slot inside the batch is fed one token

    def _fitted(self, context: List[int]) -> List[int]:
        """A text too long for the draft cache: its first token stands in (the row never drafts; _realign)."""
        return context if len(context) < self.max_draft_len else context[:1]

    def _allocate(self, meta: SpecDecodeMetadata) -> None:
        """The draft runner, the proposal buffers and the per-row state for the loop's rows."""
        B, S = meta.token_buffer.shape
        self.max_draft_len = S * DRAFT_POSITIONS_PER_TARGET
        if self.max_draft_positions is not None:
            self.max_draft_len = min(self.max_draft_len, self.max_draft_positions)
        self.runner = self.runner_factory(max_batch_size=B, max_seq_len=self.max_draft_len)
        self.token_ids = torch.zeros((B, self.slots), dtype=torch.int64, device=meta.device)  # [B, k]
        self.num_draft = torch.zeros((B,), dtype=torch.int32, device=meta.device)  # [B]
        self.probs = None
        self.context_texts = ["" for _ in range(B)]
        self.contexts = [[] for _ in range(B)]
        self.tails = ["" for _ in range(B)]
        self.held_tokens = [0 for _ in range(B)]
        self.fed = [[self._filler_token()] for _ in range(B)]
        self.lookup = self.bridge.target_to_draft(meta.device)  # [V]

    def _committed_texts(self, meta: SpecDecodeMetadata) -> List[str]:
        lengths = meta.seq_lens.tolist()
        buffer = meta.token_buffer.cpu()  # [B, S]
        self._committed = [buffer[b, :length].tolist() for b, length in enumerate(lengths)]
        return [self.bridge.target_text(ids) for ids in self._committed]

    def draft_context(self, row: int, text: str) -> List[int]:
        """The draft tokens a row's committed ``text`` is fed as: the draft's own tokenisation of all of it
        (re-encoded every step: that is the boundary re-alignment), less its last token when greedy (that
        token's text becomes the row's tail, re-drafted)."""
        tokens = self.bridge.draft_ids(text) or [self._filler_token()]
        tail = ""
        if self.step_mode == GREEDY_THROUGH_TEXT and len(tokens) > 1:
            stable_text = self.bridge.draft_text(tokens[:-1])
            if text.startswith(stable_text):
                tokens, tail, self.held_tokens[row] = tokens[:-1], text[len(stable_text):], tokens[-1]
        self.contexts[row], self.context_texts[row], self.tails[row] = tokens, text, tail
        return tokens

    def _filler_token(self) -> int:
        """What an empty text is fed as (the draft needs a token to start from): its BOS, else EOS, else 0."""
        tokenizer = self.bridge.draft_tokenizer
        for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
            if token is not None:
                return int(token)
        return 0

    # ------------------------------------------------------------------ the step
    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        k, B = self.slots, meta.batch_size
        limits = [k if budget is None else min(k, budget[b]) for b in range(B)]
        steps = max(limits, default=0)
        active = meta.active.tolist()
        texts = self._committed_texts(meta)
        drafting = list(active)
        if self.mode == BY_STEP:
            self.step_mode = GREEDY_THROUGH_TEXT if meta.all_greedy else INTERSECTION
        greedy = self.step_mode == GREEDY_THROUGH_TEXT
        draft_steps = steps + 1 if greedy and steps > 0 else steps  # greedy re-drafts the tail first
        logits = self._realign(texts, drafting, draft_steps)  # [B, V_d]
        drafting = [drafting[b] and limits[b] > 0 for b in range(B)]
        counts = [0] * B
        if greedy:
            proposals = self._greedy_through_text(logits, draft_steps, drafting)
            for b in range(B):
                row = proposals[b][: limits[b]] if drafting[b] else []
                counts[b] = len(row)
                self.token_ids[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
        else:
            self._sample_intersection(logits, steps, meta)
            counts = [limits[b] if drafting[b] else 0 for b in range(B)]
        self.num_draft[:B].copy_(torch.tensor(counts, dtype=torch.int32))
        probs = None if self.probs is None else self.probs[:B]
        return Proposal(self.token_ids[:B], probs, self.num_draft[:B], longest=max(counts, default=0))

    def _realign(self, texts: List[str], drafting: List[bool], steps: int) -> torch.Tensor:
        """Roll each live row's cache back to the prefix it shares with the draft tokens of its committed
        text and feed the rest (at least one token, for the logits at the end). A frozen row, or one whose
        text and ``steps`` drafts would overflow the draft cache (``drafting[b]`` set False: it drafts no
        more), keeps only its first token (bounded work; it is never drafted from again). Returns the
        logits after the last fed token [B, V_d]."""
        B = len(texts)
        keep, feeds = [], []
        for b in range(B):
            context = self.draft_context(b, texts[b]) if drafting[b] else self.fed[b][:1]
            if len(context) + steps > self.max_draft_len:
                context, drafting[b] = self.fed[b][:1], False
            kept = min(common_prefix_len(self.fed[b], context), len(context) - 1)
            keep.append(kept)
            feeds.append(context[kept:])
            self.fed[b] = list(context)
        device = self.runner.lengths.device
        self.runner.truncate(torch.tensor(keep, dtype=torch.int64, device=device))
        width = max(len(f) for f in feeds)
        padded = torch.tensor([f + [f[-1]] * (width - len(f)) for f in feeds], dtype=torch.int64)  # [B, W]
        counts = torch.tensor([len(f) for f in feeds], dtype=torch.int64)  # [B]
        logits = self.runner.forward(padded.to(device), counts.to(device))  # [B, W, V_d]
        self.runner.commit(counts.to(device))
        return logits[torch.arange(B), (counts - 1).to(logits.device)]

    def _feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """One draft token per row [B] into the cache; the logits after it [B, V_d]."""
        ones = torch.ones_like(tokens)
        logits = self.runner.forward(tokens[:, None], ones)[:, 0]
        self.runner.commit(ones)
        for b, token in enumerate(tokens.tolist()):
            self.fed[b].append(token)
        return logits

    def _greedy_through_text(self, logits: torch.Tensor, steps: int, drafting: List[bool]) -> List[List[int]]:
        """``steps`` greedy draft tokens per row, as target tokens after the committed ones (see
        the module docstring); a draft special token (EOS) ends a row's text."""
        drafts: List[List[int]] = [[] for _ in drafting]
        special = set(self.bridge.draft_tokenizer.all_special_ids)
        for i in range(steps):
            token = logits[:, : self.bridge.draft_vocab_size].argmax(-1)  # [B]
            if i == 0:
                token = self._keep_to_the_tail(token, drafting)
            for b, t in enumerate(token.tolist()):
                drafts[b].append(t)
            if i + 1 < steps:
                logits = self._feed(token)
        out = []
        for b, row in enumerate(drafts):
            if not drafting[b]:
                out.append([])
                continue
            cut = next((i for i, t in enumerate(row) if t in special), len(row))
            context, tail = self.contexts[b], self.tails[b]
            text = self.bridge.draft_text(context + row[:cut])[len(self.bridge.draft_text(context)):]
            if not text.startswith(tail):  # the draft disagrees with the committed text (or stopped inside it)
                out.append([])
                continue
            out.append([t for t in self.bridge.target_continuation(self._committed[b], text[len(tail):])
                        if t < self.bridge.target_vocab_size])
        return out

    def _keep_to_the_tail(self, first: torch.Tensor, drafting: List[bool]) -> torch.Tensor:
        """The first greedy draft token [B] of each row, or the held-back token where the draft's own choice
        would leave the committed text (its text neither starts with the tail nor is a start of it): the
        draft then goes on from the committed text as it is, rather than proposing nothing this step."""
        tokens = first.tolist()
        for b, token in enumerate(tokens):
            tail = self.tails[b]
            if not drafting[b] or not tail or token == self.held_tokens[b]:
                continue
            context = self.contexts[b]
            piece = self.bridge.draft_text(context + [token])[len(self.bridge.draft_text(context)):]
            if not (piece.startswith(tail) or tail.startswith(piece)):
                tokens[b] = self.held_tokens[b]
        return torch.tensor(tokens, dtype=first.dtype, device=first.device)

    def _sample_intersection(self, logits: torch.Tensor, steps: int, meta: SpecDecodeMetadata) -> None:
        """``steps`` target tokens per row sampled from the draft's q over the shared tokens (filtered like
        the target's); q into ``self.probs``, the token fed to the draft in its own id."""
        B, V = meta.batch_size, self.bridge.target_vocab_size
        if self.probs is None:
            self.probs = torch.zeros((self.token_ids.shape[0], self.slots, V), dtype=torch.float32,
                                     device=meta.device)  # [B, k, V]
        uniforms = draft_uniforms(meta, self.slots)  # [k, B, 1]
        processing = active_processing(meta)
        counts = processing.draft_counts() if processing is not None else None
        for i in range(steps):
            shared = self.bridge.to_target_logits(logits)  # [B, V]
            if processing is not None:  # q' processed as the target's p' will be (a shared vocabulary may be banned whole)
                shared = processing.apply_draft_step(shared, self.token_ids[:B, :i], meta.temperature, counts)
            token = sample_draft(shared, meta, uniforms[i], self.probs[:B, i])  # [B]
            self.token_ids[:B, i].copy_(token)
            ProcessingState.add_drafted(counts, token)
            if i + 1 < steps:
                logits = self._feed(self.lookup[token])

    def skip(self, meta: SpecDecodeMetadata) -> None:
        """No draft this step (adaptive k): the next propose re-aligns with whatever was committed."""

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        """Nothing: the next propose re-aligns the draft cache with the committed text."""

    def checkpoint(self):
        """Undo for the cost probes: the draft cache and its host mirror as they are now."""
        lengths = self.runner.lengths.clone()
        fed = [list(row) for row in self.fed]

        def undo() -> None:
            self.runner.truncate(lengths)
            self.fed = [list(row) for row in fed]

        return undo
