"""Build pydist's compiled extension, pydist._C (metadata: pyproject.toml).

    pip install --no-build-isolation -e .

pydist builds against the torch already installed (an isolated build
environment would download a torch of its own), so torch must be importable
here. The CPU part always builds; the CUDA sources build when torch has CUDA
and a CUDA toolkit is found. PYDIST_CUDA=auto|0|1 overrides:

    auto  CUDA when torch.version.cuda and a matching nvcc are found (default)
    0     CPU only
    1     CUDA required: a missing or mismatched toolkit is an error
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def fail(message):
    sys.stderr.write(f"\n[pydist setup] error: {message}\n\n")
    sys.exit(1)


def note(message):
    sys.stderr.write(f"[pydist setup] {message}\n")


try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    fail(
        "torch is not importable. pydist compiles against the torch you train with:\n"
        "  pip install torch            (on this project's CPU machines: torch==2.13.0)\n"
        "  pip install --no-build-isolation -e .\n"
        "Without --no-build-isolation pip builds in a fresh environment that has no torch."
    )


def find_cxx():
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        fail(
            f"no C++ compiler found (looked for '{cxx}' on PATH; set CXX to override). "
            "Install g++ (Debian/Ubuntu: apt-get install g++)."
        )
    check_shared_libstdcxx(cxx)
    return cxx


def check_shared_libstdcxx(cxx):
    """pydist._C must use the libstdc++ that torch has already loaded. A
    compiler that finds no libstdc++.so (a toolchain set up for static
    binaries) links a private static copy into the extension instead, and the
    two copies' iostream state clash: the build succeeds and the extension
    crashes the first time it formats a number into a message. (Linux only:
    elsewhere the C++ runtime is not libstdc++.)"""
    if not sys.platform.startswith("linux"):
        return
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return  # a compiler that cannot say (not GCC or Clang): nothing to check
    if not os.path.isabs(found):
        fail(
            f"the C++ compiler '{cxx}' finds no shared libstdc++ (-print-file-name=libstdc++.so gives "
            f"'{found}'), so it would link a static copy into pydist._C beside the one torch loads, and the "
            "extension would crash. Build with a compiler that has the shared library, for example:\n"
            "  CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED='/usr/bin/g++ -shared' "
            "pip install --no-build-isolation -e ."
        )


def nvcc_version(cuda_home):
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, f"{nvcc} --version failed: {exc}"
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (found.group(1), found.group(2)) if found else None, out


def want_cuda():
    """Decide whether to compile the CUDA sources; explain the decision."""
    mode = os.environ.get("PYDIST_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        fail(f"PYDIST_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        note("PYDIST_CUDA=0: building the CPU part only")
        return False
    problem = None
    if torch.version.cuda is None:
        problem = f"this torch ({torch.__version__}) was built without CUDA"
    elif cpp_extension.CUDA_HOME is None:
        problem = "no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)"
    elif not any(os.path.exists(os.path.join(d, "cuda_runtime.h"))
                 for d in (os.path.join(cpp_extension.CUDA_HOME, "include"), os.environ.get("CUDA_INC_PATH")) if d):
        # The header directories torch compiles with. It takes the toolkit's
        # root from nvcc's place on PATH: an nvcc that is a wrapper script
        # elsewhere (/usr/local/bin/nvcc) gives a root without headers.
        problem = (f"the CUDA toolkit torch found, {cpp_extension.CUDA_HOME}, has no include/cuda_runtime.h "
                   "(is nvcc on PATH a wrapper outside the toolkit?); set CUDA_HOME to the toolkit's root, "
                   "e.g. /usr/local/cuda")
    else:
        version, text = nvcc_version(cpp_extension.CUDA_HOME)
        torch_major = torch.version.cuda.split(".")[0]
        if version is None:
            problem = f"could not read the nvcc version: {text}"
        elif version[0] != torch_major:
            problem = (
                f"CUDA toolkit mismatch: nvcc in {cpp_extension.CUDA_HOME} is {'.'.join(version)}, "
                f"torch was built with CUDA {torch.version.cuda}; point CUDA_HOME at a "
                f"{torch_major}.x toolkit"
            )
    if problem is None:
        note(f"building the CUDA kernels (torch CUDA {torch.version.cuda}, {cpp_extension.CUDA_HOME})")
        return True
    if mode == "1":
        fail(f"PYDIST_CUDA=1 but {problem}")
    note(f"building the CPU part only: {problem}")
    return False


def choose_cuda_archs():
    """torch compiles CUDA code for the GPUs it sees, unless
    TORCH_CUDA_ARCH_LIST names the architectures, and fails where it sees
    none (an IndexError in cpp_extension._get_cuda_arch_flags): a container
    build, a login node, any machine with CUDA torch and nvcc but no GPU. There
    pydist compiles for the architectures this torch was built for, the GPUs
    its own kernels run on (the last one also as PTX, as torch does)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return
    sms = sorted({int(sm) for sm in re.findall(r"sm_(\d+)", torch._C._cuda_getArchFlags())})
    if not sms:
        fail("no GPU is visible and this torch names no CUDA architectures it was built for: set "
             "TORCH_CUDA_ARCH_LIST (e.g. '8.0;9.0') to say which GPUs to compile for, or PYDIST_CUDA=0")
    archs = ";".join(f"{sm // 10}.{sm % 10}" for sm in sms) + "+PTX"
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    note(f"no GPU visible: compiling the CUDA kernels for this torch's architectures, TORCH_CUDA_ARCH_LIST={archs}")


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def extension():
    find_cxx()
    with_cuda = want_cuda()
    cxx_flags = ["-O3", "-fopenmp", "-std=c++17"]
    # torch 2.11+ headers need C++17 at least; newer ones ask for C++20.
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 10):
        cxx_flags[-1] = "-std=c++20"
    srcs = sources("csrc/**/*.cpp")
    kwargs = dict(
        name="pydist._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        # librt: shm_open for glibc before 2.34 (csrc/transport/shm_transport.cpp); a stub after.
        extra_link_args=["-fopenmp", "-lrt"],
    )
    if with_cuda:
        choose_cuda_archs()
        # Files ending _selftest.cu are standalone executables (they have a
        # main); CMakeLists.txt builds them, the extension must not link them.
        srcs += [s for s in sources("csrc/**/*.cu") if not s.endswith("_selftest.cu")]
        return cpp_extension.CUDAExtension(
            sources=srcs,
            define_macros=[("PYDIST_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
            **kwargs,
        )
    srcs = [s for s in srcs if not s.endswith("_cuda.cpp")]
    return cpp_extension.CppExtension(sources=srcs, extra_compile_args={"cxx": cxx_flags}, **kwargs)


class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's ninja build, its objects kept in build/ under the sources.

    pip's builds (``pip install -e .``, editable or not) hand build_ext a fresh
    temporary directory, so every install recompiled every translation unit
    (minutes). In build/temp.<platform>-<python>, the directory
    ``setup.py build_ext --inplace`` uses too, ninja recompiles only the
    sources, and the headers they include, that changed since the last build."""

    def finalize_options(self):
        if self.build_temp is None:
            self.build_temp = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-"
                                           f"{sys.implementation.cache_tag}")
        super().finalize_options()


# Name, version, packages and dependencies live in pyproject.toml; setup.py
# adds only what must be computed: the extension, against the installed torch.
setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
