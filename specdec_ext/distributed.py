"""Speculative decoding over a tensor-parallel HF target (torch.distributed; docs/multi-gpu.md).

The target is loaded the HF way (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``,
or ``tp_plan="auto"``): its weights are sharded over the ranks and its forward runs the collectives
(an all-reduce per attention and MLP block, an all-gather of the logits). Every rank runs the same
decode loop with the same shapes and the same cache operations, so those collectives line up; the
drafter (a draft model, n-gram lookup or heads) is replicated on every rank. Each rank's paged KV
cache holds its own KV heads (the cache is sized from what the model produces: runners/support.py).

Identical decisions on every rank. By construction they are: the all-gathered logits are the same on
every rank and the verifier draws Philox numbers keyed by each row's seed. ``RankSync`` makes it a
guarantee, per step, after the draft and after the verification:

    "broadcast" (default)  rank 0's proposal (token ids and draft counts) and verdict (tokens,
                           accepted counts, a tree's path) are broadcast to every rank: one small
                           broadcast each per step (B x (k + 1) ints), so a rank whose arithmetic
                           differed in the last bit still follows rank 0 and never desynchronises
    "verify"               all-gather them and raise ``RankDivergenceError`` naming the step and
                           the row when any rank differs (what the tests use: it proves the ranks
                           agree by construction)
    "off"                  nothing (trust construction)

Adaptive k is off under tensor parallelism: its choices follow each rank's own timings, so the ranks
would disagree on the verify width and the collectives would not line up (plan.py gives k=None a
fixed k).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import NoReturn, Optional

import torch

from .metadata import Proposal, Verdict

TP_CHECKS = ("broadcast", "verify", "off")
ENV_TIMEOUT = "SPECDEC_TP_TIMEOUT_S"  # process-group timeout: a rank that fails ends the others' waits
DEFAULT_TIMEOUT_S = 300


class RankDivergenceError(RuntimeError):
    """The ranks of a tensor-parallel target made different decisions (tp_check="verify")."""


def is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if is_initialized() else 1


def init_from_environment(device_type: str = "cpu") -> None:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...)
    with a timeout of SPECDEC_TP_TIMEOUT_S seconds (default 300) instead of HF's two hours, so that a rank
    that fails does not leave the others waiting in a collective. Gloo on the CPU, NCCL on CUDA."""
    if is_initialized():
        return
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise RuntimeError("tensor parallelism needs one process per rank: run under torchrun "
                           "(torchrun --nproc_per_node=N -m specdec_ext generate --tp N ...) or initialise "
                           "torch.distributed yourself before loading the target")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    seconds = float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    torch.distributed.init_process_group(backend=backend, timeout=timedelta(seconds=seconds))


def destroy() -> None:
    """Tear the process group down (at the end of a torchrun program)."""
    if is_initialized():
        torch.distributed.destroy_process_group()


def exit_rank(status: int = 0) -> NoReturn:
    """End this rank's process now, without the interpreter's finalization (after ``destroy``, at the
    end of a torchrun program). Why: gloo's worker threads release finished collectives a moment after
    the caller has returned, and one that drops the last reference to a tensor made in Python needs
    the GIL; during finalization that thread is ended inside a destructor and the process aborts
    ("terminate called without an active exception": 1 run in 4 of ``specdec generate --tp 2`` on two
    busy cores). Standard output and error are flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def load_tensor_parallel(path: str, tp_size: int, **kwargs):
    """``from_pretrained(path)`` sharded over ``tp_size`` ranks (the process group must hold exactly
    that many), offline, in eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401  (HF's tensor-parallel loading needs it)
    except ImportError as error:
        raise ImportError("tensor parallelism needs accelerate: pip install accelerate (or the project's "
                          '".[tp]" extra)') from error
    if world_size() != tp_size:
        raise ValueError(f"tp_size={tp_size} but the process group has {world_size()} ranks: start "
                         f"{tp_size} processes (torchrun --nproc_per_node={tp_size})")
    _check_heads_divide(path, tp_size)
    try:
        from transformers import DistributedConfig
        sharding = dict(distributed_config=DistributedConfig(tp_size=tp_size))
    except ImportError:  # transformers before DistributedConfig
        sharding = dict(tp_plan="auto")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **sharding, **kwargs)
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load the target from {path!r} with tensor parallelism over {tp_size} ranks: "
                         f"{error}") from error
    return model.eval()


def _check_heads_divide(path: str, tp_size: int) -> None:
    """ValueError unless the attention and key/value heads divide over ``tp_size`` ranks (HF's sharded forward
    failed in a reshape, which named neither)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return  # (the load below says why)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % tp_size:
            raise ValueError(f"the target has {count} {name}, which do not divide over tp_size={tp_size} ranks: "
                             f"choose a tp_size that divides {heads} attention and {kv_heads} key/value heads")


class RankSync:
    """Makes every rank take rank 0's decisions (module docstring); one per decode call."""

    def __init__(self, mode: str = "broadcast"):
        if mode not in TP_CHECKS:
            raise ValueError(f"tp_check must be one of {TP_CHECKS}, got {mode!r}")
        self.mode = mode
        self.step = 0

    def tokens(self, token_buffer: torch.Tensor) -> None:
        """After the prefill: the prompts and the first sampled token of every row."""
        self._sync("prompt and first tokens", token_buffer)

    def proposal(self, proposal: Proposal) -> None:
        """Before the target pass: every rank verifies rank 0's drafts (the pass's inputs must agree)."""
        self._sync("draft token ids", proposal.token_ids)
        self._sync("draft counts", proposal.num_draft)
        if proposal.parents is not None:
            self._sync("tree parents", proposal.parents)

    def verdict(self, verdict: Verdict) -> None:
        """After the verifier: every rank commits rank 0's tokens."""
        self._sync("accepted counts", verdict.num_accepted)
        self._sync("emitted tokens", verdict.tokens)
        if verdict.path is not None:
            self._sync("tree path", verdict.path)
        self.step += 1

    def _sync(self, what: str, tensor: torch.Tensor) -> None:
        if self.mode == "off":
            return
        if self.mode == "broadcast":
            torch.distributed.broadcast(tensor, src=0)
            return
        gathered = [torch.empty_like(tensor) for _ in range(world_size())]
        torch.distributed.all_gather(gathered, tensor.contiguous())
        for other, values in enumerate(gathered[1:], start=1):
            if not torch.equal(values, gathered[0]):
                row = int((values != gathered[0]).reshape(values.shape[0], -1).any(1).nonzero()[0, 0])
                raise RankDivergenceError(f"rank {other} and rank 0 disagree on the {what} of row {row} at step "
                                          f"{self.step}: {values[row].tolist()} vs {gathered[0][row].tolist()}")


def rank_sync(tensor_parallel: int, mode: Optional[str]) -> Optional[RankSync]:
    """A RankSync for a target sharded over ``tensor_parallel`` ranks, or None for a whole target."""
    if tensor_parallel <= 1:
        return None
    return RankSync(mode or "broadcast")
