"""What a kernel class is, and the checks the kernel classes share.

A scheme says what the weights are; a kernel says whether it can run a given layer (`can_implement(...) ->
(ok, reason)`) and how (`apply`). The layer a linear kernel sees holds the scheme's tensors in cublade's checkpoint
layout (cublade.config.schemes), as plain Parameters, after cublade.vllm.linear brought them there; an MoE kernel
sees a FusedMoE layer's stacked expert tensors (cublade.vllm.moe). A kernel repacks them once, in its constructor
(called from process_weights_after_loading), and `apply` runs on what it left. Op choices that depend on the device
are made in the constructor too, so `apply` holds no Python dispatch and traces under torch.compile(fullgraph=True),
as vLLM compiles models.
"""
from __future__ import annotations

import os
from typing import Callable, ClassVar

import torch

from cublade.config import FP4Scheme, Scheme
from cublade.ops._dispatch import use_kernel

HALF_DTYPES = (torch.bfloat16, torch.float16)
# cublade's CUDA extension is built for sm_90a (setup.py), whose code runs on sm_90 only.
KERNEL_ARCH = 90


def _capability(device: torch.device) -> int | None:
    """The sm number of a CUDA device (90 for sm_90), None off CUDA."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def on_gpu(device: torch.device) -> bool:
    """True for a CUDA device (through `_capability`, the one place the kernels ask which GPU they are on)."""
    return _capability(device) is not None


def env_switch(name: str) -> bool:
    """An on/off environment switch of the kernel choice: "1" on, "0" or unset off, anything else an error naming it."""
    v = os.environ.get(name, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"


# The opt-in that lets the pure-PyTorch reference run a layer on a GPU (docs/kernel-selection.md#environment).
ALLOW_REFERENCE_ENV = "CUBLADE_ALLOW_REFERENCE"


def batch_invariant() -> bool:
    """vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1)."""
    from vllm import envs

    return bool(envs.VLLM_BATCH_INVARIANT)


def reference_allowed(device: torch.device) -> tuple[bool, str]:
    """(may the reference kernel run a layer on `device`, why). Off a GPU it is the CPU path and always may; on a
    GPU only when asked for with CUBLADE_ALLOW_REFERENCE=1: its fp32 math is many times slower than any
    tensor-core kernel, so a layer no tensor-core kernel takes stops the load instead of running slowly."""
    if not on_gpu(device):
        return True, "pure-PyTorch reference (cublade.ops), the CPU path"
    if os.environ.get(ALLOW_REFERENCE_ENV) == "1":
        return True, f"pure-PyTorch reference on sm_{_capability(device)}, asked for with {ALLOW_REFERENCE_ENV}=1"
    return False, (f"fp32 reference math, on a GPU only when asked for with {ALLOW_REFERENCE_ENV}=1 (many times "
                   f"slower than a tensor-core kernel)")


def gpu_half(layer: torch.nn.Module, device: torch.device) -> tuple[int | None, str]:
    """(the GPU's sm number, "") for a layer on a CUDA device with bf16/fp16 activations, else (None, why not):
    the first two checks of every GPU kernel here."""
    cap = _capability(device)
    if cap is None:
        return None, "needs a CUDA device"
    if layer.params_dtype not in HALF_DTYPES:
        return None, f"takes bf16/fp16 activations, the model runs in {layer.params_dtype}"
    return cap, ""


# cublade._C_sm80's ops (bindings_sm80.cpp: the names ending in _sm80; sm_80 / 86 / 89 machine code, compute_80 PTX)
# run from sm_80 on.
SM80_KERNEL_MIN_ARCH = 80


def why_no_kernel(name: str, device: torch.device) -> str | None:
    """Why cublade's CUDA op `torch.ops.cublade.<name>` cannot run on `device`; None when it can. cublade._C's ops run
    on sm_90 only, cublade._C_sm80's (named *_sm80) from sm_80 on."""
    cap = _capability(device)
    if cap is None:
        return "CPU"
    if name.endswith("_sm80"):
        if cap < SM80_KERNEL_MIN_ARCH:
            return f"needs sm_80 or later, this GPU is sm_{cap}"
        missing = "cublade._C_sm80 is not installed (setup.py builds it where nvcc is)"
    else:
        if cap != KERNEL_ARCH:
            return f"cublade's kernels are built for sm_90a, this GPU is sm_{cap}"
        missing = "cublade's CUDA extension has no such op: not built?"
    if not use_kernel(torch.empty(0, device=device), name):
        return missing
    return None


def cublade_op(name: str, device: torch.device, reference: Callable) -> tuple[Callable, str]:
    """cublade's CUDA op `torch.ops.cublade.<name>` where it can run, else its reference; and a few words
    saying which."""
    why = why_no_kernel(name, device)
    if why is None:
        return getattr(torch.ops.cublade, name), f"cublade's CUDA op {name}"
    return reference, f"the PyTorch reference of {name} ({why})"


def layer_tensors(layer: torch.nn.Module, scheme: Scheme) -> dict[str, torch.Tensor]:
    """The scheme's tensors as the layer holds them (cublade's layout, one fused matrix)."""
    N, K = layer.output_size_per_partition, layer.input_size_per_partition
    return {name: getattr(layer, name) for name in scheme.tensor_specs(N, K)}


def replace_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Set a layer tensor as a Parameter (vLLM's compiled graphs take layer tensors as parameters); None
    removes it."""
    if name in layer._parameters:
        del layer._parameters[name]
    elif hasattr(layer, name):
        delattr(layer, name)
    if value is None:
        return
    if not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    layer.register_parameter(name, value)


class LinearKernel:
    """Runs one layer. Subclasses set `name`, `own` (cublade's own op, or a fallback named as such)."""
    name: ClassVar[str] = ""
    own: ClassVar[bool] = False

    @classmethod
    def can_implement(cls, layer: torch.nn.Module) -> tuple[bool, str]:
        raise NotImplementedError

    def __init__(self, layer: torch.nn.Module):
        self.scheme = layer.cublade_scheme

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class MoEKernel:
    """Runs the experts of one FusedMoE layer. Subclasses set `name`, `own` (as LinearKernel)."""
    name: ClassVar[str] = ""
    own: ClassVar[bool] = True  # cublade's own op (False: a named fallback)

    @classmethod
    def can_implement(cls, layer, scheme: FP4Scheme) -> tuple[bool, str]:
        raise NotImplementedError

    def __init__(self, layer, scheme: FP4Scheme):
        self.scheme = scheme

    def apply(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        raise NotImplementedError


def local_topk_ids(layer, topk_ids: torch.Tensor) -> torch.Tensor:
    """Global expert ids -> this rank's (expert parallel: -1 for experts held elsewhere)."""
    expert_map = getattr(layer, "expert_map", None)
    return topk_ids if expert_map is None else expert_map[topk_ids.long()]
