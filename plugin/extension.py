"""Building cublade's CUDA extension on first use, for a Hopper GPU whose install has no `cublade._C`.

`pip install .` without `--no-build-isolation` (or a wheel built without the toolchain) installs cublade without
its extension. On a GPU the kernels target (sm_90: H100, H200) that would run every op on its PyTorch reference,
correct but many times slower, so instead the extension is compiled from the sources shipped in the package
(cublade/csrc) with torch.utils.cpp_extension.load, with setup.py's flags, into a cache directory keyed by
torch, CUDA, Python, the architecture and the sources, and loaded from there by every later process. A file
lock makes the processes vLLM starts (one per GPU) wait for one build. When it cannot build (no nvcc, no ninja,
a compile error) it stops with one line naming the fix; running on the references takes an explicit
CUBLADE_DISABLE_KERNELS=1. Off Hopper and on CPU machines nothing is built: the references run, as they must.

Environment: CUBLADE_EXT_CACHE (the cache root; default $XDG_CACHE_HOME/cublade/ext, else ~/.cache/cublade/ext),
MAX_JOBS (parallel compiler jobs, as for torch's builds), CUDA_HOME (the toolkit).
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
from pathlib import Path

import torch

# setup.py's flags (CUDAExtension there, torch.utils.cpp_extension.load here). An explicit -gencode keeps torch
# from adding the visible GPU's plain sm_90, whose code cannot hold the wgmma instructions.
ARCH = "sm_90a"
ARCH_FLAG = "-gencode=arch=compute_90a,code=sm_90a"
CXX_FLAGS = ["-O3", "-std=c++17"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", ARCH_FLAG]
KERNEL_CAPABILITY = (9, 0)  # sm_90a code runs on sm_90 only
CSRC = Path(__file__).resolve().parent / "csrc"
LIBRARY = "_C.so"
# Wall time of the first-use build with 16 parallel nvcc jobs on a 16-core H200 machine (scripts/jit_check.sh: 151 s);
# the build is a handful of template-heavy translation units, so fewer jobs take proportionally longer.
BUILD_SECONDS_16_JOBS = 150


def build_estimate(jobs: int) -> str:
    """'about N minutes' for `jobs` parallel nvcc jobs."""
    minutes = math.ceil(BUILD_SECONDS_16_JOBS * max(1.0, 16 / max(jobs, 1)) / 60)
    return f"about {minutes} minutes"
FIX = ("install a cublade wheel built with the extension (bash scripts/build_wheel.sh), or "
       "`pip install --no-build-isolation .` from the source tree where nvcc is installed; "
       "CUBLADE_DISABLE_KERNELS=1 runs the PyTorch references instead (many times slower)")


class ExtensionUnavailable(RuntimeError):
    """This GPU runs cublade's kernels but the extension is neither installed nor buildable here."""


def sources() -> list[Path]:
    """The extension's sources, as setup.py lists them."""
    return sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.cpp"))


def cache_root() -> Path:
    if os.environ.get("CUBLADE_EXT_CACHE"):
        return Path(os.environ["CUBLADE_EXT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cublade" / "ext"


def cache_key() -> str:
    """torch / CUDA / Python / architecture / a digest of the sources (headers included): a build for any other
    of these is a different directory, never a stale library."""
    digest = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cu", ".cuh", ".cpp", ".h"):
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    torch_version = torch.__version__.replace("+", "-")
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    return f"torch{torch_version}-cuda{torch.version.cuda}-py{py}-{ARCH}-{digest.hexdigest()[:12]}"


def cache_dir() -> Path:
    return cache_root() / cache_key()


def _vllm_platform():
    """vLLM's current platform where vLLM imports here, else None. It asks NVML, so it never initializes CUDA in a
    process that forks vLLM's engine later (which would then fail: "Cannot re-initialize CUDA in forked
    subprocess")."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001  (no vLLM, or one that does not import here)
        return None
    return current_platform


def gpu_capability() -> tuple[int, int] | None:
    """(major, minor) of the first visible CUDA GPU, None without one or with a CPU build of torch; through vLLM's
    platform where vLLM is installed, else through torch."""
    if torch.version.cuda is None:
        return None
    platform = _vllm_platform()
    if platform is not None:
        if not platform.is_cuda():
            return None
        cap = platform.get_device_capability()
        return None if cap is None else (cap.major, cap.minor)
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))


def gpu_count() -> int:
    """Visible CUDA GPUs, counted the way gpu_capability asks."""
    if torch.version.cuda is None:
        return 0
    platform = _vllm_platform()
    if platform is None:
        return torch.cuda.device_count()
    return platform.device_count() if platform.is_cuda() else 0


def kernels_target_this_gpu() -> bool:
    return gpu_capability() == KERNEL_CAPABILITY


def _toolchain_problem() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    if nvcc is None or not nvcc.exists():
        if shutil.which("nvcc") is None:
            return "nvcc not found (no CUDA toolkit: set CUDA_HOME or put nvcc on PATH)"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts its binary beside the interpreter)
        except ImportError:
            return "ninja not found (pip install ninja)"
    return None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_or_build() -> Path:
    """Load the extension from the cache, building it there first if needed (under a lock); the library's path.
    Raises ExtensionUnavailable with one line when it cannot be built."""
    d = cache_dir()
    lib = d / LIBRARY
    if not lib.exists():
        problem = _toolchain_problem()
        if problem is not None:
            raise ExtensionUnavailable(f"cublade: this GPU (sm_90) runs cublade's CUDA kernels, but cublade._C is "
                                       f"not installed and cannot be built here: {problem}. Fix: {FIX}")
        _build(d)
    try:
        torch.ops.load_library(str(lib))
    except OSError as e:
        raise ExtensionUnavailable(f"cublade: cannot load the cached extension {lib} ({e}); remove {d} to build "
                                   f"it again") from None
    return lib


def _build(d: Path) -> None:
    from filelock import FileLock  # a dependency of torch

    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExtensionUnavailable(f"cublade: cannot create the extension cache {d}: {e.strerror or e}; set "
                                   f"CUBLADE_EXT_CACHE to a writable directory") from None
    with FileLock(str(d / "build.lock")):
        if (d / LIBRARY).exists():  # another process built it while this one waited
            return
        jobs = os.environ.get("MAX_JOBS", "")
        jobs = int(jobs) if jobs.isdigit() else os.cpu_count() or 1
        _say(f"cublade: building the CUDA extension for {ARCH} into {d} (once per torch / CUDA / Python; "
             f"{build_estimate(jobs)} with MAX_JOBS={jobs}; other processes wait for it)")
        from torch.utils.cpp_extension import load

        log = d / "build.log"
        try:
            load(name="_C", sources=[str(s) for s in sources()], extra_include_paths=[str(CSRC)],
                 extra_cflags=CXX_FLAGS, extra_cuda_cflags=NVCC_FLAGS, build_directory=str(d),
                 is_python_module=True, verbose=False)  # linked and defined as setup.py's cublade._C
        except Exception as e:  # noqa: BLE001  (the compiler's output goes to the log, the reason to one line)
            log.write_text(f"{type(e).__name__}: {e}\n")
            raise ExtensionUnavailable(f"cublade: building the CUDA extension into {d} failed (compiler output in "
                                       f"{log}). Fix: {FIX}") from None
        _say(f"cublade: built {d / LIBRARY}")
