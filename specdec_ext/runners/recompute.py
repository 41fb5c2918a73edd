"""RecomputeRunner: the model-runner interface computed the obvious way, as an oracle.

It implements the ``ModelRunner`` protocol (runners/__init__.py) without a KV cache: it
keeps each row's committed token list and, for every forward, runs a plain HF forward over the whole
sequence (committed + tentative tokens). Rows of the same total length run together (no padding, so
no mask semantics are involved); a tree proposal runs one sequence per node (committed + the node's
root path), which needs no tree mask at all. Slow (quadratic), simple, and hard to get wrong: tests
compare the paged runner's logits and the decode loop's tokens against it.

Hidden-state taps (``hidden_taps=...``, runners/taps.py): each forward also asks HF for
``output_hidden_states`` and keeps the tapped layers' inputs of its tokens beside them; commits keep
them with the tokens, rollbacks drop them (HF's own numbers: the taps' oracle).

Tentative tokens: ``forward`` appends T tokens per row tentatively at positions lengths[b] + t;
``commit(num_kept)`` keeps the first num_kept[b] of them; a later ``forward`` without a commit
replaces them.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import torch

from .capabilities import RunnerCapabilities
from .checks import check_extend_chunks, check_row_counts, check_start_prompts, output_vocab_size, text_config
from .rows import RowsInUse
from .taps import check_tap_layers


class RecomputeRunner:
    """Full-recompute implementation of the model-runner interface (see the module docstring)."""

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, hidden_taps: Optional[Sequence[int]] = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.model = model
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = int(max_seq_len)
        self.vocab_size = output_vocab_size(model)
        self.device = next(model.parameters()).device
        self._committed: List[List[int]] = []
        self._tentative: List[List[int]] = []  # per row: the tokens of the last forward, in node order
        self._parents: List[Optional[List[int]]] = []  # per row: tree parents of the tentative nodes
        self._in_use = RowsInUse(self.max_batch_size)  # continuous batching: start_rows / free_rows
        self.hidden_taps = check_tap_layers(hidden_taps, int(text_config(model.config).num_hidden_layers))
        self._states: List[torch.Tensor] = []  # per row with taps: the committed tokens' states [n, width]
        self._tentative_states: List[Optional[torch.Tensor]] = []  # per row: the last forward's, in token order
        self._seq_states: Optional[List[torch.Tensor]] = None  # the last _last_logits call's, per sequence

    # ------------------------------------------------------------------ state
    @property
    def capabilities(self) -> RunnerCapabilities:
        return RunnerCapabilities(chunked_prefill=True, hidden_taps=self.hidden_taps is not None)

    @property
    def batch_size(self) -> int:
        return len(self._committed)

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row. Shape: [B] int64."""
        return torch.tensor([len(row) for row in self._committed], dtype=torch.int64, device=self.device)

    def tokens(self, row: int) -> List[int]:
        """The committed tokens of a row (a copy)."""
        return list(self._committed[row])

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def _last_logits(self, sequences: Sequence[Sequence[int]], keep: Sequence[int]) -> List[torch.Tensor]:
        """For each sequence, fp32 logits at its last keep[i] positions ([keep[i], V]); one HF forward
        per group of equal-length sequences."""
        out: List[Optional[torch.Tensor]] = [None] * len(sequences)
        states: List[Optional[torch.Tensor]] = [None] * len(sequences)  # with taps: [len, width] per sequence
        groups: Dict[int, List[int]] = defaultdict(list)
        for i, seq in enumerate(sequences):
            groups[len(seq)].append(i)
        for length, members in groups.items():
            n_keep = max(keep[i] for i in members)
            ids = torch.tensor([list(sequences[i]) for i in members], dtype=torch.int64, device=self.device)
            result = self.model(input_ids=ids, use_cache=False, logits_to_keep=n_keep,
                                output_hidden_states=self.hidden_taps is not None)
            logits = result.logits[:, -n_keep:].float()
            for j, i in enumerate(members):
                out[i] = logits[j, n_keep - keep[i]:]
                if self.hidden_taps is not None:
                    states[i] = torch.cat([result.hidden_states[layer][j].float() for layer in self.hidden_taps], -1)
        self._seq_states = states if self.hidden_taps is not None else None
        return out  # type: ignore[return-value]

    def start(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Reset to ``prompts`` (committed) and return fp32 logits at each prompt's last position.

        Shape: [B, V]
        """
        prompts = [[int(t) for t in p] for p in prompts]
        check_start_prompts(prompts, self.max_batch_size, self.max_seq_len)
        self._committed = prompts
        self._tentative = [[] for _ in prompts]
        self._parents = [None for _ in prompts]
        self._in_use.reset(len(prompts))
        rows = self._last_logits(prompts, [1] * len(prompts))
        self._states = list(self._seq_states) if self._seq_states is not None else []
        self._tentative_states = [None for _ in prompts]
        return torch.stack([r[0] for r in rows])

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Continuous batching: ``rows`` (free) take ``prompts``, the other rows keep theirs; fp32 logits
        at each prompt's last position [n, V]. The batch spans up to the highest row in use."""
        prompts = [[int(t) for t in p] for p in prompts]
        check_start_prompts(prompts, self.max_batch_size, self.max_seq_len)
        rows = self._in_use.check_free("start_rows", rows, len(prompts))
        logits = self._last_logits(prompts, [1] * len(prompts))
        self._in_use.add(rows)
        self._resize(self._in_use.width)
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            self._committed[row] = prompt
            if self._seq_states is not None:
                self._states[row] = self._seq_states[i]
        return torch.stack([r[0] for r in logits])

    def extend_rows(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Chunked prefill: append ``chunks`` to ``rows`` (in use, between steps); fp32 logits at each
        chunk's last token [n, V]."""
        chunks = [[int(t) for t in c] for c in chunks]
        rows = self._in_use.check_used("extend_rows", rows, len(chunks))
        check_extend_chunks(chunks, [len(self._committed[row]) for row in rows], self.max_seq_len)
        for row, chunk in zip(rows, chunks):
            self._committed[row] = self._committed[row] + chunk
        logits = self._last_logits([self._committed[row] for row in rows], [1] * len(rows))
        for i, row in enumerate(rows):
            if self._seq_states is not None:
                self._states[row] = self._seq_states[i]
        return torch.stack([r[0] for r in logits])

    def fork_rows(self, source: int, rows: Sequence[int]) -> None:
        """Continuous batching (between steps): free ``rows`` take row ``source``'s committed tokens."""
        source = int(source)
        if source not in self._in_use:
            raise ValueError(f"fork_rows: source row {source} is not in use (start_rows it first)")
        rows = self._in_use.check_free("fork_rows", rows, len(rows))
        self._in_use.add(rows)
        self._resize(self._in_use.width)
        for row in rows:
            self._committed[row] = list(self._committed[source])
            if self.hidden_taps is not None:
                self._states[row] = self._states[source]

    def hold_rows(self, rows: Sequence[int]) -> None:
        """Continuous batching: free ``rows`` count as in use with no tokens, without a forward (the batch
        spans them; each is a free row inside the width until free_rows)."""
        rows = self._in_use.check_free("hold_rows", rows, len(rows))
        self._in_use.add(rows)
        self._resize(self._in_use.width)

    def free_rows(self, rows: Sequence[int]) -> None:
        """Continuous batching: ``rows`` become empty; the batch shrinks to the highest row in use."""
        for row in self._in_use.remove("free_rows", rows):
            self._committed[row] = []
        self._resize(self._in_use.width)

    def _resize(self, width: int) -> None:
        """Per-row lists to ``width`` rows (new rows empty; nothing is tentative between steps)."""
        self._committed = (self._committed + [[] for _ in range(width)])[:width]
        self._tentative = [[] for _ in range(width)]
        self._parents = [None for _ in range(width)]
        if self.hidden_taps is not None:
            empty = torch.zeros((0, self._width()), dtype=torch.float32, device=self.device)
            self._states = (self._states + [empty] * width)[:width]
            self._tentative_states = [None for _ in range(width)]

    def forward(self, input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor] = None,
                tree_parents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append T tokens per row tentatively and return fp32 logits at those positions.

        input_ids [B, T] int64; num_tokens [B] (default T; positions past it are ignored and get zero
        logits); tree_parents [B, T-1] int32: parent node of nodes 1..T-1 (node 0, the root, follows
        the committed tokens; -1 also means "child of the committed tokens"). Returns [B, T, V].
        """
        B, T = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"forward: input_ids has {B} rows, the runner holds {self.batch_size}")
        ids = input_ids.tolist()
        counts = [T] * B if num_tokens is None else [int(n) for n in num_tokens.tolist()]
        parents = None if tree_parents is None else tree_parents.tolist()
        sequences, keep, owners = [], [], []
        for b in range(B):
            n = counts[b]
            if not 0 <= n <= T:
                raise ValueError(f"forward: num_tokens[{b}] = {n} is outside [0, {T}]")
            if len(self._committed[b]) + n > self.max_seq_len:
                raise ValueError(f"forward: row {b} would hold {len(self._committed[b]) + n} tokens, "
                                 f"more than max_seq_len={self.max_seq_len}")
            self._tentative[b] = ids[b][:n]
            if parents is None:
                self._parents[b] = None
                if n:
                    sequences.append(self._committed[b] + ids[b][:n])
                    keep.append(n)
                    owners.append((b, None))
                continue
            # token 0 is the root; node i (token i + 1) has parent node tree_parents[b, i], -1 = token 0
            token_parents = [-1] + [int(p) + 1 for p in parents[b][: max(n - 1, 0)]]
            self._parents[b] = token_parents
            for t in range(n):
                path, token = [], t
                while token >= 0:
                    if token_parents[token] >= token:
                        raise ValueError(f"forward: tree_parents row {b} is not a tree (node {token - 1})")
                    path.append(ids[b][token])
                    token = token_parents[token]
                sequences.append(self._committed[b] + path[::-1])
                keep.append(1)
                owners.append((b, t))
        out = torch.zeros((B, T, self.vocab_size), dtype=torch.float32, device=self.device)
        if sequences:
            for (b, t), logits in zip(owners, self._last_logits(sequences, keep)):
                if t is None:
                    out[b, : logits.shape[0]] = logits
                else:
                    out[b, t] = logits[0]
        if self.hidden_taps is not None:
            self._keep_tentative_states(B, owners, keep)
        return out

    def _width(self) -> int:
        return len(self.hidden_taps) * int(text_config(self.model.config).hidden_size)

    def _keep_tentative_states(self, B: int, owners, keep: Sequence[int]) -> None:
        """Taps: each row's tentative tokens' states from the last forward's sequences (a chain: its last
        keep columns; a tree: each node's sequence's last column), in token order."""
        per_row: List[List[torch.Tensor]] = [[] for _ in range(B)]
        for (b, t), n, states in zip(owners, keep, self._seq_states or []):
            per_row[b].append(states[-n:])
        self._tentative_states = [torch.cat(rows) if rows else None for rows in per_row]

    def tapped_states(self, positions: torch.Tensor) -> torch.Tensor:
        """The tapped hidden states (runners/taps.py) of row b's committed tokens at ``positions[b]``
        (< lengths[b]; others are zero): positions [B, W] int64 -> [B, W, n * H] fp32."""
        if self.hidden_taps is None:
            raise ValueError("tapped_states: this runner was built without hidden_taps")
        out = torch.zeros(tuple(positions.shape) + (self._width(),), dtype=torch.float32, device=self.device)
        for b, row in enumerate(positions.tolist()):
            for w, position in enumerate(row):
                if 0 <= position < self._states[b].shape[0]:
                    out[b, w] = self._states[b][position]
        return out

    def commit(self, num_kept: torch.Tensor) -> None:
        """Keep the first num_kept[b] tentative tokens of each row (a chain). num_kept [B]."""
        kept = check_row_counts("commit", "num_kept", num_kept, [len(t) for t in self._tentative], self.batch_size)
        for b, n in enumerate(kept):
            self._committed[b].extend(self._tentative[b][:n])
            self._tentative[b] = []
            if self.hidden_taps is not None and n:
                self._states[b] = torch.cat([self._states[b], self._tentative_states[b][:n]])

    def commit_tree(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a tree forward: keep token 0 and the accepted nodes path[b, :num_accepted[b]] (node
        indices in increasing order, node i = token i + 1): lengths[b] += 1 + num_accepted[b].
        A row whose forward had no tokens keeps nothing. path [B, N] int, num_accepted [B] int.
        """
        for b, (row, n) in enumerate(zip(path.tolist(), num_accepted.tolist())):
            tentative, n = self._tentative[b], int(n)
            if not tentative:
                if n:
                    raise ValueError(f"commit_tree: row {b} had no tokens but num_accepted[{b}] = {n}")
                continue
            nodes = [int(x) for x in row[:n]]
            if (not 0 <= n <= len(tentative) - 1 or any(not 0 <= x < len(tentative) - 1 for x in nodes)
                    or any(x >= y for x, y in zip(nodes, nodes[1:]))):
                raise ValueError(f"commit_tree: row {b}: path {nodes} is not an increasing list of its "
                                 f"{len(tentative) - 1} tree nodes")
            self._committed[b].append(tentative[0])
            self._committed[b].extend(tentative[x + 1] for x in nodes)
            self._tentative[b] = []
            if self.hidden_taps is not None:
                kept = self._tentative_states[b][[0] + [x + 1 for x in nodes]]
                self._states[b] = torch.cat([self._states[b], kept])

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll each row back to new_lengths[b] committed tokens (never grows). new_lengths [B]."""
        committed = [len(row) for row in self._committed]
        target = check_row_counts("truncate", "new_lengths", new_lengths, committed, self.batch_size)
        for b, n in enumerate(target):
            del self._committed[b][n:]
            self._tentative[b] = []
            if self.hidden_taps is not None:
                self._states[b] = self._states[b][:n]
