"""Small C kernels for hot loops that torch has no fused op for, built on first use.

torch runs one pass over memory per op, so a computation of six elementwise steps reads and
writes its data six times; torch.compile fuses them, but on this project's CPU its generated
code for a row reduction followed by a float -> int8 conversion took ~100 us for 64 x 4096
values against ~24 us for a plain C loop (the w8a8 activation quantizer), and a 16-entry table
lookup has no vector form in it at all (the 4-bit matmul). The C source lives in `csrc/`; the
first call compiles it with the machine's C compiler for this CPU into a cache directory and
loads it with ctypes (`loader`: the cache's trust rules). Where that cannot be done, `library()`
is None and every caller keeps its torch path -- the reference the C kernels are tested against:
bit for bit, except the 4-bit matmul's float32 sums, whose order is its own.

One binding module per C source, its ctypes declarations beside the classes that prepare a
weight for it: `rowquant` (rowquant.c), `lut4` (lut4.c, with tiles.h's `tiles`), `w4a8`,
`int8w`, `introw`, `int8mm`, `round32`, `kquant`, `decode`; `shared`: the return-code check they all use.
This package presents their public names (`native.library()`, `native.Lut4Weight`, ...).
"""
from .decode import DECODE_MAX_HEAD_DIM, DecodeStep, RowKernel, declare_decode, decode_heads_ok, function_address
from .int8mm import (
    AMX_GEMV_MAX_K, Int8Panels, amx_int8_gemm, amx_int8_ready, amx_pack, amx_w8a8_ready, declare_int8mm, q8_bf16,
    vnni_w8a8_ready, w8a8_amx_row_rc,
)
from .int8w import Int8Weight, declare_int8w, int8w_rc
from .introw import IntRowWeight, TwoLevel, declare_introw, introw_rc, introw_supported, introw_vector
from .kquant import (
    KQUANT_MAX_GROUP, LOOKUP_MAX_TABLE, declare_kquant, kquant_float_min, kquant_refine, kquant_supported,
    kquant_symmetric, lookup_signed,
)
from .loader import (
    CFLAGS, DIGEST_SUFFIX, HEADERS, LIBRARY_DIR, OPENMP_FLAGS, SOURCE_DIR, SOURCES, STALE_BUILD_S, cache_dir,
    cpu_flags, library, reset, status, turned_off,
)
from .lut4 import Lut4Weight, _Lut4Row, declare_lut4, lut4_rc, lut4_supported, tiles, tiles_kind  # noqa: F401
from .round32 import FLOAT_KINDS, declare_round32, round_float_f32, round_lut_f32, round_lut_sr_f32
from .rowquant import declare_rowquant, int8_rows_bf16, quantize_rows_int8, row_absmax, row_int8_scales, scale_rows_
from .shared import NONFINITE_ACTIVATIONS, check_rc, rc_check
from .w4a8 import W4A8Weight, declare_w4a8, w4a8_dequantized_x, w4a8_row_rc

__all__ = [
    "AMX_GEMV_MAX_K", "CFLAGS", "DECODE_MAX_HEAD_DIM", "DIGEST_SUFFIX", "FLOAT_KINDS", "HEADERS", "KQUANT_MAX_GROUP",
    "LIBRARY_DIR", "NONFINITE_ACTIVATIONS", "OPENMP_FLAGS", "SOURCES", "SOURCE_DIR", "STALE_BUILD_S",
    "DecodeStep", "Int8Panels", "Int8Weight", "IntRowWeight", "TwoLevel", "Lut4Weight", "RowKernel", "W4A8Weight",
    "amx_int8_gemm", "amx_int8_ready", "amx_pack", "amx_w8a8_ready", "cache_dir", "check_rc", "cpu_flags",
    "declare_decode", "declare_int8mm", "declare_int8w", "declare_introw", "declare_kquant", "declare_lut4", "declare_round32",
    "declare_rowquant", "declare_w4a8", "decode_heads_ok", "function_address", "int8_rows_bf16", "int8w_rc", "introw_rc", "introw_supported", "introw_vector",
    "kquant_float_min", "kquant_refine", "kquant_supported", "kquant_symmetric", "library", "lookup_signed",
    "LOOKUP_MAX_TABLE", "lut4_rc",
    "lut4_supported", "q8_bf16", "quantize_rows_int8", "rc_check", "reset", "round_float_f32", "round_lut_f32",
    "round_lut_sr_f32", "row_absmax", "row_int8_scales", "scale_rows_", "status", "tiles", "tiles_kind",
    "turned_off", "vnni_w8a8_ready", "w4a8_dequantized_x", "w4a8_row_rc", "w8a8_amx_row_rc",
]
