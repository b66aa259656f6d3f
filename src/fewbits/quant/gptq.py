"""GPTQ: Hessian-aware rounding of nn.Linear weights, layer by layer on calibration data.

For a linear layer y = x W^T with inputs X [n, in], GPTQ (Frantar et al., 2022, "Accurate
Post-Training Quantization for Generative Pre-trained Transformers") picks the quantized weights
Q to make the output error ||X W^T - X Q^T||^2 small rather than ||W - Q||^2. With
H = 2 X^T X / n (the Hessian of that error), it rounds one input column at a time and spreads
each column's rounding error over the columns not yet rounded, weighted by the inverse Hessian:

    U = upper Cholesky factor of (H + damp * mean(diag H) * I)^-1
    for each column j:  q_j = round(w_j);  e_j = (w_j - q_j) / U[j, j];  W[:, j:] -= e_j U[j, j:]

Columns are processed in blocks: the updates inside a block are applied at once per column, the
updates to the columns after the block are applied lazily as one matrix product per block
(the same arithmetic, far fewer memory passes).

Scales follow the scheme. With groups (group / mx / nvfp4 granularity), a group's scale (and zero
point) is chosen by the scheme's own rule (absmax / percentile / mse, symmetric or not, rounded to
the scale format) from the error-updated weights when the algorithm reaches the group's first
column ("dynamic" groups), or from the original weights before it starts ("static" groups:
needed with act_order, which visits columns out of order, and with double quantization, whose
scales are quantized all together). Super-block schemes (GGUF's k-quants) choose a whole
super-block's scaling at once (its groups' scales are codes under the super-block's scale): at
the super-block's first column from the updated weights, or statically from the original ones.
Per-channel and per-tensor scales come from the original weights. Because the scale layout stays
the scheme's plain layout, the result is an ordinary QuantizedTensor whose dequantize() equals
GPTQ's quantized weights bit for bit (checked).

Differences from the reference implementation, and why:
- dead input columns (H[j, j] == 0, the input is always zero there) keep their weights and are
  rounded to nearest, instead of being zeroed: zero on calibration data does not mean zero on
  all data, and decoupled columns cost nothing in the error;
- a dynamic group never straddles two blocks (the block size is rounded to a multiple of the
  group size), so its scale always sees fully updated weights;
- when the Cholesky factorisation fails, the damping is raised tenfold and retried;
- the Hessian is shrunk toward its diagonal first, H <- (1 - shrink) H + shrink diag(H)
  (`shrink`, default SHRINK): the off-diagonal terms of a few thousand calibration tokens are
  noisy, and GPTQ fitted to them overfits (on SmolLM2, layer by layer, its output error on text
  of another domain was 1.25x that of importance-weighted rounding without shrinking, ~0.83x
  with shrink 0.5 at Q4_0); shrink 1 leaves only the diagonal, which spreads no error:
  importance-weighted rounding (exactly so with static groups; dynamic groups weigh each group
  by its own slice's mean square).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..formats import FLOAT_DTYPES, IntFormat
from ..kernels import round as fb_round
from . import scales as sc
from ..progress import counter
from .lowbit_ops import one_thread
from .importance import DAMP as IMPORTANCE_DAMP
from .importance import InputHooks, collect_importance, damped, importance_sources
from .kquant_search import importance_weights
from .plan import calibration_batches, model_device, run_batch
from .scheme import QuantScheme, get_scheme
from .tensor import (_SCALE_DTYPES, QuantizedTensor, importance_view, quantize, quantize_scaled, rounding_generator,
                     takes_importance, to_groups)

__all__ = ["GPTQResult", "gptq_solve", "gptq_quantize_weight", "hessian_error", "collect_hessians",
           "gptq_quantize_model"]

_DAMP_RETRIES = 6
# the scales each group is rounded under are searched on the error weighted by the Hessian's
# diagonal (the inputs' mean squares: importance-weighted rounding, fewbits.quant.importance)
WEIGHTED_SCALES = True
DAMP = 0.01  # GPTQ's relative damping
SHRINK = 0.5  # the Hessian's shrinkage toward its diagonal (see the module docstring)


# ---------------------------------------------------------------------------------------------
# the grid: scales per group and the rounding of one column
# ---------------------------------------------------------------------------------------------
class _Grid:
    """The scheme's quantization grid over the columns of a weight matrix [rows, cols].

    For every scale group g (a range of columns): `inv[g]` (multiplies the weights before
    rounding, as quantize() does), `scale[g]` (multiplies the rounded values: what dequantize()
    uses), `zero[g]` (float zero points, asymmetric), `minimum[g]` (float minimums,
    zero_point="float": w ~= q * scale + minimum) and `raw[g]` (the stored E8M0/E4M3 scale
    codes of MX/NVFP4); super-block schemes also `sub[g]` / `sub_min[g]` (the sub-scale codes,
    int64 [rows]) and, per super-block b, `sup[b]` / `sup_min[b]` (its scales d, dmin). Everything
    is float32 [rows] so the arithmetic matches quantize() and QuantizedTensor.dequantize()
    exactly. `span`: the columns one scale choice covers (a group, or a super-block).
    """

    def __init__(self, scheme: QuantScheme, W: torch.Tensor, static: bool, generator,
                 importance: torch.Tensor | None = None):
        self.scheme = scheme
        self.importance = importance  # float64 [cols] or None: the scale searches' column weights
        self.fmt = scheme.format
        rows, cols = W.shape
        self.rows, self.cols = rows, cols
        gran = scheme.granularity
        if gran == "channel" and scheme._axis(2) != 0:
            raise ValueError("GPTQ needs per-output-channel scales (axis 0 of the [out, in] weight), "
                             f"got axis {scheme.axis}: per-input-channel scales would change inside a "
                             "column's error propagation")
        self.grouped = gran in ("group", "mx", "nvfp4")
        self.group_size = scheme.group_size if self.grouped else max(cols, 1)
        self.n_groups = -(-cols // self.group_size) if self.grouped else 1
        self.span = scheme.super_block if scheme.super_block is not None else self.group_size
        n_spans = -(-cols // self.span) if self.grouped else 1
        self.sub: list = [None] * self.n_groups
        self.sub_min: list = [None] * self.n_groups
        self.sup: list = [None] * n_spans
        self.sup_min: list = [None] * n_spans
        # static: every scale fixed from the original weights before rounding starts
        self.static = static or not self.grouped or scheme.double_quant
        self.nearest = scheme.with_(mode="nearest_even", name=scheme.name)
        self.generator = generator
        self.inv: list = [None] * self.n_groups
        self.scale: list = [None] * self.n_groups
        self.zero: list = [None] * self.n_groups
        self.minimum: list = [None] * self.n_groups
        self.raw: list = [None] * self.n_groups
        self.dq_parts = None
        self.tensor_scale = None
        if isinstance(self.fmt, IntFormat) and scheme.mode == "nearest_even":
            self._int_range = (self.fmt.lowest, self.fmt.max)
        else:
            self._int_range = None
        if gran == "nvfp4":  # the float32 tensor scale always comes from the whole original tensor
            self.tensor_scale = sc.nvfp4_tensor_scale(to_groups(W, scheme)[0], scheme)
        if self.static:
            self._set_static(W)

    # --- scale choice ------------------------------------------------------------------------
    def _set_static(self, W: torch.Tensor) -> None:
        s = self.scheme
        if s.scale_format == "none":  # a plain cast: no scale
            one = torch.ones(self.rows, device=W.device)
            self.inv[0] = self.scale[0] = one
            return
        # the scheme's own scales on the original weights, as quantize() chooses them
        g, valid = to_groups(W, s)
        scaling = sc.choose(g, valid, s, self.tensor_scale, weights=self._weights(g, valid, W.shape, 0))
        if s.double_quant:  # the elements are rounded under the scales as stored
            q, bs, off = sc.double_quantize(scaling.scale)
            self.dq_parts = {"dq_codes": q, "dq_scales": bs, "dq_offset": off}
            scaling.scale = sc.double_dequantize(q, bs, off).reshape(scaling.scale.shape)
            scaling.multiplier = sc.reciprocal(scaling.scale)
        for g in range(self.n_groups):
            self._take(g, scaling, g)
        for b in range(len(self.sup) if scaling.super_scale is not None else 0):
            self._take_super(b, scaling, b)

    def set_dynamic(self, b: int, columns: torch.Tensor) -> None:
        """Choose the scales of span b (group b, or super-block b with its groups) from the current
        (error-updated) weights of its columns: the scheme's own rule on their group view
        [rows, groups, group_size] (padded if the last group is short); NVFP4's tensor scale stays
        the whole original tensor's."""
        g, valid = to_groups(columns, self.scheme)
        scaling = sc.choose(g, valid, self.scheme, self.tensor_scale,
                            weights=self._weights(g, valid, columns.shape, b * self.span))
        first = b * (self.span // self.group_size)
        for j in range(scaling.scale.shape[1]):
            self._take(first + j, scaling, j)
        if scaling.super_scale is not None:
            self._take_super(b, scaling, 0)

    def _weights(self, g: torch.Tensor, valid, shape, first: int) -> torch.Tensor | None:
        """The importance weights of the group view (g, valid) of a [rows, cols] slice of the
        weight's columns starting at `first`, or None without importance."""
        if self.importance is None:
            return None
        imp = self.importance[first:first + shape[1]]
        return importance_weights(g, valid, importance_view(imp, self.scheme, shape))

    def _take_super(self, b: int, scaling: sc.Scaling, j: int) -> None:
        """Super-block b's scales d (and dmin): column j of `scaling`'s super-block scales."""
        self.sup[b] = scaling.super_scale[:, j].contiguous()
        if scaling.super_minimum is not None:
            self.sup_min[b] = scaling.super_minimum[:, j].contiguous()

    def _take(self, g: int, scaling: sc.Scaling, j: int) -> None:
        """Group g's scale, multiplier, zero point, minimum and codes: column j of `scaling`
        (per-tensor scales are repeated for every row)."""
        shape = (self.rows, scaling.scale.shape[1])
        self.scale[g] = scaling.scale.expand(shape)[:, j].contiguous()
        self.inv[g] = scaling.multiplier.expand(shape)[:, j].contiguous()
        zp = scaling.zero_point
        self.zero[g] = zp[:, j].to(torch.float32) if zp is not None else None
        if scaling.minimum is not None:
            self.minimum[g] = scaling.minimum.expand(shape)[:, j].contiguous()
        if scaling.codes is not None:
            self.raw[g] = scaling.codes[:, j]
        if scaling.sub_codes is not None:
            self.sub[g] = scaling.sub_codes[:, j]
            if scaling.sub_min_codes is not None:
                self.sub_min[g] = scaling.sub_min_codes[:, j]

    # --- rounding ------------------------------------------------------------------------------
    def group_of(self, col: int) -> int:
        return col // self.group_size if self.grouped else 0

    def quantize_column(self, w: torch.Tensor, col: int) -> torch.Tensor:
        """The dequantized value of column `col` (float32 [rows]), computed as quantize() and
        dequantize() compute it."""
        g = self.group_of(col)
        minimum = self.minimum[g]
        if minimum is not None:  # as quantize(): (w - min) * (1 / scale); dequantize: q * scale + min
            return self.round((w - minimum) * self.inv[g]) * self.scale[g] + minimum
        y = w * self.inv[g]
        zero = self.zero[g]
        if zero is not None:
            y = y + zero
        q = self.round(y)
        if zero is not None:
            q = q - zero
        return q * self.scale[g]

    def round(self, y: torch.Tensor) -> torch.Tensor:
        if self._int_range is not None:  # integers, nearest even: torch.round is exactly that
            return torch.round(y).clamp_(*self._int_range)
        return fb_round(y, self.fmt, mode=self.scheme.mode, overflow="saturate", generator=self.generator)

    # --- the stored tensor ---------------------------------------------------------------------
    def build(self, Q: torch.Tensor, dtype: torch.dtype) -> QuantizedTensor:
        """A QuantizedTensor holding Q (float32 [rows, cols] on this grid), in the scheme's layout."""
        s = self.scheme
        shape = Q.shape
        if s.scale_format == "none":
            qt = quantize(Q, self.nearest)
            return QuantizedTensor(s, shape, dtype, **qt.state_dict())
        values = torch.stack(self.scale, dim=1)  # [rows, groups]
        if s.super_block is not None:  # the codes from Q under the scaling assembled span by span
            stacked = {}
            if self.minimum[0] is not None:
                stacked = dict(minimum=torch.stack(self.minimum, dim=1), sub_min_codes=torch.stack(self.sub_min, dim=1),
                               super_minimum=torch.stack(self.sup_min, dim=1))
            scaling = sc.Scaling(values, torch.stack(self.inv, dim=1), sub_codes=torch.stack(self.sub, dim=1),
                                 super_scale=torch.stack(self.sup, dim=1), **stacked)
            qt = quantize_scaled(Q, s, scaling)
            return QuantizedTensor(s, shape, dtype, **qt.state_dict())
        zeros = (torch.stack(self.zero, dim=1).to(torch.int64) if self.zero[0] is not None else None)
        if self.minimum[0] is not None:  # float minimums travel as quantize()'s zero_points
            zeros = torch.stack(self.minimum, dim=1)
        if s.granularity == "tensor":  # one scale: every row holds the same
            values = values[:1]
            zeros = zeros[:1] if zeros is not None else None
        if s.granularity in ("mx", "nvfp4") or s.double_quant:
            # codes from the plain-float-scale equivalent of the layout; the scales stored as the
            # scheme stores them
            gran = "group" if s.granularity in ("mx", "nvfp4") else s.granularity
            coder = QuantScheme(s.format, gran, axis=s.axis, group_size=s.group_size if self.grouped else None,
                                symmetric=s.symmetric, scale_format="fp32", zero_point=s.zero_point)
            parts = quantize(Q, coder, scales=values, zero_points=zeros).state_dict()
            parts.pop("scales")
            if "minimums" in parts:  # already rounded to the scheme's scale format: exact in its dtype
                parts["minimums"] = parts["minimums"].to(_SCALE_DTYPES[s.scale_format])
            if s.double_quant:
                parts.update(self.dq_parts)
            else:
                parts["scales"] = torch.stack(self.raw, dim=1)
                if s.granularity == "nvfp4":
                    parts["tensor_scale"] = self.tensor_scale
            return QuantizedTensor(s, shape, dtype, **parts)
        qt = quantize(Q, self.nearest, scales=values, zero_points=zeros)
        return QuantizedTensor(s, shape, dtype, **qt.state_dict())


# ---------------------------------------------------------------------------------------------
# the algorithm on one weight matrix
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GPTQResult:
    """What gptq_solve() produced for one weight matrix.

    qtensor: the QuantizedTensor (its dequantize() equals `dequantized` exactly).
    dequantized: GPTQ's quantized weights, float32 [rows, cols], original column order.
    damp: the relative damping actually used (raised from the requested one if the Cholesky
        factorisation failed).
    perm: the column order the algorithm used (act_order), or None for the natural order.
    dead_columns: how many input columns had H[j, j] == 0.
    """

    qtensor: QuantizedTensor
    dequantized: torch.Tensor
    damp: float
    perm: torch.Tensor | None
    dead_columns: int


def check_options(block_size, damp, shrink) -> None:
    """A ValueError for a bad block size, damping or shrinkage (before any work)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not math.isfinite(damp) or damp < 0:
        raise ValueError(f"damp must be a finite number >= 0, got {damp!r}")
    if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0.0 <= shrink <= 1.0:
        raise ValueError(f"shrink must be a number in [0, 1], got {shrink!r}")


def _check_inputs(W, H, block_size, damp, shrink=0.0):
    if not isinstance(W, torch.Tensor) or not isinstance(H, torch.Tensor):
        raise TypeError("GPTQ takes torch tensors W and H")
    if W.dim() != 2:
        raise ValueError(f"W must be a 2-D weight [out, in], got shape {tuple(W.shape)}")
    if W.dtype not in FLOAT_DTYPES or H.dtype not in FLOAT_DTYPES:
        raise TypeError(f"W and H must be float tensors, got {W.dtype} and {H.dtype}")
    cols = W.shape[1]
    if tuple(H.shape) != (cols, cols):
        raise ValueError(f"H must be [{cols}, {cols}] for a weight of shape {tuple(W.shape)}, got {tuple(H.shape)}")
    if not bool(torch.isfinite(W).all()):
        raise ValueError("W contains NaN or inf")
    if not bool(torch.isfinite(H).all()):
        raise ValueError("H contains NaN or inf")
    if bool((H.diagonal() < 0).any()):
        raise ValueError("H has a negative diagonal entry: it is not a Hessian X^T X (positive semidefinite)")
    check_options(block_size, damp, shrink)


def _inverse_cholesky(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + d * mean(diag H) * I)^-1 in float64, and the d used.

    d starts at `damp` and grows tenfold (from at least 1e-4) while a factorisation fails."""
    n = H.shape[0]
    mean_diag = float(H.diagonal().mean()) if n else 1.0
    d = float(damp)
    # one [n, n] float64 temporary alive at a time besides H (8192 inputs: 512 MB each)
    for _ in range(_DAMP_RETRIES + 1):
        damped = H.clone()
        damped.diagonal().add_(d * mean_diag)
        L, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            inverse = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(inverse, upper=True)
            del inverse
            if int(info) == 0 and bool(torch.isfinite(U).all()):
                return U, d
        d = max(d * 10.0, 1e-4)
    raise ValueError(f"GPTQ: the Hessian could not be factorised even with damping {d / 10:g} "
                     "(is it badly scaled?)")


def gptq_solve(W: torch.Tensor, H: torch.Tensor, scheme, block_size: int = 128, damp: float = DAMP,
               act_order: bool = False, static_groups: bool | None = None,
               weighted_scales: bool = WEIGHTED_SCALES, shrink: float = SHRINK) -> GPTQResult:
    """GPTQ on one weight matrix W [out, in] with the Hessian H [in, in] of its input
    (H = 2 X^T X / n; see collect_hessians). See gptq_quantize_weight for the arguments."""
    scheme = get_scheme(scheme)
    _check_inputs(W, H, block_size, damp, shrink)
    grouped = scheme.granularity in ("group", "mx", "nvfp4")
    if not isinstance(act_order, bool) or not (static_groups is None or isinstance(static_groups, bool)):
        raise TypeError("act_order must be a bool and static_groups a bool or None")
    if static_groups is None:
        static_groups = act_order
    elif act_order and grouped and not static_groups:
        raise ValueError("act_order with groups needs static_groups=True: visiting columns out of order, "
                         "dynamic groups would not keep the plain group layout the tensor is stored in")
    rows, cols = W.shape
    dtype = W.dtype
    if W.numel() == 0:  # nothing to round
        empty = quantize(W.detach(), scheme)
        return GPTQResult(empty, W.detach().to(torch.float32).clone(), float(damp), None, 0)
    W32 = W.detach().to(torch.float32).clone()
    generator = rounding_generator(scheme, "cpu")  # kernels.random draws the seeds on the CPU
    importance = None
    if weighted_scales and takes_importance(scheme, W.shape) and bool((H.diagonal() > 0).any()):
        importance = damped(H.diagonal().detach().to("cpu", torch.float64)).to(torch.float64)
    grid = _Grid(scheme, W32, static_groups, generator, importance)

    H = H.detach().to(torch.float64)
    if shrink:  # (1 - shrink) H + shrink diag(H), a new tensor: the caller's Hessian stays as it was
        diagonal = H.diagonal().clone()
        H = H * (1.0 - shrink)
        H.diagonal().copy_(diagonal)
    dead = H.diagonal() == 0
    n_dead = int(dead.sum())
    perm = None
    if act_order:  # the largest input energy first; dead columns last
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    if n_dead:
        H = H.clone()  # the caller's Hessian stays as it was
        H[dead, :] = 0
        H[:, dead] = 0
        live = H.diagonal()[~dead]
        H.diagonal()[dead] = float(live.mean()) if live.numel() else 1.0  # decoupled: plain rounding
    if perm is not None:
        H = H[perm][:, perm]
        Wp = W32[:, perm].contiguous()
    else:
        Wp = W32
    U64, used_damp = _inverse_cholesky(H, damp)
    U = U64.to(torch.float32)
    del U64, H

    block = block_size
    if grouped and not grid.static:  # a dynamic group (or super-block) must lie inside one block
        gs = grid.span
        block = max(gs, block_size // gs * gs)
    # the loop runs on the transpose [cols, rows], so that a column and the rank-1 updates of
    # the columns after it are contiguous memory
    Wt = Wp.T.contiguous()
    Qt = torch.empty_like(Wt)
    order = perm.tolist() if perm is not None else None
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1 = Wt[i1:i2].clone()
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        # one thread: the column loop's operations are tiny and a parallel region per operation
        # costs more than the work (a 128 x 1536 rank-1 update: 11 us on one thread, 16 ms on two)
        with one_thread():
            for i in range(i2 - i1):
                col = order[i1 + i] if order is not None else i1 + i
                if not grid.static and col % grid.span == 0:
                    grid.set_dynamic(col // grid.span, W1[i:i + grid.span].T)
                w = W1[i]
                q = grid.quantize_column(w, col)
                Qt[i1 + i] = q
                err = (w - q) / U1[i, i]
                W1[i:].addr_(U1[i, i:], err, alpha=-1.0)
                Err1[i] = err
        if i2 < cols:
            Wt[i2:].addmm_(U[i1:i2, i2:].T, Err1, alpha=-1.0)
    Q = Qt.T
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    Q = Q.contiguous()
    qtensor = grid.build(Q, dtype)
    if not torch.equal(qtensor.dequantize(torch.float32), Q):
        raise RuntimeError(f"GPTQ internal error: the stored tensor does not reproduce the rounded weights "
                           f"({scheme.label}); please report it")
    return GPTQResult(qtensor, Q, used_damp, perm, n_dead)


def gptq_quantize_weight(W: torch.Tensor, H: torch.Tensor, scheme, block_size: int = 128,
                         damp: float = DAMP, act_order: bool = False,
                         static_groups: bool | None = None, weighted_scales: bool = WEIGHTED_SCALES,
                         shrink: float = SHRINK) -> QuantizedTensor:
    """Quantize a weight W [out, in] with GPTQ, given the Hessian H [in, in] of its input.

    scheme: a QuantScheme or preset name: any element format with per-tensor, per-output-channel
        or group scales (int2..int8, asymmetric ints, nf4, fp8, fp4, ...), double quantization,
        MX and NVFP4 blocks.
    block_size: columns per block of lazy updates (rounded to a multiple of the group size).
    damp: relative damping added to H's diagonal (times its mean); raised automatically if H
        cannot be factorised.
    act_order: round the columns in order of decreasing H[j, j] (the inputs with the most
        energy first). With groups it needs static groups (scales from the original weights).
    static_groups: choose every group's scale from the original weights up front (default: only
        with act_order; double quantization always uses static scales).
    weighted_scales: search each group's scales on the error weighted by H's diagonal (the
        inputs' mean squares, damped: fewbits.quant.importance), as method "imatrix" does, where
        the scheme's scales take importance (fewbits.quant.tensor.takes_importance; default
        True); False: the scheme's own scale rule, as quantize() without importance.
    shrink: in [0, 1], how far H is shrunk toward its diagonal first (see the module docstring;
        0: plain GPTQ, 1: importance-weighted rounding).
    Returns a QuantizedTensor whose dequantize() equals GPTQ's quantized weights exactly.
    """
    return gptq_solve(W, H, scheme, block_size, damp, act_order, static_groups, weighted_scales, shrink).qtensor


def hessian_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """trace((W - Q) H (W - Q)^T): with H = 2 X^T X / n, twice the mean squared output error
    ||X W^T - X Q^T||^2 / n that GPTQ minimises."""
    D = (W.to(torch.float64) - Q.to(torch.float64))
    return float(((D @ H.to(torch.float64)) * D).sum())


# ---------------------------------------------------------------------------------------------
# Hessians from calibration data
# ---------------------------------------------------------------------------------------------
class _StopForward(Exception):
    """Raised by a hook once every layer of interest has seen its input: the rest of the
    forward pass is not needed."""


def _version_of(x: torch.Tensor):
    try:
        return x._version
    except RuntimeError:  # inference tensors have no version counter
        return None


class _HessianHooks(InputHooks):
    """Forward pre-hooks accumulating X^T X of each watched nn.Linear's input: each batch's product
    in the input's precision (float32, float64 for float64 inputs), the sum over batches in float64.

    Several layers fed the very same tensor (q/k/v projections) share one X^T X product."""

    def __init__(self, modules: Mapping[str, nn.Module], stop_after_all: bool = False):
        super().__init__(modules)
        self.sums = {n: None for n in self.modules}
        self.counts = {n: 0 for n in self.modules}
        self.stop_after_all = stop_after_all
        self._seen: set[str] = set()
        self._last = None  # (input tensor, its version, X^T X, rows)

    def __exit__(self, *exc):
        self._last = None
        return super().__exit__(*exc)

    def start_batch(self):
        self._seen.clear()
        self._last = None

    def _hook(self, name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, torch.Tensor):
                return None
            version = _version_of(x)
            last = self._last
            if last is not None and last[0] is x and version is not None and last[1] == version:
                xtx, n = last[2], last[3]
            else:
                X = x.detach().reshape(-1, x.shape[-1])
                X = X.to(torch.float64 if X.dtype == torch.float64 else torch.float32)
                # the product in X's precision, kept so (half the memory of a float64 copy for
                # float32 inputs) and added into the float64 sum, which widens it exactly
                xtx, n = X.T @ X, X.shape[0]
                self._last = (x, version, xtx, n)
            total = self.sums[name]
            self.sums[name] = xtx.to(torch.float64, copy=True) if total is None else total.add_(xtx)
            self.counts[name] += n
            self._seen.add(name)
            if self.stop_after_all and len(self._seen) == len(self.modules):
                raise _StopForward
            return None
        return hook

    def hessians(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, module in self.modules.items():
            n = self.counts[name]
            if not n:
                warnings.warn(f"GPTQ: layer {name!r} saw no calibration input; it is rounded to nearest",
                              RuntimeWarning, stacklevel=3)
                out[name] = torch.zeros(module.in_features, module.in_features, dtype=torch.float64,
                                        device=module.weight.device)
            else:  # scaled in place and handed over: a Hessian of 8192 inputs is 512 MB
                out[name] = self.sums[name].mul_(2.0 / n)
                self.sums[name] = None
        return out


_model_device = model_device


def _run(model: nn.Module, batch, device) -> None:
    """Call the model on one calibration batch (plan.run_batch), up to the hook that stops it."""
    try:
        run_batch(model, batch, device)
    except _StopForward:
        pass


def _linear_modules(model: nn.Module, names: Iterable[str]) -> dict[str, nn.Linear]:
    modules = {}
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the model has no module {name!r}") from None
        if not isinstance(module, nn.Linear):
            raise TypeError(f"GPTQ works on nn.Linear layers; {name!r} is a {type(module).__name__}")
        modules[name] = module
    return modules


def _passes(model: nn.Module, batches: Sequence, modules: Mapping[str, nn.Module], stop_early: bool):
    """Run all batches with Hessian hooks on `modules`; returns {name: H}."""
    device = _model_device(model)
    with _HessianHooks(modules, stop_after_all=stop_early) as hooks, torch.no_grad():
        for batch in batches:
            hooks.start_batch()
            _run(model, batch, device)
        return hooks.hessians()


class _eval_mode:
    """Calibration runs in eval mode (no dropout); the model's mode is restored afterwards."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.modes = {m: m.training for m in self.model.modules()}
        self.model.eval()

    def __exit__(self, *exc):
        for m, mode in self.modes.items():
            m.training = mode
        return False


def collect_hessians(model: nn.Module, layers: Iterable[str], calibration) -> dict[str, torch.Tensor]:
    """{layer name: H = 2 X^T X / n} (float64 [in, in]) for the named nn.Linear layers, where X
    holds every input row (token) the layer sees while the model runs over `calibration` (an
    iterable of model inputs: tensors, tuples of positional args or dicts of keyword args; a single
    tensor or dict is one input). The model runs once over the data, in eval mode, without gradients."""
    modules = _linear_modules(model, layers)
    batches = calibration_batches(calibration)
    with _eval_mode(model):
        return _passes(model, batches, modules, stop_early=False)


class _Discovery:
    """What one forward pass of the float model on the first calibration batch shows.

    groups: the planned layers grouped for sequential GPTQ, in the order the model first calls
        them. Layers fed the very same input tensor (e.g. the q/k/v projections) form one group:
        none of them can affect the others' input, so one pass serves them all. A layer called
        more than once per forward stays alone; layers never called come last.
    calls: how many times each layer ran. first: each called layer's rank in call order.
    block_inputs / block_calls: for the model's list of repeated blocks (if any), each block's
        first (args, kwargs) and how many times it ran.
    """

    def __init__(self, model, batch, modules: Mapping[str, nn.Module], blocks: nn.ModuleList | None):
        first: dict[str, tuple] = {}
        self.calls = {n: 0 for n in modules}
        n_blocks = len(blocks) if blocks is not None else 0
        self.block_inputs: list = [None] * n_blocks
        self.block_calls = [0] * n_blocks
        keep = []  # hold the inputs so that their ids stay unique during the pass

        def layer_hook(name):
            def hook(module, args, kwargs):
                x = args[0] if args else kwargs.get("input")
                self.calls[name] += 1
                if name not in first and isinstance(x, torch.Tensor):
                    keep.append(x)
                    first[name] = (len(first), id(x), _version_of(x))
                return None
            return hook

        def block_hook(i):
            def hook(module, args, kwargs):
                self.block_calls[i] += 1
                if self.block_inputs[i] is None:
                    self.block_inputs[i] = (args, kwargs)
                return None
            return hook

        handles = [m.register_forward_pre_hook(layer_hook(n), with_kwargs=True) for n, m in modules.items()]
        handles += [b.register_forward_pre_hook(block_hook(i), with_kwargs=True) for i, b in enumerate(blocks or ())]
        try:
            with torch.no_grad():
                _run(model, batch, _model_device(model))
        finally:
            for h in handles:
                h.remove()
        grouped: dict = {}
        for name in sorted(first, key=lambda n: first[n][0]):
            _, ident, version = first[name]
            key = (ident, version) if self.calls[name] == 1 and version is not None else ("alone", name)
            grouped.setdefault(key, []).append(name)
        self.groups = list(grouped.values()) + [[n] for n in modules if n not in first]
        self.first = {n: first[n][0] for n in first}


# ---------------------------------------------------------------------------------------------
# running the repeated blocks one at a time (the usual transformer layout)
# ---------------------------------------------------------------------------------------------
def _find_blocks(model: nn.Module, names: Sequence[str]) -> tuple[str, nn.ModuleList] | None:
    """The nn.ModuleList (of at least 2 blocks) holding the most planned layers, if any."""
    best = None
    for prefix, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and prefix:
            count = sum(1 for n in names if n.startswith(prefix + "."))
            if count >= 2 and (best is None or count > best[0]):
                best = (count, prefix, module)
    return (best[1], best[2]) if best else None


def _hidden_of(output):
    """The hidden states a block returns: the output itself, or the first item of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _plain(value) -> bool:
    """Values a block may take besides its hidden states and still be re-run from a cache:
    tensors, numbers, strings, None, and tuples/lists/dicts of those (no cache objects, which a
    block would mutate)."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    return False


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _run_block(block: nn.Module, hidden: torch.Tensor, rest: tuple, kwargs: dict):
    try:
        return _hidden_of(block(hidden, *rest, **kwargs))
    except _StopForward:
        return None


def _block_layout(blocks_found, discovery: _Discovery):
    """(groups before the blocks, groups of each block, groups after) when the blocks can be run
    one at a time from cached inputs, else None.

    That holds when each block runs once per forward, takes its hidden states as first argument
    and returns them (alone or first in a tuple), gets the same other arguments as the first block
    (attention masks, position embeddings: no cache objects), and block i's output is exactly
    block i+1's input (checked by re-running every block on the first batch); and when the
    layers' call order is: layers outside the blocks, then block 0's, block 1's, ..., then
    layers outside again."""
    if blocks_found is None:
        return None
    prefix, blocks = blocks_found
    inputs = discovery.block_inputs
    if any(c != 1 for c in discovery.block_calls):
        return None
    for args, kwargs in inputs:
        if not args or not isinstance(args[0], torch.Tensor) or not _plain(args[1:]) or not _plain(kwargs):
            return None
    rest0, kw0 = inputs[0][0][1:], inputs[0][1]
    if not all(_same(args[1:], rest0) and _same(kwargs, kw0) for args, kwargs in inputs[1:]):
        return None
    with torch.no_grad():
        for i in range(len(blocks) - 1):
            out = _run_block(blocks[i], inputs[i][0][0], rest0, kw0)
            nxt = inputs[i + 1][0][0]
            if out is None or out.shape != nxt.shape or not torch.allclose(out, nxt, rtol=1e-5, atol=1e-6):
                return None

    def block_of(name):
        head = prefix + "."
        if not name.startswith(head):
            return None
        index = name[len(head):].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    pre, post = [], []
    per_block = [[] for _ in blocks]
    stage = 0  # 0: before the blocks, 1: inside, 2: after
    last_block = -1
    for group in discovery.groups:
        where = {block_of(n) for n in group}
        if len(where) != 1:
            return None
        b = where.pop()
        if b is None:
            if stage == 0:
                pre.append(group)
            else:
                stage = 2
                post.append(group)
        else:
            if stage == 2 or b < last_block or not all(n in discovery.first for n in group):
                return None
            stage, last_block = 1, b
            per_block[b].append(group)
    return pre, per_block, post


class _SequentialGPTQ:
    """Sequential GPTQ over a model: quantize group by group, each layer from the Hessian of its
    input with every earlier layer already quantized (computing with its dequantized weights)."""

    def __init__(self, model, plan, batches, modules, options, report):
        self.model, self.plan, self.batches, self.modules = model, plan, batches, modules
        self.options, self.report = options, report
        self.results: dict[str, QuantizedTensor] = {}
        # id(parameter) -> (parameter, its float data): keyed by parameter, so that a weight tied
        # between two planned modules keeps its true original
        self.originals: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self.done = 0

    def weight_of(self, name: str) -> torch.Tensor:
        """The module's original float weight (even if a tied module already swapped it)."""
        param = self.model.get_submodule(name).weight
        return self.originals.get(id(param), (param, param.data))[1].detach()

    def swap_in(self, name: str) -> None:
        """The layer computes with its quantized weights from now on (restored by restore())."""
        param = self.model.get_submodule(name).weight
        self.originals.setdefault(id(param), (param, param.data))
        param.data = self.results[name].dequantize(param.dtype).to(param.device)

    def restore(self) -> None:
        for param, data in self.originals.values():
            param.data = data
        self.originals.clear()

    def finish(self, name: str, hessian: torch.Tensor, swap: bool) -> None:
        W = self.weight_of(name)
        self.results[name] = gptq_quantize_weight(W, hessian, self.plan[name], **self.options)
        if swap:
            self.swap_in(name)
        self.done += 1
        self.report(self.done, name)

    def whole_model_passes(self, group, calls, swap=True) -> None:
        """The group's Hessians from passes of the whole model over the calibration data."""
        group_modules = {n: self.modules[n] for n in group}
        # stopping a pass once the group has seen its input is safe when each of its layers
        # runs once per forward
        stop_early = all(calls.get(n) == 1 for n in group)
        hessians = _passes(self.model, self.batches, group_modules, stop_early=stop_early)
        for name in group:
            self.finish(name, hessians.pop(name), swap)

    def block_by_block(self, blocks: nn.ModuleList, per_block, calls) -> None:
        """Capture the first block's inputs once, then run each block alone over the cached
        inputs: once per group of its layers (stopping at the group), once more to produce the
        next block's inputs from its quantized layers."""
        cached = capture_block_inputs(self.model, blocks[0], self.batches)
        last = max((i for i, groups in enumerate(per_block) if groups), default=-1)
        for i in range(last + 1):
            self.one_block(blocks[i], per_block[i], calls, cached)
            if i < last:
                advance_block(blocks[i], cached)

    def one_block(self, block: nn.Module, groups, calls, cached) -> None:
        """GPTQ of one block's layers, group by group, from its cached inputs (a list of [hidden
        states, other args, kwargs]); each layer computes with its quantized weights once done."""
        for group in groups:
            group_modules = {n: self.modules[n] for n in group}
            stop_early = all(calls.get(n) == 1 for n in group)
            with _HessianHooks(group_modules, stop_after_all=stop_early) as hooks, torch.no_grad():
                for hidden, rest, kwargs in cached:
                    hooks.start_batch()
                    _run_block(block, hidden, rest, kwargs)
                hessians = hooks.hessians()
            for name in group:
                self.finish(name, hessians.pop(name), swap=True)


def capture_block_inputs(model: nn.Module, block: nn.Module, batches) -> list[list]:
    """The inputs `block` gets on each calibration batch, as [hidden states, other positional
    args, kwargs]: the model runs up to the block and stops there."""
    device = _model_device(model)
    cached = []

    def capture(module, args, kwargs):
        cached.append([args[0], args[1:], kwargs])
        raise _StopForward

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                _run(model, batch, device)
    finally:
        handle.remove()
    return cached


def advance_block(block: nn.Module, cached) -> None:
    """Replace each cached block input by the block's output: the next block's input."""
    with torch.no_grad():
        for entry in cached:
            entry[0] = _run_block(block, *entry)


def tied_embedding_importance(model: nn.Module, plan: Mapping[str, QuantScheme], batches) -> dict[str, torch.Tensor]:
    """{planned embedding: the damped mean square input of the output head tied to it}, from one
    pass of the float model over `batches` ({} where no planned embedding is tied to a head)."""
    embeddings = {n: s for n, s in plan.items() if not isinstance(model.get_submodule(n), nn.Linear)}
    sources = importance_sources(model, embeddings)
    if not sources:
        return {}
    measured = collect_importance(model, sorted(set(sources.values())), batches, IMPORTANCE_DAMP)
    return {name: measured[head] for name, head in sources.items()}


def gptq_quantize_model(model: nn.Module, plan: Mapping[str, QuantScheme], calibration,
                        progress: bool | Callable | None = None, block_size: int = 128, damp: float = DAMP,
                        act_order: bool = False, static_groups: bool | None = None,
                        sequential: bool = True, weighted_scales: bool = WEIGHTED_SCALES,
                        shrink: float = SHRINK) -> dict[str, QuantizedTensor]:
    """GPTQ-quantize the weights of the planned layers; returns {name: QuantizedTensor}.

    plan: {module name: scheme} (see fewbits.quant.plan.resolve_plan); nn.Linear layers get
        GPTQ, other planned modules (nn.Embedding) are rounded to nearest: a token embedding
        tied to an output head under the importance of the head's input columns (one pass of the
        float model first), as method "imatrix" rounds it, where weighted_scales is on.
    calibration: an iterable of model inputs (tensors, tuples of positional args, or dicts of
        keyword args such as a tokenizer's output; a single tensor or dict is one input); it is
        iterated several times, so a generator is read into a list first. For a causal LM, pass
        use_cache=False in the dicts: a KV cache object passed between blocks rules out the
        block-by-block fast path below.
    sequential: quantize in the order the model calls the layers, each layer's Hessian measured
        with every layer before it already quantized (so later layers see, and compensate for,
        the earlier layers' errors). When the model is a stack of repeated blocks (an
        nn.ModuleList, as in every transformer) whose outputs feed each other directly, the first
        block's inputs are captured once and then each block runs alone; otherwise the whole
        model runs once per group of layers sharing an input, each pass stopping as soon as the
        group has seen it. False: one pass of the float model gives every Hessian.
    progress: True for a progress bar on stderr, or a callable(done, total, name).
    block_size, damp, act_order, static_groups, weighted_scales, shrink: as gptq_quantize_weight.
    The model's float weights are left as they were (quantize_model replaces the modules).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"gptq_quantize_model() takes an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping {{module name: scheme}}, got {type(plan).__name__}")
    plan = {name: get_scheme(s) for name, s in plan.items()}
    if not plan:
        raise ValueError("the plan is empty: nothing to quantize")
    batches = calibration_batches(calibration)
    check_options(block_size, damp, shrink)
    options = dict(block_size=block_size, damp=damp, act_order=act_order, static_groups=static_groups,
                   weighted_scales=weighted_scales, shrink=shrink)
    report = counter(progress, len(plan), "gptq")
    for name in plan:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the model has no module {name!r}") from None
    linear_names = [n for n in plan if isinstance(model.get_submodule(n), nn.Linear)]
    modules = _linear_modules(model, linear_names)
    run = _SequentialGPTQ(model, plan, batches, modules, options, report)
    with _eval_mode(model):
        embedding_importance = tied_embedding_importance(model, plan, batches) if weighted_scales else {}
        try:
            for name in plan:
                if name not in modules:  # embeddings: no input Hessian; rounded to nearest
                    with torch.no_grad():
                        run.results[name] = quantize(run.weight_of(name), plan[name],
                                                     importance=embedding_importance.get(name))
                    if sequential:
                        run.swap_in(name)
                    run.done += 1
                    report(run.done, name)
            if not sequential:
                if linear_names:
                    run.whole_model_passes(linear_names, {}, swap=False)
            elif linear_names:
                blocks_found = _find_blocks(model, linear_names)
                discovery = _Discovery(model, batches[0], modules, blocks_found[1] if blocks_found else None)
                layout = _block_layout(blocks_found, discovery)
                if layout is None:
                    for group in discovery.groups:
                        run.whole_model_passes(group, discovery.calls)
                else:
                    pre, per_block, post = layout
                    for group in pre:
                        run.whole_model_passes(group, discovery.calls)
                    run.block_by_block(blocks_found[1], per_block, discovery.calls)
                    for group in post:
                        run.whole_model_passes(group, discovery.calls)
        finally:
            run.restore()
    return {name: run.results[name] for name in plan}
