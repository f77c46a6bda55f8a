"""setup.py's guard against a private C++ runtime in omni_kernels._C.

A compiler install without a shared libstdc++ (the GPU machine's /opt/gcc) linked a static copy
into the module, and every TORCH_CHECK that failed crashed the process (SIGSEGV) instead of
raising. setup.py now links the runtime torch loaded, and warns when the built module still
defines the C++ runtime's entry points itself. These tests build two tiny libraries with the
machine's g++: one with a static libstdc++ (flagged), one without (clean)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = """
#include <stdexcept>
#include <string>
extern "C" int omni_check(int value) {
  if (value < 0) throw std::runtime_error("value must be >= 0; got " + std::to_string(value));
  return value;
}
"""


def _setup_module():
    spec = importlib.util.spec_from_file_location("omni_setup", REPO_ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module


def _build(tmp_path: Path, name: str, *flags: str) -> Path:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++")
    src = tmp_path / "check.cpp"
    src.write_text(SOURCE)
    lib = tmp_path / name
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, str(src), "-o", str(lib)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"g++ {' '.join(flags)} failed here: {done.stderr[-300:]}")
    return lib


def test_static_cxx_runtime_is_detected(tmp_path):
    setup = _setup_module()
    if not shutil.which("nm"):
        pytest.skip("needs nm (binutils)")
    private = setup._private_cxx_runtime_symbols(_build(tmp_path, "static.so", "-static-libstdc++"))
    assert "__cxa_throw" in private and "__gxx_personality_v0" in private, private
    assert setup._private_cxx_runtime_symbols(_build(tmp_path, "shared.so")) == []


def test_loaded_libstdcxx_is_the_runtime_torch_uses():
    import torch  # noqa: F401  (loads libstdc++ into this process)

    path = _setup_module()._loaded_libstdcxx()
    assert path is not None and os.path.basename(path).startswith("libstdc++.so") and os.path.exists(path)
