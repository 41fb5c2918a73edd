"""Loading specdec_ext._C, checked against the running torch.

A torch extension is compiled against one torch: its headers, its C++ ABI, CUDA or not. Loaded into
another torch it can fail on an undefined symbol, crash in its static op registrations, or load and
misbehave without a word. setup.py writes what the build ran against into the binary (a
``SPECDEC_BUILD_INFO=<json>`` string, csrc/bindings.cpp); :func:`load_extension` reads it from the
file BEFORE loading the module and raises :class:`ExtensionMismatchError` with the command that
rebuilds it when the running torch differs in version, CUDA version or C++11 ABI.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import mmap
import os
from urllib.parse import unquote, urlparse

import torch

MARKER = b"SPECDEC_BUILD_INFO="
# (field, what it is) in the order the message lists them
FIELDS = (("torch_version", "torch version"), ("torch_cuda_version", "torch CUDA version"),
          ("cxx11_abi", "C++11 ABI (_GLIBCXX_USE_CXX11_ABI)"), ("torch_git_version", "torch git commit"))


class ExtensionMismatchError(ImportError):
    """specdec_ext._C was built for another torch than the one running."""


def read_build_info(path: str) -> dict | None:
    """The build facts embedded in the extension file at ``path`` (not loaded), or None if it has none."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            start = data.find(MARKER)
            if start < 0:
                return None
            start += len(MARKER)
            end = data.find(b"\0", start)
            return json.loads(data[start:end if end >= 0 else size].decode("ascii"))


def running_torch_info() -> dict:
    """The same facts for the torch imported in this process."""
    return {"torch_version": torch.__version__, "torch_cuda_version": torch.version.cuda,
            "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "torch_git_version": torch.version.git_version}


def mismatches(built: dict, running: dict) -> list[str]:
    """One line per fact that differs between the build and the running torch (empty: they agree)."""
    def show(value):
        return "none (CPU-only torch)" if value is None else str(value)
    return [f"{label}: built with {show(built.get(key))}, running {show(running[key])}"
            for key, label in FIELDS if built.get(key) != running[key]]


def rebuild_command(path: str) -> str:
    """The command that rebuilds the extension at ``path`` for the torch of this environment."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))  # the folder that holds specdec_ext/
    try:
        dist = importlib.metadata.distribution("specdec_ext")
        record = json.loads(dist.read_text("direct_url.json") or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        dist, record = None, {}
    source = unquote(urlparse(record["url"]).path) if record.get("url", "").startswith("file://") else None
    if source is not None:
        if record.get("dir_info", {}).get("editable"):
            if os.path.realpath(source) == os.path.realpath(root):  # the editable install of this checkout
                return f"pip install -e {source}"
        elif os.path.realpath(str(dist.locate_file(""))) == os.path.realpath(root):  # installed from source
            return f"pip install {source}"
    if os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc")):
        # built in place (python setup.py build_ext --inplace, tools/dev_build.sh) and imported from the tree
        return f"cd {root} && python setup.py build_ext --inplace"
    return "pip install <the specdec_ext source directory> (from the environment of this torch)"


def check_extension_file(path: str) -> dict:
    """The build facts of the extension file at ``path`` (not loaded); ExtensionMismatchError when it has
    none or they do not match the running torch."""
    built = read_build_info(path)
    if built is None:
        raise ExtensionMismatchError(
            f"{path} carries no build information (it predates the torch check or is not a specdec_ext "
            f"build): rebuild it for torch {torch.__version__}:\n    {rebuild_command(path)}")
    problems = mismatches(built, running_torch_info())
    if problems:
        raise ExtensionMismatchError(
            f"specdec_ext._C ({path}) was built for another torch than the one running "
            f"({os.path.dirname(torch.__file__)}):\n  " + "\n  ".join(problems) + "\n"
            "Loading it could crash or give wrong results. Rebuild it against this torch (CUDA kernels "
            "when it is a CUDA build and nvcc is found):\n    " + rebuild_command(path))
    return built


def load_extension():
    """Import specdec_ext._C (registers torch.ops.specdec_ext.*) after checking that it was built for
    the running torch; ImportError when it is missing, ExtensionMismatchError when it does not match."""
    spec = importlib.util.find_spec("specdec_ext._C")
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        raise ImportError(
            "specdec_ext._C is not built. Install the package (`pip install .`) or build in place "
            "(`python setup.py build_ext --inplace`); running from a source tree without the compiled "
            "extension does not work.")
    check_extension_file(spec.origin)
    return importlib.import_module("specdec_ext._C")
