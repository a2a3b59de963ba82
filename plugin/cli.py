"""The `cublade` command: convert checkpoints, measure perplexity, list presets."""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

PRESET_HELP = {
    "fp8-dynamic": "FP8 E4M3 weights per output channel, activations quantized per token at run time",
    "fp8-static": "FP8 weights per channel, activations per tensor with calibrated scales (needs --calib-text)",
    "w4a16": "int4 weights in groups of 128 along K (bf16 scales), bf16/fp16 activations",
    "mxfp8": "MXFP8 weights: E4M3 with one E8M0 scale per 32 along K; bf16 activations on Hopper",
    "fp4-experts-fp8-dense": "MoE experts in MXFP4 (or NVFP4), attention and dense layers in FP8 (per-channel, "
                             "dynamic per-token activations); router, embeddings and lm_head unquantized",
}


# The preset fields the scheme options set (cublade.config.preset's keyword arguments).
SCHEME_OPTIONS = {"group_size": "--group-size", "symmetric": "--asymmetric", "weight_strategy": "--weight-strategy",
                  "activations": "--activations", "scale_rule": "--scale-rule", "format": "--fp4-format",
                  "kv_cache": "--kv-cache", "kv_rounding": "--kv-rounding"}


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500MB, 2GB, 1GiB)")
    unit = (m.group(2) or "B").upper().rstrip("B").replace("I", "")
    return int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[unit])


def _lines(text: str) -> slice:
    from cublade.text import parse_lines

    try:
        return parse_lines(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the prog, the error, where the options are listed), exit status 2, as
    every other error of the CLI; argparse's own prints the whole usage block first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    from cublade.checkpoint import FLOAT_DTYPES
    from cublade.config import PRESETS, Fp4Format, Fp8Activations, KVCacheDtype, KVRounding, ScaleRule, WeightStrategy
    from cublade.config.format import QuantMethod
    from cublade.numerics.constants import W4A16_GROUP_SIZES
    from cublade.ppl import Backend

    dtypes = [str(d).removeprefix("torch.") for d in FLOAT_DTYPES.values()]

    from cublade import __version__

    p = _Parser(prog="cublade", description="cublade: quantize Hugging Face checkpoints for "
                                "vLLM (`vllm serve OUT` then serves them through the cublade plugin) and "
                                "measure their perplexity.")
    p.add_argument("--version", action="version", version=f"cublade {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    presets_text = "\n".join(f"  {k:<22} {v}" for k, v in PRESET_HELP.items())
    c = sub.add_parser("convert", help="quantize a checkpoint (streaming, crash-safe)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Quantize the Hugging Face safetensors checkpoint SRC into a new directory OUT "
                       "with a preset policy. Tensors are streamed one at a time; OUT appears only when the "
                       "conversion is complete.",
                       epilog=f"presets:\n{presets_text}\n\nexample:\n  cublade convert fixtures/models/"
                       "stories260K-padded-hf /tmp/s-fp8 --scheme fp8-dynamic")
    c.add_argument("src", type=Path, help="source checkpoint directory (config.json + *.safetensors)")
    c.add_argument("out", type=Path, help="output directory (must not exist unless --overwrite)")
    which = c.add_mutually_exclusive_group(required=True)
    which.add_argument("--scheme", choices=list(PRESETS), metavar="PRESET",
                       help=f"preset policy: {', '.join(PRESETS)}")
    which.add_argument("--policy", type=Path, metavar="FILE.json",
                       help="a custom policy: JSON with the quantization_config fields 'schemes', 'rules', "
                       "'ignore' and 'kv_cache' (docs/format.md)")
    c.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                   help="leave these modules unquantized (repeatable): a module name or a regular expression "
                   "matched against the whole name (llm-compressor's 're:' prefix is accepted), e.g. "
                   "--ignore lm_head --ignore 're:.*layers\\.0\\..*'; added to the preset's ignore list")
    c.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the output projection (lm_head) too, with the scheme of the rule that matches it; "
                   "the presets leave it unquantized (on the bundled model it adds 0.036 to w4a16's loss, a fifth "
                   "of the other layers' cost; on Llama-3-8B it is 1 GB of bf16 read every decode step). Refused "
                   "for models whose lm_head is tied to the embeddings")
    c.add_argument("--allow-quantized-router", action="store_true",
                   help="let a custom policy quantize MoE routers (refused by default: top-k routing is "
                   "sensitive to small logit changes, and vLLM's Mixtral cannot serve a quantized router)")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (only once the new "
                   "checkpoint is complete)")
    c.add_argument("--max-shard-size", type=_size, default="2GB", help="largest output shard (default 2GB)")
    c.add_argument("--skip-unsupported", action="store_true", help="leave layers whose shape the scheme "
                   "cannot serve unquantized (listed in the checkpoint's ignore list) instead of failing")
    c.add_argument("--dtype", choices=["auto", *dtypes], default="auto",
                   help="dtype of the tensors that stay unquantized (auto: keep the source's)")
    c.add_argument("--format", choices=QuantMethod.values(), default=QuantMethod.CUBLADE.value, dest="out_format",
                   help="checkpoint format: cublade (default; every scheme, served by the cublade plugin) or "
                   "compressed-tensors (fp8 and w4a16 schemes and the FP8 KV cache with K rounded to nearest, "
                   "in the layout vLLM's own compressed-tensors method loads without cublade; --quantization "
                   "cublade serves it on cublade's kernels). docs/format.md#compressed-tensors-output")
    g = c.add_argument_group("scheme options (override the preset's defaults)")
    g.add_argument("--group-size", type=int, choices=W4A16_GROUP_SIZES, help="w4a16 group size along K (-1: "
                   "per output channel; default 128)")
    g.add_argument("--asymmetric", action="store_const", const=False, dest="symmetric",
                   help="w4a16 with zero points (default symmetric)")
    g.add_argument("--weight-strategy", choices=WeightStrategy.values(), help="fp8 weight scale granularity "
                   "(default channel)")
    g.add_argument("--activations", choices=Fp8Activations.values(),
                   help="fp8 activation quantization (default dynamic-token; fp8-static: static-tensor)")
    g.add_argument("--scale-rule", choices=ScaleRule.values(), help="MX scale rule for mxfp8/mxfp4: rceil "
                   "(default, NVIDIA: 2^ceil(log2(amax/max)), never clips) or floor (OCP MX v1.0)")
    g.add_argument("--fp4-format", choices=Fp4Format.values(), dest="format", help="expert format for "
                   "fp4-experts-fp8-dense (default mxfp4)")
    g.add_argument("--kv-cache", choices=KVCacheDtype.values(), help="add an FP8 KV cache with calibrated per-layer "
                   "k_scale/v_scale (needs --calib-text)")
    g.add_argument("--kv-rounding", choices=KVRounding.values(), help="how the FP8 cache write rounds "
                   "K (default nearest: vLLM's bytes). query-aware steers each key's rounding error away from "
                   "its own token's queries: on the bundled model the FP8 KV cost falls from +0.038 to +0.005 "
                   "loss. Same cache format; vLLM serves it with cublade's cache write (--attention-backend "
                   "CUSTOM); `cublade ppl` scores it")
    k = c.add_argument_group("calibration (GPTQ for w4a16, static FP8 input scales, FP8 KV-cache scales)")
    k.add_argument("--calib-text", type=Path, help="text file, one sample per line; with w4a16 this runs GPTQ "
                   "instead of round-to-nearest")
    k.add_argument("--calib-tokens", type=int, help="calibration tokens to use (default: all of the text)")
    k.add_argument("--calib-lines", type=_lines, metavar="START:END", help="use only these lines of the text "
                   "(python slice, e.g. :6)")
    k.add_argument("--device", metavar="DEVICE", help="where calibration runs: cuda, cuda:1, cpu (default: cuda "
                   "when available)")
    c.add_argument("--quant-device", metavar="DEVICE", default="auto", help="where the round-to-nearest "
                   "quantization of each weight runs: auto (default: the GPU where torch sees one, else the CPU), "
                   "cpu, cuda, cuda:1, ... Each weight moves there in turn and its quantized tensors come back; the "
                   "bytes are the same on either; a weight that does not fit the GPU's free memory is quantized on "
                   "the CPU")

    q = sub.add_parser("ppl", help="perplexity of one or more checkpoints on a text file",
                       description="Loss and perplexity of each MODEL on the text (each line: BOS + its "
                       "tokens; non-overlapping windows). With several models, prints a table whose first "
                       "row is the baseline.")
    q.add_argument("models", type=Path, nargs="+", metavar="MODEL", help="checkpoint directories")
    q.add_argument("--text", type=Path, required=True, help="text file, one sample per line")
    q.add_argument("--backend", choices=Backend.values(), default=Backend.REFERENCE.value,
                   help="reference: transformers on CPU through cublade's reference ops (default); "
                   "vllm: vLLM prompt logprobs (GPU)")
    q.add_argument("--lines", type=_lines, metavar="START:END", help="score only these lines (python slice)")
    q.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    q.add_argument("--dtype", default=None, choices=dtypes,
                   help="compute dtype (default: float32 for reference, bfloat16 for vllm)")
    q.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="vllm backend: GPUs to shard the model over (vLLM's --tensor-parallel-size; default 1)")
    q.add_argument("--enable-expert-parallel", action="store_true",
                   help="vllm backend: shard MoE experts over the GPUs instead of each expert's matrices "
                        "(vLLM's --enable-expert-parallel)")
    q.add_argument("--max-model-len", type=int, metavar="N", help="vllm backend: vLLM's --max-model-len "
                   "(default: the window + 1, the positions a window's prompt logprobs need)")
    q.add_argument("--attention-backend", metavar="NAME", help="vllm backend: vLLM's attention backend (default: "
                   "CUSTOM, cublade's FP8 cache write, for a checkpoint whose FP8 KV cache rounds K query-aware; "
                   "vLLM's choice for any other)")

    sub.add_parser("presets", help="list the preset policies")
    sub.add_parser("doctor", help="versions, the GPU, the CUDA extension's state, each op's kernel or reference, "
                   "and the kernel each scheme takes here",
                   description="Prints what this machine gives cublade: versions of cublade, torch, vLLM, CUDA and "
                   "Python; the GPU and its compute capability; whether the CUDA extension is loaded (installed, "
                   "built on first use into the cache, or why not); which ops run a CUDA kernel; and the kernel "
                   "class vLLM's layers would take for each preset's schemes on this GPU.")
    return p


def main(argv: list[str] | None = None) -> int:
    from cublade.extension import ExtensionUnavailable

    args = build_parser().parse_args(argv)
    try:
        _check_options(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "ppl":
            return _ppl(args)
        if args.command == "doctor":
            from cublade.doctor import report

            print("\n".join(report()))
            return 0
        if args.command == "presets":
            for k, v in PRESET_HELP.items():
                print(f"{k:<22} {v}")
            return 0
    except (ValueError, NotImplementedError, OSError, ExtensionUnavailable) as e:
        print(f"cublade {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        what = "; the temporary output was removed and OUT is unchanged" if args.command == "convert" else ""
        print(f"cublade {args.command}: interrupted{what}", file=sys.stderr)
        return 130
    return 1


def _one_line(e: BaseException) -> str:
    """An error as one line: an OS error as its path(s) and the OS's reason, others as their message."""
    import errno

    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        code = f" [{errno.errorcode[e.errno]}]" if e.errno in errno.errorcode else ""
        where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
        return f"{where}: {e.strerror}{code}"
    return " ".join(str(e).split("\n"))


def _check_options(args) -> None:
    """Values that would make no sense, named by their options."""
    if args.command == "convert":
        if args.max_shard_size <= 0:
            raise ValueError(f"--max-shard-size must be positive (got {args.max_shard_size} bytes)")
        if args.calib_text is None:
            given = [o for o, v in (("--calib-tokens", args.calib_tokens), ("--calib-lines", args.calib_lines),
                                    ("--device", args.device)) if v is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} {'sets' if len(given) == 1 else 'set'} how calibration "
                                 f"runs; {'it needs' if len(given) == 1 else 'they need'} --calib-text")
    if args.command == "ppl":
        if args.window < 2:
            raise ValueError(f"--window {args.window}: a window needs at least 2 tokens (one to predict from)")
        if args.max_model_len is not None and args.max_model_len < 2:
            raise ValueError(f"--max-model-len {args.max_model_len}: must be at least 2")
        for m in args.models:
            positions = _max_positions(m)
            if positions is not None and args.window > positions:
                raise ValueError(f"--window {args.window} is longer than {m}'s {positions} positions "
                                 f"(max_position_embeddings in config.json); use --window {positions} or less")


def _max_positions(model: Path) -> int | None:
    import json

    try:
        cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the scorer's own load says what is wrong with the checkpoint
    text = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    n = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return n if isinstance(n, int) and n > 0 else None


def _convert(args) -> int:
    import torch

    from cublade.config import preset
    from cublade.convert import convert

    overrides = {k: getattr(args, k) for k in ("group_size", "symmetric", "weight_strategy", "activations",
                                               "scale_rule", "format", "kv_cache", "kv_rounding")}
    if args.policy is not None:
        given = sorted(k for k, v in overrides.items() if v is not None)
        if given:
            raise ValueError(f"--policy takes its schemes from the file; drop {', '.join(given)}")
        policy = _read_policy(args.policy)
    else:
        if args.kv_rounding is not None and args.kv_cache is None:
            raise ValueError(f"--kv-rounding {args.kv_rounding} sets how the FP8 KV cache is written; it needs "
                             f"--kv-cache fp8")
        try:
            policy = preset(args.scheme, **overrides)
        except ValueError as e:  # the preset's fields, as the options that set them
            msg = str(e)
            for field, option in SCHEME_OPTIONS.items():
                msg = re.sub(rf"\b{field}\b", option, msg)
            raise ValueError(msg) from None
    if args.quantize_lm_head:
        policy = policy.with_lm_head()
    if args.ignore:
        policy = policy.with_ignore(*_ignore_patterns(args.src, args.ignore))
    t0 = time.time()
    out = convert(args.src, args.out, policy, overwrite=args.overwrite, max_shard_bytes=args.max_shard_size,
                  skip_unsupported=args.skip_unsupported, allow_quantized_router=args.allow_quantized_router,
                  dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
                  calib_text=args.calib_text, calib_tokens=args.calib_tokens, calib_lines=args.calib_lines,
                  calib_device=args.device, out_format=args.out_format, quant_device=args.quant_device)
    print(f"wrote {out} ({policy.preset}, {args.out_format} format) in {time.time() - t0:.1f} s")
    return 0


def _ignore_patterns(src: Path, given: list[str]) -> list[str]:
    """--ignore values as the policy's ignore regexes (whole-name matches); each must be a valid regex and match
    at least one module of SRC (a pattern that matches nothing is a typo that would quantize what the user meant
    to keep)."""
    from cublade.checkpoint import tensor_infos

    patterns = [g[3:] if g.startswith("re:") else g for g in given]
    for g, pat in zip(given, patterns):
        try:
            re.compile(pat)
        except re.error as e:
            raise ValueError(f"--ignore {g!r}: not a valid regular expression ({e})") from None
    modules = {name.rsplit(".", 1)[0] for _, name, _, _ in tensor_infos(src)}
    for g, pat in zip(given, patterns):
        if not any(re.fullmatch(pat, m) for m in modules):
            raise ValueError(f"--ignore {g!r} matches no module of {src} (it must match a whole name, e.g. "
                             f"'model.layers.0.mlp.down_proj' or 're:.*down_proj')")
    return patterns


def _read_policy(path: Path):
    import json

    from cublade.config import Policy

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"--policy {path}: cannot read a JSON policy ({_one_line(e)})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--policy {path}: a policy is a JSON object (docs/format.md)")
    try:
        return Policy.from_dict({"preset": f"custom:{path.name}", **d})
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise ValueError(f"--policy {path}: not a valid policy ({type(e).__name__}: {e}; the fields: "
                         f"docs/format.md)") from None


def _ppl(args) -> int:
    from cublade.ppl import Backend, evaluate, format_table

    backend = Backend(args.backend)
    dtype = args.dtype or ("float32" if backend is Backend.REFERENCE else "bfloat16")
    vllm_only = {"--attention-backend": args.attention_backend, "--max-model-len": args.max_model_len,
                 "--tensor-parallel-size": args.tensor_parallel_size if args.tensor_parallel_size != 1 else None,
                 "--enable-expert-parallel": True if args.enable_expert_parallel else None}
    extra = {}
    if backend is Backend.VLLM:
        # counted without initializing CUDA here: vLLM forks its engine from this process
        from cublade.extension import gpu_count

        gpus = gpu_count()
        if gpus == 0:
            raise ValueError("--backend vllm needs a CUDA GPU and this machine has none; --backend reference "
                             "scores the same checkpoint on the CPU")
        if args.tensor_parallel_size < 1 or args.tensor_parallel_size > gpus:
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: this machine has {gpus} GPU(s)")
        extra = {"attention_backend": args.attention_backend, "tensor_parallel_size": args.tensor_parallel_size,
                 "max_model_len": args.max_model_len,
                 "enable_expert_parallel": True if args.enable_expert_parallel else None}
        extra = {k: v for k, v in extra.items() if v is not None}
    else:
        given = [k for k, v in vllm_only.items() if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for --backend vllm")
    results = []
    for m in args.models:
        r = evaluate(m, args.text, backend=backend, lines=args.lines, window=args.window, dtype=dtype, **extra)
        print(f"{m}: loss {r.loss:.4f}  ppl {r.ppl:.3f}  ({r.n_tokens} tokens, {r.backend}, {dtype})", flush=True)
        results.append(r)
    if len(results) > 1:
        print()
        print(format_table(results))
    if backend is Backend.VLLM:
        # Each engine was shut down after its run (ppl._vllm_nll); leave without the interpreter's teardown too,
        # where vLLM 0.26's leftover client threads have aborted a finished run (see _vllm_nll).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
