"""Thin driver: configures and builds CMakeLists.txt, placing kvprune_cuda._C in the package.

    pip install --no-build-isolation --no-deps .

Environment:
    KVPRUNE_CUDA_ARCHS   CUDA architectures, CMake syntax (default "80;90a;100;120")
    KVPRUNE_ENABLE_CUDA  0 to build the CPU backend only even where nvcc exists
    KVPRUNE_BUILD_DIR    build directory (default: a per-interpreter folder under build/)
    MAX_JOBS             parallel compile jobs (default: CPU count)
"""

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # One build folder per interpreter (each may hold a different torch).
        interpreter = hashlib.sha1(sys.executable.encode()).hexdigest()[:8]
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-{sysconfig.get_platform()}-{interpreter}"
        build_dir = Path(os.environ.get("KVPRUNE_BUILD_DIR", ROOT / "build" / tag))
        build_dir.mkdir(parents=True, exist_ok=True)
        enable_cuda = os.environ.get("KVPRUNE_ENABLE_CUDA", "1") not in ("0", "OFF", "off", "")
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DKVPRUNE_BUILD_PYTHON=ON",
            f"-DKVPRUNE_ENABLE_CUDA={'ON' if enable_cuda else 'OFF'}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DKVPRUNE_PYTHON_OUTPUT_DIR={output_dir}",
        ]
        if _has_ninja():
            configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs], check=True)


def _has_ninja() -> bool:
    try:
        subprocess.run(["ninja", "--version"], check=True, capture_output=True)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


setup(
    ext_modules=[CMakeExtension("kvprune_cuda._C")],
    cmdclass={"build_ext": CMakeBuild},
)
