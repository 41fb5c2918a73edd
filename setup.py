"""Build of specdec_ext: one torch extension, specdec_ext._C.

The extension is compiled against the torch of the environment it is installed into, whatever the
frontend does: with `pip install --no-build-isolation .` that torch is importable here; with a plain
(isolated) `pip install .` or `pip wheel .` the build environment holds no torch (pyproject.toml does
not ask for one), so this script asks the Python that runs pip where its torch lives and imports that
one (_import_target_torch). With no torch there at all it stops and says what to install.

CUDAExtension when that torch is a CUDA build and nvcc is found (CUDA_HOME, default /usr/local/cuda,
else the nvcc on PATH); a CUDA torch without nvcc is an error (a CPU-only build would fail on every
CUDA tensor) unless SPECDEC_FORCE_CPU=1 asks for it; a CPU torch gives the CppExtension.
Overrides:
  SPECDEC_FORCE_CPU=1   always build the CPU-only extension
  SPECDEC_FORCE_CUDA=1  require the CUDA extension; fail with the reason when it cannot be built
  TORCH_CUDA_ARCH_LIST  GPU architectures (default "9.0" when no GPU is visible, e.g. in CI)
  MAX_JOBS              parallel compile jobs (ninja)
  SPECDEC_DEBUG_INFO=1  keep debug info in _C (-g, and nvcc's -lineinfo), for profilers and debuggers

A release build by default: no debug info in _C. Python's sysconfig CFLAGS, which torch's BuildExtension
puts in front of every C++ compile, hold -g (23 MB of the CPU build's 24 MB _C); -g0 after them turns
it off and the link drops any debug section left (_C: 1.1 MB, same code). The symbol table stays (perf
still names functions). nvcc gets no -g from sysconfig; its -lineinfo (source lines for Nsight Compute
and compute-sanitizer) tripled the device code (sm_90: 1.7 -> 5.8 MB), so it is a debug-info flag too.
SPECDEC_DEBUG_INFO=1 adds -g (host, both compilers) and -lineinfo, never -G: the same device code.
See docs/profiling.md.

What the build ran against (torch version and git commit, its CUDA version, the C++11 ABI, CUDA or
not) goes into the binary (a generated header read by csrc/bindings.cpp); specdec_ext/_extension.py
reads it from the file before loading the module and refuses a mismatching torch.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
INSTALL_TORCH_FIRST = (
    "specdec_ext compiles against the torch of the environment it is installed into, and {where}. "
    "Install torch there first, then build, e.g. for the CPU:\n"
    "    pip install torch==2.13.0 ninja && pip install .\n"
    "or with the CUDA build of torch you use (and nvcc): pip install torch ninja && pip install .\n"
    "If your torch is in another environment than that one (a frontend running from its own venv), "
    "build with that environment's Python without isolation:\n"
    "    python -m pip install --no-build-isolation ."
)


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


# --- the torch of the target environment ----------------------------------------------------------

def _parent_binary():
    """The executable the parent process runs (resolved), or None (not Linux)."""
    try:
        return os.path.realpath(f"/proc/{os.getppid()}/exe")
    except OSError:
        return None


def _parent_python():
    """The Python executable of the process that runs this build (pip, python -m build), or None.

    An isolated build runs this script in a fresh environment (pip: its own site-packages in front of,
    or, with venv isolation, instead of, the user's; build/uv: a new venv), and no frontend says which
    environment it installs into. The parent process is the frontend itself: when it is a Python (pip,
    build), its sys.executable is the user's interpreter (e.g. .venv/bin/python). Linux only (/proc);
    argv[0] is resolved as CPython resolves it (a path, or a name looked up on the parent's PATH) and
    must be the binary the parent runs, so a venv's symlinked python keeps its venv.
    """
    proc = f"/proc/{os.getppid()}"
    binary = _parent_binary()
    try:
        argv0 = open(f"{proc}/cmdline", "rb").read().split(b"\0")[0].decode()
        cwd = os.readlink(f"{proc}/cwd")
        environ = open(f"{proc}/environ", "rb").read().split(b"\0")
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    if binary is None or not re.match(r"(python|pypy)[0-9.]*$", os.path.basename(binary)):
        return None  # e.g. uv, make, a shell: not a Python we could ask
    if "/" in argv0:
        candidates = [os.path.join(cwd, argv0)]
    else:
        path = next((e[5:].decode(errors="replace") for e in environ if e.startswith(b"PATH=")), "")
        candidates = [os.path.join(cwd, d, argv0) for d in path.split(os.pathsep)]
    for candidate in candidates:
        if os.path.isfile(candidate) and os.path.realpath(candidate) == binary:
            return os.path.abspath(candidate)
    return None


def _target_torch():
    """{'python', 'prefix', 'version', 'torch_dir'} of the interpreter that runs the frontend (None:
    unknown). torch_dir is the folder that holds its torch package (None: it has no torch)."""
    python = _parent_python()
    if python is None:
        return None
    probe = ("import importlib.util, json, os, sys; s = importlib.util.find_spec('torch'); "
             "print(json.dumps({'prefix': sys.prefix, 'version': list(sys.version_info[:2]), 'torch_dir': "
             "os.path.dirname(list(s.submodule_search_locations)[0]) if s else None}))")
    # Without the build environment's PYTHONPATH (pip's sitecustomize), that Python sees what the user's does.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    try:
        out = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    found["python"] = python
    return found


def _import_target_torch():
    try:
        import torch  # noqa: F401  (--no-build-isolation, python setup.py ...: the environment's own torch)
        return torch
    except ImportError:
        pass
    target = _target_torch()
    if target is None:
        uv = os.path.basename(_parent_binary() or "") == "uv"
        frontend = ("uv " if uv else "") + "pip install --no-build-isolation ."
        raise SystemExit(
            "specdec_ext compiles against the torch of the environment it is installed into, but torch is not "
            f"importable by this build's Python ({sys.executable}) and the process that started the build is "
            "not a Python whose environment could be asked (an isolated build from a frontend such as uv, or "
            "setup.py run directly). Install torch into your environment, then build there without isolation:\n"
            f"    {frontend}")
    if target["torch_dir"] is None:
        raise SystemExit(INSTALL_TORCH_FIRST.format(where=f"{target['prefix']} (Python {target['python']}) has none"))
    if tuple(target["version"]) != sys.version_info[:2]:
        raise SystemExit(
            f"the environment pip installs into ({target['prefix']}) runs Python "
            f"{'.'.join(map(str, target['version']))} but this build runs Python {sys.version_info[0]}."
            f"{sys.version_info[1]}: build with the Python of your torch environment, without isolation:\n"
            "    python -m pip install --no-build-isolation .")
    # Appended, not prepended: the build environment's setuptools and ninja keep precedence.
    sys.path.append(target["torch_dir"])
    import torch
    print(f"specdec_ext: building against torch {torch.__version__} of {target['prefix']} "
          f"({os.path.dirname(torch.__file__)})", file=sys.stderr)
    return torch


torch = _import_target_torch()

# --- CUDA or not ---------------------------------------------------------------------------------

def _cuda_home():
    """CUDA_HOME, else /usr/local/cuda, else the toolkit of the nvcc on PATH. Set before importing
    torch.utils.cpp_extension: torch guesses it from the nvcc on PATH, which may be a wrapper script."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return "/usr/local/cuda"


os.environ["CUDA_HOME"] = _cuda_home()

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _nvcc_path():
    candidate = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


def _use_cuda():
    if _flag("SPECDEC_FORCE_CPU") and _flag("SPECDEC_FORCE_CUDA"):
        raise SystemExit("SPECDEC_FORCE_CPU and SPECDEC_FORCE_CUDA are both set: choose one")
    if _flag("SPECDEC_FORCE_CPU"):
        return False
    if torch.version.cuda is None:
        if _flag("SPECDEC_FORCE_CUDA"):
            raise SystemExit(f"SPECDEC_FORCE_CUDA=1 but the CUDA extension cannot be built: torch "
                             f"{torch.__version__} is a CPU-only build")
        return False
    if _nvcc_path() is None:
        raise SystemExit(
            f"torch {torch.__version__} is a CUDA {torch.version.cuda} build but nvcc was not found at "
            f"$CUDA_HOME/bin/nvcc (CUDA_HOME={os.environ['CUDA_HOME']}), and a CPU-only specdec_ext would "
            "fail on every CUDA tensor. Point CUDA_HOME at a CUDA toolkit of the same major version:\n"
            "    CUDA_HOME=/path/to/cuda pip install .\n"
            "or ask for the CPU-only extension explicitly:\n"
            "    SPECDEC_FORCE_CPU=1 pip install .")
    return True


USE_CUDA = _use_cuda()
if USE_CUDA and not torch.cuda.is_available():
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
DEBUG_INFO = _flag("SPECDEC_DEBUG_INFO")

BUILD_INFO = {
    "torch_version": torch.__version__,
    "torch_git_version": torch.version.git_version,
    "torch_cuda_version": torch.version.cuda,
    "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    "built_with_cuda": USE_CUDA,
    "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST", "visible GPUs") if USE_CUDA else None,
    "debug_info": DEBUG_INFO,
}


def _c_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _build_info_header():
    info = json.dumps(BUILD_INFO, sort_keys=True)  # ASCII: json escapes the rest
    return "\n".join([
        "// Generated by setup.py: what this build of specdec_ext._C was compiled against.",
        "#pragma once",
        f"#define SPECDEC_BUILD_INFO_JSON {_c_string(info)}",
        f"#define SPECDEC_BUILD_TORCH_VERSION {_c_string(BUILD_INFO['torch_version'])}",
        f"#define SPECDEC_BUILD_TORCH_CUDA_VERSION {_c_string(BUILD_INFO['torch_cuda_version'] or '')}",
        f"#define SPECDEC_BUILD_CXX11_ABI {int(BUILD_INFO['cxx11_abi'])}",
        f"#define SPECDEC_BUILD_WITH_CUDA {int(USE_CUDA)}",
        "",
    ])


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extension():
    cpp_sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp") + _sources("csrc/cpu/simd/*.cpp")
    # -fopenmp: at::parallel_for parallelises through OpenMP pragmas compiled into the caller; without
    # it the CPU kernels run on one thread whatever torch.get_num_threads() says.
    # -ffp-contract=off: no multiply-add fused behind the code's back (the x86-64-v3 clones, the AVX2
    # regions, AArch64), so each instruction-set path rounds as its source says (csrc/cpu/simd).
    cxx_flags = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
    link_flags = ["-fopenmp"]
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr"]
    # Debug info (see the module docstring): these come after the sysconfig CFLAGS (and $CFLAGS) on the
    # compile line, so the last -g option wins.
    if DEBUG_INFO:
        cxx_flags.append("-g")
        nvcc_flags += ["-g", "-lineinfo"]  # host debug info; device line tables (-G would change the code)
    else:
        cxx_flags.append("-g0")
        link_flags.append("-Wl,--strip-debug")
    if USE_CUDA:
        return CUDAExtension(
            "specdec_ext._C",
            cpp_sources + _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu"),
            define_macros=[("SPECDEC_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
        )
    return CppExtension("specdec_ext._C", cpp_sources, extra_compile_args={"cxx": cxx_flags},
                        extra_link_args=link_flags)


class BuildExt(BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)):
    """torch's BuildExtension, plus: the build-info header, one temp folder per torch and variant
    (CPU and CUDA builds of one checkout keep their objects), and always a fresh link: build/lib may
    hold the _C of another torch, which setuptools would otherwise keep as "up to date"."""

    def finalize_options(self):
        temp_given = self.build_temp is not None
        super().finalize_options()
        if not temp_given:
            variant = "cuda" if USE_CUDA else "cpu"
            self.build_temp += "-torch" + re.sub(r"[^A-Za-z0-9.]", "_", torch.__version__) + "-" + variant
        self.force = True

    def build_extensions(self):
        header_dir = os.path.abspath(os.path.join(self.build_temp, "generated"))
        os.makedirs(header_dir, exist_ok=True)
        header = os.path.join(header_dir, "specdec_build_info.h")
        text = _build_info_header()
        if not os.path.exists(header) or open(header).read() != text:  # unchanged: no recompile
            with open(header, "w") as f:
                f.write(text)
        for ext in self.extensions:
            ext.include_dirs.append(header_dir)
        super().build_extensions()


setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExt})
