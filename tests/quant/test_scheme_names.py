"""Scheme names follow the format names' spelling rule: one vocabulary (issue 12, item 8)."""
import pytest

import fewbits as fb
from fewbits.formats.registry import normalize_name
from fewbits.quant import get_scheme, list_schemes


@pytest.mark.parametrize("spelling, preset", [
    ("e4m3", "fp8"), ("FP8 E4M3", "fp8"), ("float8_e4m3fn", "fp8"), ("fp8_e4m3fn", "fp8"),
    ("e5m2", "fp8_e5m2"), ("float8_e5m2", "fp8_e5m2"),
    ("e2m1", "fp4"), ("fp4_e2m1", "fp4"), ("float4_e2m1fn", "fp4"),
    ("i8", "int8"), ("int8_t", "int8"), ("INT-4", "int4"), ("i4", "int4"),
    ("normalfloat4", "nf4"), ("NF4", "nf4"), ("bfloat16", "bf16"), ("half", "fp16"),
    ("nf4.dq", "nf4_dq"), ("Int4 Asym G32", "int4_asym_g32"), ("MX-FP4", "mxfp4"),
])
def test_a_format_spelling_names_the_preset_of_that_format(spelling, preset):
    assert get_scheme(spelling) is get_scheme(preset)


def test_every_format_alias_of_a_preset_named_after_a_format_works():
    """Every spelling the format registry accepts for int8, nf4, fp8, fp4, bf16, ... is the preset."""
    for name in list_schemes():
        try:
            fmt = fb.get_format(name)
        except ValueError:
            continue  # mxfp4, int4_g32, ...: not a format's name
        for alias in fb.formats.aliases_of(fmt) + [fmt.name]:
            assert get_scheme(alias).format == fmt, (name, alias)


def test_one_spelling_rule():
    """get_scheme ignores exactly what get_format ignores (case, spaces, '_', '-', '.')."""
    for name in list_schemes():
        for variant in (name.upper(), name.replace("_", "-"), name.replace("_", " "), name.replace("_", ".")):
            assert get_scheme(variant) is get_scheme(name)
            assert normalize_name(variant) == normalize_name(name)


@pytest.mark.parametrize("name, msg", [
    ("e3m2", "format fp6_e3m2, which has no preset of its own. Presets with fp6_e3m2 elements: mxfp6"),
    ("uint4", "int4_asym"),
    ("fp32", "QuantScheme('fp32'"),
    ("nf5", "Did you mean: nf4"),
])
def test_a_format_without_a_preset_says_so(name, msg):
    with pytest.raises(ValueError, match="unknown quantization scheme") as info:
        get_scheme(name)
    assert msg in str(info.value)


def test_schemes_without_super_blocks_describe_themselves_as_before():
    """Files written today of schemes without k-quant super-blocks carry no new scheme fields, so
    the fewbits release that wrote format-1 files first (which refuses unknown fields) reads them."""
    import fewbits as fb

    before = {"format", "granularity", "axis", "group_size", "symmetric", "scale_format", "scale_method",
              "percentile", "mx_scale_mode", "mode", "seed", "double_quant", "activations", "zero_point", "name"}
    for name in ("int4", "nf4_dq", "q4_1", "w8a8", "mxfp4"):
        d = fb.get_scheme(name).to_dict()
        assert set(d) == before, name
        assert fb.QuantScheme.from_dict(d) == fb.get_scheme(name)
    d = fb.get_scheme("q4_k").to_dict()
    assert d["super_block"] == 256 and d["sub_scale_format"] == "uint6"
    assert fb.QuantScheme.from_dict(d) == fb.get_scheme("q4_k")
