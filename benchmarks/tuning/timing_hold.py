"""What holding the stream does to a kernel timed with CUDA events (cublade.vllm.kernels.measured.HOLD_CYCLES).

    python benchmarks/tuning/timing_hold.py

Prints how long torch.cuda._sleep(cycles) holds the stream, how long the 256 MB L2 flush takes, and the time of one
bf16 GEMM (16 x 4096 @ 4096 x 28672) timed after the flush with 0 / 50 / 150 us of host work between its start event
and its launch (as a Python op's dispatch puts there): unheld, host work longer than the flush counts; held by
HOLD_CYCLES, the timing stays the kernel's own while the host work is shorter than the hold. Last, the same GEMM
through the load-time timing (time_rows, one CUDA graph replay a call) with 0 and 400 us of host work inside the
call: a replay leaves the host work out whatever its length."""
from __future__ import annotations

import statistics
import time

import torch

from cublade.vllm.kernels.measured import FLUSH_BYTES, HOLD_CYCLES, time_rows


def busy(us: float) -> None:
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e6 < us:
        pass


def main() -> None:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def median_us(fn, host_us: float = 0.0, before=None, n: int = 20) -> float:
        out = []
        for _ in range(n):
            if before:
                before()
            start.record()
            busy(host_us)
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        return statistics.median(out)

    torch.cuda._sleep(1000)
    for cycles in (50_000, 100_000, HOLD_CYCLES, 2 * HOLD_CYCLES):
        print(f"_sleep({cycles}): {median_us(lambda: torch.cuda._sleep(cycles)):.1f} us")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    print(f"flush {FLUSH_BYTES >> 20} MB: {median_us(flush.zero_):.1f} us")
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)
    w2 = w[:4096]
    gemm = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    gemm2 = lambda: torch.nn.functional.linear(x, w2)  # noqa: E731
    held = lambda: (flush.zero_(), torch.cuda._sleep(HOLD_CYCLES))  # noqa: E731
    for host in (0, 50, 150):
        print(f"linear 16x4096x28672 with {host} us of host work first: unheld "
              f"{median_us(gemm, host, flush.zero_):.1f} us, held {median_us(gemm, host, held):.1f} us")
    slow = {host: lambda a, host=host: (busy(host), torch.nn.functional.linear(a, w2))[1] for host in (0, 400)}
    times = time_rows(slow, 4096, torch.bfloat16, torch.device("cuda"), rows=(16, 256))
    print(f"linear Mx4096x4096 in time_rows, 0 / 400 us of host work in the call: {times} us")
    print(f"  the same held, not graphed: 0 us {median_us(gemm2, 0, held):.1f}, "
          f"400 us {median_us(gemm2, 400, held):.1f} us (M=16)")


if __name__ == "__main__":
    main()
