"""The build facts embedded in specdec_ext._C and the check that refuses to load it into another torch
(specdec_ext/_extension.py, csrc/bindings.cpp, setup.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import specdec_ext
from specdec_ext import _C, _extension


def test_embedded_build_info_is_the_running_torch():
    from_file = _extension.read_build_info(_C.__file__)
    assert from_file == json.loads(_C.build_info)
    assert from_file["torch_version"] == torch.__version__ == _C.torch_version
    assert from_file["torch_cuda_version"] == torch.version.cuda == _C.torch_cuda_version
    assert from_file["cxx11_abi"] == bool(torch._C._GLIBCXX_USE_CXX11_ABI) == _C.cxx11_abi
    assert from_file["torch_git_version"] == torch.version.git_version
    assert from_file["built_with_cuda"] == _C.built_with_cuda
    assert _extension.mismatches(from_file, _extension.running_torch_info()) == []


def _fake_extension(path, info):
    # an ELF-looking file with the marker somewhere inside, as the linker leaves it in .rodata
    path.write_bytes(b"\x7fELF" + os.urandom(4096).replace(b"\0", b"\1") + b"\0" + _extension.MARKER
                     + json.dumps(info).encode() + b"\0" + os.urandom(4096))
    return str(path)


def test_a_build_for_another_torch_is_refused_before_loading(tmp_path):
    built = dict(_extension.running_torch_info(), torch_version="2.14.1+cu130", torch_cuda_version="13.0",
                 torch_git_version="5c4886908584029761b579af026dcfb627c84070", built_with_cuda=True)
    # not a loadable library at all: the check must decide from the file alone
    path = _fake_extension(tmp_path / "_C.cpython-311-x86_64-linux-gnu.so", built)
    with pytest.raises(_extension.ExtensionMismatchError) as error:
        _extension.check_extension_file(path)
    message = str(error.value)
    assert isinstance(error.value, ImportError)
    assert f"torch version: built with 2.14.1+cu130, running {torch.__version__}" in message
    if torch.version.cuda is None:
        assert "torch CUDA version: built with 13.0, running none (CPU-only torch)" in message
    assert "Rebuild it against this torch" in message and "pip install" in message
    assert path in message


def test_only_the_differing_facts_are_listed(tmp_path):
    built = dict(_extension.running_torch_info(), cxx11_abi=not torch._C._GLIBCXX_USE_CXX11_ABI)
    with pytest.raises(_extension.ExtensionMismatchError) as error:
        _extension.check_extension_file(_fake_extension(tmp_path / "_C.so", built))
    problems = [line for line in str(error.value).splitlines() if ": built with " in line]
    assert len(problems) == 1 and "C++11 ABI" in problems[0]


def test_a_file_without_build_info_is_refused(tmp_path):
    path = tmp_path / "_C.so"
    path.write_bytes(b"\x7fELF" + bytes(1000))
    with pytest.raises(_extension.ExtensionMismatchError, match="carries no build information"):
        _extension.check_extension_file(str(path))


def test_rebuild_command_names_a_build():
    command = _extension.rebuild_command(_C.__file__)
    assert command.startswith("pip install ") or command.endswith("python setup.py build_ext --inplace")


def test_importing_into_another_torch_fails_with_the_fix():
    """The whole import path in a fresh process whose torch reports another version: the real _C is
    refused before it is loaded, with the difference and the command."""
    code = ("import torch; torch.__version__ = '9.9.9+fake'\n"
            "try:\n    import specdec_ext\nexcept ImportError as e:\n"
            "    import sys; print(type(e).__name__); print(e); "
            "print('loaded' if 'specdec_ext._C' in sys.modules else 'not loaded')\n")
    package_root = os.path.dirname(os.path.dirname(specdec_ext.__file__))
    env = dict(os.environ, PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
                         timeout=300).stdout
    assert out.startswith("ExtensionMismatchError"), out
    assert f"torch version: built with {_C.torch_version}, running 9.9.9+fake" in out
    assert "Rebuild it against this torch" in out
    assert out.rstrip().endswith("not loaded")


def test_every_op_has_a_cpu_kernel_and_the_cpu_only_list_is_registered():
    from specdec_ext.ops import CPU_ONLY_OPS
    ops = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("specdec_ext::"))
    assert {f"specdec_ext::{name}" for name in CPU_ONLY_OPS} <= set(ops)
    # cpu_isa takes no tensor, so its one kernel is CompositeExplicitAutograd (it answers on any build)
    no_cpu = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
              and not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeExplicitAutograd")]
    assert no_cpu == []
    # the CUDA side of this list is asserted by tools/cuda_compile_check.sh on the CUDA build
    if _C.built_with_cuda:
        cuda_missing = {op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")}
        assert cuda_missing == {f"specdec_ext::{name}" for name in CPU_ONLY_OPS}
