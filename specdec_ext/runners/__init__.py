"""Model runners: one interface over a HF causal LM and its KV cache, three implementations.

A runner holds B rows. Row b's committed tokens are in its cache; a ``forward`` appends T tokens per
row TENTATIVELY, and ``commit`` / ``commit_tree`` keep some of them and roll the rest back (rollback
is metadata: lengths). Shapes: B rows, T tokens per row in a forward, V the model's logits, N tree nodes.

    start(prompts)                          prefill B ragged prompts -> fp32 logits at each last token [B, V]
    forward(input_ids, num_tokens=None,     T tokens per row [B, T] (row b's first num_tokens[b] are real),
            tree_parents=None)              a chain, or a tree (tree_parents [B, T-1], csrc/tree.h layout,
                                            token 0 the root) -> fp32 logits [B, T, V]
    commit(num_kept)                        after a chain forward: keep num_kept[b] tokens [B]
    commit_tree(path, num_accepted)         after a tree forward: keep token 0 and the accepted path
                                            (tree_verify's path [B, N], num_accepted [B])
    truncate(new_lengths)                   roll rows back to new_lengths [B] committed tokens
    lengths                                 committed tokens per row, int64 on the device [B]

Continuous batching (the serving engine, specdec_ext/serve/; runners/rows.py):

    start_rows(rows, prompts)               prefill free rows (slots) while the others keep their caches
                                            -> fp32 logits at each prompt's last token [n, V]
    fork_rows(source, rows)                 free rows take a row's committed tokens without a forward
                                            (the n choices of one request): the paged runner shares the
                                            source's full pages (copy-on-write, kv_cache.py), the lean
                                            runner copies its cache rows, recompute its token list
    hold_rows(rows)                         free rows count as in use with empty caches, no forward: a
                                            drafter's placeholder for a row it starts later (serving)
    free_rows(rows)                         release rows and their cache at once

After them the batch B spans rows 0 .. the highest row in use; a free row inside it is empty (length 0)
and the caller freezes it. The paged runner does this in host mode only (not static shapes).

Optional capabilities (``runner.capabilities``, a ``RunnerCapabilities``; ``capabilities_of(kind, model)``
says before building what a runner will have, and the plan resolves it into its fields):

    capability      methods                                 who has it      plan field that uses it
    greedy_chain    greedy_chain(tokens, steps, vocab_limit, lean on the CPU   target_capabilities: plain
                    check_logits, feed, feed_counts):       kernels, head   greedy decoding as chains
                    n greedy one-token passes in one call   not hooked      (decode.py); draft_capabilities:
                                                                            a greedy draft in one call
                                                                            (drafters/model_drafter.py)
    device_steps    reserve_step(width, tokens),            paged, host     cuda_graphs of a server plan
                    sync_host(): one step on the device     mode            (serve/batcher.py, step.py)
    chunked_prefill extend_rows(rows, chunks): append a     lean,           chunked_prefill of a server
                    prompt's next chunk to rows in use      recompute       plan (serve/batcher.py)
    hidden_taps     tapped_states(positions): the inputs of every kind      the EAGLE-3 drafter's features
                    chosen layers per committed token       built with      (specdec_ext/eagle/)
                    (runners/taps.py), rolled back with     hidden_taps=
                    the cache                               (paged: host)

Implementations (``make_runner(kind, ...)``):

    "lean"       runners/lean.py: the CPU kernels (a pure-torch forward off the CPU) over the HF weights
                 of a Llama/Mistral/Qwen2 model and a contiguous cache (``lean.unsupported_reason`` says when it does not apply)
    "paged"      runners/paged.py: the HF modules over a paged KV cache (every architecture the paged
                 attention supports); ``static_shapes=True`` is its CUDA-graph mode
    "recompute"  runners/recompute.py: no cache, a full HF forward per call (the tests' oracle)

Positions, cache slots and attention visibility of a forward come from one builder, layout.py.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

from .capabilities import RunnerCapabilities
from .checks import output_vocab_size, text_config
from .lean import LeanLlamaRunner, lean_capabilities, unsupported_reason
from .paged import PagedModelRunner, PoolFullError
from .recompute import RecomputeRunner

__all__ = ["ModelRunner", "make_runner", "capabilities_of", "RunnerCapabilities", "RUNNER_KINDS", "TAP_RUNNER_KINDS", "LeanLlamaRunner", "PagedModelRunner", "RecomputeRunner",
           "PoolFullError", "unsupported_reason", "output_vocab_size", "text_config"]

RUNNER_KINDS = ("lean", "paged", "recompute")
TAP_RUNNER_KINDS = ("lean", "paged", "recompute")  # the runners that tap hidden states (hidden_taps=)


@runtime_checkable
class ModelRunner(Protocol):
    """What the decode loop and the drafters use of a runner (see the module docstring)."""

    model: torch.nn.Module
    device: torch.device
    vocab_size: int
    max_batch_size: int
    max_seq_len: int

    @property
    def capabilities(self) -> RunnerCapabilities: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def lengths(self) -> torch.Tensor: ...

    def start(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor] = None,
                tree_parents: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def commit(self, num_kept: torch.Tensor) -> None: ...

    def commit_tree(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None: ...

    def truncate(self, new_lengths: torch.Tensor) -> None: ...

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def fork_rows(self, source: int, rows: Sequence[int]) -> None: ...

    def hold_rows(self, rows: Sequence[int]) -> None: ...

    def free_rows(self, rows: Sequence[int]) -> None: ...


def make_runner(kind: str, model, *, max_batch_size: int, max_seq_len: int,
                compute_dtype: Optional[torch.dtype] = None, static_shapes: bool = False,
                hidden_taps: Optional[Sequence[int]] = None) -> ModelRunner:
    """The runner of ``kind`` over ``model``. ``compute_dtype`` applies to "lean" (weights cast once),
    ``static_shapes`` to "paged" (its CUDA-graph mode); ``hidden_taps`` (layer ids, runners/taps.py): the
    runner keeps those layers' inputs per committed token (``tapped_states``; the paged one in host mode)."""
    sizes = dict(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    if hidden_taps is not None and kind not in TAP_RUNNER_KINDS:
        raise ValueError(f"hidden_taps (EAGLE-3's features) need a runner of {TAP_RUNNER_KINDS}, not {kind!r}")
    if kind == "lean":
        return LeanLlamaRunner(model, compute_dtype=compute_dtype, hidden_taps=hidden_taps, **sizes)
    if kind == "paged":
        return PagedModelRunner(model, static_shapes=static_shapes, hidden_taps=hidden_taps, **sizes)
    if kind == "recompute":
        return RecomputeRunner(model, hidden_taps=hidden_taps, **sizes)
    raise ValueError(f"runner kind must be one of {RUNNER_KINDS}, got {kind!r}")


def capabilities_of(kind: str, model, *, compute_dtype: Optional[torch.dtype] = None, static_shapes: bool = False,
                    head_hooked: bool = False, hidden_taps: bool = False) -> RunnerCapabilities:
    """The capabilities a runner of ``kind`` over ``model`` will have, before it is built (the plan's
    question). ``head_hooked``: something will hook the model's LM head (heads on the target), which
    keeps the CPU kernels' greedy chains off; ``hidden_taps``: it is built with hidden_taps= (only the
    TAP_RUNNER_KINDS can be; greedy chains are then off too)."""
    if hidden_taps and kind not in TAP_RUNNER_KINDS:
        raise ValueError(f"hidden_taps (EAGLE-3's features) need a runner of {TAP_RUNNER_KINDS}, not {kind!r}")
    if kind == "lean":
        capabilities = lean_capabilities(model, compute_dtype, hidden_taps)
        return RunnerCapabilities(greedy_chain=capabilities.greedy_chain and not head_hooked, chunked_prefill=True,
                                  hidden_taps=hidden_taps)
    if kind == "paged":
        return RunnerCapabilities(device_steps=not static_shapes, hidden_taps=hidden_taps)
    if kind == "recompute":
        return RunnerCapabilities(chunked_prefill=True, hidden_taps=hidden_taps)
    raise ValueError(f"runner kind must be one of {RUNNER_KINDS}, got {kind!r}")
