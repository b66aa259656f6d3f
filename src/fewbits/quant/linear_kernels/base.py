"""What every kernel of a QuantLinear shares: the interface of a kernel family (LinearKernel) and
of a weight held for one (PreparedWeight), the QuantizedTensor a kernel holds in its own layout
(KernelQuantizedTensor), the batch rules every weight-only kernel follows (bf16_blocks,
tile_batch), the scheme checks several families make, and the steps around a kernel call (the
bias, the activation scales, blocks of decoded rows)."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ...formats import IntFormat
from ...kernels import native
from .. import lowbit_ops as ops
from .. import scales as sc
from ..scheme import QuantScheme
from ..tensor import STATE_KEYS, QuantizedTensor

# up to this many rows of x the w4a8 kernel (4 rows per pass over the codes); larger batches:
# dequant's blocks, faster from about 12-16 rows (1536 x 576 and 4096 x 4096 layers, 1 and 2 threads)
W4A8_MAX_BATCH = 12
LUT4_MAX_BATCH = 8  # up to this many rows of x the fused 4-bit matmul (one pass over the codes)
# bf16 batches on AMX tiles over blocks decoded in the caches (lut4.c's fb_lut4_tile_matmul,
# int8w.c's) up to this many rows x in_features: x's bf16 pairs, which every block of weight rows
# reads, within 1 MiB of the core's 2 MiB L2. Beyond, oneDNN's bf16 GEMM on decoded blocks wins:
# 4 x 4096^2 layers at 128 rows (2^19 values) 5.2-5.9x fp32 on tiles against 4.2-4.5x on blocks,
# at 256 rows 3.5-3.9x against 4.0-5.9x; SmolLM2's layers at 256 rows (<= 2^18.6) 2.4-2.8x
# against 1.6-2.5x (Xeon with AMX, 1 and 2 threads).
TILE_MAX_VALUES = 1 << 19
# the same multiply with AVX512-BF16 dot products (CPUs without AMX, tiles.h's dp_block) keeps
# ahead of oneDNN's blocks further: 4096^2 at 256 rows (2^20 values) 40.8 ms against 47.2 at one
# thread, 20.5 against 22.1 at two; at 512 rows 82.9 against 83.3 (AMD Zen 4, from the caches)
DOT_MAX_VALUES = 1 << 21
# values decoded per block on the dequant path (8 MiB of float32; bfloat16 blocks twice as many
# values, 8 MiB). Blocks of 2^18 values (1 MiB) left batches of 16-256 rows of 4096-wide layers
# at 2.0-3.0x fp32 and made 4x as many GEMM calls; these reach 2.5-4.8x (benchmarks/bench_linear.py)
_ROW_BLOCK_VALUES = 1 << 21


# ---------------------------------------------------------------------------------------------
# the interface: a kernel family, and a weight held for it
# ---------------------------------------------------------------------------------------------
class PreparedWeight:
    """One layer's weight as one kernel holds it, prepared once (QuantLinear builds it when the
    weight arrives and keeps it until the next one).

    `qweight` is the QuantizedTensor the layer exposes (a KernelQuantizedTensor where the kernel
    keeps its own tensors), `extra_nbytes` the bytes held besides it (parameters derived rather
    than read as stored). forward(x2d, bias, dtype) is the kernel on a 2-d input, the bias added,
    in `dtype`. row_call() is the C call that runs one float32 row (the decoder's one-row kernel
    and QuantLinear's fast path for it): (the C function's name, its argument address, its
    return-code check, the object that owns what the address points at), or None.
    tile_call() names the C function that runs float32 batches bound for the bf16 tiles with the
    same arguments as row_call(), or None."""

    extra_nbytes = 0

    def __init__(self, qweight: QuantizedTensor):
        self.qweight = qweight
        self.out_features, self.in_features = (int(d) for d in qweight.shape)

    def forward(self, x2d: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def row_call(self):
        return None

    def tile_call(self) -> str | None:
        return None


class LinearKernel:
    """A kernel family member: its name, whether it runs a scheme and shape on a device
    (can_run), and how a weight is prepared for it (prepare -> PreparedWeight). Each family lives
    in a module of its own; linear_kernels.registry lists them in the order `auto` tries them."""

    name = ""

    def can_run(self, s: QuantScheme, shape: tuple[int, int], device: torch.device) -> bool:
        raise NotImplementedError

    def prepare(self, qt: QuantizedTensor) -> PreparedWeight:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


# ---------------------------------------------------------------------------------------------
# a QuantizedTensor as a kernel holds it
# ---------------------------------------------------------------------------------------------
def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != torch.strided or b.layout != torch.strided:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class KernelQuantizedTensor(QuantizedTensor):
    """A QuantizedTensor held the way a fast kernel wants it.

    It has the scheme, shape, scales and zero points of the tensor it was built from, plus the
    kernel's own tensors (`kernel_tensors`). When the kernel's layout already holds the element
    codes (`codes_from_kernel` given), no second copy is kept: reading `.codes` derives them
    (bit-identical to the original), which costs a pass over the weight. `nbytes` is every byte
    held: the scheme's tensors except derived codes, plus kernel tensors that are not views of
    them (`kernel_nbytes` overrides the size of tensors whose bytes torch cannot see, such as
    oneDNN's opaque prepacked weights).
    """

    def __init__(self, qt: QuantizedTensor, kernel_tensors: dict[str, torch.Tensor],
                 codes_from_kernel: Callable[[dict], torch.Tensor] | None = None,
                 kernel_nbytes: dict[str, int] | None = None):
        # the source tensor was validated when it was built; nothing here changes its meaning
        self.scheme, self.shape, self.dtype = qt.scheme, qt.shape, qt.dtype
        for key in STATE_KEYS:
            if key != "codes":
                setattr(self, key, getattr(qt, key))
        self._stored_codes = None if codes_from_kernel is not None else qt.codes
        self._codes_from_kernel = codes_from_kernel
        self.kernel_tensors = dict(kernel_tensors)
        self._kernel_nbytes = dict(kernel_nbytes or {})

    @property
    def codes(self) -> torch.Tensor:
        if self._stored_codes is not None:
            return self._stored_codes
        return self._codes_from_kernel(self.kernel_tensors)

    @property
    def codes_derived(self) -> bool:
        """True when the codes live only in the kernel's layout."""
        return self._stored_codes is None

    def _held(self) -> list[torch.Tensor]:
        held = [getattr(self, k) for k in STATE_KEYS if k != "codes" and getattr(self, k) is not None]
        if self._stored_codes is not None:
            held.append(self._stored_codes)
        return held

    @property
    def nbytes(self) -> int:
        held = self._held()
        total = sum(t.nbytes for t in held)
        for name, t in self.kernel_tensors.items():
            if name in self._kernel_nbytes:
                total += self._kernel_nbytes[name]
            elif not any(same_storage(t, h) for h in held):
                total += t.nbytes
        return total

    def plain(self) -> QuantizedTensor:
        """A plain QuantizedTensor with the same state (codes materialized)."""
        return QuantizedTensor.from_state_dict(self.scheme, self.shape, self.dtype, self.state_dict())

    def __reduce__(self):
        # copies and pickles are plain QuantizedTensors: kernel layouts (oneDNN's opaque
        # tensors among them) belong to this process and are rebuilt by the module
        return QuantizedTensor.from_state_dict, (self.scheme, self.shape, self.dtype, self.state_dict())


# ---------------------------------------------------------------------------------------------
# batch rules shared by every weight-only kernel
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _tile_limit(lib) -> int:
    return DOT_MAX_VALUES if native.tiles_kind(lib) == 1 else TILE_MAX_VALUES


def tile_limit() -> int:
    """The most rows x in_features of a batch that goes to tiles.h's fused multiply here: on AMX
    tiles TILE_MAX_VALUES, with AVX512-BF16 dot products DOT_MAX_VALUES."""
    lib = native.library()
    return TILE_MAX_VALUES if lib is None else _tile_limit(lib)


def tile_batch(rows: int, in_features: int) -> bool:
    """Whether a batch bf16_blocks sends to bf16 goes to tiles.h's fused multiply (where the build
    has it) rather than to oneDNN's GEMM on decoded blocks: one rule for every weight-only kernel."""
    return rows * in_features <= tile_limit()


def bf16_blocks(x2d: torch.Tensor) -> bool:
    """Whether a weight-only layer multiplies this input in bfloat16 blocks of decoded weight:
    float32 batches of more than LUT4_MAX_BATCH rows on a CPU with hardware bf16 products (where
    oneDNN's bf16 GEMM runs 4-5x as fast as float32's). One rule for every weight-only kernel."""
    return (x2d.dtype == torch.float32 and x2d.shape[0] > LUT4_MAX_BATCH and x2d.device.type == "cpu"
            and ops.fast_bf16_matmul())


def rows_per_block(row_len: int, bits: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows per decoded block: about _ROW_BLOCK_VALUES values (twice as many in bfloat16, whose
    GEMM wants wider blocks), starting on whole bytes."""
    values = _ROW_BLOCK_VALUES * (2 if dtype == torch.bfloat16 else 1)
    rows = max(1, values // max(row_len, 1))
    if bits <= 8:
        step = 8 // math.gcd(row_len * bits, 8)
        rows = max(step, rows // step * step)
    return rows


# ---------------------------------------------------------------------------------------------
# scheme checks that several families make
# ---------------------------------------------------------------------------------------------
def is_int(fmt, bits: int, signed: bool) -> bool:
    return isinstance(fmt, IntFormat) and fmt.bits == bits and fmt.signed == signed


def per_row_or_tensor(s: QuantScheme) -> bool:
    return s.granularity == "tensor" or (s.granularity == "channel" and s._axis(2) == 0)


def int8_weight(s: QuantScheme) -> bool:
    """int8 symmetric weights per output channel or per tensor."""
    return is_int(s.format, 8, True) and s.symmetric and per_row_or_tensor(s)


def w8a8_activations_fast(a: QuantScheme) -> bool:
    """Dynamic activation schemes the fused path computes with quantize()'s exact arithmetic."""
    return (is_int(a.format, 8, True) and a.symmetric and a.scale_method == "absmax"
            and a.mode == "nearest_even" and a.scale_format in ("fp32", "fp16", "bf16")
            and not a.double_quant and a.activations is None
            and (a.granularity == "tensor" or (a.granularity == "channel" and a.axis in (0, -2))))


# ---------------------------------------------------------------------------------------------
# the steps around a kernel call
# ---------------------------------------------------------------------------------------------
def weight_scales(qt: QuantizedTensor) -> torch.Tensor:
    """float32 per-output-channel scales [N] of a per-channel or per-tensor weight."""
    return qt.scale_values().reshape(-1).expand(int(qt.shape[0])).contiguous()


def int8_activations(a: QuantScheme, x2d: torch.Tensor, offset: bool):
    """x's int8 codes and float32 scales per token (or tensor) in activation scheme `a`, as
    quantize() makes them (offset: as uint8 codes + 128, for VNNI's unsigned operand)."""
    with ops.one_thread_if_small(x2d.numel()):
        fp32 = a.scale_format == "fp32"
        return ops.quantize_rows_int8(x2d, a.granularity == "channel",
                                      None if fp32 else lambda v: sc.round_scales(v, a.scale_format),
                                      saturate=not fp32, offset=offset)


def with_bias(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y (a fresh kernel result) in `dtype` plus the bias, in one pass where the types allow."""
    if bias is None:
        return y.to(dtype)
    if y.dtype == dtype:
        return y.add_(bias)
    if torch.promote_types(y.dtype, bias.dtype) == dtype:
        return torch.add(y, bias)
    return y.to(dtype).add_(bias)


def finished(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A float32 kernel result as forward() returns it: as it is where nothing is left to do,
    else with_bias() (single-threaded where small)."""
    if bias is None and dtype == torch.float32:
        return y
    with ops.one_thread_if_small(y.numel()):
        return with_bias(y, bias, dtype)


def rescaled(y: torch.Tensor, act_scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """float32 y * act_scales (+ bias) in `dtype` (one pass when there is a float32 bias): the
    product and the bias added with one rounding (an FMA, as torch.addcmul does on this CPU)."""
    if act_scales.numel() == 1 and y.shape[0] != 1:  # a per-tensor activation scale: one per row
        act_scales = act_scales.reshape(1, 1).expand(y.shape[0], 1)
    lib = native.library() if y.device.type == "cpu" and y.stride(-1) == 1 else None
    if lib is not None and (bias is None or bias.dtype == torch.float32):
        return native.scale_rows_(lib, y, act_scales, bias).to(dtype)
    if bias is not None and bias.dtype == torch.float32:  # in place: no second output buffer
        return torch.addcmul(bias, y, act_scales, out=y).to(dtype)
    return with_bias(y.mul_(act_scales), bias, dtype)


def block_matmul(xm: torch.Tensor, n: int, step: int, block: Callable, bias, dtype) -> torch.Tensor:
    """x @ W.T [rows, n] from W's rows decoded `step` at a time by block(r0, r1) (in xm's dtype;
    each block is used before the next is asked for, so it may reuse one buffer), with the bias."""
    x_t = xm.t()
    y_t = torch.empty(n, xm.shape[0], dtype=xm.dtype, device=xm.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        torch.mm(block(r0, r1), x_t, out=y_t[r0:r1])
    with ops.one_thread_if_small(y_t.numel()):
        return with_bias(y_t.t(), bias, dtype)
