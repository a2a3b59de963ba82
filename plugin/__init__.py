"""cublade: a vLLM quantization plugin with its own CUDA kernels for NVIDIA Hopper.

Importing the package is light (no vLLM, no extension load); the vLLM side lives in cublade.vllm and is
loaded through the `vllm.general_plugins` entry point."""
__version__ = "0.1.0"
