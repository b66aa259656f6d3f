"""What a number becomes in each format, and what each format is: the data behind
`fewbits explain` and `fewbits formats`.

Everything here is computed with the exact scalar reference (fewbits.formats.reference), so it is
correct to the bit and slow; it is meant for people looking at one number or one format.

JSON: the records are plain dicts of floats, ints, strings, booleans and None. Values can be
infinite or NaN (a result that overflowed to inf, a NaN input); `jsonable()` turns such floats
into the strings "inf", "-inf" and "nan", which is how every `--json` output of fewbits writes
them (strict JSON has no literal for them).
"""
from __future__ import annotations

import math
import sys
from decimal import Decimal
from fractions import Fraction

from .base import Format
from .floats import FloatFormat
from .integers import IntFormat
from .lookup import LookupFormat
from .reference import check_mode, encode_value, round_value
from .registry import aliases_of, describe, get_format, list_formats

_RAND_WORDS = 2 ** 32


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def exact_decimal(v: float) -> str:
    """The exact decimal expansion of a float (every binary fraction has a finite one):
    0.001953125, 448, -0.39453125, 5.877471754111437539843682686111228389093327783860437607543758531392086738309604e-39.
    Plain notation between 1e-6 and 1e16, scientific outside; 'inf', '-inf', 'nan' for specials."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "-0" if math.copysign(1.0, v) < 0 else "0"
    d = Decimal(v)
    if 1e-6 <= abs(v) < 1e16:
        s = format(d, "f")
        if "." in s:
            s = s.rstrip("0").rstrip(".")
        return s
    mant, _, exp = format(d, "e").partition("e")
    if "." in mant:
        mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{int(exp):+03d}"


def jsonable(obj):
    """obj with every non-finite float replaced by "inf", "-inf" or "nan" (recursively), so that
    json.dumps(..., allow_nan=False) accepts it."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def short_layout(fmt: Format) -> str:
    """'1-4-3' (sign-exponent-mantissa bits) for floats, 'int'/'uint' for integers, 'codebook'."""
    if isinstance(fmt, FloatFormat):
        return fmt.layout
    if isinstance(fmt, IntFormat):
        return "int" if fmt.signed else "uint"
    if isinstance(fmt, LookupFormat):
        return "codebook"
    return getattr(fmt, "layout", fmt.kind)


def code_fields(fmt: Format, code: int) -> dict:
    """The bit string of a code, split into its fields.

    Floats: {"sign": "0", "exponent": "0101", "mantissa": "101", "bits": "0|0101|101"} (a format
    without a sign bit has sign None and no sign field in "bits"; one without mantissa bits has
    mantissa ""). Integers and codebooks: the plain bits, fields None."""
    width = fmt.bits
    raw = format(code, f"0{width}b")
    if isinstance(fmt, FloatFormat):
        s, e, m = fmt.split_code(code)
        sign = str(s) if fmt.signed else None
        exponent = format(e, f"0{fmt.exp_bits}b")
        mantissa = format(m, f"0{fmt.man_bits}b") if fmt.man_bits else ""
        parts = ([sign] if sign is not None else []) + [exponent] + ([mantissa] if mantissa else [])
        return {"sign": sign, "exponent": exponent, "mantissa": mantissa, "bits": "|".join(parts)}
    return {"sign": None, "exponent": None, "mantissa": None, "bits": raw}


def _code_info(fmt: Format, code: int | None) -> dict:
    if code is None:
        return {"code": None, "hex": None, "bits": None, "sign": None, "exponent": None, "mantissa": None,
                "index": None}
    info = {"code": code, "hex": _hex(fmt, code), **code_fields(fmt, code)}
    info["index"] = code if isinstance(fmt, LookupFormat) else None
    return info


def _hex(fmt: Format, code: int) -> str:
    return f"0x{code:0{max(1, (fmt.bits + 3) // 4)}x}"


# ---------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------
def as_float64(x) -> float:
    """x as a Python float; ValueError for a finite number float64 cannot hold (float() would
    raise a bare OverflowError for big ints and Fractions, and give inf for Decimals and strings)."""
    try:
        v = float(x)
    except OverflowError:
        v = math.inf
    if math.isinf(v) and not _is_infinite(x):
        raise ValueError(f"x = {_short(x)} is beyond float64's range (largest finite value "
                         f"{sys.float_info.max:.6g}); explain reads x as a float64: pass math.inf to see "
                         "what infinity becomes in each format")
    return v


def _is_infinite(x) -> bool:
    if isinstance(x, (int, Fraction)):
        return False
    if isinstance(x, Decimal):
        return x.is_infinite()
    if isinstance(x, str):
        return x.strip().lower().lstrip("+-") in ("inf", "infinity")
    return math.isinf(x)


def _short(x) -> str:
    s = str(x)
    return s if len(s) <= 40 else f"{s[:12]}...{s[-6:]} ({len(s)} characters)"


def explain(x: float, formats=None, modes=("nearest_even",), overflow: str | None = None) -> list[dict]:
    """What x becomes in each format under each rounding mode, exactly.

    x is read as a Python float (float64): a decimal such as 0.3952 is first the nearest float64,
    and errors are measured from that float64. A finite number beyond float64's range (10**400,
    Fraction(10**400), Decimal("1e400"), "1e400") raises ValueError rather than becoming inf;
    pass math.inf to see what infinity becomes. formats: names or Format objects (default: every
    registered format); modes: rounding modes (fewbits.MODES); overflow: an overflow policy or
    preset for every format (default: each format's own default; a policy a format cannot take,
    such as 'inf' for fp8_e4m3, raises ValueError).

    Integer formats hold integers and have no scale here: 0.3952 in int8 is 0 ('underflow→0').
    A quantizer (fewbits.quant) would first divide by a scale; this shows the format itself.

    One dict per (format, mode), formats outer, with keys:
      x, format, kind, format_bits, mode, overflow (the policy applied),
      value (float; may be inf or NaN), exact_value (its exact decimal, a string),
      code (int, None when the result has no code: NaN into a format without NaN), hex,
      bits (the code as a bit string split into fields: "0|0101|101" for sign|exponent|mantissa;
      plain bits for integers and codebooks), sign, exponent, mantissa (the field strings, None
      for integers and codebooks), index (the table index for codebooks, else None),
      abs_error (|value - x|, exact then rounded to float; inf on overflow to inf/NaN; None for a
      NaN input), rel_error (abs_error / |x|; None when x is 0, infinite or NaN),
      status: 'exact' (value == x), 'rounded', 'saturated' (x lies outside [lowest, max] and
      became the nearest finite end), 'underflow→0' (non-zero x became 0), 'overflow→inf',
      'overflow→nan', 'nan' (x is NaN),
      probability: chance of this outcome (1.0 except in 'stochastic' mode, where the record
      shows the likelier of the two neighbours, the one toward zero on a tie),
      alternative: for 'stochastic', the other outcome as {value, exact_value, code, hex, bits,
      probability}; None otherwise or when x is exact.
    """
    x = as_float64(x)
    fmts = list_formats() if formats is None else [get_format(f) for f in formats]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if not modes:
        raise ValueError("explain needs at least one rounding mode")
    for mode in modes:
        check_mode(mode)
    records = []
    for fmt in fmts:
        policy = fmt.check_overflow(overflow)
        for mode in modes:
            records.append(_explain_one(x, fmt, mode, policy))
    return records


def _explain_one(x: float, fmt: Format, mode: str, policy: str) -> dict:
    alternative = None
    probability = 1.0
    if mode == "stochastic" and not math.isnan(x):
        away_words = _stochastic_away_words(x, fmt, policy)
        away = round_value(x, fmt, mode, policy, rand32=0)
        toward = round_value(x, fmt, mode, policy, rand32=_RAND_WORDS - 1)
        p_away = away_words / _RAND_WORDS
        if away_words == 0 or _same(away, toward):
            value = toward
            probability = 1.0
        else:
            if p_away > 0.5:
                value, other, probability, p_other = away, toward, p_away, 1.0 - p_away
            else:
                value, other, probability, p_other = toward, away, 1.0 - p_away, p_away
            alternative = {"value": other, "exact_value": exact_decimal(other), "probability": p_other,
                           **_pick_code_info(fmt, x, mode, policy, other)}
        code_info = _pick_code_info(fmt, x, mode, policy, value)
    else:
        value = round_value(x, fmt, mode, policy)
        code_info = _code_info(fmt, _code_or_none(x, fmt, mode, policy))
    abs_error, rel_error = _errors(x, value)
    return {
        "x": x, "format": fmt.name, "kind": fmt.kind, "format_bits": fmt.bits, "mode": mode,
        "overflow": policy, "value": value, "exact_value": exact_decimal(value), **code_info,
        "abs_error": abs_error, "rel_error": rel_error, "status": _status(x, value, fmt),
        "probability": probability, "alternative": alternative,
    }


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


def _stochastic_away_words(x: float, fmt: Format, policy: str) -> int:
    """How many of the 2**32 random words round x away from zero (the reference rounds away iff
    r < K, so K is found by bisection on r)."""
    toward = round_value(x, fmt, "stochastic", policy, rand32=_RAND_WORDS - 1)
    lo, hi = 0, _RAND_WORDS  # invariant: words < lo round away; words >= hi do not
    while lo < hi:
        mid = (lo + hi) // 2
        if _same(round_value(x, fmt, "stochastic", policy, rand32=mid), toward):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _pick_code_info(fmt: Format, x: float, mode: str, policy: str, value: float) -> dict:
    """Code info of a stochastic outcome: encode with the random word that produces it."""
    for word in (0, _RAND_WORDS - 1):
        if _same(round_value(x, fmt, mode, policy, rand32=word), value):
            return _code_info(fmt, _code_or_none(x, fmt, mode, policy, rand32=word))
    raise AssertionError("unreachable: a stochastic outcome not produced by either extreme word")


def _code_or_none(x: float, fmt: Format, mode: str, policy: str, rand32: int | None = None) -> int | None:
    try:
        return encode_value(x, fmt, mode, policy, rand32=rand32)
    except ValueError:  # NaN into a format without a NaN code
        return None


def _errors(x: float, value: float) -> tuple[float | None, float | None]:
    if math.isnan(x):
        return None, None
    if math.isinf(x):
        return (0.0 if value == x else math.inf), None
    if math.isnan(value) or math.isinf(value):
        return math.inf, (None if x == 0 else math.inf)
    err = abs(Fraction(value) - Fraction(x))
    rel = None if x == 0 else float(err / abs(Fraction(x)))
    return float(err), rel


def _status(x: float, value: float, fmt: Format) -> str:
    if math.isnan(x):
        return "nan"
    if math.isnan(value):
        return "overflow→nan"
    if math.isinf(value):
        return "exact" if value == x else "overflow→inf"
    if value == x:
        return "exact"
    if x > fmt.max or x < fmt.lowest:
        return "saturated"
    if value == 0:
        return "underflow→0"
    return "rounded"


# ---------------------------------------------------------------------------------------------
# describing formats
# ---------------------------------------------------------------------------------------------
def format_summary(fmt) -> dict:
    """Every property of a format as a JSON-ready dict (all numbers are finite; absent ones are
    None). Keys: name, description, aliases, kind, bits, layout ('1-4-3', 'int', 'uint',
    'codebook'), layout_description, signed, sign_bits, exponent_bits, mantissa_bits, bias,
    specials (float convention 'ieee'|'fn'|'fnuz'|'none', else None), specials_description,
    subnormals, has_inf, has_nan, has_negative_zero, max, lowest, min_normal (smallest positive
    normal; for integers and codebooks the smallest positive value), min_subnormal, min_positive,
    eps, decimal_digits, num_values, default_overflow, bytes_per_billion, values (codebooks only)."""
    fmt = get_format(fmt)
    is_float = isinstance(fmt, FloatFormat)
    min_positive = fmt.min_positive if is_float else fmt.min_normal
    return {
        "name": fmt.name,
        "description": describe(fmt),
        "aliases": aliases_of(fmt),
        "kind": fmt.kind,
        "bits": fmt.bits,
        "layout": short_layout(fmt),
        "layout_description": fmt.layout,
        "signed": fmt.signed,
        "sign_bits": int(fmt.signed) if is_float else None,
        "exponent_bits": fmt.exp_bits if is_float else None,
        "mantissa_bits": fmt.man_bits if is_float else None,
        "bias": fmt.bias if is_float else None,
        "specials": fmt.specials if is_float else None,
        "specials_description": fmt.specials_description,
        "subnormals": fmt.subnormals if is_float else None,
        "has_inf": fmt.has_inf,
        "has_nan": fmt.has_nan,
        "has_negative_zero": fmt.has_negative_zero if is_float else False,
        "max": fmt.max,
        "lowest": fmt.lowest,
        "min_normal": fmt.min_normal,
        "min_subnormal": fmt.min_subnormal,
        "min_positive": min_positive,
        "eps": fmt.eps,
        "decimal_digits": fmt.decimal_digits,
        "num_values": fmt.num_values,
        "default_overflow": fmt.default_overflow,
        "bytes_per_billion": fmt.bytes_per_billion(),
        "values": list(fmt.table) if isinstance(fmt, LookupFormat) else None,
    }


def value_formula(fmt: Format) -> str:
    """How a code maps to its value, in words and symbols."""
    if isinstance(fmt, FloatFormat):
        s = "(-1)^S × " if fmt.signed else ""
        frac = "1.M" if fmt.man_bits else "1"
        lines = [f"value = {s}2^(E-{fmt.bias}) × {frac}" if fmt.bias >= 0 else
                 f"value = {s}2^(E+{-fmt.bias}) × {frac}"]
        if fmt.zero:
            lines[0] += "   (E ≥ 1)"
            if fmt.subnormals and fmt.man_bits:
                lines.append(f"subnormal, E = 0: value = {s}2^{fmt.emin} × 0.M")
            else:
                lines.append("E = 0 holds only zero (no subnormals)")
        return "; ".join(lines)
    if isinstance(fmt, IntFormat):
        return ("value = the two's complement integer of the bits" if fmt.signed
                else "value = the unsigned integer of the bits")
    if isinstance(fmt, LookupFormat):
        return "value = table[code] (the code is an index into the codebook)"
    return ""


def code_kind(fmt: Format, code: int) -> str:
    """'zero' | 'subnormal' | 'normal' | 'inf' | 'nan' for floats; 'zero' | 'integer' for integers;
    'zero' | 'entry' for codebooks."""
    if isinstance(fmt, FloatFormat):
        kind = fmt.code_kind(code)
        if kind != "finite":
            return kind
        _, e, m = fmt.split_code(code)
        if e == 0 and fmt.zero:
            return "subnormal" if (m and fmt.subnormals) else "zero"
        return "normal"
    value = fmt.decode_code(code)
    if value == 0:
        return "zero"
    return "integer" if isinstance(fmt, IntFormat) else "entry"


def binary_form(fmt: Format, code: int) -> str | None:
    """The value of a finite float code as significand × power of two, exactly: '1.625 × 2^-2',
    '0.25 × 2^-6', '-1.5 × 2^3'. None for specials, zero and non-float formats."""
    if not isinstance(fmt, FloatFormat) or fmt.code_kind(code) != "finite":
        return None
    s, e, m = fmt.split_code(code)
    if e == 0 and fmt.zero:
        if not (m and fmt.subnormals):
            return None
        significand, power = Fraction(m, 2 ** fmt.man_bits), fmt.emin
    else:
        significand, power = 1 + Fraction(m, 2 ** fmt.man_bits), e - fmt.bias
    sig = exact_decimal(float(significand))
    return f"{'-' if s else ''}{sig} × 2^{power}"


def code_table(fmt, max_bits: int = 8) -> list[dict]:
    """Every code of a format of at most max_bits bits: {code, hex, bits, sign, exponent,
    mantissa, value (float, may be inf/NaN), exact_value (string), binary (significand × 2^e,
    floats only), kind}."""
    fmt = get_format(fmt)
    if fmt.bits > max_bits:
        raise ValueError(f"{fmt.name} has {2 ** fmt.bits:,} codes; code tables are for formats of at most "
                         f"{max_bits} bits (see binade_table)")
    n = len(fmt.table) if isinstance(fmt, LookupFormat) else 2 ** fmt.bits
    rows = []
    for code in range(n):
        value = fmt.decode_code(code)
        fields = code_fields(fmt, code)
        rows.append({"code": code, "hex": _hex(fmt, code), **fields, "value": value,
                     "exact_value": exact_decimal(value), "binary": binary_form(fmt, code),
                     "kind": code_kind(fmt, code)})
    return rows


def binade_table(fmt) -> list[dict]:
    """The positive values of a float format by binade (one exponent field each), ascending:
    {exponent_field, exponent (unbiased, None for subnormals), kind ('subnormal'|'normal'),
    first, last (smallest and largest finite value), step (gap between neighbours), count (finite
    values)}. Integers: one row covering the positive integers. Codebooks: not applicable (ValueError)."""
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        return [{"exponent_field": None, "exponent": None, "kind": "integer", "first": 1.0, "last": fmt.max,
                 "step": 1.0, "count": int(fmt.max)}]
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"{fmt.name} is a codebook; it has no binades (see code_table)")
    rows = []
    m = fmt.man_bits
    if fmt.zero and fmt.subnormals and m:
        rows.append({"exponent_field": 0, "exponent": None, "kind": "subnormal",
                     "first": fmt.min_subnormal, "last": math.ldexp(1 - 2.0 ** -m, fmt.emin),
                     "step": fmt.min_subnormal, "count": 2 ** m - 1})
    top_field, top_man = fmt._max_code_fields()
    for field in range(1 if fmt.zero else 0, top_field + 1):
        e = field - fmt.bias
        count = 2 ** m if field < top_field else top_man + 1
        rows.append({"exponent_field": field, "exponent": e, "kind": "normal", "first": math.ldexp(1.0, e),
                     "last": float((1 + Fraction(count - 1, 2 ** m)) * Fraction(2) ** e),
                     "step": math.ldexp(1.0, e - m), "count": count})
    return rows
