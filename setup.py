"""Builds omni and, when a CUDA toolkit and a CUDA build of torch are present, omni_kernels._C.

setup.py only drives CMake (CMakeLists.txt owns sources and architectures). Environment:

* ``CUDA_HOME``: the CUDA toolkit (default: the folder of ``nvcc`` on PATH, or /usr/local/cuda).
* ``OMNI_CUDA_ARCHS``: e.g. ``"90a"`` to build for Hopper only (default ``"80;89;90a"``).
* ``OMNI_GPU_LANG``: ``CUDA`` (default) or ``HIP``.
* ``OMNI_SKIP_CUDA_BUILD=1``: install the pure-Python/Triton package only.
* ``OMNI_REQUIRE_CUDA_BUILD=1``: fail instead of skipping when the extension cannot be built
  (CI and the GPU machine set it, so a kernel that stops compiling fails the run).
* ``MAX_JOBS``: parallel compile jobs (default: the CPU count).

``pip install --no-build-isolation -e .`` and ``python setup.py build_ext --inplace`` both put
``_C*.so`` inside ``omni_kernels/``.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _find_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        # /usr/local/bin/nvcc may be a wrapper script: ask nvcc where it really lives.
        real = Path(os.path.realpath(nvcc))
        if real.parent.name == "bin" and (real.parent.parent / "include" / "cuda.h").exists():
            return str(real.parent.parent)
    for candidate in sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if (Path(candidate) / "bin" / "nvcc").exists():
            return candidate
    return None


def _why_extension_cannot_build() -> str | None:
    """None when the CUDA/HIP extension can be built here, else the reason."""
    try:
        import torch
    except ImportError:
        return "torch is not installed in the build environment (use --no-build-isolation)"
    if os.environ.get("OMNI_GPU_LANG", "CUDA") == "HIP":
        return None if torch.version.hip else "OMNI_GPU_LANG=HIP needs a ROCm build of torch"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    cuda_home = _find_cuda_home()
    if cuda_home is None or not (Path(cuda_home) / "bin" / "nvcc").exists():
        return "no CUDA toolkit found (set CUDA_HOME to a folder with bin/nvcc)"
    return None


def _nvidia_wheel_paths(subdirs: tuple[str, ...], pattern: str = "") -> list[str]:
    """Paths inside the pip-installed nvidia-* wheels that sit beside torch."""
    found = []
    for site in sys.path:
        for sub in subdirs:
            path = Path(site) / sub
            if path.is_dir():
                found.extend(sorted(glob.glob(str(path / pattern))) if pattern else [str(path)])
    return found


def _cuda_cmake_hints(cuda_home: str) -> list[str]:
    """CMake cache entries that let torch's CMake config find CUDA on a bare toolkit.

    Torch's headers include cuBLAS/cuSPARSE headers and its CMake targets name libnvrtc; a
    minimal toolkit may lack both while the nvidia-* wheels that torch depends on carry them.
    """
    hints = []
    includes = _nvidia_wheel_paths(("nvidia/cu13/include", "nvidia/cublas/include",
                                    "nvidia/cusparse/include", "nvidia/cuda_nvrtc/include"))
    hints.append("-DOMNI_EXTRA_INCLUDE_DIRS=" + ";".join(includes))
    if not glob.glob(str(Path(cuda_home) / "lib64" / "libnvrtc.so*")):
        nvrtc = _nvidia_wheel_paths(("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"), "libnvrtc.so.*")
        if nvrtc:
            hints.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc[0]}")
    return hints


def _loaded_library(prefix: str) -> str | None:
    """The path of a shared library named ``prefix``* that this process (torch) has loaded, from
    /proc/self/maps (Linux), else ``None``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def _loaded_libstdcxx() -> str | None:
    """The shared C++ runtime this process (torch) has loaded."""
    return _loaded_library("libstdc++.so")


def _private_cxx_runtime_symbols(library: Path) -> list[str]:
    """C++ runtime entry points ``library`` defines itself (a static libstdc++ linked in)."""
    if not shutil.which("nm"):
        return []
    listing = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True)
    symbols = {line.split()[-1] for line in listing.stdout.splitlines() if line.strip()}
    return sorted(symbols & {"__cxa_throw", "__gxx_personality_v0", "__cxa_begin_catch"})


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self) -> None:
        if _env_flag("OMNI_SKIP_CUDA_BUILD"):
            print("omni: OMNI_SKIP_CUDA_BUILD set; building the Python package only")
            return
        reason = _why_extension_cannot_build()
        if reason is not None:
            if _env_flag("OMNI_REQUIRE_CUDA_BUILD"):
                raise RuntimeError(f"omni_kernels._C cannot be built: {reason}")
            print(f"omni: skipping omni_kernels._C ({reason}); Triton/PyTorch paths only")
            return
        super().run()

    def build_extension(self, ext: Extension) -> None:
        import torch

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        gpu_lang = os.environ.get("OMNI_GPU_LANG", "CUDA")
        config = "Debug" if self.debug else "Release"
        args = [
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DOMNI_GPU_LANG={gpu_lang}",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        if os.environ.get("OMNI_CUDA_ARCHS"):
            args.append(f"-DOMNI_CUDA_ARCHS={os.environ['OMNI_CUDA_ARCHS']}")
        if gpu_lang == "CUDA":
            cuda_home = _find_cuda_home()
            args.append(f"-DCMAKE_CUDA_COMPILER={Path(cuda_home) / 'bin' / 'nvcc'}")
            args.append(f"-DCUDAToolkit_ROOT={cuda_home}")
            # Torch's CMake config still runs the legacy FindCUDA, which reads this variable.
            args.append(f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}")
            args.extend(_cuda_cmake_hints(cuda_home))
            # The cuBLASLt torch loaded (its nvidia wheel's, or the toolkit's): the FP8 GEMM op
            # calls it, and must share the library (and handle) torch's own GEMMs use.
            cublaslt = _loaded_library("libcublasLt.so")
            if cublaslt:
                args.append(f"-DOMNI_RUNTIME_CUBLASLT={cublaslt}")
        runtime = _loaded_libstdcxx()
        if runtime:
            args.append(f"-DOMNI_RUNTIME_LIBSTDCXX={runtime}")
        env = dict(os.environ)
        if gpu_lang == "CUDA":
            env["CUDA_HOME"] = _find_cuda_home()
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        print(f"omni: building omni_kernels._C with torch {torch.__version__}, {' '.join(args)}")
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_temp, env=env, check=True)
        subprocess.run(
            ["cmake", "--build", ".", "--config", config, "--parallel", jobs],
            cwd=build_temp, env=env, check=True,
        )
        for library in out_dir.glob("_C*.so"):
            private = _private_cxx_runtime_symbols(library)
            if private:
                print(f"omni: WARNING: {library.name} defines {', '.join(private)} itself (a static C++ "
                      "runtime linked in): errors raised in C++ may crash the process instead of "
                      "reaching Python. Build with a compiler that has a shared libstdc++.")


if __name__ == "__main__":  # pip and `python setup.py` run it as __main__; tests import the helpers
    setup(
        ext_modules=[CMakeExtension("omni_kernels._C")],
        cmdclass={"build_ext": CMakeBuild},
    )
