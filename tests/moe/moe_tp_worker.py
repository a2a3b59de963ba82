"""One rank of the parallel MoE test (test_moe_vllm.py::test_tensor_and_expert_parallel): builds the FusedMoE
layer with cublade's FP4 method at TP or EP = 2 or 4 on CPU (gloo), loads the full checkpoint block (vLLM's loader
takes this rank's rows of w1/w3 and columns of w2, packed bytes and scales alike, or under EP this rank's whole
experts), runs the layer (vLLM all-reduces) and saves the output."""
from __future__ import annotations

import sys

import torch


def run(rank: int, world: int, ep: bool, init_method: str, jobs: list[tuple[str, str, str]]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from cublade.config.schemes import FP4Scheme
    from test_moe_vllm import checkpoint_block, forward, load, make_layer, router
    from vllm_model import cpu_vllm_config

    cfg = cpu_vllm_config()
    cfg.parallel_config.enable_expert_parallel = ep  # each rank holds world / 8 whole experts instead
    with set_current_vllm_config(cfg):
        init_distributed_environment(world, rank, init_method, rank, "gloo")
        initialize_model_parallel(world, 1)
    from pathlib import Path

    for ckpt, fmt, out in jobs:
        layer = make_layer(cfg, FP4Scheme(format=fmt), dtype=torch.float32)
        re_ = layer.routed_experts
        want = (8 // world, 2 * 256) if ep else (8, 2 * 256 // world)  # (experts, w1 and w3 rows) on this rank
        assert tuple(re_.w13_weight_packed.shape[:2]) == want, re_.w13_weight_packed.shape
        load(layer, checkpoint_block(Path(ckpt)))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(37, 128, generator=g)
        y = forward(cfg, layer, x, x @ router(Path(ckpt)).t())
        if rank == 0:
            torch.save(y, out)
    # An intermediate size whose per-rank share breaks the mxfp4 block rule (96 over 2 ranks: 48; over 4: 24): each
    # rank's one-line error, beside the outputs.
    from cublade.config.schemes import UnsupportedShape

    if not ep:  # (expert parallelism splits no expert)
        try:
            make_layer(cfg, FP4Scheme(format="mxfp4"), inter=96)
            refusal = "no error"
        except UnsupportedShape as e:
            refusal = str(e)
        Path(jobs[0][2]).with_name(f"refusal-rank{rank}.txt").write_text(refusal)
    # Tear the groups down before exit: left to the interpreter's exit, gloo's threads were destroyed while still
    # joinable now and then ("terminate called without an active exception", the rank's exit status -6).
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    torch.distributed.barrier()
    destroy_model_parallel()
    destroy_distributed_environment()


if __name__ == "__main__":
    # argv: rank, world size (tp2, tp4: tensor parallel; ep2, ep4: expert parallel), rendezvous, (ckpt fmt out)...
    rank, mode, init_method = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rest = sys.argv[4:]
    run(rank, int(mode[2:]), mode.startswith("ep"), init_method,
        [tuple(rest[i:i + 3]) for i in range(0, len(rest), 3)])
