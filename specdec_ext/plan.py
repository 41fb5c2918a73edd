"""DecodePlan: every choice of a generate() call, resolved once from its arguments and the models.

generate() is: normalise the prompts -> ``make_plan`` -> build the runners and the drafter (build.py)
-> decode (decode.py). Nothing after the plan decides anything: the drafter's kind and shape, the draft
length (fixed or adaptive), the runners, CUDA graphs, the batch padding and the cache size are all
here, with the reason for each (``plan.explain()``, ``specdec generate --explain``).

The rules, in the order ``make_plan`` applies them:

1. drafter: "model" (a HF draft model), "ngram" (lookup), "heads" (Medusa-style heads on the target)
   or "none" (plain decoding); heads always draft a tree (``HEADS_TREE`` by default), a draft model a
   tree when ``draft_tree`` is given, otherwise a chain.
2. draft length of a chain: an int k, or "auto" (adaptive k, adaptive.py: the length is chosen per
   step up to k_max); k=None means "auto" except where adaptive k would cost something: a seeded
   sample at T > 0 (adaptive choices follow measured times, so the seed would not reproduce it) and a
   draft model where CUDA graphs capture the decode steps (adaptive steps change shape and run
   eagerly): those get ``FIXED_K``. A tree's size is its node count N' (``tree_num_nodes``).
3. runners: runner="auto" takes the lean runner (runners/lean.py) for a model it supports, except
   where CUDA graphs are available (the paged runner's static-shapes mode is what they capture), and
   the paged runner otherwise; a bf16/fp16 draft on the CPU computes in fp32 (the CPU kernels read its
   half-precision weights as they are and widen them exactly). An explicit "lean", "paged" or "recompute" is taken as asked (or refused with why).
4. CUDA graphs: on only for a chain of fixed k on a CUDA device (SPECDEC_CUDA_GRAPHS not 0) with the
   paged runner for the target and no drafter or a draft model on the paged runner; the batch is then
   padded to a bucket (``BUCKETS``) with frozen rows.
5. cache: every row holds its prompt, max_new_tokens and two steps of drafts (``required_cache_len``);
   more than max_seq_len (or the models' max_position_embeddings) is refused before any work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import adaptive as adaptive_k
from .cuda_graphs import graphs_available
from .drafters.tree_drafter import tree_num_nodes
from .metadata import SCRATCH_COLUMNS
from .distributed import TP_CHECKS
from .runners import RUNNER_KINDS, unsupported_reason
from .runners.checks import tensor_parallel_size
from .runners.lean import forward_description
from .runners.support import unsupported_reason as paged_unsupported_reason
from .sampling import SamplingParams

AUTO_K = "auto"  # k= value: the draft length chosen per step (adaptive.py); what k=None means by default
FIXED_K = 4  # what k=None means where adaptive k is not used: seeded sampling, CUDA-graph-captured steps
HEADS_TREE = (3, 3, 8)  # default (b, d, N) of a heads tree (BENCHMARKS.md: heads trees on the bundled pair)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes CUDA graphs are captured for
DRAFTER_KINDS = ("model", "ngram", "heads", "none")


def bucket_size(batch: int) -> int:
    """The smallest bucket >= batch; a batch above the largest bucket keeps its own size."""
    if batch < 1:
        raise ValueError(f"bucket_size: batch must be >= 1, got {batch}")
    return next((bucket for bucket in BUCKETS if batch <= bucket), batch)


def required_cache_len(max_prompt_len: int, max_new_tokens: int, slots: int) -> int:
    """Cache positions a row needs. A row commits at most slots + 1 tokens per step, so it ends with at
    most prompt + max_new_tokens + slots committed (the excess is cut on the host); once finished it is
    frozen but still takes part in each step with slots + 1 tentative tokens. Plus the token buffer's
    scratch column."""
    return max_prompt_len + max_new_tokens + 2 * (slots + 1) + SCRATCH_COLUMNS


@dataclass(frozen=True)
class DecodePlan:
    """What one generate() call will run (see the module docstring for the rules)."""

    drafter: str  # "model", "ngram", "heads" or "none" (plain decoding)
    tree: Optional[Tuple[int, int, int]]  # (b, d, N) of a draft tree; None: a chain (or no drafts)
    slots: int  # draft slots per step: a chain's k (adaptive: k_max), a tree's N'; 0 without drafts
    adaptive: bool  # the draft length is chosen per step (adaptive.py), at most ``slots``
    target_runner: str  # "lean", "paged" or "recompute"
    draft_runner: Optional[str]  # the draft model's runner; None without a draft model
    draft_compute_dtype: Optional[torch.dtype]  # lean draft: weights cast once to this (None: its own)
    cuda_graphs: bool  # draft / verify / commit captured in CUDA graphs (the paged runners' static shapes)
    device: torch.device
    target_dtype: torch.dtype
    sampling: SamplingParams
    batch_size: int  # prompts
    padded_batch_size: int  # rows the loop runs: the CUDA-graph bucket (batch_size without graphs)
    max_seq_len: int  # S: cache positions per row
    max_new_tokens: int
    draft_confidence: float  # a draft model stops drafting a row below this probability (0: off)
    tensor_parallel: int = 1  # ranks the target is sharded over (every rank runs this plan)
    tp_check: str = "broadcast"  # how the ranks are kept on rank 0's decisions (distributed.RankSync)
    reasons: Tuple[Tuple[str, str], ...] = ()  # (choice, why), in the order they were made
    controller: Optional[adaptive_k.AdaptiveK] = field(default=None, compare=False, repr=False)

    @property
    def is_tree(self) -> bool:
        return self.tree is not None

    def explain(self) -> str:
        """One line per choice: what was chosen and why."""
        width = max(len(choice) for choice, _ in self.reasons)
        return "\n".join(f"{choice:<{width}}  {why}" for choice, why in self.reasons)


def make_plan(target_model, draft_model, *, drafter: str, prompt_lengths: Sequence[int], max_new_tokens: int,
              k: Union[None, int, str, adaptive_k.AdaptiveK] = None, draft_tree: Optional[Tuple[int, int, int]] = None,
              runner: str = "auto", sampling: SamplingParams = SamplingParams(), seeded: bool = False,
              max_seq_len: Optional[int] = None, draft_confidence: float = 0.0,
              tp_check: str = "broadcast") -> DecodePlan:
    """Resolve every choice (module docstring) and check what can be checked before any work."""
    if drafter not in DRAFTER_KINDS:
        raise ValueError(f"drafter must be one of {DRAFTER_KINDS}, got {drafter!r}")
    if runner != "auto" and runner not in RUNNER_KINDS:
        raise ValueError(f"runner must be 'auto' or one of {RUNNER_KINDS}, got {runner!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not 0.0 <= draft_confidence < 1.0:
        raise ValueError(f"draft_confidence must lie in [0, 1), got {draft_confidence}")
    sampling.validate()
    reasons: List[Tuple[str, str]] = []
    param = next(target_model.parameters())
    device, target_dtype = param.device, param.dtype
    if draft_model is not None:
        draft_device = next(draft_model.parameters()).device
        if draft_device != device:
            raise ValueError(f"the draft is on {draft_device}, the target on {device}: use one device")
    graphs_ok, graphs_reason = graphs_available(device)
    tensor_parallel = tensor_parallel_size(target_model)
    if tp_check not in TP_CHECKS:
        raise ValueError(f"tp_check must be one of {TP_CHECKS}, got {tp_check!r}")

    # 1. drafter and shape
    tree = _tree_shape(drafter, draft_tree)
    # 2. draft length
    controller = None
    if drafter == "none":
        slots = 0
        reasons.append(("drafter", "none: plain decoding, one target pass per token"))
    elif tree is not None:
        slots = tree_num_nodes(*tree)
        source = "heads on the target" if drafter == "heads" else "the draft model"
        reasons.append(("drafter", f"{drafter} tree (b, d, N) = {tree}: {slots} nodes from {source}, verified "
                                   f"in one pass of {slots + 1} tokens (k does not apply)"))
    else:
        if tensor_parallel > 1 and (k == AUTO_K or isinstance(k, adaptive_k.AdaptiveK)):
            raise ValueError("k='auto' cannot run on a tensor-parallel target: adaptive choices follow each rank's own "
                             "timings, so the ranks would disagree on the verify width; pass an int k")
        if k is None and tensor_parallel > 1:
            k, why = FIXED_K, (f"k=None on a tensor-parallel target: a fixed k={FIXED_K} (adaptive choices follow "
                               "each rank's own timings)")
        elif k is None:
            k, why = _default_draft_length(drafter, sampling, seeded, runner, graphs_ok)
        else:
            why = "as asked"
        slots, controller = adaptive_k.resolve(k)
        if controller is not None:
            reasons.append(("drafter", f"{drafter} chain, k=auto (adaptive, up to {slots} per step): {why}"))
        else:
            reasons.append(("drafter", f"{drafter} chain, k={slots}: {why}"))
    # 3. runners
    cache_len = required_cache_len(max(prompt_lengths), max_new_tokens, slots)
    target_runner, why = _runner_for(target_model, runner, graphs_ok, cache_len, device, "target", tree is not None)
    reasons.append(("target runner", f"{target_runner}: {why}"))
    if drafter == "heads" and target_runner == "recompute":
        raise ValueError("draft='heads' needs the paged or lean runner (runner='auto'), not 'recompute' (its HF "
                         "forwards are per group of equal lengths, not one per pass)")
    draft_runner = draft_dtype = None
    if draft_model is not None:
        draft_runner, why = _runner_for(draft_model, runner, graphs_ok, cache_len, device, "draft", tree is not None)
        weights = next(draft_model.parameters()).dtype
        if draft_runner == "lean" and device.type == "cpu" and weights in (torch.bfloat16, torch.float16):
            draft_dtype = torch.float32
            why += f"; {weights} weights computed in fp32 (the CPU kernels widen them exactly as they stream them)"
        reasons.append(("draft runner", f"{draft_runner}: {why}"))
    # 4. CUDA graphs
    graphs, why = _graphs(graphs_ok, graphs_reason, drafter, tree, controller, target_runner, draft_runner)
    reasons.append(("cuda graphs", f"{'on' if graphs else 'off'}: {why}"))
    batch = len(prompt_lengths)
    padded = bucket_size(batch) if graphs else batch
    reasons.append(("batch", f"{batch} rows" + (f", padded to the graph bucket {padded} with frozen rows"
                                                 if padded > batch else "")))
    # 5. cache
    limit = max_seq_len
    if limit is None:
        limits = [m for m in (_max_positions(x) for x in (target_model, draft_model) if x is not None) if m]
        limit = min(limits) if limits else None
    if limit is not None:
        for b, length in enumerate(prompt_lengths):
            needs = required_cache_len(length, max_new_tokens, slots)
            if needs > limit:
                raise ValueError(
                    f"prompt {b} has {length} tokens; with max_new_tokens={max_new_tokens} and {slots} draft "
                    f"slots it needs {needs} cache positions but the cache holds {limit} (max_seq_len, or the "
                    f"models' max_position_embeddings): shorten the prompt or lower max_new_tokens")
    reasons.append(("cache", f"{cache_len} positions per row (longest prompt {max(prompt_lengths)} + "
                             f"{max_new_tokens} new + two steps of drafts)"))
    reasons.append(("sampling", "greedy" if sampling.greedy else
                    f"T={sampling.temperature}, top_k={sampling.top_k}, top_p={sampling.top_p}"))
    if tensor_parallel > 1:
        reasons.append(("tensor parallel", f"the target is sharded over {tensor_parallel} ranks, each running this "
                                           f"loop with a replicated drafter; tp_check={tp_check} (distributed.py)"))
    return DecodePlan(drafter=drafter, tree=tree, slots=slots, adaptive=controller is not None,
                      target_runner=target_runner, draft_runner=draft_runner, draft_compute_dtype=draft_dtype,
                      cuda_graphs=graphs, device=device, target_dtype=target_dtype, sampling=sampling,
                      batch_size=batch, padded_batch_size=padded, max_seq_len=cache_len,
                      max_new_tokens=max_new_tokens, draft_confidence=float(draft_confidence),
                      tensor_parallel=tensor_parallel, tp_check=tp_check, reasons=tuple(reasons),
                      controller=controller)


def _tree_shape(drafter: str, draft_tree) -> Optional[Tuple[int, int, int]]:
    if draft_tree is not None:
        if (not isinstance(draft_tree, (tuple, list)) or len(draft_tree) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in draft_tree)):
            raise ValueError(f"draft_tree must be a tuple (b, d, N) of ints >= 1, got {draft_tree!r}")
        if drafter == "ngram":
            raise ValueError("draft_tree needs a draft model or heads, not the n-gram drafter")
        if drafter == "none":
            raise ValueError("draft_tree needs a draft model or heads (plain decoding drafts nothing)")
        return tuple(draft_tree)
    return HEADS_TREE if drafter == "heads" else None


def _default_draft_length(drafter: str, sampling: SamplingParams, seeded: bool, runner: str,
                          graphs_ok: bool) -> Tuple[Union[int, str], str]:
    """What k=None runs for a chain: (AUTO_K or FIXED_K, why)."""
    if seeded and not sampling.greedy:
        return FIXED_K, (f"k=None with a seeded sample at T > 0: a fixed k={FIXED_K}, so that the seed reproduces "
                         "the sample (adaptive choices follow measured times)")
    if drafter == "model" and graphs_ok and runner in ("auto", "paged"):
        return FIXED_K, (f"k=None where CUDA graphs capture the decode steps: a fixed k={FIXED_K} (adaptive "
                         "steps change shape and run eagerly)")
    return AUTO_K, "k=None: the draft length that maximises measured tokens per second, per step"


def _runner_for(model, runner: str, graphs_ok: bool, cache_len: int, device: torch.device, role: str,
                tree: bool) -> Tuple[str, str]:
    """(runner kind, why) for the target or the draft model; refuses a model the chosen runner cannot run
    (the error names the architecture and the missing feature)."""
    lean_reason = unsupported_reason(model, cache_len)
    if runner == "lean":
        if lean_reason is not None:
            raise ValueError(f"runner='lean' cannot run the {role} model: {lean_reason}")
        return "lean", "as asked"
    if runner == "auto" and not graphs_ok and lean_reason is None:
        return "lean", f"a Llama-family model: {forward_description(model)} over its weights and a contiguous cache"
    if runner in ("auto", "paged"):
        paged_reason = paged_unsupported_reason(model, tree=tree)
        if paged_reason is not None:
            lean_note = lean_reason is not None and not lean_reason.startswith("model_type")
            raise ValueError(f"the {role} model cannot be run: {paged_reason}"
                             + (f" (and the lean runner does not apply: {lean_reason})" if lean_note else ""))
    if runner != "auto":
        return runner, "as asked"
    if graphs_ok:
        return "paged", f"{device.type} with CUDA graphs available: the paged runner's static shapes are captured"
    return "paged", f"the lean runner does not apply ({lean_reason})"


def _graphs(graphs_ok: bool, graphs_reason: Optional[str], drafter: str, tree, controller, target_runner: str,
            draft_runner: Optional[str]) -> Tuple[bool, str]:
    """(CUDA graphs on, why)."""
    if not graphs_ok:
        return False, graphs_reason
    if tree is not None:
        return False, "a tree's forwards vary per step (eager)"
    if controller is not None:
        return False, "adaptive k changes the verify width per step (eager)"
    if target_runner != "paged":
        return False, f"the {target_runner} target runner syncs with the host"
    if drafter in ("ngram", "heads"):
        return False, f"the {drafter} drafter proposes on the host"
    if drafter == "model" and draft_runner != "paged":
        return False, f"the {draft_runner} draft runner syncs with the host"
    return True, "a chain of fixed k on the paged runners (static shapes): draft, verify and commit are graphs"


def _max_positions(model) -> Optional[int]:
    return getattr(model.config, "max_position_embeddings", None)
