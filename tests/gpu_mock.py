"""A GPU of a given compute capability as cublade's kernel selection and vLLM's kernel checks see it, on a CPU
machine: the selection's own device query (cublade.vllm.kernels.base._capability), vLLM's platform capability
queries, and the two answers that come from vLLM's compiled ops (CUTLASS FP8 support, the Marlin MoE op's presence).
The kernels' real `can_implement` logic runs on top; nothing is constructed (that needs the GPU)."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def mocked_gpu(monkeypatch, cap: int, extension: bool = True):
    """Within the block every device is a GPU of capability `cap` (80 = sm_80). `extension`: cublade's CUDA
    extension is built (its ops are found on sm_90, the arch it is built for)."""
    import vllm._custom_ops as vllm_ops
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from cublade.vllm.kernels import base

    def as_int(c):
        return c if isinstance(c, int) else c[0] * 10 + c[1]

    monkeypatch.setattr(base, "_capability", lambda device: cap)
    monkeypatch.setattr(base, "use_kernel", lambda x, name: extension)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability",
                        lambda device_id=0: DeviceCapability(cap // 10, cap % 10))
    monkeypatch.setattr(current_platform, "has_device_capability", lambda c, device_id=0: cap >= as_int(c))
    monkeypatch.setattr(current_platform, "is_device_capability", lambda c, device_id=0: cap == as_int(c))
    monkeypatch.setattr(current_platform, "import_kernels", lambda: None)
    # vLLM's C++ answer: CUTLASS FP8 GEMMs from sm_89 (Ada) on.
    monkeypatch.setattr(vllm_ops, "cutlass_scaled_mm_supports_fp8", lambda c: c >= 89, raising=False)
    lib = None
    if not hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm"):  # the op vLLM's fused Marlin MoE calls
        lib = torch.library.Library("_moe_C", "FRAGMENT")
        lib.define("moe_wna16_marlin_gemm(Tensor x) -> Tensor")
    try:
        yield
    finally:
        if lib is not None:
            lib._destroy()
