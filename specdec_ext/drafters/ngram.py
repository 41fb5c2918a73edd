"""NgramDrafter: training-free lookup drafting (``draft="ngram"``) over a suffix automaton per row.

Each row keeps a ``specdec_ext._C.SuffixAutomaton`` (csrc/suffix_automaton.h) over its prompt and
every committed token. Per step it proposes up to k tokens per row: the tokens that followed the
EARLIEST earlier occurrence of the longest suffix of the row that occurred before (continuing as an
overlapping copy when that continuation runs into the end of the row, so a loop of period P < k is
proposed in full); nothing while that match is shorter than ``min_match`` tokens. Proposals are
ragged: ``num_draft[b]`` is the number proposed for row b (0..k), the rest of the row's ``token_ids`` is
padded with token 0; the longest proposal, known on the host, narrows the verify pass.

The drafts are deterministic, so the proposal's ``probs`` is None: chain_verify treats q as one-hot at
the drafted token (accept x with probability p(x), recover from normalise(max(0, p - onehot(x)))), and
the output is distributed exactly as sampling from the target.

Host work per step: one device-to-host read of the new committed tokens (in ``commit``), one host-to-
device copy of the proposals (in ``propose``); O(k) automaton work per row. Committed tokens are never
rolled back, so the automaton is append-only; rejected drafts never enter it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..metadata import Proposal, SpecDecodeMetadata, Verdict
from .base import Drafter

# A one-token match is a weak signal, but a proposal costs only verify width (the pass covers the
# longest proposal + 1): on the bundled pair 1 verified 2-6% more tokens per pass than 2 at equal or
# better speed on both benchmark workloads (BENCHMARKS.md), and HF's prompt lookup also falls back to it.
DEFAULT_MIN_MATCH = 1
PAD_TOKEN = 0  # draft slots past num_draft[b] (ignored by the verifier; any valid id would do)


def _suffix_automaton_class():
    try:
        from .._C import SuffixAutomaton
    except ImportError as error:  # pragma: no cover - only without the compiled extension
        raise ImportError("NgramDrafter needs the compiled extension specdec_ext._C (SuffixAutomaton): build it "
                          f"with `pip install --no-build-isolation .` or tools/dev_build.sh ({error})") from error
    return SuffixAutomaton


class NgramDrafter(Drafter):
    """Prompt/generation lookup drafter: one suffix automaton per row (see the module docstring).

    Parameters
    ----------
    k : int
        Draft tokens per step (at most; rows propose 0..k).
    min_match : int
        Shortest matched suffix (tokens) that proposes anything (>= 1, default 1).
    overlap_copy : bool
        Continue the copy from the proposal itself when the continuation reaches the end of the row.
    """

    def __init__(self, k: int, *, min_match: int = DEFAULT_MIN_MATCH, overlap_copy: bool = True):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (draft tokens per step) must be an int >= 1, got {k!r}")
        if isinstance(min_match, bool) or not isinstance(min_match, int) or min_match < 1:
            raise ValueError(f"min_match must be an int >= 1, got {min_match!r}")
        self.slots = k
        self.min_match = min_match
        self.overlap_copy = bool(overlap_copy)
        self._automaton_class = _suffix_automaton_class()
        self.automata: List = []  # one SuffixAutomaton per row

    # ------------------------------------------------------------------ lifecycle
    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """Index each row's prompt and first emitted token (token_buffer[b, :seq_lens[b]])."""
        self._allocate(meta)
        self.automata = self._index_rows(range(meta.batch_size), meta)

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """Continuous batching: index the joining rows (``meta`` covers every slot; a free row has no
        automaton and proposes nothing)."""
        if len(self.automata) != meta.batch_size:
            self._allocate(meta)
            self.automata = [None] * meta.batch_size
        for row, automaton in zip(rows, self._index_rows(rows, meta)):
            self.automata[row] = automaton

    def free_rows(self, rows: Sequence[int]) -> None:
        for row in rows:
            self.automata[row] = None

    def _allocate(self, meta: SpecDecodeMetadata) -> None:
        if meta.slots != self.slots:
            raise ValueError(f"NgramDrafter(k={self.slots}) used with metadata for {meta.slots} draft slots")
        B, device = meta.batch_size, meta.device
        self.token_ids = torch.zeros((B, self.slots), dtype=torch.int64, device=device)  # [B, k]
        self.num_draft = torch.zeros((B,), dtype=torch.int32, device=device)  # [B]

    def _index_rows(self, rows: Sequence[int], meta: SpecDecodeMetadata) -> List:
        """A fresh automaton over token_buffer[b, :seq_lens[b]] for each row b of ``rows``."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=meta.device)
        lengths = meta.seq_lens[index].tolist()
        tokens = meta.token_buffer[index].cpu()  # [n, S]
        automata = []
        for i, length in enumerate(lengths):
            automaton = self._automaton_class(self.min_match, self.overlap_copy)
            automaton.extend(tokens[i, :length])
            automata.append(automaton)
        return automata

    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        """Up to k tokens per row (padded with PAD_TOKEN); the longest count is known on the host."""
        k, B = self.slots, meta.batch_size
        drafts = [[] if a is None else a.propose(k if budget is None else min(k, budget[b]))
                  for b, a in enumerate(self.automata[:B])]
        counts = [len(d) for d in drafts]
        padded = [d + [PAD_TOKEN] * (k - len(d)) for d in drafts]
        token_ids, num_draft = self.token_ids[:B], self.num_draft[:B]
        token_ids.copy_(torch.tensor(padded, dtype=torch.int64).view(B, k))
        num_draft.copy_(torch.tensor(counts, dtype=torch.int32))
        return Proposal(token_ids, None, num_draft, longest=max(counts, default=0))

    def skip(self, meta: SpecDecodeMetadata) -> None:
        """No proposal this step (adaptive k); commit() indexes the committed token as usual."""

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        """Index the tokens committed since the last call: token_buffer[b, seen_b:seq_lens[b]].

        One host read: seq_lens and the k+1 token columns from each row's old length (a step commits
        at most k+1 tokens per row; more, e.g. a caller that skipped commit, falls back to a slice).
        """
        S = meta.token_buffer.shape[1]
        device = meta.device
        automata = self.automata[: meta.batch_size]
        seen = torch.tensor([0 if a is None else len(a) for a in automata], dtype=torch.int64, device=device)  # [B]
        columns = torch.arange(self.slots + 1, dtype=torch.int64, device=device)  # [k+1]
        window = torch.gather(meta.token_buffer, 1, (seen[:, None] + columns).clamp(max=S - 1))  # [B, k+1]
        host = torch.cat([meta.seq_lens[:, None], window], dim=1).tolist()  # [B, 1 + k+1]
        for b, automaton in enumerate(automata):
            if automaton is None:
                continue  # a free slot (continuous batching)
            new = host[b][0] - len(automaton)
            if new < 0:
                raise RuntimeError(f"NgramDrafter: row {b} has {host[b][0]} tokens but its automaton already "
                                   f"indexed {len(automaton)} (committed tokens are never rolled back)")
            if new == 0:
                continue  # frozen row
            if new <= self.slots + 1:
                automaton.extend(host[b][1:1 + new])
            else:
                automaton.extend(meta.token_buffer[b, len(automaton):host[b][0]].cpu())
