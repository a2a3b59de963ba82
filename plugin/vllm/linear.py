"""cublade's vLLM linear method: one class for every scheme (fp8, w4a16, mxfp8); the scheme says what the
tensors are, cublade.vllm.kernels says how a layer runs.

Lifecycle of a layer (vLLM calls these in order):
  create_weights   the rank's shapes checked against the scheme's sharding rules (check_partition: K per rank
                   a multiple of the int4 packing, the group size, the MX block; one error naming the rule), then
                   the scheme's tensors as vLLM parameter classes (ModelWeightParameter, Channel/Group/
                   PerTensor scale parameters, PackedvLLMParameter), so vLLM's own loaders shard them for
                   tensor parallelism and place fused shards (q/k/v, gate/up). Each loader is wrapped to
                   check the checkpoint tensor against the scheme (shape, dtype) and record which shards
                   arrived, so a bad checkpoint fails naming the tensor instead of an assert deep in vLLM.
  loading          vLLM's weight loaders, through those wrappers.
  process_weights_after_loading
                   a tensor the scheme needs that never arrived is an error naming it; the tensors are
                   brought to cublade's checkpoint layout (cublade.config.schemes) as one fused matrix:
                   * fp8 per-tensor weight scales of fused shards: one scale per shard cannot ride one GEMM
                     as a scalar. Equal scales stay one scalar; different ones become a per-channel scale
                     vector (each shard's scale repeated over its rows). Exact, unlike vLLM's
                     requantize-to-the-max-scale, and every FP8 kernel here takes per-channel weight scales.
                   * static fp8 input scales of fused shards: their max, as vLLM does (the shards see the
                     same input, so calibration gives them the same scale; the max only matters otherwise);
                   * compressed-tensors layouts (cublade.config.compressed_tensors): [N, 1] FP8 channel
                     scales -> [N]; int4 zero points packed 8 per int32 along N -> uint8 [N, groups];
                   then the kernel selector picks the layer's kernel, which repacks once.
  apply            the kernel.
"""
from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.linear import (LinearMethodBase, MergedColumnParallelLinear, QKVParallelLinear,
                                               register_weight_loader_v2_supported_method)
from vllm.model_executor.parameter import (BasevLLMParameter, ChannelQuantScaleParameter,
                                           GroupQuantScaleParameter, ModelWeightParameter, PackedColumnParameter,
                                           PackedvLLMParameter, PerTensorScaleParameter)
from vllm.model_executor.utils import set_weight_attrs

from cublade.config import Fp8Scheme, MXFP8Scheme, Scheme, W4A16Scheme
from cublade.config import compressed_tensors as ct_format
from cublade.config.format import QuantMethod
from cublade.numerics.constants import INT4_PER_INT32, MX_BLOCK
from cublade.numerics.fp8 import FP8_DTYPE
from cublade.vllm.kernels import select_kernel
from cublade.vllm.kernels.base import replace_parameter

logger = logging.getLogger("vllm.cublade")

QKV_INDEX = {"q": 0, "k": 1, "v": 2}


def _per_rank(dim: str, per_rank, full: int, tp_size: int) -> str:
    """'K=192 per rank (in_features 384 at tensor-parallel size 2)', or 'K=192' on one rank."""
    return f"{dim}={per_rank}" + (f" per rank ({'in' if dim == 'K' else 'out'}_features {full} at tensor-parallel "
                                   f"size {tp_size})" if tp_size > 1 else "")


def check_partition(scheme: Scheme, layer: str, parts: list[int], K: int, K_full: int, N_full: int,
                    tp_size: int = 1, compressed_tensors: bool = False) -> None:
    """The sharding rules of a linear layer's scheme on one tensor-parallel rank: `parts` are the rank's output
    sizes (one per fused shard: vLLM splits each of q/k/v or gate/up along its rows; N_full in all), K its input
    size (K_full over tp_size ranks for a row-parallel layer). A rule broken is one ValueError naming the layer, N
    or K per rank, the tensor-parallel size and the rule. Shapes every rule allows and a kernel's tiles do not are
    the kernel selection's to refuse (docs/kernel-selection.md#tensor-parallelism)."""
    def refuse(rule: str, dim: str, per_rank, full: int) -> ValueError:
        return ValueError(f"{layer}: {_per_rank(dim, per_rank, full, tp_size)} breaks a rule of scheme "
                          f"{scheme.describe()}: {rule}")

    if isinstance(scheme, W4A16Scheme):
        if K % INT4_PER_INT32:
            raise refuse(f"in_features per rank must be a multiple of {INT4_PER_INT32} (int4 values pack "
                         f"{INT4_PER_INT32} per int32 along K)", "K", K, K_full)
        if scheme.group_size != -1 and K % scheme.group_size:
            raise refuse(f"in_features per rank must be a multiple of the group size {scheme.group_size} (a group "
                         f"and its scale live on one rank)", "K", K, K_full)
        if compressed_tensors and not scheme.symmetric and any(p % INT4_PER_INT32 for p in parts):
            raise refuse(f"output features per rank of each fused shard must be multiples of {INT4_PER_INT32} "
                         f"(compressed-tensors packs zero points {INT4_PER_INT32} per int32 along N)", "N",
                         parts if len(parts) > 1 else parts[0], N_full)
    if isinstance(scheme, MXFP8Scheme) and K % MX_BLOCK:
        raise refuse(f"in_features per rank must be a multiple of the MX block {MX_BLOCK} (a block and its E8M0 "
                     f"scale live on one rank)", "K", K, K_full)


@register_weight_loader_v2_supported_method
class CubladeLinearMethod(LinearMethodBase):
    """One layer's method (vLLM makes one per layer through CubladeConfig.get_quant_method): the layer's scheme,
    its name, the checkpoint module names it holds (one, or a fused layer's shards) and the checkpoint's format."""

    def __init__(self, scheme: Scheme, prefix: str, shards: list[str], source: QuantMethod = QuantMethod.CUBLADE):
        self.scheme = scheme
        self.prefix = prefix
        self.shards = shards
        self.ct = QuantMethod(source) is QuantMethod.COMPRESSED_TENSORS
        self.loaded: dict[str, set] = {}  # tensor suffix -> shard ids loaded (None: the whole layer)
        self.param_names: list[str] = []
        self.kernel = None

    # ---- create_weights --------------------------------------------------------------------------------
    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        vllm_loader = extra_weight_attrs.pop("weight_loader")
        N, K = sum(output_partition_sizes), input_size_per_partition
        check_partition(self.scheme, self.prefix, output_partition_sizes, K, input_size, output_size,
                        getattr(layer, "tp_size", 1), self.ct)
        layer.cublade_scheme = self.scheme
        if isinstance(self.scheme, Fp8Scheme):
            from cublade.vllm import fusion

            fusion.install()  # the RMSNorm + quantization fusion, before vLLM's compile backend copies its config
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition, layer.output_size_per_partition = K, N
        layer.params_dtype = params_dtype
        for name, param in self._make_params(output_partition_sizes, K, params_dtype, vllm_loader).items():
            param.weight_loader = self._checked_loader(layer, name, vllm_loader)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
            self.param_names.append(name)

    def _make_params(self, parts: list[int], K: int, params_dtype: torch.dtype, wl) -> dict:
        """suffix -> vLLM parameter (loaded by `wl`), in the checkpoint's layout (cublade's, or
        compressed-tensors' where it differs)."""
        s, N, ct = self.scheme, sum(parts), self.ct
        e = torch.empty
        f: dict = {}
        if isinstance(s, Fp8Scheme):
            f["weight"] = ModelWeightParameter(data=e(N, K, dtype=FP8_DTYPE), input_dim=1, output_dim=0,
                                               weight_loader=wl)
            if s.per_channel:
                shape = (N, 1) if ct else (N,)
                f["weight_scale"] = ChannelQuantScaleParameter(
                    data=e(shape, dtype=torch.float32), output_dim=0, weight_loader=wl)
            else:  # one scale per fused shard; reconciled after loading
                f["weight_scale"] = PerTensorScaleParameter(
                    data=e(len(parts), dtype=torch.float32), weight_loader=wl)
            if s.static:
                f["input_scale"] = PerTensorScaleParameter(
                    data=e(len(parts), dtype=torch.float32), weight_loader=wl)
        elif isinstance(s, W4A16Scheme):
            groups = 1 if s.group_size == -1 else K // s.group_size
            scale_dtype = params_dtype if ct else s.tensor_specs(N, K)["weight_scale"][1]
            f["weight_packed"] = PackedvLLMParameter(
                data=e(N, K // INT4_PER_INT32, dtype=torch.int32), input_dim=1, output_dim=0, packed_dim=1,
                packed_factor=INT4_PER_INT32, weight_loader=wl)
            # Per-channel scales are [N, 1] whatever the rank's K: replicated, never split along K.
            if s.group_size == -1:
                f["weight_scale"] = ChannelQuantScaleParameter(
                    data=e(N, 1, dtype=scale_dtype), output_dim=0, weight_loader=wl)
            else:
                f["weight_scale"] = GroupQuantScaleParameter(
                    data=e(N, groups, dtype=scale_dtype), output_dim=0, input_dim=1, weight_loader=wl)
            if not s.symmetric and ct:
                zshape = (N // INT4_PER_INT32, groups)
                if s.group_size == -1:
                    f["weight_zero_point"] = PackedColumnParameter(
                        data=torch.zeros(zshape, dtype=torch.int32), output_dim=0, packed_dim=0,
                        packed_factor=INT4_PER_INT32, weight_loader=wl)
                else:
                    f["weight_zero_point"] = PackedvLLMParameter(
                        data=torch.zeros(zshape, dtype=torch.int32), input_dim=1, output_dim=0, packed_dim=0,
                        packed_factor=INT4_PER_INT32, weight_loader=wl)
            elif not s.symmetric:
                if s.group_size == -1:
                    f["weight_zero_point"] = ChannelQuantScaleParameter(
                        data=e(N, 1, dtype=torch.uint8), output_dim=0, weight_loader=wl)
                else:
                    f["weight_zero_point"] = GroupQuantScaleParameter(
                        data=e(N, groups, dtype=torch.uint8), output_dim=0, input_dim=1, weight_loader=wl)
            if ct:
                f["weight_shape"] = BasevLLMParameter(data=e(2, dtype=torch.int64), weight_loader=wl)
        elif isinstance(s, MXFP8Scheme):
            f["weight"] = ModelWeightParameter(data=e(N, K, dtype=FP8_DTYPE), input_dim=1, output_dim=0,
                                               weight_loader=wl)
            f["weight_scale"] = GroupQuantScaleParameter(
                data=e(N, K // MX_BLOCK, dtype=torch.uint8), output_dim=0, input_dim=1, weight_loader=wl)
        else:
            raise NotImplementedError(f"{self.prefix}: cublade has no vLLM linear method for scheme "
                                      f"{s.describe()}")
        return f

    # ---- loading ---------------------------------------------------------------------------------------
    def _module(self, shard_id) -> str:
        """Checkpoint module name of a loaded shard."""
        if shard_id is None or isinstance(shard_id, tuple) or len(self.shards) == 1:
            return self.prefix
        idx = QKV_INDEX[shard_id] if isinstance(shard_id, str) else shard_id
        return self.shards[idx] if idx < len(self.shards) else f"{self.prefix}[shard {shard_id}]"

    @staticmethod
    def _rows(layer: torch.nn.Module, shard_id) -> int | None:
        """Full (all ranks) output rows of a checkpoint shard; None where vLLM's layer does not say."""
        if shard_id is None:
            return layer.output_size
        if isinstance(layer, QKVParallelLinear) and shard_id in QKV_INDEX:
            heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
            return heads * (layer.v_head_size if shard_id == "v" else layer.head_size)
        if isinstance(layer, MergedColumnParallelLinear) and isinstance(shard_id, int):
            return layer.output_sizes[shard_id]
        return None

    def expected(self, rows: int, K: int) -> dict[str, tuple[tuple, torch.dtype | None]]:
        """suffix -> (shape, dtype) of a checkpoint tensor for a [rows, K] module; dtype None: any float."""
        if self.ct:
            return ct_format.tensor_specs(self.scheme, rows, K)
        return dict(self.scheme.tensor_specs(rows, K))

    def _checked_loader(self, layer: torch.nn.Module, name: str, vllm_loader):
        def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
            shard_id = args[0] if args else kwargs.get("loaded_shard_id")
            rows = self._rows(layer, shard_id)
            if rows is not None:
                self._check_tensor(f"{self._module(shard_id)}.{name}", loaded_weight,
                                   *self.expected(rows, layer.input_size)[name])
            vllm_loader(param, loaded_weight, *args, **kwargs)
            self.loaded.setdefault(name, set()).add(shard_id)
        return load

    def _check_tensor(self, tensor: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None) -> None:
        got = tuple(t.shape)
        # A one-element scale may be stored as [1] or as a scalar [].
        if got != tuple(shape) and not (tuple(shape) == (1,) and got == ()):
            raise ValueError(f"{tensor}: shape {list(got)} does not match scheme {self.scheme.describe()}, which "
                             f"expects {list(shape)} for this module")
        if dtype is None:
            if not t.is_floating_point() or t.element_size() == 1:
                raise ValueError(f"{tensor}: dtype {t.dtype}, expected a float scale (fp32/bf16/fp16)")
        elif t.dtype != dtype and not (dtype == torch.int64 and not t.is_floating_point()):
            raise ValueError(f"{tensor}: dtype {t.dtype} does not match scheme {self.scheme.describe()}, which "
                             f"expects {dtype}" + (" (an unquantized checkpoint?)" if t.is_floating_point()
                                                   and t.element_size() > 1 else ""))

    def _check_complete(self, layer: torch.nn.Module, names: list[str]) -> None:
        """Every tensor the scheme needs arrived, for every shard."""
        if not any(self.loaded.values()):
            # Nothing was loaded through this layer at all: vLLM's dummy/random weights (--load-format dummy),
            # which set the parameters without the loaders.
            return
        if isinstance(layer, QKVParallelLinear):
            shards = set(QKV_INDEX)
        elif isinstance(layer, MergedColumnParallelLinear):
            shards = set(range(len(layer.output_sizes)))
        else:
            shards = {None}
        for name in names:
            got = self.loaded.get(name, set())
            if None in got:
                continue  # fused on disk: the whole matrix in one tensor
            missing = sorted(shards - got, key=str)
            if missing:
                tensors = ", ".join(f"{self._module(m)}.{name}" for m in missing)
                raise ValueError(f"checkpoint has no {tensors}: scheme {self.scheme.describe()} of "
                                 f"{self.prefix} needs it (quantization_config says this module is quantized)")

    # ---- after loading ---------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_complete(layer, [n for n in self.param_names if n not in ct_format.DESCRIPTIVE])
        for n in self.param_names:  # loading is over: plain Parameters from here on
            if n in ct_format.DESCRIPTIVE:
                replace_parameter(layer, n, None)
            else:
                replace_parameter(layer, n, getattr(layer, n).data)
        s = self.scheme
        if isinstance(s, Fp8Scheme):
            scale = layer.weight_scale.data.float()
            if s.per_channel:
                scale = scale.reshape(-1)
            elif scale.numel() > 1 and bool((scale != scale[0]).any()):
                widths = torch.tensor(layer.logical_widths, device=scale.device)
                scale = torch.repeat_interleave(scale, widths)  # per-tensor shard scales -> per channel
            else:
                scale = scale[:1]
            replace_parameter(layer, "weight_scale", scale.contiguous())
            if s.static:
                replace_parameter(layer, "input_scale", layer.input_scale.data.float().max().reshape(1))
        elif isinstance(s, W4A16Scheme) and not s.symmetric and self.ct:
            replace_parameter(layer, "weight_zero_point", ct_format.unpack_zero_points(
                layer.weight_zero_point.data, layer.output_size_per_partition))
        self.kernel = select_kernel(layer, self.prefix)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.apply(layer, x, bias)


class CubladeLMHeadMethod(CubladeLinearMethod):
    """The output projection (vLLM's ParallelLMHead: the vocabulary's rows split over the ranks, each rank's share
    padded to a multiple of 64 rows) on the scheme's linear kernels; vLLM's LogitsProcessor calls apply(). The
    checkpoint holds the vocabulary's rows only: vLLM's loader fills the padding rows with zeros (weights and
    scales), and the logits of those rows are dropped before sampling."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        if layer.num_added_embeddings:
            raise ValueError(f"{self.prefix}: a quantized lm_head with added vocabulary rows (LoRA extra vocab) is "
                             f"not supported")
        # What the linear method reads from a LinearBase: the checkpoint's rows and the input size
        layer.output_size, layer.input_size = layer.org_vocab_size, input_size
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, **extra_weight_attrs)
