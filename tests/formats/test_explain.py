"""fewbits.formats.explanation: what a number becomes in each format, and format summaries."""
import json
import math
from fractions import Fraction

import pytest
import torch

import fewbits as fb
from fewbits.formats import NF4_VALUES
from fewbits.formats.explanation import (
    binade_table, code_fields, code_table, exact_decimal, explain, format_summary, jsonable,
)


def one(x, fmt, mode="nearest_even", **kw):
    (rec,) = explain(x, [fmt], [mode], **kw)
    return rec


def test_e4m3_of_0_3952():
    r = one(0.3952, "fp8_e4m3")
    # 0.3952 lies between 0.375 = 1.5 * 2^-2 and 0.40625 = 1.625 * 2^-2, nearer the latter
    assert r["value"] == 0.40625
    assert r["code"] == 0x2D and r["hex"] == "0x2d"
    assert r["bits"] == "0|0101|101"
    assert (r["sign"], r["exponent"], r["mantissa"]) == ("0", "0101", "101")
    assert r["abs_error"] == float(Fraction(0.40625) - Fraction(0.3952))
    assert r["rel_error"] == float((Fraction(0.40625) - Fraction(0.3952)) / Fraction(0.3952))
    assert r["status"] == "rounded"
    assert r["probability"] == 1.0 and r["alternative"] is None
    assert r["format"] == "fp8_e4m3" and r["mode"] == "nearest_even" and r["overflow"] == "saturate"


def test_bf16_and_fp32_of_0_3952():
    r = one(0.3952, "bf16")
    assert r["value"] == 0.39453125  # 101/256
    assert r["bits"] == "0|01111101|1001010"
    assert r["exact_value"] == "0.39453125"
    r = one(0.3952, "fp32")
    assert r["value"] == float(torch.tensor(0.3952, dtype=torch.float32))
    assert r["bits"] == "0|01111101|10010100101011110101000"


def test_integers_have_no_scale_and_underflow():
    r = one(0.3952, "int8")
    assert r["value"] == 0.0 and r["status"] == "underflow→0"
    assert r["bits"] == "00000000" and r["sign"] is None and r["rel_error"] == 1.0
    r = one(-3.0, "int4")
    assert r["value"] == -3.0 and r["bits"] == "1101" and r["status"] == "exact"
    assert one(-3.0, "uint4")["status"] == "saturated"


def test_codebook_gives_index():
    r = one(0.3952, "nf4")
    assert r["value"] == NF4_VALUES[12] and r["index"] == 12 and r["bits"] == "1100"
    assert r["exponent"] is None


def test_unsigned_exponent_only_format_has_no_sign_field():
    r = one(0.3952, "e8m0")
    assert r["value"] == 0.5 and r["bits"] == "01111110" and r["sign"] is None and r["mantissa"] == ""
    assert one(0.0, "e8m0")["status"] == "saturated"  # no zero: the smallest value, 2^-127


def test_statuses_at_the_edges():
    assert one(1e6, "fp8_e5m2")["status"] == "overflow→inf"
    assert one(1e6, "fp8_e5m2")["abs_error"] == math.inf
    r = one(1e6, "fp8_e4m3")
    assert (r["value"], r["status"], r["bits"]) == (448.0, "saturated", "0|1111|110")
    r = one(1e6, "fp8_e4m3", overflow="nan")
    assert r["status"] == "overflow→nan" and r["bits"] == "0|1111|111"
    assert one(1e-9, "fp8_e4m3")["status"] == "underflow→0"
    assert one(448.0, "fp8_e4m3")["status"] == "exact"
    assert one(-math.inf, "fp8_e5m2")["status"] == "exact"


def test_zero_and_nan():
    r = one(0.0, "fp16")
    assert r["status"] == "exact" and r["rel_error"] is None and r["abs_error"] == 0.0
    r = one(math.nan, "fp8_e4m3")
    assert r["status"] == "nan" and r["code"] == 0x7F and r["abs_error"] is None
    r = one(math.nan, "fp4_e2m1")  # no NaN code in fp4
    assert r["status"] == "nan" and r["code"] is None and r["bits"] is None


def test_modes():
    assert one(0.3952, "fp8_e4m3", "toward_zero")["value"] == 0.375
    assert one(0.3952, "fp8_e4m3", "down")["value"] == 0.375
    assert one(0.3952, "fp8_e4m3", "up")["value"] == 0.40625
    assert one(-0.3952, "fp8_e4m3", "up")["bits"] == "1|0101|100"
    recs = explain(0.3952, ["e4m3", "bf16"], fb.MODES)
    assert [r["mode"] for r in recs] == list(fb.MODES) * 2


def test_stochastic_reports_both_outcomes_with_their_probabilities():
    r = one(0.3952, "fp8_e4m3", "stochastic")
    p_away = math.floor((Fraction(0.3952) - Fraction(0.375)) / Fraction(1, 32) * 2 ** 32) / 2 ** 32
    assert r["value"] == 0.40625 and r["probability"] == p_away
    alt = r["alternative"]
    assert alt["value"] == 0.375 and alt["bits"] == "0|0101|100"
    assert alt["probability"] + r["probability"] == 1.0
    exact = one(0.375, "fp8_e4m3", "stochastic")
    assert exact["probability"] == 1.0 and exact["alternative"] is None


def test_matches_the_fast_kernels():
    for mode in ("nearest_even", "nearest_away", "toward_zero", "up", "down"):
        for x in (0.3952, -1e6, 1e-9, 2748.0, 300.0):
            for r in explain(x, modes=[mode]):
                fmt = fb.get_format(r["format"])
                t = torch.tensor([x], dtype=torch.float64)
                v = fb.round(t, fmt, mode=mode).item()
                assert v == r["value"] or (math.isnan(v) and math.isnan(r["value"])), (x, mode, fmt.name)
                if fmt.bits <= 32:
                    assert fb.encode(t, fmt, mode=mode).item() % 2 ** fmt.bits == r["code"], (x, mode, fmt.name)


def test_bad_input():
    with pytest.raises(ValueError, match="did you mean"):
        explain(1.0, ["fp8_e4m4x"])
    with pytest.raises(ValueError, match="rounding mode"):
        explain(1.0, ["bf16"], ["nearest"])
    with pytest.raises(ValueError, match="no infinity"):
        explain(1.0, ["e4m3"], overflow="inf")


def test_records_are_json_ready_after_jsonable():
    recs = explain(1e6, ["e5m2", "e4m3"]) + explain(math.nan, ["e4m3"])
    text = json.dumps(jsonable(recs), allow_nan=False)
    back = json.loads(text)
    assert back[0]["value"] == "inf" and back[0]["abs_error"] == "inf" and back[2]["value"] == "nan"


def test_format_summary_is_plain_json_for_every_format():
    for fmt in fb.list_formats():
        s = format_summary(fmt)
        json.dumps(s, allow_nan=False)
        for key in ("name", "bits", "layout", "max", "min_normal", "min_subnormal", "eps", "decimal_digits",
                    "specials_description", "bytes_per_billion", "num_values", "aliases", "description"):
            assert key in s
    s = format_summary("e4m3")
    assert (s["name"], s["max"], s["layout"], s["bias"], s["min_subnormal"]) == ("fp8_e4m3", 448.0, "1-4-3", 7,
                                                                                  2.0 ** -9)
    assert format_summary("e5m2")["max"] == 57344.0
    assert format_summary("fp8_e4m3_ieee")["max"] == 240.0
    assert format_summary("int4")["layout"] == "int" and format_summary("nf4")["layout"] == "codebook"
    assert format_summary("fp6_e2m3")["bytes_per_billion"] == 750e6


def test_code_table_e4m3():
    rows = code_table("e4m3")
    assert len(rows) == 256 and [r["code"] for r in rows] == list(range(256))
    assert rows[0x7F]["kind"] == "nan" and rows[0xFF]["kind"] == "nan"
    assert rows[0x7E]["value"] == 448.0 and rows[0x7E]["binary"] == "1.75 × 2^8"
    assert rows[0x01]["exact_value"] == "0.001953125" and rows[0x01]["kind"] == "subnormal"
    assert rows[0x08]["kind"] == "normal" and rows[0x00]["kind"] == "zero"
    assert rows[0x80]["exact_value"] == "-0" and rows[0x80]["kind"] == "zero"
    assert sum(r["kind"] != "nan" for r in rows) == 254  # 253 values, +0 and -0 both listed
    e5m2 = code_table("e5m2")
    assert e5m2[0x7C]["kind"] == "inf" and e5m2[0x7D]["kind"] == "nan"
    assert code_table("e4m3fnuz")[0x80]["kind"] == "nan"
    assert [r["value"] for r in code_table("nf4")] == list(NF4_VALUES)
    assert code_table("int4")[0xF]["value"] == -1.0
    with pytest.raises(ValueError, match="at most 8 bits"):
        code_table("fp16")


def test_binade_table_counts_every_positive_value():
    for name in ("fp16", "bf16", "e4m3", "e5m2fnuz", "e8m0", "fp4_e2m1"):
        fmt = fb.get_format(name)
        rows = binade_table(fmt)
        positives = (fmt.num_values - (1 if fmt.zero else 0)) // (2 if fmt.signed else 1)
        assert sum(r["count"] for r in rows) == positives, name
        assert rows[-1]["last"] == fmt.max
    rows = binade_table("fp16")
    assert rows[0]["kind"] == "subnormal" and rows[0]["first"] == 2.0 ** -24 and len(rows) == 31


def test_exact_decimal_and_fields():
    assert exact_decimal(2.0 ** -9) == "0.001953125"
    assert exact_decimal(448.0) == "448" and exact_decimal(-0.0) == "-0"
    tiny = exact_decimal(2.0 ** -127)
    assert tiny.startswith("5.87747175411143753984368268611122838909") and tiny.endswith("e-39")
    assert exact_decimal(math.inf) == "inf" and exact_decimal(math.nan) == "nan"
    assert Fraction(exact_decimal(0.1)) == Fraction(0.1)
    assert code_fields(fb.get_format("fp4_e2m1"), 0b1011)["bits"] == "1|01|1"


@pytest.mark.parametrize("x", [10 ** 400, -10 ** 400, Fraction(10 ** 400, 3), "1e400", "-1e999"], ids=lambda v: str(v)[:12])
def test_a_number_beyond_float64_is_a_clear_value_error(x):
    with pytest.raises(ValueError, match="beyond float64's range"):
        explain(x, ["fp8_e4m3"])


def test_decimal_beyond_float64_is_refused_too():
    from decimal import Decimal

    with pytest.raises(ValueError, match="beyond float64's range"):
        explain(Decimal("1e400"), ["fp8_e4m3"])  # float() would give inf in silence
    assert one(Decimal("-Infinity"), "fp8_e4m3")["value"] == -448.0


@pytest.mark.parametrize("x", [math.inf, "inf", "-Infinity", 10 ** 300, Fraction(1, 3)], ids=str)
def test_infinity_and_big_finite_numbers_still_work(x):
    r = one(x, "fp8_e4m3")
    assert abs(r["value"]) == (448.0 if x != Fraction(1, 3) else 0.34375)
