"""The checkpoint's `quantization_config` (in config.json) and its versioning.

    "quantization_config": {
      "quant_method": "cublade",
      "format_version": 1,
      "preset": "fp8-dynamic",
      "schemes": {"fp8": {"kind": "fp8", "weight_strategy": "channel", "activations": "dynamic-token"}},
      "rules": [{"pattern": ".*", "scheme": "fp8"}],
      "ignore": [".*embed_tokens", "(.*\\.)?lm_head", ".*\\.gate", ".*\\.router"],
      "kv_cache": null
    }

Tensor names and layouts per scheme: cublade.config.schemes (module docstring).
"""
from __future__ import annotations

import json
from pathlib import Path

from cublade.config.policy import Policy
from cublade.numerics.choice import Choice


class QuantMethod(Choice):
    """A checkpoint's quantization_config.quant_method, for the checkpoints cublade reads."""
    CUBLADE = "cublade"  # written by `cublade convert` (this module)
    COMPRESSED_TENSORS = "compressed-tensors"  # FP8 W8A8 / int4 W4A16 ones (cublade.config.compressed_tensors)


QUANT_METHOD = QuantMethod.CUBLADE.value
FORMAT_VERSION = 1


def to_quantization_config(policy: Policy) -> dict:
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, **policy.to_dict()}


def parse_quantization_config(qc: dict) -> Policy:
    """Policy of a checkpoint's quantization_config, with errors naming the bad field."""
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"quantization_config.quant_method is {method!r}, expected {QUANT_METHOD!r}")
    version = qc.get("format_version")
    if not isinstance(version, int):
        raise ValueError(f"quantization_config.format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"quantization_config.format_version={version} was written by a newer cublade; "
                         f"this one reads format_version <= {FORMAT_VERSION}: upgrade cublade")
    return Policy.from_dict(qc)


def read_policy(model_dir: str | Path) -> Policy | None:
    """The cublade policy of a checkpoint directory, or None for an unquantized checkpoint."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    return parse_quantization_config(qc)
