"""Build of specdec_ext: one torch extension, specdec_ext._C.

CUDAExtension when torch is a CUDA build and nvcc is found (CUDA_HOME, default /usr/local/cuda),
else CppExtension. Overrides:
  SPECDEC_FORCE_CPU=1   always build the CPU-only extension
  SPECDEC_FORCE_CUDA=1  require the CUDA extension; fail with the reason when it cannot be built
  TORCH_CUDA_ARCH_LIST  GPU architectures (default "9.0" when no GPU is visible, e.g. in CI)
  MAX_JOBS              parallel compile jobs (ninja)
"""
import glob
import os
import shutil

from setuptools import setup

# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper script: set it first.
os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError as error:  # pragma: no cover - only on a misconfigured build
    raise SystemExit(
        "specdec_ext builds against the installed torch: install torch first "
        "(e.g. `pip install torch==2.13.0`), then `pip install --no-build-isolation .`"
    ) from error

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _nvcc_path():
    candidate = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


def _use_cuda():
    if _flag("SPECDEC_FORCE_CPU") and _flag("SPECDEC_FORCE_CUDA"):
        raise SystemExit("SPECDEC_FORCE_CPU and SPECDEC_FORCE_CUDA are both set: choose one")
    if _flag("SPECDEC_FORCE_CPU"):
        return False
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    if _nvcc_path() is None:
        reasons.append(f"nvcc not found at $CUDA_HOME/bin/nvcc (CUDA_HOME={os.environ['CUDA_HOME']})")
    if reasons and _flag("SPECDEC_FORCE_CUDA"):
        raise SystemExit("SPECDEC_FORCE_CUDA=1 but the CUDA extension cannot be built: " + "; ".join(reasons))
    return not reasons


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extension():
    cpp_sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    # -fopenmp: at::parallel_for parallelises through OpenMP pragmas compiled into the caller; without
    # it the CPU kernels run on one thread whatever torch.get_num_threads() says.
    cxx_flags = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if _use_cuda():
        if not torch.cuda.is_available():
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        return CUDAExtension(
            "specdec_ext._C",
            cpp_sources + _sources("csrc/cuda/*.cu"),
            define_macros=[("SPECDEC_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]},
            extra_link_args=link_flags,
        )
    return CppExtension("specdec_ext._C", cpp_sources, extra_compile_args={"cxx": cxx_flags},
                        extra_link_args=link_flags)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
)
