"""build_engine: the target's runner, the drafter and the batcher for a pair, sized for the server's slots.

The server's plan (plan.plan_server: the runners, the draft length by load or a fixed k, chunked prefill,
CUDA graphs by batch bucket, by the same rules as generate()'s) is built here; the caches are sized for ``max_rows`` slots of ``max_seq_len``
positions (the paged pool for ``cache_tokens`` if given).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..build import build_drafter
from ..generate import eos_token_ids_of  # generate()'s EOS rule, so that a response ends where generate() would
from ..models import Models
from ..plan import FIXED_K, graph_draft_lengths, plan_server
from ..runners import PagedModelRunner, make_runner
from ..runners.paged import DEFAULT_PAGE_SIZE
from . import DEFAULT_MAX_QUEUE, DEFAULT_MAX_ROWS
from .batcher import ContinuousBatcher, Scheduling
from .draft_length import LoadGatedK, describe
from .engine import DEFAULT_MAX_PREFILL_TOKENS, Engine
from .metrics import ServeMetrics

FALLBACK_MAX_SEQ_LEN = 2048  # a row's positions when the models do not say (max_position_embeddings)


@dataclass(frozen=True)
class EngineOptions:
    """The server's knobs (``specdec serve --help`` explains each)."""

    max_rows: int = DEFAULT_MAX_ROWS  # slots: the most rows that decode at once
    max_queue: int = DEFAULT_MAX_QUEUE  # requests that may wait for a slot (then 429)
    k: Optional[int] = None  # draft tokens per step (None: by load, serve/draft_length.py)
    max_seq_len: Optional[int] = None  # positions per row (default: the models' max_position_embeddings)
    cache_tokens: Optional[int] = None  # paged runner: positions in the target's page pool (default: every slot full)
    runner: str = "auto"  # as generate()'s runner=
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # whole-prompt prefill: prompt tokens per admission
    prefill_chunk: Optional[int] = None  # chunked prefill: tokens per step (None: plan.DEFAULT_PREFILL_CHUNK, 0: off)
    tpot_slo_ms: Optional[float] = None  # a target time per output token (serve/slo.py); None: none

    def validate(self) -> None:
        for name in ("max_rows", "max_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {self.max_queue!r}")
        if self.tpot_slo_ms is not None and not (isinstance(self.tpot_slo_ms, (int, float))
                                                 and not isinstance(self.tpot_slo_ms, bool) and self.tpot_slo_ms > 0):
            raise ValueError(f"tpot_slo_ms must be a number > 0 or None, got {self.tpot_slo_ms!r}")
        for name in ("k", "max_seq_len", "cache_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


def build_engine(models: Models, options: EngineOptions = EngineOptions()) -> Engine:
    """An Engine (not started) over ``models``: a draft model (with the target's tokenizer or its own), "ngram",
    an EAGLE-3 head (chains) or no drafter ("none")."""
    options.validate()
    seq_len = options.max_seq_len or _model_positions(models) or FALLBACK_MAX_SEQ_LEN
    plan = plan_server(models.target, models.draft, drafter=models.drafter, k=options.k, runner=options.runner,
                       max_rows=options.max_rows, max_seq_len=seq_len, prefill_chunk=options.prefill_chunk,
                       vocab_bridge=models.bridge)
    target = _target_runner(models, plan, options, seq_len)
    drafter = build_drafter(plan, models, target)
    slo = None if options.tpot_slo_ms is None else options.tpot_slo_ms / 1e3
    metrics = ServeMetrics(plan.slots, tpot_slo=slo)
    draft_length = None
    if plan.adaptive:
        lengths = graph_draft_lengths(plan.slots, FIXED_K) if plan.cuda_graphs else None
        draft_length = LoadGatedK(plan.slots, rows=options.max_rows, pinned_k=FIXED_K, lengths=lengths)
    batcher = ContinuousBatcher(target, drafter, max_rows=options.max_rows, slots=plan.slots, max_seq_len=seq_len,
                                metrics=metrics, graphs=plan.cuda_graphs,
                                scheduling=Scheduling(draft_length, plan.prefill_chunk, slo))
    engine = Engine(batcher, max_queue=options.max_queue, max_prefill_tokens=options.max_prefill_tokens)
    engine.description = (f"target runner {plan.target_runner}, drafter {models.drafter}"
                          + (f" (draft runner {plan.draft_runner})" if plan.draft_runner is not None else "")
                          + f"; {describe(draft_length, plan.slots)}; "
                          + (f"prefill in chunks of {plan.prefill_chunk} tokens per step" if plan.prefill_chunk
                             else "whole-prompt prefill")
                          + (f"; TPOT target {options.tpot_slo_ms:g} ms (prefill chunks and admission)" if slo else "")
                          + f"; {options.max_rows} rows of {seq_len} positions, queue {options.max_queue}; "
                          + f"cache budget {batcher.budget.capacity} {batcher.budget.unit}; "
                          + ("steps in CUDA graphs by batch bucket" if plan.cuda_graphs else
                             f"steps eager ({dict(plan.reasons).get('cuda graphs', 'cuda graphs off')})"))
    engine.plan = plan
    return engine


def _target_runner(models: Models, plan, options: EngineOptions, seq_len: int):
    kind = plan.target_runner
    if kind == "paged":
        pages = None if options.cache_tokens is None else -(-options.cache_tokens // DEFAULT_PAGE_SIZE)
        return PagedModelRunner(models.target, max_batch_size=options.max_rows, max_seq_len=seq_len, num_pages=pages,
                                hidden_taps=plan.hidden_taps)
    if options.cache_tokens is not None:
        raise ValueError(f"cache_tokens sizes the paged runner's page pool; the {kind} runner keeps max_seq_len "
                         f"positions per row: use runner='paged' (--runner paged) or leave cache_tokens out")
    return make_runner(kind, models.target, max_batch_size=options.max_rows, max_seq_len=seq_len,
                       hidden_taps=plan.hidden_taps)


def _model_positions(models: Models) -> Optional[int]:
    limits = [getattr(m.config, "max_position_embeddings", None) for m in (models.target, models.draft) if m is not None]
    limits = [x for x in limits if x]
    return min(limits) if limits else None



def eos_token_ids(target, tokenizer) -> List[int]:
    """The ids that end a row: generate()'s rule (the target's generation_config, else the tokenizer's)."""
    return eos_token_ids_of(None, target, tokenizer)
