"""Per-row status codes the verifier ops write into ``num_accepted`` (csrc/common/sampling_math.h).

A negative value marks a row whose input was invalid; the ops never raise from inside a kernel, so
they stay free of host synchronisation and safe inside CUDA graphs. The Python wrappers turn the
codes into errors that name the argument.
"""
import torch

ROW_STATUS_MESSAGES = {
    -1: "target_logits: row {row} has a NaN or +inf logit (or every logit is -inf) at a verified position",
    -2: "draft_probs: row {row} has an invalid probability where the walk reads it: q(x) at a verified draft x that "
        "is NaN, negative, > 1 or 0 (x cannot have been drawn from it), or, where a rejection resamples from the "
        "whole q row, a NaN, negative or > 1 entry or a sum off 1 by more than 1e-3",
    -3: "{ids}: row {row} has a token id outside [0, V) among its first {counts} entries",
    -4: "num_draft: row {row} is outside [0, k]",
    -5: "temperature: row {row} is negative or NaN",
    -6: "top_k: row {row} is negative",
    -7: "top_p: row {row} is outside (0, 1]",
    -8: "uniforms: row {row} has a value outside [0, 1)",
    -9: "parents: row {row} is not a valid tree (a parent index must be -1 or smaller than the node's own)",
    -10: "num_nodes: row {row} is outside [0, N]",
    -11: "seed/uniforms: row {row} samples (temperature >= GREEDY_TEMPERATURE) but neither seed nor uniforms "
         "was given (inside a CUDA graph capture the wrappers cannot draw seeds: pass seed)",
}

# Messages of ops whose arguments are named differently from the verifiers'.
_OP_MESSAGES = {
    "sample_filtered": {-1: "logits: row {row} has a NaN or +inf logit (or every logit is -inf)"},
}

# The names of the drafted ids and of their per-row count in each verifier's signature.
_ARGUMENT_NAMES = {
    "tree_verify": dict(ids="tree_token_ids", counts="num_nodes"),
}
_CHAIN_NAMES = dict(ids="draft_token_ids", counts="num_draft")


def raise_for_row_status(op_name: str, num_accepted: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the argument if any row of ``num_accepted`` is negative.

    Reads ``num_accepted`` on the host (one device synchronisation on CUDA).
    """
    bad = (num_accepted < 0).nonzero()
    if bad.numel() == 0:
        return
    row = int(bad[0, 0])
    code = int(num_accepted[row])
    message = _OP_MESSAGES.get(op_name, {}).get(code) or ROW_STATUS_MESSAGES.get(code, f"row {{row}} failed with status {code}")
    names = _ARGUMENT_NAMES.get(op_name, _CHAIN_NAMES)
    raise ValueError(f"{op_name}: " + message.format(row=row, **names))
