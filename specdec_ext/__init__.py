"""specdec_ext: lossless speculative decoding for Hugging Face models.

The kernels are torch ops under ``torch.ops.specdec_ext`` with typed wrappers in
``specdec_ext.ops``.
"""
import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

from ._extension import load_extension as _load_extension

# registers torch.ops.specdec_ext.*; ImportError when _C is not built or was built for another torch
_C = _load_extension()

from . import ops  # noqa: E402
from .adaptive import AdaptiveK  # noqa: E402
from .audit import audit  # noqa: E402
from .default_pair import load_default_pair  # noqa: E402
from .eagle import EagleDrafterSpec, load_eagle  # noqa: E402
from .generate import GenerationResult, generate, plain_generate  # noqa: E402
from .models import VocabularyMismatchError, load_pair  # noqa: E402
from .ops.lean_forward import refresh_weights  # noqa: E402
from .plan import DecodePlan  # noqa: E402

__all__ = ["ops", "generate", "plain_generate", "audit", "load_pair", "load_default_pair", "AdaptiveK",
           "GenerationResult", "DecodePlan", "VocabularyMismatchError", "EagleDrafterSpec", "load_eagle",
           "refresh_weights"]
__version__ = "0.1.0"
