"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1) for the w4a16 checkpoint format.

For one linear layer with weight W [N, K] and the Hessian of its layer-wise squared error on the calibration
inputs, H = 2 X^T X / n [K, K], GPTQ quantizes W one input column at a time, in a fixed order, and after
each column spreads that column's rounding error over the columns not yet quantized, weighted by the
inverse Hessian, so that the layer's output on the calibration inputs moves as little as possible:

    H <- H + damp * mean(diag H) * I                      (dampening keeps the Cholesky stable)
    U  = upper Cholesky factor of H^-1                   (row i of U holds what column i's error feeds)
    for each column i:  q_i = quant(w_i);  e_i = (w_i - q_i) / U[i, i];  w_j -= e_i * U[i, j]  (j > i)

"Lazy batch updates" (Sec. 3, step 2): the updates inside a block of B columns are applied at once per
column to that block only; the rest of W gets the block's accumulated errors in one matmul at the end of
the block (same result, far fewer memory passes).

Quantization grid: the checkpoint's, through `cublade.numerics.int4.group_params` / `quantize_groups`, so the
packed nibbles, bf16 scales and zero points are exactly what `int4_dequant_weight` decodes. Groups are
contiguous runs of `group_size` input columns (the format cannot describe a per-column group index):
  * in natural order, a group's scale/zero is computed when its first column comes up, from the group's
    columns as the error feedback has left them (the paper's grouping; the block size is a multiple of the
    group size, so the whole group sits in the current block and already carries every earlier update);
  * with act_order (columns taken in order of decreasing H diagonal, the paper's "act-order" heuristic for
    outlier-heavy layers), the columns of one group are quantized at scattered times, so all group params
    are computed up front from the original weight ("static groups"), then each column uses its group's.
Group size -1 (one group per row) always uses params from the original weight, as the reference code does.
Each group's scale comes from a small range search (`search_group_params`, the reference quantizer's `mse`
option) rather than the plain abs-max; `clip_grid=0` gives the paper's plain GPTQ.

Columns whose input is always zero on the calibration data (diag H = 0: the padded model has such
columns) get H[i, i] = 1: they are rounded to nearest and pass no error on. Unlike the reference code we do
not zero their weights: an input dead on the calibration text need not be dead elsewhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cublade.numerics.constants import INT4_SYM_OFFSET
from cublade.numerics.int4 import group_params, pack_int4, quantize_groups


@dataclass(frozen=True)
class GPTQConfig:
    """damp_percent: dampening as a fraction of the mean Hessian diagonal (the paper's 1%).
    act_order: quantize columns in order of decreasing Hessian diagonal (static groups, see above).
    block_size: lazy-batch width, rounded down to a multiple of the group size.
    clip_grid, clip_min, clip_norm, clip_weighted: range search for each group's scale (see
    `search_group_params`); clip_grid=0 turns it off (plain abs-max scales, as round-to-nearest)."""
    damp_percent: float = 0.01
    act_order: bool = True
    block_size: int = 128
    clip_grid: int = 100
    clip_min: float = 0.8
    clip_norm: float = 2.4
    clip_weighted: bool = True

    def __post_init__(self):
        if not 0.0 < self.damp_percent < 1.0:
            raise ValueError(f"gptq: damp_percent={self.damp_percent} must be in (0, 1) (fraction of the mean "
                             f"Hessian diagonal, e.g. 0.01)")
        if self.block_size < 1:
            raise ValueError(f"gptq: block_size={self.block_size} must be >= 1")
        if self.clip_grid < 0 or not 0.0 < self.clip_min <= 1.0 or self.clip_norm <= 0:
            raise ValueError(f"gptq: clip_grid={self.clip_grid} must be >= 0, clip_min={self.clip_min} in (0, 1], "
                             f"clip_norm={self.clip_norm} > 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def search_group_params(w: torch.Tensor, group_size: int, symmetric: bool, config: GPTQConfig,
                        col_weight: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group (scale, zero) of w [N, K] on the checkpoint's grid, the group's range shrunk by the factor
    f in {1, 1 - 1/grid, ..., clip_min} that minimizes sum_j c_j |w_j - q_j|^clip_norm over the group
    (c_j = col_weight[j], the Hessian diagonal when clip_weighted, else 1).

    Why: the abs-max scale spends the grid on the group's largest weight; a slightly smaller scale clips
    that weight a little and rounds every other one finer. This is the reference GPTQ quantizer's `mse`
    option (grid 100, max shrink 0.8, norm 2.4); weighting by diag(H) scores each weight's rounding error
    by how much its input moves the layer's output. Measured on the bundled model (w4a16 g128, calibrated
    on lines 0:6, scored on 6:): see tests/calib/test_calib_model.py."""
    if config.clip_grid == 0:
        return group_params(w, group_size, symmetric)
    N, K = w.shape
    G = K if group_size == -1 else group_size
    wg = w.float().reshape(N, K // G, G)
    c = None if col_weight is None else col_weight.float().reshape(1, K // G, G)
    best = best_s = best_z = None
    for k in range(int(round((1 - config.clip_min) * config.clip_grid)) + 1):
        s, z = group_params(w * (1 - k / config.clip_grid), group_size, symmetric)
        # |dequantized - w|^norm in place on one fp32 temporary (the same operations as out of place)
        e = quantize_groups(w, s, z, group_size).reshape(N, K // G, G).float()
        e.sub_(INT4_SYM_OFFSET if z is None else z.float().unsqueeze(-1)).mul_(s.float().unsqueeze(-1)).sub_(wg)
        e.abs_().pow_(config.clip_norm)
        err = (e if c is None else e.mul_(c)).sum(-1)
        del e
        if best is None:
            best, best_s, best_z = err, s, z
            continue
        better = err < best
        best = torch.where(better, err, best)
        best_s = torch.where(better, s, best_s)
        if z is not None:
            best_z = torch.where(better, z, best_z)
    return best_s, best_z


@dataclass
class GPTQResult:
    tensors: dict[str, torch.Tensor]  # weight_packed, weight_scale[, weight_zero_point] (checkpoint format)
    dequant: torch.Tensor  # fp32 [N, K]: the weight the checkpoint decodes to
    damp: float  # dampening actually added (absolute), after any retries


def _upper_cholesky_of_inverse(hessian: torch.Tensor, perm: torch.Tensor | None, dead: torch.Tensor,
                               damp_percent: float, name: str) -> tuple[torch.Tensor, float]:
    """U with U^T U = (H + damp I)^-1, upper triangular, for H = `hessian` with its rows and columns in the order
    `perm` (None: as they are) and the diagonal of the `dead` columns (in that order) set to 1. A Hessian that is
    not positive definite after dampening (rank-deficient in fp32) is retried with 10x the dampening, up to 4 times.

    Memory: at most three K x K matrices beside `hessian` at once: the matrix being factorized with cholesky_ex's
    result and workspace, or the factor and its inverse. H is one copy (a single gather with `perm`), dampened in
    place (the same sums as H + damp * I) and freed once factorized; the factor is freed once inverted; a retry makes
    the copy again."""
    pct, mean_diag = damp_percent, None
    for _ in range(5):
        H = hessian.detach().float()[perm.unsqueeze(1), perm] if perm is not None else hessian.detach().float().clone()
        H.diagonal()[dead] = 1.0
        if mean_diag is None:
            mean_diag = torch.mean(torch.diag(H)).item()
        damp = pct * mean_diag
        H.diagonal().add_(damp)
        L, info = torch.linalg.cholesky_ex(H)
        del H
        if info.item() == 0:
            H_inv = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(H_inv, upper=True)
            del H_inv
            if info.item() == 0:
                return U, damp
        pct *= 10
    raise ValueError(f"gptq: Hessian of {name or 'layer'} is not positive definite even with dampening "
                     f"{pct / 10:g} x mean diagonal; the calibration inputs may contain NaN/Inf")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool,
                  config: GPTQConfig = GPTQConfig(), name: str = "") -> GPTQResult:
    """GPTQ-quantize weight [N, K] given the Hessian [K, K] of its inputs (any positive multiple of X^T X).
    Runs on the weight's device in fp32."""
    if weight.dim() != 2:
        raise ValueError(f"gptq: weight of {name or 'layer'} must be 2-D [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if hessian.shape != (K, K):
        raise ValueError(f"gptq: Hessian of {name or 'layer'} has shape {tuple(hessian.shape)}, expected {(K, K)}")
    if not torch.isfinite(hessian).all():
        raise ValueError(f"gptq: Hessian of {name or 'layer'} has NaN/Inf (calibration activations overflowed?)")
    G = K if group_size == -1 else group_size
    if K % G:
        raise ValueError(f"w4a16: in_features={K} is not a multiple of group_size={group_size} "
                         f"(layer {name or '?'})")
    n_groups = K // G
    W = weight.detach().float().clone()
    hdiag = torch.diag(hessian.detach()).float()  # a copy: dead columns get H[i, i] = 1 below
    dead = hdiag == 0
    hdiag[dead] = 1.0

    # Static group params: from the original weight (group -1, or act_order). Otherwise filled per group.
    static = group_size == -1 or config.act_order
    if static:
        scale, zero = search_group_params(W, group_size, symmetric, config, hdiag if config.clip_weighted else None)
    else:
        scale = torch.empty(N, n_groups, dtype=torch.bfloat16, device=W.device)
        zero = None if symmetric else torch.empty(N, n_groups, dtype=torch.uint8, device=W.device)

    perm = None
    if config.act_order:
        perm = torch.argsort(hdiag, descending=True, stable=True)
        W, hdiag, dead = W[:, perm], hdiag[perm], dead[perm]
    col_group = ((perm.cpu() if perm is not None else torch.arange(K)) // G).tolist()  # host list: no syncs

    U, damp = _upper_cholesky_of_inverse(hessian, perm, dead, config.damp_percent, name)

    # A group must start at a block boundary and fit in the block (natural order), so B is a multiple of G.
    B = K if G >= K else max(G, config.block_size // G * G)
    Q = torch.empty_like(W)
    nibbles = torch.empty(N, K, dtype=torch.uint8, device=W.device)
    for i1 in range(0, K, B):
        i2 = min(i1 + B, K)
        W1 = W[:, i1:i2].clone()
        E1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col_group[col]
            if not static and col % G == 0:
                s, z = search_group_params(W1[:, i:i + G], G, symmetric, config,
                                           hdiag[col:col + G] if config.clip_weighted else None)
                scale[:, g:g + 1] = s
                if zero is not None:
                    zero[:, g:g + 1] = z
            s = scale[:, g:g + 1]
            z = None if zero is None else zero[:, g:g + 1]
            w = W1[:, i:i + 1]
            u = quantize_groups(w, s, z, -1)  # [N, 1] nibbles on the checkpoint's grid
            q = (u.float() - (INT4_SYM_OFFSET if z is None else z.float())) * s.float()
            nibbles[:, col] = u[:, 0]
            Q[:, col] = q[:, 0]
            err = (w[:, 0] - q[:, 0]) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]

    if perm is not None:
        inv = torch.argsort(perm)
        Q, nibbles = Q[:, inv], nibbles[:, inv]
    tensors = {"weight_packed": pack_int4(nibbles), "weight_scale": scale}
    if zero is not None:
        tensors["weight_zero_point"] = zero
    return GPTQResult(tensors=tensors, dequant=Q, damp=damp)


def weighted_error(weight: torch.Tensor, dequant: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): the layer's summed squared output error on the inputs H was built from
    (times the Hessian's normalization). Compares GPTQ against round-to-nearest on the same data."""
    D = weight.float() - dequant.float()
    return float(((D @ hessian.float()) * D).sum())
