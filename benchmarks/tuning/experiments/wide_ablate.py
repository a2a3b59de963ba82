"""Ablation builds of the W4A16 wide kernel, for the tuning sweep only (never production): rewrites a copy of
plugin/csrc so the wide kernel skips part of its work, to see what bounds each configuration.

    python benchmarks/tuning/experiments/wide_ablate.py MODE SRC_DIR OUT_DIR
    nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I OUT_DIR benchmarks/tuning/w4a16_wide.cu ...

MODE no-mma: the consumers dequantize every batch as production does but issue no wgmma (the dequantized words
are XOR-ed into one accumulator so the work stays). MODE no-math: they only wait for each stage, read one word of
it and release it (the copy pipeline alone: bulk copies, mbarriers, ring depth as production). MODE no-x: the
producer copies no x (the consumers multiply whatever x the stage holds). MODE no-copy: it copies nothing and
arrives on each stage with no bytes (the consumers' math and the ring's handshakes alone). MODE no-dequant: A is
a lane-dependent constant instead of the dequantized packets (the mma's, the fold and the ring). MODE no-fold
(after no-dequant): the mma's sum into acc and are waited for once a stage (no fold). Modes combine by
running the script on its own output. The outputs are garbage ("FAIL" in the sweep's check column); only the times mean
anything.
Used in the eighth session (benchmarks/runs/2026-11-22-2345-*, -2355-*, 2026-11-23-0001-*).
"""
import pathlib
import shutil
import sys

BATCH_MMA = ("        wgmma::fence();\n#pragma unroll\n        for (int k = 0; k < 8; ++k) {\n"
             "          // k-step 8b + k")
BATCH_END = "          wgmma::fence_regs(acc);\n        }\n"
LOOP = "#pragma unroll\n      for (int b = 0; b < KS / 128; ++b) {\n"


def ablate(text: str, mode: str) -> str:
    begin = text.index(BATCH_MMA)
    end = text.index(BATCH_END, begin) + len(BATCH_END)
    if mode == "no-mma":
        return text[:begin] + (
            "        uint32_t h = 0;  // ablation: the dequant stays, no mma\n"
            "#pragma unroll\n"
            "        for (int k = 0; k < 8; ++k) h ^= a[k][0] ^ a[k][1] ^ a[k][2] ^ a[k][3];\n"
            "        acc[b % ND] += __uint_as_float(h & 1u);\n") + text[end:]
    if mode == "no-math":
        loop = text.rindex(LOOP, 0, begin)
        ring = ("      for (int b = 0; b < KS / 128; ++b)  // ablation: the ring alone\n"
                "        acc[b % ND] += __uint_as_float(lowbit::lds128(tb + 2 * b * 512 + lane * 16).x & 1u);\n"
                "      if (false) {\n      for (int b = 0; b < 0; ++b) {\n")
        # the dead loop keeps the old body and its own closing brace; one more closes the `if`
        return text[:loop] + ring + text[loop + len(LOOP):end] + "      }\n" + text[end:]
    if mode == "no-x":
        tx = "      const uint32_t stage_tx = ngroups * Lay::kGroupBytes + Lay::kXBytes;\n"
        act = "      auto activations = [&](int c, int s) {\n"
        assert tx in text and act in text
        text = text.replace(tx, "      const uint32_t stage_tx = ngroups * Lay::kGroupBytes;  // ablation: no x\n")
        return text.replace(act, act + "        if (true) return;  // ablation: no x\n")
    if mode == "no-copy":  # the producer arrives on each stage with no bytes: the consumers' math (and the
        # ring's handshakes) on whatever the shared memory holds
        tx = "      const uint32_t stage_tx = ngroups * Lay::kGroupBytes + Lay::kXBytes;\n"
        assert tx in text
        text = text.replace(tx, "      const uint32_t stage_tx = 0;  // ablation: no copies\n")
        for lam in ("      auto weights = [&](int c, int s) {  // stage c's blocks of the CTA's tile groups\n",
                    "      auto activations = [&](int c, int s) {\n"):
            assert lam in text
            text = text.replace(lam, lam + "        if (true) return;  // ablation: no copies\n")
        return text
    if mode == "no-dequant":  # the consumers skip the packets' loads and dequant: A is a lane-dependent constant
        deq = text.rindex("#pragma unroll\n        for (int pk = 0; pk < 2; ++pk) {\n", 0, begin)
        return text[:deq] + (
            "#pragma unroll\n        for (int k = 0; k < 8; ++k)  // ablation: no dequant\n"
            "#pragma unroll\n          for (int j = 0; j < 4; ++j) a[k][j] = 0x3C003C00u ^ (lane << 3) ^ (4 * k + j);\n"
        ) + text[begin:]
    if mode == "no-fold":  # with no-dequant only (A must not change under running mma's): the batches' mma's sum
        # into acc and are not waited for until the stage ends (no part, no fold): the tensor cores' rate alone
        assert "// ablation: no dequant" in text, "no-fold needs no-dequant first"
        mma = "          else wgmma::MmaRS<T, NTOK>::run(part, a[k], desc, k);  // k = 0: part = A * B\n"
        assert mma in text
        text = text.replace(mma, "          else wgmma::MmaRS<T, NTOK>::run(acc, a[k], desc, 1);  // ablation\n")
        begin = text.index("        wgmma::commit();\n        wgmma::wait<0>();\n")
        end = text.index(BATCH_END, begin) + len(BATCH_END)
        text = text[:begin] + "        wgmma::commit();  // ablation: no wait, no fold\n" + text[end:]
        rel = "      __syncwarp();\n      if (lane == 0) lowbit::mbar_arrive(empty + s);\n"
        assert rel in text
        wait = "      wgmma::wait<0>();  // ablation: once a stage\n      wgmma::fence_regs(acc);\n"
        return text.replace(rel, wait + rel, 1)
    sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    mode, src, out = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
    shutil.copytree(src, out, dirs_exist_ok=True)
    path = out / "w4a16_gemm.cu"
    path.write_text(ablate(path.read_text(), mode))
    print(f"{mode}: {path}")
