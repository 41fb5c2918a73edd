"""What generate() runs on: the target, the drafter's model or heads, the tokenizer; loaded offline,
the bundled pair once per process, and the draft's vocabulary checked against the target's (a draft whose
tokenizer differs gets a vocab_bridge.VocabularyBridge and the "cross-tokenizer" drafter)."""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .eagle.spec import EAGLE_DRAFT, eagle_head_for, is_eagle_draft
from .heads import MedusaHeads
from .runners import output_vocab_size
from .vocab_bridge import VocabularyBridge

ModelSpec = Union[None, str, os.PathLike, torch.nn.Module]

NGRAM_DRAFT = "ngram"  # draft= value selecting suffix-automaton lookup over the prompt and output
HEADS_DRAFT = "heads"  # draft= value selecting the bundled target's Medusa-style heads
CROSS_TOKENIZER = "cross-tokenizer"  # Models.drafter of a draft model with another tokenizer than the target's
MAX_MISMATCHES_REPORTED = 5  # mismatching token ids named in a vocabulary error


class VocabularyMismatchError(ValueError):
    """The draft and the target do not share a vocabulary."""


@dataclass
class Models:
    """The models of one generate() call."""

    target: torch.nn.Module
    drafter: str  # "model", "cross-tokenizer", "ngram", "heads", "eagle" or "none" (plain decoding)
    draft: Optional[torch.nn.Module] = None  # with drafter "model" or "cross-tokenizer"; "eagle": the Eagle3Model
    heads: Optional[MedusaHeads] = None  # with drafter "heads", on the target's device and dtype
    tokenizer: object = None  # the target's tokenizer, or None (token-id prompts only)
    bridge: Optional[VocabularyBridge] = None  # with drafter "cross-tokenizer": the two tokenizers' bridge

    def to(self, device: Union[str, torch.device]) -> "Models":
        """The same models on ``device`` ("cpu", "cuda", "cuda:1"; moved in place, as nn.Module.to does).
        ValueError naming the device when torch cannot use it (``usable_device``)."""
        device = usable_device(device)
        for module in (self.target, self.draft, self.heads):
            if module is not None:
                module.to(device)
        return self


def usable_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch.device the models can run on here; ValueError naming it otherwise."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:  # an unknown device string
        raise ValueError(f"device {device}: {str(error).splitlines()[0]}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {parsed}: CUDA is not available here (torch {torch.__version__}; "
                         "run on the CPU with device cpu)")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {parsed}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {parsed}: the models run on cpu or cuda")
    return parsed


def cast_model(module: torch.nn.Module, dtype: torch.dtype, *, copy: bool = False) -> torch.nn.Module:
    """``module`` with its floating-point parameters in ``dtype``, the way ``from_pretrained(dtype=...)`` loads
    it: buffers keep their dtype (a Llama's rotary ``inv_freq`` / ``original_inv_freq`` stay float32, where
    ``module.to(dtype=...)`` would round them to bf16 and shift every logit: -0.64398 against -0.64237 on the
    bundled target's first token in bf16), and so do the parameters of the modules HF keeps in float32
    (``_keep_in_fp32_modules_strict``; ``_keep_in_fp32_modules`` for float16). In place, as nn.Module.to, unless
    ``copy`` (a deep copy, cast; ``module`` itself when nothing changes). The one place a loaded model is cast."""
    import copy as copying
    import re

    keep = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
    kept = re.compile("|".join(rf"(^|\.){re.escape(name)}(\.|$)" for name in sorted(keep))) if keep else None
    todo = [(name, p) for name, p in module.named_parameters()
            if p.is_floating_point() and p.dtype != dtype and not (kept and kept.search(name))]
    if not todo:
        return module
    if copy:
        module = copying.deepcopy(module)
        names = {name for name, _ in todo}
        todo = [(name, p) for name, p in module.named_parameters() if name in names]
    for _, param in todo:  # named_parameters lists a tied weight (lm_head = embed_tokens) once
        param.data = param.data.to(dtype)
    return module


def default_device() -> str:
    """Where a command's models run unless told: the GPU where torch sees one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_models(target: ModelSpec = None, draft: Union[ModelSpec, MedusaHeads] = None, *, tokenizer=None,
                draft_tokenizer=None, plain: bool = False, tp_size: Optional[int] = None) -> Models:
    """The target and the drafter's model for generate(): both None is the bundled pair; ``draft`` a
    path, a model, "ngram", "heads" (the bundled target's heads) or a MedusaHeads; ``plain`` loads the
    target alone (no drafter); ``tp_size`` loads a target path sharded over that many ranks (the draft
    replicated on each, on the target's device). ``draft_tokenizer`` (default: the one next to a draft
    path) that spells some token id differently from ``tokenizer`` makes the drafter "cross-tokenizer"
    (drafters/cross_tokenizer.py), refused here unless both tokenizers round-trip text."""
    tokenizer, draft_tokenizer = (_tokenizer_arg(name, given) for name, given in
                                  (("tokenizer", tokenizer), ("draft_tokenizer", draft_tokenizer)))
    for name, given in (("tokenizer", tokenizer), ("draft_tokenizer", draft_tokenizer)):
        if given is not None and not callable(given):
            raise TypeError(f"{name} must be a Hugging Face tokenizer (called on text, it gives input_ids), got "
                            f"{type(given).__name__} {given!r}")
    if tp_size is not None:
        target = _tensor_parallel_target(target, tp_size)
        if tokenizer is None:
            tokenizer = _load_tokenizer(target)
    if plain or (isinstance(draft, str) and draft == NGRAM_DRAFT):
        target_model, tokenizer = _load_target(target, tokenizer)
        return Models(target_model, "none" if plain else "ngram", tokenizer=tokenizer)
    if is_eagle_draft(draft):  # an EAGLE-3 head (specdec_ext/eagle/spec.py): checked against the target here
        if isinstance(draft, str) and draft == EAGLE_DRAFT and not is_bundled_target(target):
            raise ValueError("draft='eagle' uses the bundled EAGLE-3 head, trained for the bundled target; for "
                             "another target pass draft=EagleDrafterSpec('path/to/head') with a head trained for "
                             "it (specdec train-eagle; load_eagle reads SafeAILab/EAGLE, SpecForge and "
                             "speculators checkpoints)")
        target_model, tokenizer = _load_target(target, tokenizer)
        return Models(target_model, "eagle", draft=eagle_head_for(draft, target_model), tokenizer=tokenizer)
    if isinstance(draft, MedusaHeads) or (isinstance(draft, str) and draft == HEADS_DRAFT):
        return _load_heads(target, draft, tokenizer)
    target_model, draft_model, tokenizer = load_pair(target, draft, tokenizer)
    if tp_size is not None:  # the draft is replicated on every rank, beside the rank's shard of the target
        draft_model = draft_model.to(next(target_model.parameters()).device)
    if draft_tokenizer is None and not isinstance(draft, torch.nn.Module) and draft is not None:
        draft_tokenizer = _load_tokenizer(draft)
    if draft_tokenizer is None and target is None and draft is None:
        draft_tokenizer = tokenizer  # the bundled pair shares one tokenizer
    if tokenizer is not None and draft_tokenizer is not None and _mismatching_ids(tokenizer, draft_tokenizer):
        bridge = cross_tokenizer_bridge(target_model, draft_model, tokenizer, draft_tokenizer)
        return Models(target_model, CROSS_TOKENIZER, draft=draft_model, tokenizer=tokenizer, bridge=bridge)
    check_vocabularies(target_model, draft_model, tokenizer, draft_tokenizer)
    return Models(target_model, "model", draft=draft_model, tokenizer=tokenizer)


def _tensor_parallel_target(target: ModelSpec, tp_size: int) -> torch.nn.Module:
    """The target sharded over ``tp_size`` ranks: loaded so from a path (torch.distributed initialised
    from torchrun's environment when needed), or checked when already loaded."""
    from . import distributed
    from .runners.checks import tensor_parallel_size

    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if isinstance(target, torch.nn.Module):
        if tensor_parallel_size(target) != tp_size:
            raise ValueError(f"tp_size={tp_size} but the target given is sharded over {tensor_parallel_size(target)} "
                             "rank(s): load it with distributed_config=DistributedConfig(tp_size=...) or pass its path")
        return target
    if target is None:
        raise ValueError("tp_size needs target= (a local path to load sharded)")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    distributed.init_from_environment(device_type)
    return distributed.load_tensor_parallel(os.fspath(target), tp_size)


def load_pair(target: ModelSpec = None, draft: ModelSpec = None, tokenizer=None):
    """(target, draft, tokenizer): models from local paths (offline) or as given; the bundled pair
    (loaded once per process) when both are None."""
    if target is None and draft is None:
        target_model, draft_model, bundled_tokenizer = _bundled_pair()
        return target_model, draft_model, tokenizer if tokenizer is not None else bundled_tokenizer
    if target is None or draft is None:
        missing = "target" if target is None else "draft"
        raise ValueError(f"pass both target= and draft= (or neither, for the bundled pair): {missing} is missing")
    target_model, draft_model = _load_model(target, "target"), _load_model(draft, "draft")
    if tokenizer is None:
        tokenizer = _load_tokenizer(target)
    return target_model, draft_model, tokenizer


_BUNDLED_PAIR_LOCK = threading.Lock()


def _bundled_pair():
    """The bundled pair, loaded once per process: concurrent first calls wait for one load (lru_cache alone
    let each of them load it)."""
    with _BUNDLED_PAIR_LOCK:
        return _load_bundled_pair()


@functools.lru_cache(maxsize=1)
def _load_bundled_pair():
    try:
        from .default_pair import load_default_pair
    except ImportError as error:
        raise ValueError("no target/draft given and the bundled default pair is not available: "
                         f"pass target= and draft= ({error})") from error
    return load_default_pair()


def _load_target(target: ModelSpec, tokenizer):
    """The target model and its tokenizer alone (no draft model): the bundled target when None."""
    if target is None:
        target_model, _, bundled_tokenizer = _bundled_pair()
        return target_model, tokenizer if tokenizer is not None else bundled_tokenizer
    return _load_model(target, "target"), tokenizer if tokenizer is not None else _load_tokenizer(target)


def _load_heads(target: ModelSpec, heads: Union[str, MedusaHeads], tokenizer) -> Models:
    if isinstance(heads, str) and not is_bundled_target(target):
        raise ValueError("draft='heads' uses the bundled heads, trained for the bundled target; for another "
                         "target pass draft=specdec_ext.heads.load_heads(<dir>) with heads trained for it "
                         "(tools/train_heads.py)")
    target_model, tokenizer = _load_target(target, tokenizer)
    param = next(target_model.parameters())
    if isinstance(heads, str):
        from .default_pair import load_default_heads
        heads = load_default_heads(dtype=param.dtype, device=param.device)
    heads.check_target(target_model)
    return Models(target_model, "heads", heads=cast_model(heads, param.dtype).to(param.device), tokenizer=tokenizer)


def _load_model(spec: ModelSpec, role: str):
    if isinstance(spec, torch.nn.Module):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        extra = ", 'ngram', 'heads', 'eagle', MedusaHeads or EagleDrafterSpec" if role == "draft" else ""
        raise TypeError(f"the {role} must be a model id or local path, a loaded model{extra}, or None; got "
                        f"{type(spec).__name__} {spec!r}")
    from transformers import AutoModelForCausalLM

    path = bundled_path(os.fspath(spec))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load the {role} model from {path!r} (offline, local files only): {error}") from error
    return model.eval()


def bundled_path(path: str) -> str:
    """``path``, or the bundled target's unpacked directory when ``path`` is its folder in the package (which
    holds its weights packed: default_pair/packing.py)."""
    from .default_pair import PACKED_TARGET_DIR, target_dir
    return target_dir() if os.path.realpath(path) == os.path.realpath(PACKED_TARGET_DIR) else path


def _model_path(spec: ModelSpec) -> Optional[str]:
    """A local path for a model spec (a loaded model's name_or_path), or None."""
    if isinstance(spec, torch.nn.Module):
        spec = getattr(spec, "name_or_path", None) or getattr(spec.config, "_name_or_path", None)
    return bundled_path(os.fspath(spec)) if isinstance(spec, (str, os.PathLike)) and spec else None


def _tokenizer_arg(name: str, given):
    """A tokenizer argument given as a directory (or os.PathLike): the tokenizer saved there, as the CLI's
    --draft-tokenizer PATH loads it; anything else as given."""
    if not isinstance(given, (str, os.PathLike)):
        return given
    path = os.fspath(given)
    if not os.path.isdir(path):
        raise ValueError(f"{name}={path!r}: no such directory (a tokenizer object, or the directory it was saved to)")
    real = os.path.realpath(path)
    loaded = _tokenizer_at(real, _files_changed_ns(real))
    if loaded is None:
        raise ValueError(f"{name}={path!r}: no tokenizer could be loaded from that directory")
    return loaded


def _load_tokenizer(spec: ModelSpec):
    """The tokenizer next to a model path (or a loaded model's name_or_path); the bundled tokenizer for
    the bundled models (it lives beside them); or None."""
    path = _model_path(spec)
    if path is None:
        return None
    from .default_pair import DRAFT_DIR, TOKENIZER_DIR, target_dir_path
    if os.path.realpath(path) in (os.path.realpath(target_dir_path()), os.path.realpath(DRAFT_DIR)):
        path = TOKENIZER_DIR
    if not os.path.isdir(path):
        return None
    path = os.path.realpath(path)
    return _tokenizer_at(path, _files_changed_ns(path))


@functools.lru_cache(maxsize=8)
def _tokenizer_at(path: str, changed_ns: int):
    """The tokenizer saved in ``path``, loaded once per version of its files (``changed_ns``): generate() and
    plain_generate() called with a loaded model find its tokenizer here every call, and loading it took
    16-40 ms (the bundled one), 5-14% of a 96-token generation on one CPU thread."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def _files_changed_ns(path: str) -> int:
    """The latest modification time of the files directly in ``path`` (ns)."""
    with os.scandir(path) as entries:
        return max((entry.stat().st_mtime_ns for entry in entries if entry.is_file()), default=0)


def is_bundled_target(target: ModelSpec) -> bool:
    """Whether ``target`` is the bundled pair's target: None, its directory, or a model loaded from it."""
    from .default_pair import target_dir_path
    if target is None:
        return True
    path = _model_path(target)
    return path is not None and os.path.realpath(path) == os.path.realpath(target_dir_path())


# ------------------------------------------------------------------------------------- the vocabulary check
def _id_to_token(tokenizer) -> dict:
    return {i: t for t, i in tokenizer.get_vocab().items()}


def _mismatching_ids(target_tokenizer, draft_tokenizer) -> list:
    """The token ids the two tokenizers spell differently (or only one of them has)."""
    ids_t, ids_d = _id_to_token(target_tokenizer), _id_to_token(draft_tokenizer)
    return [i for i in sorted(set(ids_t) | set(ids_d)) if ids_t.get(i) != ids_d.get(i)]


def cross_tokenizer_bridge(target_model, draft_model, target_tokenizer, draft_tokenizer) -> VocabularyBridge:
    """The bridge for a draft whose tokenizer differs from the target's (issue 29): each model must score
    its own tokenizer's tokens, and both tokenizers must round-trip text (vocab_bridge.check_round_trip
    raises TokenizerRoundTripError naming what was tried)."""
    for role, model, tokenizer in (("target", target_model, target_tokenizer), ("draft", draft_model, draft_tokenizer)):
        size, real = output_vocab_size(model), len(tokenizer)
        if size < real:
            raise VocabularyMismatchError(f"the {role} model scores {size} tokens but its tokenizer has {real}")
    return VocabularyBridge.build(target_tokenizer, draft_tokenizer, output_vocab_size(target_model),
                                  output_vocab_size(draft_model))


def check_vocabularies(target_model, draft_model, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise VocabularyMismatchError unless the draft and the target share a vocabulary.

    With both tokenizers, every token id must map to the same token string. The models' embedding
    (logit) sizes may differ (padding), but each must cover the target tokenizer's tokens.
    """
    v_target, v_draft = output_vocab_size(target_model), output_vocab_size(draft_model)
    if target_tokenizer is not None and draft_tokenizer is not None:
        ids_t, ids_d = _id_to_token(target_tokenizer), _id_to_token(draft_tokenizer)
        bad = _mismatching_ids(target_tokenizer, draft_tokenizer)
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
                + ", ".join(str(i) for i in range(min(v_target, v_draft),
                                                  min(max(v_target, v_draft), min(v_target, v_draft) + MAX_MISMATCHES_REPORTED))))


def missing_model_directory(value: str) -> Optional[str]:
    """Why ``value`` cannot be a model directory or a cached Hub model id, or None when it can be (the models load
    offline, and a missing path made the loader say "Repo id must use alphanumeric chars", never that it does not
    exist: the command line checks its model options with this before any load)."""
    if os.path.isdir(value):
        return None
    if os.path.exists(value):
        return f"not a directory: {value}"
    if not _could_be_hub_id(value):  # a path: it starts with / . or ~, or holds two slashes, a backslash...
        return f"no such directory: {value}"
    if _in_hub_cache(value):
        return None
    return f"no such directory: {value} (nor a model id in the Hugging Face cache: models load offline)"


def _could_be_hub_id(value: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds any file of the model ``repo_id`` (transformers' offline loads read
    it: HF_HUB_CACHE, or the older TRANSFORMERS_CACHE where set)."""
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    caches = [HF_HUB_CACHE] + [os.environ[v] for v in ("TRANSFORMERS_CACHE",) if os.environ.get(v)]
    return any(os.path.isdir(os.path.join(cache, folder)) for cache in caches)
