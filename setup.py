"""cublade: `pip install .` installs the pure-Python package everywhere; where torch with CUDA and nvcc
are present (and the build is not isolated: `pip install --no-build-isolation .`), it also builds the
CUDA extensions: `cublade._C` from plugin/csrc for Hopper (sm_90a), and `cublade._C_sm80` from plugin/csrc/sm80 for
Ampere and Ada (sm_80, sm_86, sm_89 machine code and compute_80 PTX, which the driver compiles for later GPUs).
Set CUBLADE_BUILD_EXT=0 to skip them, =1 to require them."""
import glob
import os
import shutil

from setuptools import setup

HOPPER_ARCH = "-gencode=arch=compute_90a,code=sm_90a"
SM80_ARCH = ("-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_86,code=sm_86 "
             "-gencode=arch=compute_89,code=sm_89 -gencode=arch=compute_80,code=compute_80")


def ext_modules():
    want = os.environ.get("CUBLADE_BUILD_EXT", "auto")
    if want == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        if want == "1":
            raise
        return [], {}
    sources = sorted(glob.glob("plugin/csrc/*.cu")) + sorted(glob.glob("plugin/csrc/*.cpp"))
    have_cuda = torch.version.cuda is not None and shutil.which("nvcc") is not None
    if not sources or not have_cuda:
        if want == "1":
            raise RuntimeError("CUBLADE_BUILD_EXT=1 but torch has no CUDA, nvcc is missing, or no sources")
        return [], {}
    arch = os.environ.get("CUBLADE_CUDA_ARCH", HOPPER_ARCH)
    arch_sm80 = os.environ.get("CUBLADE_CUDA_ARCH_SM80", SM80_ARCH)

    def extension(name: str, sources: list[str], arch: str) -> CUDAExtension:
        # --threads 0: a file built for several targets (the sm_80-89 library's four) compiles them in parallel
        return CUDAExtension(
            name=name,
            sources=sources,
            include_dirs=[os.path.abspath("plugin/csrc")],
            extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                                "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "--threads", "0",
                                         *arch.split()]},
            py_limited_api=False,
        )

    exts = [extension("cublade._C", sources, arch)]
    sm80 = sorted(glob.glob("plugin/csrc/sm80/*.cu")) + sorted(glob.glob("plugin/csrc/sm80/*.cpp"))
    if sm80 and arch_sm80:  # CUBLADE_CUDA_ARCH_SM80="" leaves it out
        exts.append(extension("cublade._C_sm80", sm80, arch_sm80))
    return exts, {"build_ext": BuildExtension}


exts, cmdclass = ext_modules()

setup(
    name="cublade",
    version="0.1.0",
    description="vLLM quantization plugin with CUDA kernels for NVIDIA Hopper: FP8, W4A16, MXFP8, FP4 experts",
    packages=["cublade", "cublade.numerics", "cublade.config", "cublade.ops", "cublade.vllm", "cublade.vllm.kernels",
              "cublade.calib"],
    package_dir={"cublade": "plugin"},
    package_data={"cublade": ["csrc/*.cu", "csrc/*.cuh", "csrc/*.cpp", "csrc/*.h", "csrc/sm80/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "safetensors>=0.4", "tqdm>=4.60", "transformers>=4.50"],
    extras_require={"vllm": ["vllm==0.26.0"], "test": ["pytest>=8"]},
    entry_points={
        "console_scripts": ["cublade=cublade.cli:main"],
        "vllm.general_plugins": ["cublade = cublade.vllm:register"],
    },
    ext_modules=exts,
    cmdclass=cmdclass,
)
