"""The public API: ``generate()``: input normalisation, model loading, the vocabulary check, the result
object and streaming. The loop itself is in ``decode.py``."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import adaptive as adaptive_k
from . import cuda_graphs
from .decode import RowState, StopCriteria, Verifier, chain_verifier, decode, required_cache_len
from .drafters import HeadsDrafter, ModelDrafter, NgramDrafter
from .drafters.calibration import shared_calibration
from .drafters.tree_drafter import TreeModelDrafter, tree_num_nodes
from .heads import MedusaHeads
from .metadata import SamplingParams
from .reference_runner import RecomputeRunner
from .runner_checks import output_vocab_size
from .stats import GenerationStats

Prompt = Union[str, Sequence[int]]
ModelSpec = Union[None, str, os.PathLike, torch.nn.Module]

AUTO_K = "auto"  # k= value: the draft length chosen per step (specdec_ext/adaptive.py); what k=None means
FIXED_K = 4  # what k=None means where adaptive k is not used: seeded sampling, CUDA-graph-captured steps
NGRAM_DRAFT = "ngram"  # draft= value selecting suffix-automaton lookup over the prompt and output
HEADS_DRAFT = "heads"  # draft= value selecting the bundled target's Medusa-style heads
HEADS_TREE = (3, 3, 8)  # default (b, d, N) of a heads tree (BENCHMARKS.md: heads trees on the bundled pair)
MAX_MISMATCHES_REPORTED = 5  # mismatching token ids named in a vocabulary error
SEED_BITS = 62  # random row seeds are drawn in [0, 2^62)


class VocabularyMismatchError(ValueError):
    """The draft and the target do not share a vocabulary."""


# ------------------------------------------------------------------------------------- result
@dataclass
class GenerationResult:
    """New tokens and text per prompt, finish reasons and stats (``GenerationStats``)."""

    token_ids: List[List[int]]  # new tokens per prompt (EOS included when it ended the row)
    text: Optional[List[str]]  # decoded new tokens per prompt (stop string excluded); None without a tokenizer
    finish_reasons: List[str]  # "eos", "length" or "stop" per prompt
    stats: GenerationStats
    prompt_token_ids: List[List[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


class TextPiece(str):
    """A piece of streamed text; ``.index`` is the prompt it belongs to, ``.token_ids`` its new tokens."""

    index: int
    token_ids: List[int]

    def __new__(cls, text: str, index: int, token_ids: List[int]):
        piece = super().__new__(cls, text)
        piece.index = index
        piece.token_ids = token_ids
        return piece


class GenerationStream:
    """Iterator of ``TextPiece`` (a str with ``.index``) as tokens are accepted; ``.result`` at the end."""

    def __init__(self, events: Iterator[List[List[int]]], rows: List[RowState], finish):
        self._events = events
        self._rows = rows
        self._finish = finish
        self._sent = [0] * len(rows)  # characters of each row's text already yielded
        self._closed = [False] * len(rows)  # finished and fully yielded
        self.result: Optional[GenerationResult] = None

    def __iter__(self) -> Iterator[TextPiece]:
        for new in self._events:
            for b, tokens in enumerate(new):
                row = self._rows[b]
                if self._closed[b] or (not tokens and not row.finished):
                    continue
                self._closed[b] = row.finished
                text = self._finish.row_text(row)
                if text is None:
                    if tokens:
                        yield TextPiece("", b, tokens)
                    continue
                if not row.finished:
                    if text.endswith("\ufffd"):
                        continue  # an incomplete UTF-8 sequence: wait for the next token
                    text = text[: len(text) - self._finish.stop_prefix_len(text)]
                piece = text[self._sent[b]:]
                self._sent[b] = max(self._sent[b], len(text))
                if piece or tokens:
                    yield TextPiece(piece, b, tokens)
        self.result = self._finish.result()


# ------------------------------------------------------------------------------------- loading
def _load_model(spec: ModelSpec, role: str):
    if isinstance(spec, torch.nn.Module):
        return spec
    from transformers import AutoModelForCausalLM

    path = os.fspath(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load the {role} model from {path!r} (offline, local files only): {error}") from error
    return model.eval()


def _load_tokenizer(spec: ModelSpec):
    """The tokenizer next to a model path (or a loaded model's name_or_path), or None."""
    if isinstance(spec, torch.nn.Module):
        spec = getattr(spec, "name_or_path", None) or getattr(spec.config, "_name_or_path", None)
        if not spec or not os.path.isdir(spec):
            return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(spec), local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def load_pair(target: ModelSpec = None, draft: ModelSpec = None, tokenizer=None):
    """(target, draft, tokenizer): models from ids/paths (offline) or as given; the default pair when
    both are None."""
    if target is None and draft is None:
        try:
            from .default_pair import load_default_pair
        except ImportError as error:
            raise ValueError("no target/draft given and the bundled default pair is not available: "
                             f"pass target= and draft= ({error})") from error
        target_model, draft_model, default_tokenizer = load_default_pair()
        return target_model.eval(), draft_model.eval(), tokenizer if tokenizer is not None else default_tokenizer
    if target is None or draft is None:
        missing = "target" if target is None else "draft"
        raise ValueError(f"pass both target= and draft= (or neither, for the bundled pair): {missing} is missing")
    target_model, draft_model = _load_model(target, "target"), _load_model(draft, "draft")
    if tokenizer is None:
        tokenizer = _load_tokenizer(target)
    return target_model, draft_model, tokenizer


# ------------------------------------------------------------------------------------- checks
def _id_to_token(tokenizer) -> dict:
    return {i: t for t, i in tokenizer.get_vocab().items()}


def check_vocabularies(target_model, draft_model, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise VocabularyMismatchError unless the draft and the target share a vocabulary.

    With both tokenizers, every token id must map to the same token string. The models' embedding
    (logit) sizes may differ (padding), but each must cover the target tokenizer's tokens.
    """
    v_target, v_draft = output_vocab_size(target_model), output_vocab_size(draft_model)
    if target_tokenizer is not None and draft_tokenizer is not None:
        ids_t, ids_d = _id_to_token(target_tokenizer), _id_to_token(draft_tokenizer)
        bad = [i for i in sorted(set(ids_t) | set(ids_d)) if ids_t.get(i) != ids_d.get(i)]
        if bad:
            shown = ", ".join(f"id {i}: target {ids_t.get(i)!r} vs draft {ids_d.get(i)!r}"
                              for i in bad[:MAX_MISMATCHES_REPORTED])
            raise VocabularyMismatchError(
                f"the draft and the target tokenizers differ at {len(bad)} token ids; first mismatches: {shown}")
    if target_tokenizer is not None:
        real = len(target_tokenizer)
        for role, size in (("target", v_target), ("draft", v_draft)):
            if size < real:
                names = _id_to_token(target_tokenizer)
                missing = ", ".join(f"id {i}: {names.get(i)!r}" for i in range(size, min(real, size + MAX_MISMATCHES_REPORTED)))
                raise VocabularyMismatchError(
                    f"the {role} model scores {size} tokens but the tokenizer has {real}; first tokens "
                    f"it lacks: {missing}")
    elif v_target != v_draft:
        # No tokenizer to say which ids are real: the shared ids are the common prefix, and ids
        # beyond the draft's size are never proposed. Padded sizes are fine only for equal configs.
        t_cfg, d_cfg = getattr(target_model.config, "vocab_size", None), getattr(draft_model.config, "vocab_size", None)
        if t_cfg != d_cfg and min(v_target, v_draft) < max(t_cfg or 0, d_cfg or 0):
            raise VocabularyMismatchError(
                f"the target scores {v_target} tokens (config vocab_size {t_cfg}) and the draft {v_draft} "
                f"(config vocab_size {d_cfg}): first ids only one of them has: "
                + ", ".join(str(i) for i in range(min(v_target, v_draft), min(v_target, v_draft) + MAX_MISMATCHES_REPORTED)))


def _normalise_prompts(prompts, tokenizer) -> Tuple[List[List[int]], bool]:
    """-> (token id lists, whether the prompts were text)."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
        if prompts and not isinstance(prompts[0], list):
            prompts = [prompts]
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of strings or token ids, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        prompts = [list(prompts)]  # one prompt as token ids
    is_text = isinstance(prompts[0], str)
    out = []
    for b, p in enumerate(prompts):
        if isinstance(p, str) != is_text:
            raise TypeError("prompts must be all strings or all token id lists, not a mix")
        if is_text:
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass tokenizer= or token ids")
            if not p:
                raise ValueError(f"prompt {b} is empty")
            ids = tokenizer(p)["input_ids"]
        else:
            ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"prompt {b} must be a string or a list of int token ids")
        if not ids:
            raise ValueError(f"prompt {b} is empty (no tokens)")
        out.append([int(t) for t in ids])
    return out, is_text


def _eos_ids(eos_token_id, target_model, tokenizer) -> List[int]:
    if eos_token_id is False:
        return []
    if eos_token_id is None:
        config = getattr(target_model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(t) for t in eos_token_id]


def _row_seeds(seed, batch: int) -> torch.Tensor:
    if seed is None:
        return torch.tensor([secrets.randbits(SEED_BITS) for _ in range(batch)], dtype=torch.int64)
    if isinstance(seed, int) and not isinstance(seed, bool):
        return torch.full((batch,), seed, dtype=torch.int64)
    seeds = [int(s) for s in seed]
    if len(seeds) != batch:
        raise ValueError(f"seed: got {len(seeds)} seeds for {batch} prompts")
    return torch.tensor(seeds, dtype=torch.int64)


def _max_positions(model) -> Optional[int]:
    return getattr(model.config, "max_position_embeddings", None)


def _runner_factory(runner):
    """'auto' -> the paged runner when it exists, else the recompute oracle; or a name / a class."""
    if runner in ("auto", "paged"):
        try:
            from .model_runner import PagedModelRunner
            return PagedModelRunner
        except ImportError:
            if runner == "paged":
                raise
            return RecomputeRunner
    if runner == "recompute":
        return RecomputeRunner
    if callable(runner):
        return runner
    raise ValueError(f"runner must be 'auto', 'paged', 'recompute' or a runner class, got {runner!r}")


def _draft_runner_factory(runner, factory):
    """The chain draft's runner factory: with runner='auto', the lean Llama runner for the drafts it
    supports (llama/mistral/qwen2, default RoPE: a plain pure-torch forward over a contiguous cache,
    several times cheaper per token than the paged HF path for small drafts; not where CUDA graphs
    capture the static paged runner), ``factory`` otherwise."""
    if runner != "auto":
        return factory
    from .lean_llama import lean_runner_factory

    return lean_runner_factory(factory)


def _target_runner_factory(runner, factory):
    """The target's runner factory: with runner='auto', the lean Llama runner for the targets it
    supports (chains, trees, heads and plain decoding), computing in the model's own dtype (the HF
    forward's arithmetic in another order; on the CPU its step costs about 0.8x the paged one,
    BENCHMARKS.md); the paged runner where CUDA graphs capture the static paged runner, for other
    models, and for any other ``runner``."""
    if runner != "auto":
        return factory
    from .lean_llama import lean_runner_factory

    return lean_runner_factory(factory, cpu_fp32=False)


class _Finisher:
    """Turns the rows into text and the final result."""

    def __init__(self, rows, tokenizer, stats, prompts, stop_strings=()):
        self.rows, self.tokenizer, self.stats, self.prompts = rows, tokenizer, stats, prompts
        self.stop_strings = list(stop_strings)

    def stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that could begin a stop string (held back while
        streaming, so that a stop string is never partly shown)."""
        best = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def row_text(self, row: RowState) -> Optional[str]:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return text[: row.stop_text_end] if row.stop_text_end is not None else text

    def result(self) -> GenerationResult:
        texts = [self.row_text(r) for r in self.rows] if self.tokenizer is not None else None
        return GenerationResult(token_ids=[list(r.tokens) for r in self.rows], text=texts,
                                finish_reasons=[r.finish_reason or "length" for r in self.rows],
                                stats=self.stats, prompt_token_ids=self.prompts)


# ------------------------------------------------------------------------------------- generate
def generate(prompts, target: ModelSpec = None, draft: ModelSpec = None, *, max_new_tokens: int = 128,
             k: Union[None, int, str, "adaptive_k.AdaptiveK"] = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed=None,
             eos_token_id=None, stop=None, stream: bool = False, tokenizer=None, draft_tokenizer=None,
             max_seq_len: Optional[int] = None, runner="auto", verifier: Verifier = chain_verifier,
             cost_probe: bool = True, draft_confidence: float = 0.0,
             draft_tree: Optional[Tuple[int, int, int]] = None) -> Union[GenerationResult, GenerationStream]:
    """Lossless speculative generation: the tokens are distributed exactly as sampling from the target.

    Parameters
    ----------
    prompts : str, list of str, list of int, list of lists of int, or a [B, T] tensor
        The prompts (text needs the target's tokenizer).
    target, draft : model id / local path (loaded offline with from_pretrained) or a loaded model
        Both None: the bundled default pair. ``draft="ngram"``: no draft model, a suffix automaton
        over each row's prompt and output proposes the continuation of its longest earlier match.
        ``draft="heads"``: no draft model, the bundled target's Medusa-style heads
        (specdec_ext/heads.py) propose a token tree from the target's last hidden state (the target
        must be the bundled one); ``draft=MedusaHeads`` (``specdec_ext.heads.load_heads(dir)``) does
        the same with heads trained for ``target`` (tools/train_heads.py). Heads always draft a tree:
        ``draft_tree`` (default ``HEADS_TREE`` = (3, 3, 8)) with d <= the number of heads.
    max_new_tokens : int
        Exact cap on new tokens per prompt (>= 0).
    k : None (default), int >= 1, "auto", or an ``AdaptiveK``
        Draft tokens per step. "auto": per step, the draft length 0..8 that maximises the expected
        tokens per second from the measured acceptance by position and draft/verify costs, speculation
        switched off where it does not pay (specdec_ext/adaptive.py; an ``AdaptiveK`` sets k_max and
        the controller's knobs); the steps then run eagerly. None: "auto", except where adaptive k
        would cost something (``default_draft_length``): seeded sampling at temperature > 0 (the
        adaptive choices follow measured times, so a seed would not reproduce its sample) and a
        draft model on a device where CUDA graphs capture the decode steps get ``FIXED_K`` = 4.
        ``result.stats.adaptive`` says what the controller chose; ``result.stats.k`` is the
        static draft width (k_max with "auto").
    temperature, top_k, top_p : float, int, float
        The sampling filter (0 = greedy; top_k 0 and top_p 1 are off), applied to target and draft.
    seed : int, list of int, or None
        Philox seed per prompt: an int is used for every row (a row's tokens depend on its prompt and
        seed only, not on the batch; identical prompts with one seed give identical samples; with an
        int k, which k=None then is), a list gives one per prompt, None draws random seeds.
    eos_token_id : int, list of int, None or False
        None: the target's generation_config (or the tokenizer's) EOS; False: no EOS stop.
        A row ends at its first EOS (the EOS is returned); later tokens of the step are discarded.
    stop : str or list of str
        Stop strings: a row ends after the token that completes one; the text excludes the stop string.
    stream : bool
        Return a ``GenerationStream``: an iterator of ``TextPiece`` (str with ``.index``), with
        ``.result`` set once exhausted.
    tokenizer, draft_tokenizer : optional tokenizers (default: loaded next to the model paths)
    max_seq_len : int, optional
        Cache capacity per row (default: the target's max_position_embeddings); a prompt that does not
        fit with max_new_tokens and one step of drafts raises ValueError.
    runner : 'auto' | 'paged' | 'recompute' | class
        The model runner of target and draft. 'auto': for Llama/Mistral/Qwen2-style models a lean
        pure-torch forward over a contiguous cache (specdec_ext/lean_llama.py; the target in its own
        dtype, the draft in fp32 on the CPU), the paged KV cache for other models and where CUDA graphs
        run.
    verifier : callable
        The verification step (default: the lossless chain_verify); for tests.
    cost_probe : bool
        Time a few plain target passes after prefill for the cost-model stats.
    draft_confidence : float
        A row stops drafting (before k) after a token the draft gives probability below this; it
        saves draft passes that would mostly be rejected. 0 (default) always drafts k. Lossless either way.
    draft_tree : (b, d, N), optional
        Draft a token tree instead of a chain: the draft model (or the heads) expands its top-b tokens
        per node over d levels (each level keeping its best min(b^l, N) nodes by cumulative score),
        then the N best expanded nodes form the tree (drafters/tree_drafter.py; b = 1 is a chain of
        min(d, N)); a node's score is the learnt log-rate at which the target emits such candidates
        (drafters/calibration.py, kept per draft model and temperature across calls). At T > 0 a draft
        model samples each node's children without replacement from its filtered q instead of taking
        the top-b (heads always take the top-b). One target pass verifies the tree with the tree mask,
        tree_verify picks the path (recursive rejection sampling for sampled children, the
        deterministic-candidate rule otherwise; both lossless) and commit_tree keeps it. ``k`` is then
        ignored (the verify budget is N + 1 tokens). Needs a draft model or heads (not "ngram");
        draft_confidence does not apply; the steps run eagerly (no CUDA graphs).

    Returns
    -------
    GenerationResult (``.token_ids``, ``.text``, ``.finish_reasons``, ``.stats``) or GenerationStream.
    """
    requested_k = k
    k, controller = adaptive_k.resolve(FIXED_K if k is None else k)  # validates an explicit k early
    heads = None
    if isinstance(draft, MedusaHeads) or (isinstance(draft, str) and draft == HEADS_DRAFT):
        heads, draft = draft, None
        draft_tree = HEADS_TREE if draft_tree is None else draft_tree
    if draft_tree is not None:
        if (not isinstance(draft_tree, (tuple, list)) or len(draft_tree) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in draft_tree)):
            raise ValueError(f"draft_tree must be a tuple (b, d, N) of ints >= 1, got {draft_tree!r}")
        if isinstance(draft, str) and draft == NGRAM_DRAFT:
            raise ValueError("draft_tree needs a draft model or heads, not the n-gram drafter")
        k = tree_num_nodes(*draft_tree)  # the verify budget: N' + 1 tokens, N' = min(N, expanded nodes)
        controller = None  # a tree drafter has its own node budget (adaptive k is for chains)
    if not 0.0 <= draft_confidence < 1.0:
        raise ValueError(f"draft_confidence must lie in [0, 1), got {draft_confidence}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if heads is not None:
        if isinstance(heads, str) and not _is_bundled_target(target):
            raise ValueError("draft='heads' uses the bundled heads, trained for the bundled target; for another "
                             "target pass draft=specdec_ext.heads.load_heads(<dir>) with heads trained for it "
                             "(tools/train_heads.py)")
        if runner == "recompute":  # its HF forwards are per group of equal lengths, not one per pass
            raise ValueError("draft='heads' needs the paged runner (runner='auto' or 'paged'), not 'recompute'")
        target_model, tokenizer = _load_target(target, tokenizer)
        param = next(target_model.parameters())
        if isinstance(heads, str):
            from .default_pair import load_default_heads
            heads = load_default_heads(dtype=param.dtype, device=param.device)
        heads.check_target(target_model)
        heads = heads.to(dtype=param.dtype, device=param.device)
        return _run(prompts, target_model, None, tokenizer, k=k, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                    stop=stop, stream=stream, max_seq_len=max_seq_len, runner=runner, verifier=verifier,
                    cost_probe=cost_probe, draft_tree=draft_tree, heads=heads)
    if isinstance(draft, str) and draft == NGRAM_DRAFT:
        target_model, tokenizer = _load_target(target, tokenizer)
        if requested_k is None:
            k, controller = adaptive_k.resolve(default_draft_length(temperature, seed, runner, None))
        return _run(prompts, target_model, None, tokenizer, k=k, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                    stop=stop, stream=stream, max_seq_len=max_seq_len, runner=runner, verifier=verifier,
                    cost_probe=cost_probe, ngram=True, adaptive=controller)
    target_model, draft_model, tokenizer = load_pair(target, draft, tokenizer)
    if draft_tokenizer is None and not isinstance(draft, torch.nn.Module) and draft is not None:
        draft_tokenizer = _load_tokenizer(draft)
    if draft_tokenizer is None and target is None and draft is None:
        draft_tokenizer = tokenizer  # the bundled pair shares one tokenizer
    check_vocabularies(target_model, draft_model, tokenizer, draft_tokenizer)
    device = next(target_model.parameters()).device
    if next(draft_model.parameters()).device != device:
        raise ValueError(f"the draft is on {next(draft_model.parameters()).device}, the target on {device}: use one device")
    if requested_k is None and draft_tree is None:
        k, controller = adaptive_k.resolve(default_draft_length(temperature, seed, runner, device))
    return _run(prompts, target_model, draft_model, tokenizer, k=k, max_new_tokens=max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id, stop=stop,
                stream=stream, max_seq_len=max_seq_len, runner=runner, verifier=verifier, cost_probe=cost_probe,
                draft_confidence=draft_confidence, draft_tree=draft_tree, adaptive=controller)


def default_draft_length(temperature: float, seed, runner, graph_device: Optional[torch.device]) -> Union[int, str]:
    """What ``generate(k=None)`` runs: "auto" (adaptive k), or ``FIXED_K`` where adaptive k would cost
    something:

    - seeded sampling (``seed`` given, temperature > 0): the controller's choices follow measured
      times, so a seed would reproduce its sample only with a fixed k;
    - a draft model on ``graph_device`` where CUDA graphs capture the decode steps (the paged runner,
      ``runner`` 'auto' or 'paged'): adaptive steps vary their shapes and run eagerly, and the graphs
      are the larger win there. ``graph_device`` None: a drafter that proposes on the host (lookup),
      which is never captured.
    """
    if seed is not None and temperature > 0:
        return FIXED_K
    if graph_device is not None and runner in ("auto", "paged") and cuda_graphs.graphs_enabled(graph_device)[0]:
        return FIXED_K
    return AUTO_K


def plain_generate(prompts, target: ModelSpec = None, *, max_new_tokens: int = 128, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, seed=None, eos_token_id=None, stop=None, stream: bool = False,
                   tokenizer=None, max_seq_len: Optional[int] = None, runner="auto"):
    """Plain decoding (one target pass per token) over the same runner, sampler and stop checks as
    ``generate``: the baseline of the benchmarks and of the cost model. Same arguments, no draft;
    the target None means the bundled pair's target."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    target_model, tokenizer = _load_target(target, tokenizer)
    return _run(prompts, target_model, None, tokenizer, k=0, max_new_tokens=max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id, stop=stop,
                stream=stream, max_seq_len=max_seq_len, runner=runner, verifier=chain_verifier, cost_probe=False)


def _is_bundled_target(target: ModelSpec) -> bool:
    """Whether ``target`` is the bundled pair's target: None, its directory, or a model loaded from it."""
    from .default_pair import TARGET_DIR
    if target is None:
        return True
    path = getattr(getattr(target, "config", None), "_name_or_path", target)
    return isinstance(path, (str, os.PathLike)) and os.path.realpath(path) == os.path.realpath(TARGET_DIR)


def _closing(events, drafter):
    """The loop's events; the drafter is closed (hooks on the target removed) when they end."""
    try:
        yield from events
    finally:
        drafter.close()


def _load_target(target: ModelSpec, tokenizer):
    """The target model and its tokenizer alone (no draft model): the bundled target when None."""
    if target is None:
        target_model, _, default_tokenizer = load_pair(None, None, tokenizer)
        return target_model, tokenizer if tokenizer is not None else default_tokenizer
    return _load_model(target, "target"), tokenizer if tokenizer is not None else _load_tokenizer(target)


def _run(prompts, target_model, draft_model, tokenizer, *, k, max_new_tokens, temperature, top_k, top_p, seed,
         eos_token_id, stop, stream, max_seq_len, runner, verifier, cost_probe, draft_confidence=0.0, ngram=False,
         draft_tree=None, adaptive=None, heads=None):
    """Validate the rest of the arguments, build the runners and the drafter, run the loop."""
    sampling = SamplingParams(float(temperature), top_k, float(top_p))
    sampling.validate()
    stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stop_strings):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    models = [m for m in (target_model, draft_model) if m is not None]

    token_prompts, _ = _normalise_prompts(prompts, tokenizer)
    vocab_size = output_vocab_size(target_model)
    for b, p in enumerate(token_prompts):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab_size}): {bad[:MAX_MISMATCHES_REPORTED]}")
    limit = max_seq_len
    if limit is None:
        limits = [m for m in (_max_positions(model) for model in models) if m]
        limit = min(limits) if limits else None
    needed = required_cache_len(max(len(p) for p in token_prompts), max_new_tokens, k)
    if limit is not None:
        for b, p in enumerate(token_prompts):
            row_needs = required_cache_len(len(p), max_new_tokens, k)
            if row_needs > limit:
                raise ValueError(
                    f"prompt {b} has {len(p)} tokens; with max_new_tokens={max_new_tokens} and k={k} it needs "
                    f"{row_needs} cache positions but the cache holds {limit} (max_seq_len, or the models' "
                    f"max_position_embeddings): shorten the prompt or lower max_new_tokens")
    device = next(target_model.parameters()).device

    B = len(token_prompts)
    seeds = _row_seeds(seed, B).to(device)
    stats = GenerationStats(k=k, batch_size=B)
    rows = [RowState() for _ in range(B)]
    finisher = _Finisher(rows, tokenizer, stats, token_prompts, stop_strings)
    if max_new_tokens == 0:
        events = iter(())
    else:
        factory = cuda_graphs.static_runner_factory(_runner_factory(runner), device)
        target_runner = _target_runner_factory(runner, factory)(target_model, max_batch_size=B, max_seq_len=needed)
        if ngram:
            drafter = NgramDrafter(k)
        elif heads is not None:
            drafter = HeadsDrafter(target_model, heads, branch=draft_tree[0], depth=draft_tree[1],
                                   budget=draft_tree[2],
                                   calibration=shared_calibration(heads, draft_tree[1], sampling.temperature))
        elif draft_model is not None and draft_tree is not None:
            drafter = TreeModelDrafter(draft_model, _draft_runner_factory(runner, factory), branch=draft_tree[0],
                                       depth=draft_tree[1],
                                       budget=draft_tree[2], vocab_size=vocab_size,
                                       calibration=shared_calibration(draft_model, draft_tree[1], sampling.temperature))
        elif draft_model is not None:
            drafter = ModelDrafter(draft_model, _draft_runner_factory(runner, factory), k=k,
                                   vocab_size=vocab_size, confidence_threshold=draft_confidence)
        else:
            drafter = None
        stop_criteria = StopCriteria(
            max_new_tokens=max_new_tokens, eos_token_ids=_eos_ids(eos_token_id, target_model, tokenizer),
            stop_strings=stop_strings,
            decode_text=(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None)
        events = decode(target_runner, drafter, token_prompts, k=k, sampling=sampling, seeds=seeds,
                        stop=stop_criteria, max_seq_len=needed, vocab_size=vocab_size, verifier=verifier,
                        stats=stats, rows=rows, cost_probe=cost_probe, adaptive=adaptive)
        if drafter is not None:
            events = _closing(events, drafter)
    if stream:
        return GenerationStream(events, rows, finisher)
    for _ in events:
        pass
    return finisher.result()
