"""DecodePlan: every choice of a generate() call, resolved once from its arguments and the models.

generate() is: normalise the prompts -> ``make_plan`` -> build the runners and the drafter (build.py)
-> decode (decode.py); ``specdec serve`` plans with ``plan_server``. Nothing after the plan decides anything: the drafter's kind and shape, the draft
length (fixed or adaptive), the runners, CUDA graphs, the batch padding and the cache size are all
here, with the reason for each (``plan.explain()``, ``specdec generate --explain``).

The rules, in the order ``make_plan`` applies them:

1. drafter: "model" (a HF draft model), "cross-tokenizer" (a HF draft model with another tokenizer:
   greedy-through-text when greedy, the vocabularies' intersection when sampling; chains only, on the
   host), "ngram" (lookup), "heads" (Medusa-style heads on the target) or "none" (plain decoding); heads
   always draft a tree (``HEADS_TREE`` by default), a draft model a tree when ``draft_tree`` is given,
   otherwise a chain.
2. draft length of a chain: an int k, or "auto" (adaptive k, adaptive.py: the length is chosen per
   step up to k_max); k=None means "auto" except where adaptive k would cost something: a seeded
   sample at T > 0 (adaptive choices follow measured times, so the seed would not reproduce it) and a
   draft model or EAGLE head where CUDA graphs capture the decode steps (adaptive steps change shape and run
   eagerly): those get ``FIXED_K``. A tree's size is its node count N' (``tree_num_nodes``); a draft
   model's or heads' tree ranks its nodes by the calibration learnt across calls, except a seeded sample
   at T > 0, which ranks its tree's nodes by the prior alone (``tree_calibration``), for the same reason.
3. runners: runner="auto" takes the lean runner (runners/lean.py) for a model it supports, except
   where CUDA graphs are available (the paged runner's static-shapes mode is what they capture), and
   the paged runner otherwise; a bf16/fp16 draft on the CPU computes in fp32 (the CPU kernels read its
   half-precision weights as they are and widen them exactly). An explicit "lean", "paged" or "recompute" is taken as asked (or refused with why).
4. CUDA graphs: on only for a chain of fixed k on a CUDA device (SPECDEC_CUDA_GRAPHS not 0) with the
   paged runner for the target and no drafter, a draft model on the paged runner or an EAGLE-3 head
   (``GRAPH_DRAFTERS``); the batch is then padded to a bucket (``BUCKETS``) with frozen
   rows.
5. cache: the positions a row writes (``loop_cache_len``): plain decoding its prompt and max_new_tokens - 1
   (the last token is sampled, never fed), a draft its prompt, max_new_tokens and two steps of drafts;
   more than max_seq_len (or the models' max_position_embeddings) is refused before any work, and an
   explicit max_seq_len that lets the rows run past max_position_embeddings is warned about (a model with
   an absolute position table, GPT-2's wpe, is bounded by it whatever max_seq_len says: it cannot look
   past it). A draft length left to the plan (k None or "auto") shrinks to what the cache leaves, down to
   plain decoding (``_fit_default_draft_length``); an asked k or tree is refused.
6. capabilities: what the chosen runners can do beyond the ModelRunner contract
   (runners/capabilities.py: greedy chains, device steps), resolved before they are built; the loop,
   the drafters and the server branch on these plan fields, never on the runner objects.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import adaptive as adaptive_k
from .cuda_graphs import graphs_available
from .drafters.cross_tokenizer import BY_STEP, GREEDY_THROUGH_TEXT, INTERSECTION
from .drafters.model_drafter import draft_window_of
from .drafters.tree_drafter import tree_num_nodes
from .distributed import TP_CHECKS
from .logprobs import check_top_logprobs
from .processing import Processing
from .runners import RUNNER_KINDS, RunnerCapabilities, capabilities_of, unsupported_reason
from .runners.checks import output_vocab_size, tensor_parallel_size, text_config
from .runners.lean import forward_description, rope_parameters
from .runners.paged import DEFAULT_PAGE_SIZE
from .runners.support import model_type, unsupported_reason as paged_unsupported_reason
from .sampling import SamplingParams

AUTO_K = "auto"  # k= value: the draft length chosen per step (adaptive.py); what k=None means by default
DEFAULT_PREFILL_CHUNK = 256  # a server's prompt tokens per step of chunked prefill (BENCHMARKS.md, issue 30)
MIN_PREFILL_CHUNK = 32  # ... at least this many, whatever the running rows' verify tokens take of it
PAGED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the paged cache's (kv_write's) dtypes
FIXED_K = 4  # what k=None means where adaptive k is not used: seeded sampling, CUDA-graph-captured steps
SHARED_CALIBRATION = "shared"  # a tree ranks its nodes by what earlier calls learnt (drafters/calibration.py)
PRIOR_CALIBRATION = "prior"  # ... by the prior alone, never learnt: a seeded sample at T > 0
HEADS_TREE = (3, 3, 8)  # default (b, d, N) of a heads tree (BENCHMARKS.md: heads trees on the bundled pair)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes CUDA graphs are captured for
GRAPH_DRAFTERS = ("model", "eagle")  # drafters whose chains are device work (captured in generate() and serve)
GRAPH_DRAFT_LENGTHS = (0, 1, 2, 4, 8)  # draft lengths a server under CUDA graphs chooses from (with its k_max
# and pinned k): each one is a capture per bucket and filter, so a few, each about half the next one's pass
DRAFTER_KINDS = ("model", "cross-tokenizer", "ngram", "heads", "eagle", "none")  # cross-tokenizer: a draft model with
# another tokenizer than the target's (drafters/cross_tokenizer.py)


def bucket_size(batch: int) -> int:
    """The smallest bucket >= batch; a batch above the largest bucket keeps its own size."""
    if batch < 1:
        raise ValueError(f"bucket_size: batch must be >= 1, got {batch}")
    return next((bucket for bucket in BUCKETS if batch <= bucket), batch)


def required_cache_len(max_prompt_len: int, max_new_tokens: int, slots: int) -> int:
    """Cache positions a server row is budgeted (serve/budget.py; generate() plans ``loop_cache_len``). A
    row commits at most slots + 1 tokens per step, so it ends with at most prompt + max_new_tokens + slots
    committed (the excess is cut on the host); once finished it is frozen but still takes part in each
    step with slots + 1 tentative tokens."""
    return max_prompt_len + max_new_tokens + 2 * (slots + 1)


def loop_cache_len(prompt_len: int, max_new_tokens: int, slots: int) -> int:
    """The most target cache positions a generate() row writes (the plan's max_seq_len). Plain decoding
    (``slots`` 0): the prompt, then one pass per new token but the last, which is sampled and never fed:
    prompt + max_new_tokens - 1. With drafts: an unfinished row has at most max_new_tokens - 1 tokens out
    and its step commits at most slots + 1 more, so it ends with at most prompt + max_new_tokens + slots
    tokens out, prompt + max_new_tokens + slots - 1 of them in the cache (the excess is cut on the host);
    a finished row is frozen but still takes part in each step with its pending token and up to ``slots``
    tentative drafts after them: prompt + max_new_tokens + 2 * slots. (Measured on the bundled pair: a
    k=4 chain's frozen rows reach exactly that; the decode loop's token buffer holds one token more,
    the last one emitted: decode.LoopConfig.of.)"""
    if slots == 0:
        return prompt_len + max(max_new_tokens - 1, 0)
    return prompt_len + max_new_tokens + 2 * slots


def draft_room(limit: int, prompt_len: int, max_new_tokens: int) -> int:
    """The most draft slots whose ``loop_cache_len`` (prompt + max_new_tokens + 2 x slots) fits ``limit``
    positions (0 where none does)."""
    return max((limit - prompt_len - max_new_tokens) // 2, 0)


@dataclass(frozen=True)
class DecodePlan:
    """What one generate() call will run (see the module docstring for the rules)."""

    drafter: str  # DRAFTER_KINDS: "model", "cross-tokenizer", "ngram", "heads" or "none" (plain decoding)
    tree: Optional[Tuple[int, int, int]]  # (b, d, N) of a draft tree; None: a chain (or no drafts)
    slots: int  # draft slots per step: a chain's k (adaptive: k_max), a tree's N'; 0 without drafts
    adaptive: bool  # the draft length is chosen per step (adaptive.py), at most ``slots``
    target_runner: str  # "lean", "paged" or "recompute"
    draft_runner: Optional[str]  # the draft model's runner; None without a draft model
    draft_compute_dtype: Optional[torch.dtype]  # lean draft: weights cast once to this (None: its own)
    cuda_graphs: bool  # draft / verify / commit captured in CUDA graphs
    static_shapes: bool  # the paged runners in their CUDA-graph mode (generate(); a server's stay in host mode)
    device: torch.device
    target_dtype: torch.dtype
    sampling: SamplingParams
    batch_size: int  # prompts
    padded_batch_size: int  # rows the loop runs: the CUDA-graph bucket (batch_size without graphs)
    max_seq_len: int  # S: cache positions per row
    max_new_tokens: int
    draft_confidence: float  # a draft model stops drafting a row below this probability (0: off)
    target_capabilities: RunnerCapabilities  # the target runner's optional methods (runners/capabilities.py)
    draft_capabilities: Optional[RunnerCapabilities]  # the draft model's runner's; None without a draft model
    tensor_parallel: int = 1  # ranks the target is sharded over (every rank runs this plan)
    tp_check: str = "broadcast"  # how the ranks are kept on rank 0's decisions (distributed.RankSync)
    reasons: Tuple[Tuple[str, str], ...] = ()  # (choice, why), in the order they were made
    prefill_chunk: int = 0  # a server's prompt tokens prefilled per step (0: whole prompts)
    cross_tokenizer: Optional[str] = None  # drafter "cross-tokenizer": "greedy-through-text", "intersection" or
    #                                       "by step" (the server's: the one that fits each step's rows)
    processing: Optional[Processing] = None  # every row's logits processors (processing.py); None: none
    top_logprobs: Optional[int] = None  # logprobs of the emitted tokens with this many top tokens; None: off
    hidden_taps: Optional[Tuple[int, ...]] = None  # drafter "eagle": the layers its target runner taps (taps.py)
    tree_calibration: Optional[str] = None  # a draft model's or heads' tree: SHARED_CALIBRATION or PRIOR_CALIBRATION
    controller: Optional[adaptive_k.AdaptiveK] = field(default=None, compare=False, repr=False)

    @property
    def is_tree(self) -> bool:
        return self.tree is not None

    def explain(self) -> str:
        """One line per choice: what was chosen and why."""
        width = max(len(choice) for choice, _ in self.reasons)
        return "\n".join(f"{choice:<{width}}  {why}" for choice, why in self.reasons)


@dataclass(frozen=True)
class PlanRequest:
    """What a generate() call asks of ``make_plan`` (beyond the models)."""

    drafter: str  # DRAFTER_KINDS
    prompt_lengths: Sequence[int]
    max_new_tokens: int
    k: Union[None, int, str, adaptive_k.AdaptiveK] = None
    draft_tree: Optional[Tuple[int, int, int]] = None
    runner: str = "auto"
    sampling: SamplingParams = SamplingParams()
    seeded: bool = False  # a seed was given (a seeded sample at T > 0 keeps a fixed k)
    max_seq_len: Optional[int] = None
    draft_confidence: float = 0.0
    tp_check: str = "broadcast"
    vocab_bridge: object = None  # drafter "cross-tokenizer": its vocab_bridge.VocabularyBridge
    processing: Optional[Processing] = None  # logits processors (checked against the target's vocabulary)
    top_logprobs: Optional[int] = None
    num_heads: Optional[int] = None  # drafter "heads": how many (a tree is no deeper)

    def validate(self) -> None:
        _check_kinds(self.drafter, self.runner)
        if (self.drafter == "cross-tokenizer") != (self.vocab_bridge is not None):
            raise ValueError("drafter 'cross-tokenizer' needs vocab_bridge= (and only it takes one)")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if (isinstance(self.draft_confidence, bool) or not isinstance(self.draft_confidence, (int, float))
                or not 0.0 <= self.draft_confidence < 1.0):
            raise ValueError(f"draft_confidence must be a number in [0, 1), got {self.draft_confidence!r}")
        if self.max_seq_len is not None and (isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int)
                                             or self.max_seq_len < 1):
            raise ValueError(f"max_seq_len must be an int >= 1 or None, got {self.max_seq_len!r}")
        if self.tp_check not in TP_CHECKS:
            raise ValueError(f"tp_check must be one of {TP_CHECKS}, got {self.tp_check!r}")
        self.sampling.validate()
        check_top_logprobs(self.top_logprobs, "logprobs")


def _check_kinds(drafter: str, runner: str) -> None:
    if drafter not in DRAFTER_KINDS:
        raise ValueError(f"drafter must be one of {DRAFTER_KINDS}, got {drafter!r}")
    if runner != "auto" and runner not in RUNNER_KINDS:
        raise ValueError(f"runner must be 'auto' or one of {RUNNER_KINDS}, got {runner!r}")


@dataclass(frozen=True)
class _Models:
    """What the rules read of the models, once."""

    target: object
    draft: object
    device: torch.device
    target_dtype: torch.dtype
    graphs_ok: bool
    graphs_reason: Optional[str]
    tensor_parallel: int

    @classmethod
    def of(cls, target_model, draft_model) -> "_Models":
        param = next(target_model.parameters())
        _check_model_state("target", target_model)
        if draft_model is not None:
            if isinstance(draft_model, torch.nn.Module):
                _check_model_state("draft", draft_model)
            draft_device = next(draft_model.parameters()).device
            if draft_device != param.device:
                raise ValueError(f"the draft is on {draft_device}, the target on {param.device}: use one device")
        graphs_ok, graphs_reason = graphs_available(param.device)
        return cls(target_model, draft_model, param.device, param.dtype, graphs_ok, graphs_reason,
                   tensor_parallel_size(target_model))


def _holds_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (the modules by their dicts), those of
    modules that accelerate offloads left out (their ``_hf_hook`` loads them for each forward)."""
    stack = [model]
    while stack:
        module = stack.pop()
        if not hasattr(module, "_hf_hook"):
            for tensors in (module._parameters, module._buffers):
                if any(t is not None and t.is_meta for t in tensors.values()):
                    return True
        stack.extend(child for child in module._modules.values() if child is not None)
    return False


def _check_model_state(role: str, model: torch.nn.Module) -> None:
    """ValueError where the model cannot give its own output: weights on the meta device (not loaded: any of
    them, a partial load too, where torch computed with uninitialised memory), or training mode with dropout
    (every pass random: no output to be lossless to)."""
    if _holds_meta(model):  # (the names only then: named_parameters() costs 0.1 ms a call on the bundled target)
        tensors = itertools.chain(model.named_parameters(), model.named_buffers())
        meta = next(name for name, tensor in tensors if tensor.is_meta)
        first = next(model.parameters(), None)
        what = "weights are" if first is not None and first.is_meta else f"{meta} is"
        raise ValueError(f"the {role} model's {what} on the meta device (not loaded): load them first")
    if not model.training:
        return
    config = getattr(model, "config", None)
    dropouts = [(name, m.p) for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    attention = getattr(text_config(config), "attention_dropout", 0.0) if config is not None else 0.0
    if dropouts or (isinstance(attention, (int, float)) and attention > 0):
        where = f"{dropouts[0][0] or 'the model'} p={dropouts[0][1]}" if dropouts else f"attention_dropout={attention}"
        raise ValueError(f"the {role} model is in training mode with dropout ({where}): its passes are random; "
                         f"call model.eval() first")


def _rope_switch(target) -> Optional[Tuple[str, int, str, str]]:
    """(rope type, the position past which a forward's furthest position changes every position's rotary
    frequencies, that limit's config name, what happens there) of a longrope or dynamic-NTK target, else None."""
    config = text_config(getattr(target, "config", None))
    rope = rope_parameters(config) if config is not None else {}
    rope_type = rope.get("rope_type")
    if rope_type == "longrope":
        limit = rope.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
        name, what = "original_max_position_embeddings", "switches to its long factors"
    elif rope_type == "dynamic":
        limit = getattr(config, "max_position_embeddings", None)
        name, what = "max_position_embeddings", "recomputes its frequencies from each forward's furthest position"
    else:
        return None
    return (rope_type, limit, name, what) if limit else None


def _check_rope_switch(ask: "PlanRequest", slots: int, target, cache_len: int) -> None:
    """ValueError where a target's rotary frequencies depend on the furthest position of each forward (HF's
    longrope: the long factors for a whole forward once it passes original_max_position_embeddings; dynamic
    NTK: frequencies recomputed from it past max_position_embeddings) and this generation would give its rows
    other frequencies than their own plain decoding does: a verify pass reaches further than a plain one (the
    check keeps 2 x slots positions of margin), and in a batch the longest row sets them for every row (plain
    decoding too). Its tokens would then differ from the target's, silently."""
    switch = _rope_switch(target)
    if switch is None:
        return
    rope_type, limit, name, what = switch
    shortest, longest = min(ask.prompt_lengths), max(ask.prompt_lengths)
    # longrope flips once: a row that starts past the limit stays on the long factors; dynamic NTK recomputes
    # its frequencies from every forward's furthest position past the limit, so no row may be there
    crossing = limit < cache_len and (rope_type == "dynamic" or shortest <= limit)
    if not crossing:
        return
    if slots:
        raise ValueError(f"the target's {rope_type} rope {what} past {name}={limit}, inside this generation "
                         f"(prompts of {shortest}-{longest} tokens, up to {cache_len} positions with {slots} draft "
                         f"slots): a verify pass reaches further than the target's own decoding does. Keep every "
                         f"row within {limit - 2 * slots} positions, or decode plainly (draft='none')")
    if len(set(ask.prompt_lengths)) > 1:
        raise ValueError(f"the target's {rope_type} rope {what} past {name}={limit}, inside this generation, and "
                         f"its prompts differ in length ({shortest}-{longest} tokens): in one batch the longest row "
                         f"would set the others' frequencies. Generate the rows one at a time (or in groups of "
                         f"equal length), or keep every row within {limit} positions")


def make_plan(target_model, draft_model, **request) -> DecodePlan:
    """Resolve every choice (module docstring) and check what can be checked before any work.
    ``request``: the fields of ``PlanRequest`` (drafter=, prompt_lengths=, max_new_tokens=, k=, ...)."""
    ask = PlanRequest(**request)
    ask.validate()
    models = _Models.of(target_model, draft_model)
    reasons: List[Tuple[str, str]] = []
    tree = _tree_shape(ask.drafter, ask.draft_tree, output_vocab_size(models.target), ask.num_heads)
    slots, controller = _draft_length(ask, tree, models, reasons)
    if tree is None and slots and (ask.k is None or ask.k == AUTO_K):
        ask, slots, controller = _fit_default_draft_length(ask, slots, controller, models, reasons)
    calibration = _tree_calibration(ask, tree, reasons)
    cross_mode = _cross_tokenizer_mode(ask, reasons)
    cache_len = loop_cache_len(max(ask.prompt_lengths), ask.max_new_tokens, slots)
    runners = _runners(ask.drafter, ask.runner, tree, models, cache_len, reasons)
    graphs, why = _graphs(models.graphs_ok, models.graphs_reason, ask.drafter, tree, controller, runners)
    if graphs and ask.processing is not None and ask.processing.grammar is not None:
        graphs, why = False, "a grammar's masks are filled on the host between the draft and the verify pass"
    reasons.append(("cuda graphs", f"{'on' if graphs else 'off'}: {why}"))
    batch = len(ask.prompt_lengths)
    padded = bucket_size(batch) if graphs else batch
    reasons.append(("batch", f"{batch} rows" + (f", padded to the graph bucket {padded} with frozen rows"
                                                 if padded > batch else "")))
    _check_cache(ask, slots, models)
    _check_rope_switch(ask, slots, models.target, cache_len)
    reasons.append(("cache", f"{cache_len} positions per row (longest prompt {max(ask.prompt_lengths)}"
                             + (", no new token)" if ask.max_new_tokens == 0 and slots == 0 else
                                f" + {ask.max_new_tokens} new - 1: the last is never fed)" if slots == 0 else
                                f" + {ask.max_new_tokens} new + 2 x {slots} draft slots)")))
    capabilities = _capabilities(runners, ask.drafter, models, static_shapes=graphs)
    every_token_sampled = (ask.processing is not None and ask.processing.active) or ask.top_logprobs is not None
    reasons.append(("capabilities", _describe_capabilities(*capabilities, ask.sampling, every_token_sampled)))
    reasons.append(("sampling", "greedy" if ask.sampling.greedy else
                    f"T={ask.sampling.temperature}, top_k={ask.sampling.top_k}, top_p={ask.sampling.top_p}"))
    _describe_processing(ask, models, reasons)
    taps = _hidden_taps(ask.drafter, draft_model, reasons)
    if models.tensor_parallel > 1:
        reasons.append(("tensor parallel", f"the target is sharded over {models.tensor_parallel} ranks, each running "
                                           f"this loop with a replicated drafter; tp_check={ask.tp_check} "
                                           "(distributed.py)"))
    return DecodePlan(drafter=ask.drafter, tree=tree, slots=slots, adaptive=controller is not None,
                      target_runner=runners.target, draft_runner=runners.draft, draft_compute_dtype=runners.draft_dtype,
                      cuda_graphs=graphs, static_shapes=graphs, device=models.device, target_dtype=models.target_dtype,
                      sampling=ask.sampling, batch_size=batch, padded_batch_size=padded, max_seq_len=cache_len,
                      max_new_tokens=ask.max_new_tokens, draft_confidence=float(ask.draft_confidence),
                      target_capabilities=capabilities[0], draft_capabilities=capabilities[1],
                      tensor_parallel=models.tensor_parallel, tp_check=ask.tp_check, reasons=tuple(reasons),
                      cross_tokenizer=cross_mode, processing=ask.processing, top_logprobs=ask.top_logprobs,
                      hidden_taps=taps, tree_calibration=calibration, controller=controller)


def _tree_calibration(ask: PlanRequest, tree, reasons: List[Tuple[str, str]]) -> Optional[str]:
    """Rule 2 for a tree: which node calibration ranks its nodes (drafters/calibration.py). The shared one
    holds what earlier calls in the process learnt, so the tree's shape, and a seeded sample drawn through
    it, would depend on what ran before; a calibration learnt within the call would make each row's shape
    depend on the other rows' outcomes, and its sample on the batch. Like adaptive k, which a seeded sample
    at T > 0 gives up for a fixed k, such a sample ranks its nodes by the prior alone (never learnt), so that
    the seed reproduces it, alone or batched. Greedy output never depends on the shape, and an unseeded
    sample is not reproducible anyway: those keep learning across calls."""
    if tree is None or ask.drafter not in ("model", "heads"):  # an EAGLE tree ranks by its own probabilities
        return None
    if ask.seeded and not ask.sampling.greedy:
        reasons.append(("tree calibration", f"{PRIOR_CALIBRATION}: a seeded sample at T > 0 ranks the tree's "
                                            "nodes by the prior alone (the draft's probabilities), so that the seed "
                                            "reproduces the sample whatever ran before and whatever rows run beside it"))
        return PRIOR_CALIBRATION
    reasons.append(("tree calibration", f"{SHARED_CALIBRATION}: nodes ranked by the rate at which the target emitted "
                                        "such candidates, learnt across this process's calls"))
    return SHARED_CALIBRATION


def _hidden_taps(drafter: str, head, reasons: List[Tuple[str, str]]) -> Optional[Tuple[int, ...]]:
    """Drafter "eagle": the target layers whose inputs its runner keeps per token (the head's layer ids)."""
    if drafter != "eagle":
        return None
    reasons.append(("hidden taps", f"the target runner keeps the inputs of layers {tuple(head.config.layer_ids)} per "
                                   "token for the EAGLE-3 head (rolled back with its cache)"))
    return tuple(head.config.layer_ids)


def _describe_processing(ask: PlanRequest, models: _Models, reasons: List[Tuple[str, str]]) -> None:
    """Check the processors against the target's vocabulary; say what runs."""
    if ask.processing is not None and ask.processing.active:
        ask.processing.validate(output_vocab_size(models.target))
        reasons.append(("processing", f"{ask.processing.describe()}: on the target's logits at every position of "
                                      "a verify pass (each with its drafts before it) and on a draft model's, an "
                                      "EAGLE-3 head's or the heads' as they draft (processing.py)"))
    if ask.top_logprobs is not None:
        reasons.append(("logprobs", f"each emitted token's logprob and the top {ask.top_logprobs} under the "
                                    "processed target at the row's temperature (logprobs.py)"))


def graph_draft_lengths(k_max: int, pinned_k: int) -> Tuple[int, ...]:
    """The draft lengths a server's steps may take under CUDA graphs (serve/draft_length.LoadGatedK's
    ``lengths``): GRAPH_DRAFT_LENGTHS up to k_max, k_max and the seeded requests' pinned length."""
    return tuple(sorted({K for K in GRAPH_DRAFT_LENGTHS if K <= k_max} | {int(k_max), int(pinned_k)}))


def plan_server(target_model, draft_model, *, drafter: str, k: Optional[int], runner: str, max_rows: int,
                max_seq_len: int, prefill_chunk: Optional[int] = None, vocab_bridge=None) -> DecodePlan:
    """The plan of ``specdec serve``: the runners, draft length, prefill and CUDA graphs of a continuous
    batcher of ``max_rows`` slots of ``max_seq_len`` positions. It differs from a generate() plan in four
    ways: ``k`` None is the draft length by load (``adaptive``: serve/draft_length.py chooses 0..k_max per
    step from the step costs measured at the running width; seeded requests draft FIXED_K every step) and
    an int fixes it; the runners stay in host mode between steps (rows join and leave a shared page pool),
    so where CUDA graphs are on the batcher runs each step on the device by batch-size bucket
    (``static_shapes`` False, ``cuda_graphs`` True), k by load choosing among the few lengths it captures
    (``graph_draft_lengths``); a joining prompt is prefilled in chunks
    of ``prefill_chunk`` tokens between decode steps where the target runner can (``chunked_prefill``;
    None: DEFAULT_PREFILL_CHUNK, 0: whole prompts); the sampling filter is each request's own."""
    if drafter == "heads":
        raise ValueError("specdec serve runs chain drafters (a draft model, one with another tokenizer, ngram, "
                         "eagle) or none: the heads drafter proposes trees, which continuous batching does not run")
    _check_kinds(drafter, runner)
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 0):
        raise ValueError(f"prefill_chunk must be an int >= 0 (0: whole prompts) or None, got {prefill_chunk!r}")
    models = _Models.of(target_model, draft_model)
    reasons: List[Tuple[str, str]] = []
    runners = _runners(drafter, runner, None, models, max_seq_len, reasons)
    graphs, why = _graphs(models.graphs_ok, models.graphs_reason, drafter, None, None, runners)
    slots, by_load = _server_draft_length(drafter, k, graphs, models.tensor_parallel, reasons)
    if required_cache_len(1, 0, slots) > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} leaves no room for a token with {slots} draft slots "
                         f"(a row needs {required_cache_len(1, 1, slots)} positions for a one-token prompt)")
    switch = _rope_switch(models.target)
    if switch is not None and switch[1] < max_seq_len:  # (a server's rows share every forward)
        rope_type, limit, name, what = switch
        raise ValueError(f"the target's {rope_type} rope {what} past {name}={limit}, and a server's rows share "
                         f"their forwards: a row past it would change every other row's frequencies (and a verify "
                         f"pass reaches further than the row's own decoding). Serve with max_seq_len <= {limit}")
    reasons.append(("cuda graphs", f"{'on, by batch-size bucket: ' if graphs else 'off: '}{why}"))
    reasons.append(("batch", f"{max_rows} slots of {max_seq_len} positions"))
    capabilities = _capabilities(runners, drafter, models, static_shapes=False)
    reasons.append(("capabilities", _describe_capabilities(*capabilities, None)))
    chunk = _server_prefill_chunk(prefill_chunk, capabilities[0], runners.target, graphs, reasons)
    taps = _hidden_taps(drafter, draft_model, reasons)
    cross_mode = _server_cross_tokenizer_mode(drafter, vocab_bridge, reasons)
    return DecodePlan(drafter=drafter, tree=None, slots=slots, adaptive=by_load, target_runner=runners.target,
                      draft_runner=runners.draft, draft_compute_dtype=runners.draft_dtype, cuda_graphs=graphs,
                      static_shapes=False, device=models.device, target_dtype=models.target_dtype,
                      sampling=SamplingParams(), batch_size=max_rows, padded_batch_size=max_rows,
                      max_seq_len=max_seq_len, max_new_tokens=max_seq_len - required_cache_len(1, 0, slots),
                      draft_confidence=0.0, target_capabilities=capabilities[0], draft_capabilities=capabilities[1],
                      tensor_parallel=models.tensor_parallel, reasons=tuple(reasons), prefill_chunk=chunk,
                      hidden_taps=taps, cross_tokenizer=cross_mode)


def _server_cross_tokenizer_mode(drafter: str, bridge, reasons: List[Tuple[str, str]]) -> Optional[str]:
    """A served draft with another tokenizer: each step drafts through text when all its rows are greedy,
    from the vocabularies' intersection otherwise (refused, with its size, when too small to draft from)."""
    if drafter != "cross-tokenizer":
        return None
    if bridge is None:
        raise ValueError("drafter 'cross-tokenizer' needs vocab_bridge= (the two tokenizers' VocabularyBridge)")
    bridge.check_intersection()
    reasons.append(("vocabularies", f"differ: {BY_STEP} ({GREEDY_THROUGH_TEXT} for a step whose rows are all "
                                    f"greedy, else {INTERSECTION} over the {bridge.intersection_size} tokens spelt "
                                    "the same in both vocabularies)"))
    return BY_STEP


def _server_draft_length(drafter: str, k: Optional[int], graphs: bool, tensor_parallel: int,
                         reasons: List[Tuple[str, str]]) -> Tuple[int, bool]:
    """(slots, by load) of a server plan."""
    if drafter == "none":
        reasons.append(("drafter", "none: plain decoding"))
        return 0, False
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (draft tokens per step) must be an int >= 1 or None (by load), got {k!r}")
        reasons.append(("drafter", f"{drafter} chain, k={k}: fixed, as asked"))
        return k, False
    if tensor_parallel > 1:
        reasons.append(("drafter", f"{drafter} chain, k={FIXED_K}: fixed (the ranks would disagree on measured times)"))
        return FIXED_K, False
    k_max = adaptive_k.DEFAULT_K_MAX
    lengths = (", ".join(map(str, graph_draft_lengths(k_max, FIXED_K))) + " (the lengths CUDA graphs capture)"
               if graphs else f"0..{k_max}")
    reasons.append(("drafter", f"{drafter} chain, k by load: {lengths} per step, the length that "
                               f"maximises measured tokens/s at the running width (seeded requests: {FIXED_K})"))
    return k_max, True


def _server_prefill_chunk(asked: Optional[int], target: RunnerCapabilities, kind: str, graphs: bool,
                          reasons: List[Tuple[str, str]]) -> int:
    """Prompt tokens prefilled per step for a joining request (0: whole prompts before the next step)."""
    if asked == 0:
        reasons.append(("prefill", "whole prompts before the next step (prefill_chunk=0)"))
        return 0
    if not target.chunked_prefill or graphs:
        why = "CUDA-graph steps" if graphs else f"the {kind} runner prefills whole prompts"
        if asked is not None:
            raise ValueError(f"prefill_chunk={asked}: chunked prefill needs a target runner with extend_rows "
                             f"(lean, recompute) and eager steps, not {why}; pass 0 or leave it out")
        reasons.append(("prefill", f"whole prompts before the next step ({why})"))
        return 0
    chunk = DEFAULT_PREFILL_CHUNK if asked is None else asked
    reasons.append(("prefill", f"in chunks: {chunk} tokens per step, less the running rows' verify tokens "
                               f"(at least {MIN_PREFILL_CHUNK}), between decode steps"))
    return chunk


def _draft_length(ask: PlanRequest, tree, models: _Models, reasons: List[Tuple[str, str]]
                  ) -> Tuple[int, Optional[adaptive_k.AdaptiveK]]:
    """(slots, adaptive k's controller or None): rules 1 and 2."""
    drafter, k = ask.drafter, ask.k
    if drafter == "none":
        reasons.append(("drafter", "none: plain decoding, one target pass per token"))
        return 0, None
    if tree is not None:
        slots = tree_num_nodes(*tree)
        source = {"heads": "heads on the target", "eagle": "the EAGLE-3 head (EAGLE-2 dynamic tree)"}.get(
            drafter, "the draft model")
        reasons.append(("drafter", f"{drafter} tree (b, d, N) = {tree}: {slots} nodes from {source}, verified "
                                   f"in one pass of {slots + 1} tokens (k does not apply)"))
        return slots, None
    if models.tensor_parallel > 1 and (k == AUTO_K or isinstance(k, adaptive_k.AdaptiveK)):
        raise ValueError("k='auto' cannot run on a tensor-parallel target: adaptive choices follow each rank's own "
                         "timings, so the ranks would disagree on the verify width; pass an int k")
    if k is None and models.tensor_parallel > 1:
        k, why = FIXED_K, (f"k=None on a tensor-parallel target: a fixed k={FIXED_K} (adaptive choices follow "
                           "each rank's own timings)")
    elif k is None:
        k, why = _default_draft_length(drafter, ask.sampling, ask.seeded, ask.runner, models.graphs_ok)
    else:
        why = "as asked"
    slots, controller = adaptive_k.resolve(k)
    if controller is not None:
        reasons.append(("drafter", f"{drafter} chain, k=auto (adaptive, up to {slots} per step): {why}"))
    else:
        reasons.append(("drafter", f"{drafter} chain, k={slots}: {why}"))
    return slots, controller


@dataclass(frozen=True)
class _Runners:
    target: str
    draft: Optional[str]
    draft_dtype: Optional[torch.dtype]


def _runners(drafter: str, runner: str, tree, models: _Models, cache_len: int,
             reasons: List[Tuple[str, str]]) -> _Runners:
    """Rule 3: the target's and the draft model's runner kinds (and the draft's compute dtype)."""
    target_runner, why = _runner_for(models.target, runner, models.graphs_ok, cache_len, models.device, "target",
                                     tree is not None)
    reasons.append(("target runner", f"{target_runner}: {why}"))
    if drafter == "heads" and target_runner == "recompute":
        raise ValueError("draft='heads' needs the paged or lean runner (runner='auto'), not 'recompute' (its HF "
                         "forwards are per group of equal lengths, not one per pass)")
    if models.draft is None or drafter in ("eagle", "none"):  # an EAGLE head runs in torch beside the target's runner
        return _Runners(target_runner, None, None)
    draft_runner, why = _runner_for(models.draft, runner, models.graphs_ok, cache_len, models.device, "draft",
                                    tree is not None)
    weights = next(models.draft.parameters()).dtype
    draft_dtype = None
    if draft_runner == "lean" and models.device.type == "cpu" and weights in (torch.bfloat16, torch.float16):
        draft_dtype = torch.float32
        why += f"; {weights} weights computed in fp32 (the CPU kernels widen them exactly as they stream them)"
    reasons.append(("draft runner", f"{draft_runner}: {why}"))
    return _Runners(target_runner, draft_runner, draft_dtype)


def _capabilities(runners: _Runners, drafter: str, models: _Models, *, static_shapes: bool
                  ) -> Tuple[RunnerCapabilities, Optional[RunnerCapabilities]]:
    """The optional methods the built runners will have (runners.capabilities_of); heads on the target
    hook its LM head, which keeps its logits off a greedy chain."""
    target = capabilities_of(runners.target, models.target, static_shapes=static_shapes,
                             head_hooked=drafter == "heads", hidden_taps=drafter == "eagle")
    draft = None
    if runners.draft is not None:
        draft = capabilities_of(runners.draft, models.draft, compute_dtype=runners.draft_dtype,
                                static_shapes=static_shapes)
    return target, draft


def _describe_capabilities(target: RunnerCapabilities, draft: Optional[RunnerCapabilities],
                           sampling: Optional[SamplingParams], every_token_sampled: bool = False) -> str:
    """The capabilities line of ``explain()``: what each runner offers and what the loop uses it for."""
    uses = []
    if target.greedy_chain:
        uses.append("greedy chains unused (processors or logprobs)" if every_token_sampled else
                    "greedy plain decoding runs as greedy chains" if sampling is None or sampling.greedy else
                    "greedy chains unused (sampling)")
    if draft is not None and draft.greedy_chain and not every_token_sampled:
        uses.append("a greedy draft is one call")
    if target.device_steps:
        uses.append("device steps for serving under CUDA graphs")
    line = f"target runner: {target.describe()}"
    if draft is not None:
        line += f"; draft runner: {draft.describe()}"
    return line + (f" ({'; '.join(uses)})" if uses else "")


def _cache_limits(ask: PlanRequest, models: _Models) -> Tuple[Optional[int], Optional[Tuple[int, str]], str]:
    """(the positions a row may use: max_seq_len, else the models' max_position_embeddings, or None; the
    models' (max_position_embeddings, "target" or "draft"), or None; what sets the first). A model with an
    absolute position table bounds the rows whatever max_seq_len says: it cannot look past its table."""
    # a draft with another tokenizer counts its own positions (a row that outgrows them stops drafting), one that
    # declares a context window keeps its cache within it (drafters/model_drafter.py), and plain decoding runs none
    bounded = {"target": models.target}
    if (ask.drafter not in ("cross-tokenizer", "eagle", "none") and models.draft is not None
            and draft_window_of(models.draft) is None):
        bounded["draft"] = models.draft
    positions = [(_max_positions(model), role) for role, model in bounded.items() if _max_positions(model)]
    model_limit = min(positions) if positions else None
    source = f"the {model_limit[1]} model's {_limit_name(bounded[model_limit[1]])}" if model_limit else ""
    if ask.max_seq_len is None:
        return (model_limit[0] if model_limit else None), model_limit, source
    for limit, role in sorted(positions):
        table = _position_table(bounded[role]) if limit < ask.max_seq_len else None  # (a walk only past a limit)
        if table is not None:
            return limit, model_limit, (f"the {role} model's position table {table}, of {_limit_name(bounded[role])}"
                                        f"={limit}, which it cannot look past whatever max_seq_len says")
    return ask.max_seq_len, model_limit, "max_seq_len"


def _fit_default_draft_length(ask: PlanRequest, slots: int, controller, models: _Models,
                              reasons: List[Tuple[str, str]]) -> Tuple[PlanRequest, int, object]:
    """Rule 5's room for drafts, for a draft length the caller left to the plan (k None or "auto"): where the
    longest prompt, max_new_tokens and two steps of ``slots`` drafts (``loop_cache_len``) pass the cache's
    positions but the request itself fits, the chain drafts what fits, and with no room for one draft the call
    decodes plain (as HF's assisted generation and vLLM stop drafting at the end of the context). An asked
    k or tree is refused by ``_check_cache`` instead, with the numbers."""
    limit, _, _ = _cache_limits(ask, models)
    longest = max(ask.prompt_lengths)
    if limit is None or loop_cache_len(longest, ask.max_new_tokens, slots) <= limit:
        return ask, slots, controller
    room = draft_room(limit, longest, ask.max_new_tokens)
    if room >= 1:
        reasons.append(("draft length", f"at most {room} (not {slots}): the longest prompt ({longest}) and "
                                        f"max_new_tokens={ask.max_new_tokens} leave {limit - longest - ask.max_new_tokens} "
                                        f"of the cache's {limit} positions for two steps of drafts"))
        if controller is not None:
            return ask, room, adaptive_k.AdaptiveK(room)  # (k None or "auto": the default controller)
        return ask, room, None
    plain = ("drafter", f"none: the longest prompt ({longest}) and max_new_tokens={ask.max_new_tokens} leave no room "
                        f"for drafts in the cache's {limit} positions (two steps of drafts need 2 x k more): plain "
                        "decoding")
    asked = [i for i, (name, _) in enumerate(reasons) if name == "drafter"]  # (the drafter that will not run)
    if asked:
        reasons[asked[0]] = plain
    else:
        reasons.append(plain)
    return replace(ask, drafter="none", vocab_bridge=None), 0, None


def _check_cache(ask: PlanRequest, slots: int, models: _Models) -> None:
    """Rule 5: every prompt fits max_seq_len (or the models' max_position_embeddings) with its tokens; an
    explicit max_seq_len past max_position_embeddings runs, with one warning per call."""
    limit, model_limit, source = _cache_limits(ask, models)
    if limit is None:
        return
    for b, length in enumerate(ask.prompt_lengths):
        needs = loop_cache_len(length, ask.max_new_tokens, slots)
        if needs > limit:
            # (a chain that plain decoding would fit: the default k shrinks to fit, _fit_default_draft_length)
            fits = (loop_cache_len(length, ask.max_new_tokens, 0) <= limit and ask.draft_tree is None
                    and ask.drafter != "heads")
            raise ValueError(
                f"prompt {b} has {length} tokens; with max_new_tokens={ask.max_new_tokens} and {slots} draft "
                f"slots it needs {needs} cache positions but the cache holds {limit} ({source}): shorten the "
                "prompt or lower max_new_tokens"
                + (f", or leave k to the plan (None or 'auto': up to {adaptive_k.DEFAULT_K_MAX} drafts a step, fewer "
                   f"where the cache leaves fewer slots: {draft_room(limit, length, ask.max_new_tokens)} here)"
                   if fits and slots else ""))
    needs = loop_cache_len(max(ask.prompt_lengths), ask.max_new_tokens, slots)
    if ask.max_seq_len is not None and model_limit is not None and needs > model_limit[0]:
        warnings.warn(
            f"max_seq_len={ask.max_seq_len} lets rows run to {needs} positions (longest prompt "
            f"{max(ask.prompt_lengths)}, max_new_tokens={ask.max_new_tokens}, {slots} draft slots), past the "
            f"{model_limit[1]} model's max_position_embeddings={model_limit[0]} (without max_seq_len it would be "
            "refused): the model was not trained for those positions and its outputs there may degrade",
            UserWarning, stacklevel=5)  # (generate -> _run -> make_plan)


def _tree_shape(drafter: str, draft_tree, vocab_size: int, num_heads: Optional[int] = None
                ) -> Optional[Tuple[int, int, int]]:
    """The (b, d, N) tree asked (checked), or the heads' default (``HEADS_TREE``, no deeper than the heads)."""
    if draft_tree is not None:
        if (not isinstance(draft_tree, (tuple, list)) or len(draft_tree) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in draft_tree)):
            raise ValueError(f"draft_tree must be a tuple (b, d, N) of ints >= 1, got {draft_tree!r}")
        if draft_tree[0] > vocab_size:
            raise ValueError(f"draft_tree={tuple(draft_tree)!r}: b = {draft_tree[0]} children per node, more than the "
                             f"vocabulary's {vocab_size} tokens")
        if drafter == "ngram":
            raise ValueError("draft_tree needs a draft model or heads, not the n-gram drafter")
        if drafter == "cross-tokenizer":
            raise ValueError("draft_tree needs a draft sharing the target's tokenizer: a draft with another "
                             "tokenizer drafts chains")
        if drafter == "none":
            raise ValueError("draft_tree needs a draft model or heads (plain decoding drafts nothing)")
        if num_heads is not None and draft_tree[1] > num_heads:
            raise ValueError(f"draft_tree={tuple(draft_tree)!r}: depth d = {draft_tree[1]} exceeds the {num_heads} "
                             "heads (one head per depth)")
        return tuple(draft_tree)
    if drafter != "heads":
        return None
    b, d, n = HEADS_TREE
    return b, d if num_heads is None else min(d, num_heads), n  # (fewer heads than its depth: as deep as they reach)


def _cross_tokenizer_mode(ask: PlanRequest, reasons: List[Tuple[str, str]]) -> Optional[str]:
    """A draft with another tokenizer: greedy rows draft through text, sampled ones from the intersection
    of the vocabularies (refused, with its size, when too small)."""
    bridge = ask.vocab_bridge
    if bridge is None:
        return None
    shared = f"{bridge.intersection_size} tokens spelt the same in both vocabularies"
    if ask.sampling.greedy:
        reasons.append(("vocabularies", f"differ: {GREEDY_THROUGH_TEXT} (greedy draft tokens decoded to text and "
                                        f"re-encoded as target tokens at the committed boundary; {shared}, unused)"))
        return GREEDY_THROUGH_TEXT
    bridge.check_intersection()
    reasons.append(("vocabularies", f"differ: {INTERSECTION} (the draft samples from its distribution moved onto "
                                    f"the {shared}, renormalised: q over target ids)"))
    return INTERSECTION


def _default_draft_length(drafter: str, sampling: SamplingParams, seeded: bool, runner: str,
                          graphs_ok: bool) -> Tuple[Union[int, str], str]:
    """What k=None runs for a chain: (AUTO_K or FIXED_K, why)."""
    if seeded and not sampling.greedy:
        return FIXED_K, (f"k=None with a seeded sample at T > 0: a fixed k={FIXED_K}, so that the seed reproduces "
                         "the sample (adaptive choices follow measured times)")
    if drafter in GRAPH_DRAFTERS and graphs_ok and runner in ("auto", "paged"):
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
        paged_reason = paged_unsupported_reason(model, tree=tree, cache_len=cache_len)
        if paged_reason is not None:
            lean_note = lean_reason is not None and not lean_reason.startswith("model_type")
            raise ValueError(f"the {role} model cannot be run: {paged_reason}"
                             + (f" (and the lean runner does not apply: {lean_reason})" if lean_note else ""))
    dtype = next(model.parameters()).dtype
    if dtype not in PAGED_DTYPES and runner in ("auto", "paged"):
        raise ValueError(f"the {role} model is {dtype}: the paged runner's cache holds {PAGED_DTYPES}"
                         + (f", and the lean runner does not apply ({lean_reason})" if lean_reason else "")
                         + ": convert it with model.to(torch.float32)")
    if runner != "auto":
        return runner, "as asked"
    if graphs_ok:
        return "paged", f"{device.type} with CUDA graphs available: the paged runner's static shapes are captured"
    return "paged", f"the lean runner does not apply ({lean_reason})"


def _graphs(graphs_ok: bool, graphs_reason: Optional[str], drafter: str, tree, controller,
            runners: _Runners) -> Tuple[bool, str]:
    """Rule 4: (CUDA graphs on, why)."""
    target_runner, draft_runner = runners.target, runners.draft
    if not graphs_ok:
        return False, graphs_reason
    if tree is not None:
        return False, "a tree's forwards vary per step (eager)"
    if controller is not None:
        return False, "adaptive k changes the verify width per step (eager)"
    if target_runner != "paged":
        return False, f"the {target_runner} target runner syncs with the host"
    if drafter not in GRAPH_DRAFTERS + ("none",):
        return False, f"the {drafter} drafter proposes on the host"
    if drafter == "model" and draft_runner != "paged":
        return False, f"the {draft_runner} draft runner syncs with the host"
    if drafter == "eagle":
        return True, ("an EAGLE-3 chain of fixed k on the paged target runner (static shapes, its hidden states "
                      "tapped on the device): draft, verify and commit are graphs")
    return True, "a chain of fixed k on the paged runners (static shapes): draft, verify and commit are graphs"


# the names HF gives a learned (or fixed sinusoidal) absolute position table: GPT-2-style ``wpe``, OPT's and
# BART's ``embed_positions``, BERT-style ``position_embeddings`` (embeddings); GPT-J's and CodeGen's rotary
# ``embed_positions`` and CTRL's ``pos_encoding`` (buffers of sin/cos rows indexed by position)
POSITION_TABLE_NAMES = ("wpe", "embed_positions", "position_embeddings")
POSITION_BUFFER_NAMES = ("embed_positions", "pos_encoding")
# MPT builds its ALiBi bias over config.max_seq_len keys: a hard bound as a table is, which the paged runner's
# whole pages of keys (runners/paged.py DEFAULT_PAGE_SIZE) must stay within too
TABLE_LENGTH_CONFIGS = {"mpt": "max_seq_len"}


def _position_table(model) -> Optional[str]:
    """The name of ``model``'s absolute position table (an embedding or buffer indexed by position, or MPT's
    ALiBi bias), or None: such a model cannot run past the table, where a rotary or ALiBi model only leaves its
    training range."""
    length_config = TABLE_LENGTH_CONFIGS.get(model_type(model))
    if length_config is not None:
        return f"(its ALiBi bias over config.{length_config} keys)"
    embedding = next((name for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLE_NAMES), None)
    return embedding or next((name for name, _ in model.named_buffers()
                              if name.rsplit(".", 1)[-1] in POSITION_BUFFER_NAMES), None)


def _limit_name(model) -> str:
    """What ``_max_positions`` read, for the messages."""
    length_config = TABLE_LENGTH_CONFIGS.get(model_type(model))
    if length_config is not None:
        return f"ALiBi bias of config.{length_config} keys (in whole pages of {DEFAULT_PAGE_SIZE})"
    return "max_position_embeddings"


def _max_positions(model) -> Optional[int]:
    """max_position_embeddings, or for MPT its ALiBi bias's length rounded down to whole pages of the paged
    runner (it attends over whole pages: more keys than the bias has failed inside HF's attention)."""
    length_config = TABLE_LENGTH_CONFIGS.get(model_type(model))
    if length_config is not None:
        length = getattr(text_config(model.config), length_config, None)
        return length // DEFAULT_PAGE_SIZE * DEFAULT_PAGE_SIZE if isinstance(length, int) else None
    return getattr(model.config, "max_position_embeddings", None)
