"""specdec_ext: lossless speculative decoding for Hugging Face models.

The kernels are torch ops under ``torch.ops.specdec_ext`` with typed wrappers in
``specdec_ext.ops``.
"""
import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

try:
    from . import _C  # noqa: F401  (registers torch.ops.specdec_ext.*)
except ImportError as error:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "specdec_ext._C is not built. Install the package (`pip install --no-build-isolation .`) "
        "or build in place (`python setup.py build_ext --inplace`); running from a source tree "
        f"without the compiled extension does not work. Original error: {error}"
    ) from error

from . import ops  # noqa: E402
from .adaptive import AdaptiveK  # noqa: E402
from .audit import audit  # noqa: E402
from .default_pair import load_default_pair  # noqa: E402
from .generate import GenerationResult, generate, plain_generate  # noqa: E402
from .models import VocabularyMismatchError, load_pair  # noqa: E402
from .plan import DecodePlan  # noqa: E402

__all__ = ["ops", "generate", "plain_generate", "audit", "load_pair", "load_default_pair", "AdaptiveK",
           "GenerationResult", "DecodePlan", "VocabularyMismatchError"]
__version__ = "0.1.0"
