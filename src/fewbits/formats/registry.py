"""The named formats, their aliases, and a parser for eXmY / intN names."""
from __future__ import annotations

import difflib
import re

import torch

from .base import Format
from .floats import FloatFormat
from .integers import IntFormat
from .lookup import IQ4_NL_VALUES, NF4_VALUES, LookupFormat
from .names import _ALIASES, _DESCRIPTIONS, _REGISTRY, normalize_name, register


def describe(fmt: Format) -> str:
    return _DESCRIPTIONS.get(fmt.name, "")


def _f(name, e, m, aliases=(), description="", **kw):
    return register(FloatFormat(e, m, name=name, **kw), aliases, description)


_f("fp64", 11, 52, ("float64", "double", "f64", "binary64", "e11m52"), "IEEE 754 double precision")
_f("fp32", 8, 23, ("float32", "float", "single", "f32", "binary32", "e8m23"), "IEEE 754 single precision")
_f("tf32", 8, 10, ("tensorfloat32", "e8m10"), "NVIDIA TensorFloat-32: fp32 range, fp16 precision (matmul inputs)")
_f("bf16", 8, 7, ("bfloat16", "e8m7", "brain float"), "bfloat16: fp32 range, 8 bits of precision")
_f("fp16", 5, 10, ("float16", "half", "f16", "binary16", "e5m10"), "IEEE 754 half precision")
_f("fp8_e4m3", 4, 3, ("e4m3", "e4m3fn", "float8_e4m3fn", "fp8_e4m3fn", "fp8"), specials="fn",
   description="OCP FP8 E4M3 (e4m3fn): no inf, NaN = S.1111.111, max 448")
_f("fp8_e4m3_ieee", 4, 3, ("float8_e4m3", "e4m3_ieee"),
   description="IEEE-style E4M3 with inf and NaN, max 240 (ml_dtypes float8_e4m3)")
_f("fp8_e4m3fnuz", 4, 3, ("e4m3fnuz", "float8_e4m3fnuz"), specials="fnuz",
   description="E4M3 fnuz (AMD/Graphcore): bias 8, no inf, no -0, NaN = 0x80, max 240")
_f("fp8_e4m3b11fnuz", 4, 3, ("e4m3b11fnuz", "float8_e4m3b11fnuz", "e4m3b11"), bias=11, specials="fnuz",
   description="E4M3 with bias 11, fnuz (TPU): max 30")
_f("fp8_e5m2", 5, 2, ("e5m2", "float8_e5m2"), description="OCP FP8 E5M2: IEEE-style, inf and NaN, max 57344")
_f("fp8_e5m2fnuz", 5, 2, ("e5m2fnuz", "float8_e5m2fnuz"), specials="fnuz",
   description="E5M2 fnuz: bias 16, no inf, no -0, NaN = 0x80, max 57344")
_f("fp8_e3m4", 3, 4, ("e3m4", "float8_e3m4"), description="IEEE-style E3M4 with inf and NaN, max 15.5 (ml_dtypes)")
_f("fp6_e3m2", 3, 2, ("e3m2", "e3m2fn", "float6_e3m2fn", "fp6_e3m2fn"), specials="none",
   description="OCP MX FP6 E3M2: no inf, no NaN, max 28")
_f("fp6_e2m3", 2, 3, ("e2m3", "e2m3fn", "float6_e2m3fn", "fp6_e2m3fn", "fp6"), specials="none",
   description="OCP MX FP6 E2M3: no inf, no NaN, max 7.5")
_f("fp4_e2m1", 2, 1, ("e2m1", "e2m1fn", "float4_e2m1fn", "fp4_e2m1fn", "fp4", "mxfp4_element"), specials="none",
   description="OCP MX FP4 E2M1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6")
# E8M0 rounds to the nearest power of two down to 2^-127; torch's and ml_dtypes' casts give
# 2^-126 for every float32 subnormal strictly between 2^-127 and 2^-126 (see fewbits.round)
_f("e8m0", 8, 0, ("fp8_e8m0", "e8m0fnu", "float8_e8m0fnu", "e8m0_scale"), bias=127, specials="fn",
   subnormals=False, signed=False, zero=False,
   description="OCP MX shared scale E8M0: unsigned powers of two 2^-127..2^127, NaN = 0xFF, no zero")
register(LookupFormat("nf4", NF4_VALUES), ("normalfloat4", "nf4_bnb"),
         "QLoRA NormalFloat4 codebook (bitsandbytes), values in [-1, 1]")
register(LookupFormat("iq4_nl", IQ4_NL_VALUES), ("iq4nl", "kvalues_iq4nl"),
         "llama.cpp's IQ4_NL non-linear 4-bit codebook: integers -127..113, denser near 0")
for _b in range(2, 9):
    register(IntFormat(_b, True), (f"int{_b}_t", f"i{_b}"), f"{_b}-bit signed integer (two's complement)")
    register(IntFormat(_b, False), (f"uint{_b}_t", f"u{_b}"), f"{_b}-bit unsigned integer")

_FLOAT_RE = re.compile(
    r"^(?:fp(?P<total>\d+))?(?P<u>u)?e(?P<e>\d+)m(?P<m>\d+)(?P<spec>fnuz|fnu|fn|ieee|finite)?(?:b(?P<bias>-?\d+))?"
    r"(?P<nosub>nosub)?$"
)
_INT_RE = re.compile(r"^(?P<u>u)?int(?P<bits>\d+)$")


def _parse(key: str) -> Format | None:
    m = _INT_RE.match(key)
    if m:
        return IntFormat(int(m["bits"]), signed=not m["u"])
    m = _FLOAT_RE.match(key)
    if not m:
        return None
    e, man = int(m["e"]), int(m["m"])
    spec = m["spec"]
    signed = not (m["u"] or spec == "fnu")
    specials = {None: "ieee", "ieee": "ieee", "fn": "fn", "fnu": "fn", "fnuz": "fnuz", "finite": "none"}[spec]
    fmt = FloatFormat(e, man, bias=int(m["bias"]) if m["bias"] is not None else None, specials=specials,
                      subnormals=not m["nosub"], signed=signed)
    if m["total"] is not None and int(m["total"]) != fmt.bits:
        raise ValueError(f"fp{m['total']} does not match e{e}m{man}, which is {fmt.bits} bits")
    return fmt


def get_format(name) -> Format:
    """The format for a name, an alias, an eXmY/intN spelling, a torch or ml_dtypes dtype, or a Format."""
    if isinstance(name, Format):
        return name
    if name is None:
        raise TypeError("get_format() needs a format name (e.g. 'fp8_e4m3'), a dtype or a Format, got None")
    if not isinstance(name, str):
        name = _dtype_name(name)
    key = normalize_name(name)
    if key in _ALIASES:
        return _REGISTRY[_ALIASES[key]]
    fmt = _parse(key)
    if fmt is not None:
        return fmt
    candidates = sorted(set(_ALIASES))
    close = difflib.get_close_matches(key, candidates, n=5, cutoff=0.5)
    names = []
    for c in close:
        if _ALIASES[c] not in names:
            names.append(_ALIASES[c])
    hint = f"; did you mean {', '.join(names)}?" if names else ""
    raise ValueError(f"unknown format {name!r}{hint} (fewbits.list_formats() lists them all; "
                     "any eXmY[fn|fnuz|finite] or intN/uintN name also works)")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the value dtypes fewbits takes

# the torch dtypes whose values are exactly a format's: the one map between the two vocabularies
# (get_format(dtype) goes the other way)
_TORCH_DTYPES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(fmt) -> torch.dtype | None:
    """The torch dtype that stores exactly the values of `fmt` (fp64, fp32, bf16, fp16), or None
    where torch has no such floating dtype (tf32, fp8 and narrower are emulated or stored as codes)."""
    name = _TORCH_DTYPES.get(get_format(fmt).name)
    return None if name is None else getattr(torch, name)


def _dtype_name(obj) -> str:
    s = str(obj)
    if s.startswith("torch."):
        return s[len("torch."):]
    name = getattr(obj, "__name__", None) or getattr(obj, "name", None)
    if isinstance(name, str):
        return name
    try:
        import numpy as np

        return np.dtype(obj).name
    except Exception as exc:  # noqa: BLE001 - we only want a readable error
        raise TypeError(f"cannot interpret {obj!r} as a format; pass a name such as 'fp8_e4m3'") from exc


def list_formats(kind: str | None = None) -> list[Format]:
    """Every named format (optionally only 'float', 'int' or 'lookup'), in registry order."""
    fmts = list(_REGISTRY.values())
    if kind is not None:
        fmts = [f for f in fmts if f.kind == kind]
    return fmts


def aliases_of(fmt: Format) -> list[str]:
    return sorted(a for a, n in _ALIASES.items() if n == fmt.name and a != normalize_name(fmt.name))
