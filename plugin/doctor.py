"""`cublade doctor`: what this machine gives cublade. Versions (cublade, torch, vLLM, CUDA, Python), the GPU and its
compute capability, the CUDA extension's state, which ops run their CUDA kernel and which their PyTorch reference,
and the kernel class each preset's schemes would take for a linear layer (or MoE experts) on this GPU: the
selector's own candidates (cublade.vllm.kernels.CANDIDATES) asked on a stand-in layer with the scheme's tensors
at a typical shape, so it answers without a model."""
from __future__ import annotations

import re
import shutil
import sys
from importlib.metadata import PackageNotFoundError, version

import torch

# Stand-in shapes: a 4096 x 4096 bf16 linear; 8 MoE experts of hidden size and intermediate size 1024.
LINEAR_NK = (4096, 4096)
MOE_EHI = (8, 1024, 1024)


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def op_names() -> list[str]:
    """Every op of the extension, from the schemas in bindings.cpp (shipped with the package)."""
    from cublade.extension import CSRC

    return re.findall(r'm\.def\("(\w+)\(', (CSRC / "bindings.cpp").read_text())


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _section(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [title] + [f"  {k:<{width}}  {v}" for k, v in rows]


def versions() -> list[tuple[str, str]]:
    import cublade
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = shutil.which("nvcc") or (f"{CUDA_HOME}/bin/nvcc" if CUDA_HOME else None)
    return [("cublade", f"{cublade.__version__} ({cublade.__path__[0]})"),
            ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})"),
            ("vLLM", _version("vllm")),
            ("Python", sys.version.split()[0]),
            ("nvcc", nvcc or "not found (needed only to build the extension)")]


def gpu() -> list[tuple[str, str]]:
    if not torch.cuda.is_available():
        return [("GPU", "none (CPU machine: every op runs its PyTorch reference)")]
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    target = "cublade's kernels run here" if (major, minor) == (9, 0) else \
        "cublade's kernels are sm_90a only: vLLM's kernels or cublade's references run here"
    return [("GPU", f"{name} x{torch.cuda.device_count()}, sm_{major}{minor} ({target})")]


def extension() -> list[tuple[str, str]]:
    from cublade import extension

    try:
        from cublade.ops import _dispatch
    except extension.ExtensionUnavailable as e:
        return [("extension", f"missing: {e}")]
    sm80 = _dispatch.sm80_extension_path()
    sm80_row = ("sm_80 kernels", f"loaded: {sm80}" if sm80 else
                "cublade._C_sm80 not installed (its kernels run sm_80-89 layers; setup.py builds it where nvcc is)")
    if _dispatch.extension_path():
        where = _dispatch.extension_path()
        how = "built on first use into the cache" if where and where.startswith(str(extension.cache_root())) else \
            "installed"
        return [("extension", f"loaded, {how}: {where}"), sm80_row]
    why = _dispatch.extension_load_error()
    if why == "CUBLADE_DISABLE_KERNELS=1":
        state = "not loaded: CUBLADE_DISABLE_KERNELS=1 (every op runs its PyTorch reference)"
    else:
        here = "no GPU" if not torch.cuda.is_available() else "cublade's kernels are sm_90a only"
        state = f"not installed ({why}); not needed here ({here})"
    return [("extension", state), sm80_row, ("cache", f"{extension.cache_dir()} (where a Hopper GPU builds it)")]


def ops() -> list[tuple[str, str]]:
    from cublade.vllm.kernels.base import why_no_kernel

    device = _device()
    rows = []
    for name in op_names():
        why = why_no_kernel(name, device)
        if why is None:
            rows.append((name, "CUDA kernel"))
        else:
            rows.append((name, f"PyTorch reference ({'no GPU' if why == 'CPU' else why})"))
    return rows


def _stand_in(scheme, device: torch.device):
    """A layer-like object with the scheme's tensors (zeros) at a typical shape, for can_implement."""
    from types import SimpleNamespace

    from cublade.config import FP4Scheme

    if isinstance(scheme, FP4Scheme):
        E, H, I = MOE_EHI
        t = {}
        for prefix, (n, k) in (("w13", (2 * I, H)), ("w2", (H, I))):
            for s, (shape, dtype) in scheme.tensor_specs(n, k).items():
                t[f"{prefix}_{s}"] = torch.zeros((E, *shape), dtype=dtype, device=device)
            t[f"{prefix}_weight_global_scale"] = torch.ones(E, 2, device=device)
        return SimpleNamespace(params_dtype=torch.bfloat16, **t)
    N, K = LINEAR_NK
    t = {s: torch.zeros(shape, dtype=dtype, device=device) for s, (shape, dtype) in scheme.tensor_specs(N, K).items()}
    return SimpleNamespace(params_dtype=torch.bfloat16, output_size_per_partition=N, input_size_per_partition=K,
                           cublade_scheme=scheme, **t)


def kernel_choices() -> list[tuple[str, str]]:
    from cublade.config import PRESETS, FP4Scheme, preset

    try:
        from cublade.vllm.kernels import CANDIDATES, first_runnable
    except ImportError as e:
        return [("(all)", f"cannot tell: vLLM is not importable ({e})")]
    device = _device()
    rows, seen = [], set()
    for name in PRESETS:
        for _, scheme in preset(name).schemes:
            if scheme.describe() in seen:
                continue
            seen.add(scheme.describe())
            layer = _stand_in(scheme, device)
            args = (layer, scheme) if isinstance(scheme, FP4Scheme) else (layer,)

            def ask(k):
                try:
                    return k.can_implement(*args)
                except Exception as e:  # noqa: BLE001  (a check that needs more than the stand-in has)
                    return False, f"cannot tell without a real layer ({type(e).__name__}: {e})"

            k, reason, skipped = first_runnable(CANDIDATES[type(scheme)], ask)
            what = "MoE experts" if isinstance(scheme, FP4Scheme) else "linear"
            choice = f"{k.name}{'' if k.own else ' (fallback)'}: {reason}" if k else "none"
            passed = f"; passed over {'; '.join(skipped)}" if skipped else ""
            rows.append((f"{scheme.describe()} {what}", choice + passed))
    return rows


def report() -> list[str]:
    lines = _section("versions", versions()) + _section("GPU", gpu())
    lines += _section("CUDA extension", extension())
    lines += _section("ops", ops())
    lines += _section(f"kernel per scheme on {_device().type.upper()} (bf16 activations; a stand-in "
                      f"{LINEAR_NK[0]}x{LINEAR_NK[1]} linear, {MOE_EHI[0]} experts of {MOE_EHI[1]}x{MOE_EHI[2]})",
                      kernel_choices())
    lines.append("  (on each GPU generation: docs/kernel-selection.md#by-gpu)")
    return lines
