"""The format math: constants and pure-PyTorch arithmetic of the number formats cublade stores (FP8 E4M3,
the E8M0 block scales of MXFP8 / MXFP4, NVFP4, int4 groups), and the reference linears and experts over them.

Plain PyTorch on any device: nothing here loads cublade's CUDA extension (cublade.ops does) or knows vLLM or
the checkpoint format (cublade.config). The op references in cublade.ops call into these modules."""
