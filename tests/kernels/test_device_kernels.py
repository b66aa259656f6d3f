"""The rounding kernels on an accelerator (CUDA) equal the CPU kernels bit for bit.

The CPU kernels are proven equal to the exact reference (test_round_exact.py), so each device
result is compared with the CPU result on the same inputs: every boundary input of every small
format, in every mode and overflow policy, eager; the compiled (Triton) kernels for a set of
cases that reaches every kernel path; stochastic rounding draws the same random word per
element on both. Skipped without CUDA (see the `accel` fixture in tests/conftest.py).
"""
import pytest
import torch

import fewbits as fb
from fewbits import FloatFormat, IntFormat, LookupFormat
from helpers import (assert_same, boundary_inputs, fmt_id, generator, random_wide_floats, sampled_boundary_inputs,
                     valid_overflows)

MODES = list(fb.MODES)
FORMATS = [f for f in fb.list_formats() if f.bits <= 8] + [fb.get_format(n) for n in (
    "bf16", "fp16", "tf32", "fp32", "e5m7", "ue4m3", "e3m2nosub", "int12", "uint10")] + [
    FloatFormat(4, 3, bias=-3), FloatFormat(3, 1, specials="none", zero=False, subnormals=False),
    FloatFormat(8, 2), FloatFormat(11, 10, subnormals=False), IntFormat(16, False),
    LookupFormat("uneven", [-10.0, -0.3125, 2.0 ** -10, 0.25, 7.0]),
    LookupFormat("tiny", [-(2.0 ** -133), 0.0, 2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -127]),
]


def _inputs(fmt, dtype):
    return boundary_inputs(fmt, dtype) if fmt.bits <= 12 else sampled_boundary_inputs(fmt, dtype, n=400, seed=5)


def _compare_round(x, fmt, mode, ovf, accel, what):
    try:
        cpu = fb.round(x, fmt, mode, ovf, generator=generator(5))
    except ValueError as exc:  # float32 input whose results float32 cannot hold: the device refuses too
        assert "beyond float32's range" in str(exc), what
        with pytest.raises(ValueError, match="beyond float32's range"):
            fb.round(x.to(accel), fmt, mode, ovf, generator=generator(5))
        return
    dev = fb.round(x.to(accel), fmt, mode, ovf, generator=generator(5))
    assert dev.device.type == accel.type and dev.dtype == x.dtype and dev.shape == x.shape
    assert_same(dev.cpu(), cpu, x, what)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_eager_round_equals_cpu(fmt, accel):
    with fb.use_backend("eager"):
        for dtype in (torch.float32, torch.float64):
            x = _inputs(fmt, dtype)
            for mode in MODES:
                for ovf in [None] + valid_overflows(fmt):
                    _compare_round(x, fmt, mode, ovf, accel, f"{accel} eager {fmt.name} {mode} {ovf} {dtype}")


@pytest.mark.parametrize("fmt", [fb.get_format(n) for n in ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "nf4", "bf16",
                                                            "fp16", "int8", "e8m0")], ids=fmt_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_inputs_equal_cpu(fmt, dtype, accel):
    x = boundary_inputs(fmt, torch.float32).to(dtype)
    with fb.use_backend("eager"):
        for mode in ("nearest_even", "toward_zero", "stochastic"):
            _compare_round(x, fmt, mode, None, accel, f"{accel} {fmt.name} {mode} {dtype}")


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.bits <= 16], ids=fmt_id)
def test_encode_decode_equal_cpu(fmt, accel):
    x = _inputs(fmt, torch.float32)
    x = x[~torch.isnan(x)] if not fmt.has_nan else x
    with fb.use_backend("eager"):
        for mode in ("nearest_even", "stochastic"):
            cpu = fb.encode(x, fmt, mode, "saturate", generator=generator(3))
            dev = fb.encode(x.to(accel), fmt, mode, "saturate", generator=generator(3))
            assert dev.device.type == accel.type
            assert torch.equal(dev.cpu(), cpu), f"{fmt.name} {mode} codes differ"
            assert_same(fb.decode(dev, fmt).cpu(), fb.decode(cpu, fmt), None, f"{fmt.name} decode")


# the compiled kernels (Triton on CUDA): one case per kernel path and mode, as in
# test_round_exact.COMPILED_CASES
E11M10_NOSUB = FloatFormat(11, 10, subnormals=False)
COMPILED_CASES = [
    ("fp8_e4m3", torch.float32, "nearest_even", "saturate"), ("fp8_e5m2", torch.float64, "nearest_even", "inf"),
    ("nf4", torch.float32, "nearest_even", None), ("e8m0", torch.float32, "nearest_away", "nan"),
    ("int4", torch.float64, "nearest_away", "saturate"), ("bf16", torch.float32, "toward_zero", None),
    ("fp8_e4m3fnuz", torch.float64, "toward_zero", "nan"), ("ue8m0fn", torch.float32, "up", None),
    ("fp64", torch.float64, "up", "saturate"), ("fp4_e2m1", torch.float32, "down", None),
    (E11M10_NOSUB, torch.float64, "down", None), ("fp8_e4m3", torch.float32, "stochastic", "nan"),
    ("e8m0", torch.float64, "stochastic", "saturate"), ("nf4", torch.float32, "stochastic", None),
    ("fp16", torch.float32, "nearest_even", None), ("e8m0", torch.float32, "nearest_even", None),
]


@pytest.mark.parametrize("name,dtype,mode,ovf", COMPILED_CASES,
                         ids=[f"{fmt_id(c[0])}-{c[1]}-{c[2]}-{c[3]}" for c in COMPILED_CASES])
def test_compiled_round_equals_cpu(name, dtype, mode, ovf, accel):
    fmt = fb.get_format(name)
    x = _inputs(fmt, dtype)
    with fb.use_backend("eager"):
        cpu = fb.round(x, fmt, mode, ovf, generator=generator(9))
    with fb.use_backend("compiled"):
        dev = fb.round(x.to(accel), fmt, mode, ovf, generator=generator(9))
        out = torch.empty_like(x, device=accel)
        r = fb.round(x.to(accel), fmt, mode, ovf, generator=generator(9), out=out)
    assert r is out
    assert_same(dev.cpu(), cpu, x, f"compiled {accel} {fmt.name} {mode} {ovf} {dtype}")
    assert_same(out.cpu(), cpu, x, f"compiled out= {accel} {fmt.name} {mode} {ovf} {dtype}")


@pytest.mark.parametrize("mode", ["nearest_even", "stochastic"])
def test_large_input_equals_cpu(mode, accel):
    """2^22 values (random words past 2^16 indices; auto backend: compiled on both)."""
    x = random_wide_floats(1 << 22, seed=3, dtype=torch.float32, lo=-20, hi=20).reshape(1024, -1)
    for fmt in ("fp8_e4m3", "nf4"):
        cpu = fb.round(x, fmt, mode, generator=generator(2))
        dev = fb.round(x.to(accel), fmt, mode, generator=generator(2))
        assert_same(dev.cpu(), cpu, None, f"{fmt} {mode} 2^22 values")
        # non-contiguous input
        cpu_t = fb.round(x.t(), fmt, mode, generator=generator(2))
        dev_t = fb.round(x.to(accel).t(), fmt, mode, generator=generator(2))
        assert_same(dev_t.cpu(), cpu_t, None, f"{fmt} {mode} transposed")


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"),
                                        ("fp8_e4m3fnuz", "float8_e4m3fnuz"), ("fp8_e5m2fnuz", "float8_e5m2fnuz"),
                                        ("bf16", "bfloat16"), ("fp16", "float16")])
def test_torch_preset_equals_torch_cast_on_device(name, dtype, accel):
    """overflow="torch" reproduces torch's own cast on the device too."""
    fmt = fb.get_format(name)
    dt = getattr(torch, dtype)
    x = boundary_inputs(fmt, torch.float32).to(accel)
    try:
        native = x.to(dt).float()
    except (RuntimeError, TypeError) as exc:
        pytest.skip(f"torch cannot cast to {dtype} on {accel}: {exc}")
    with fb.use_backend("eager"):
        ours = fb.round(x, fmt, overflow="torch")
    assert_same(ours.cpu(), native.cpu(), x.cpu(), f"{name} vs torch {dtype} on {accel}")


def test_parameters_off_the_cpu_are_cached_not_copied():
    """On an accelerator the kernels' small parameter vectors are copied there once (cached);
    per-call seeds are filled in on a clone. (The meta device stands in: no GPU needed.)"""
    from fewbits.kernels.random import ints_on, seed_tensor

    a = ints_on((1, 2, 3), "meta")
    assert ints_on((1, 2, 3), "meta") is a and a.device.type == "meta"
    assert ints_on((1, 2, 3), "meta", fill={1: 2}) is a  # nothing to change
    c = ints_on((1, 2, 3), "meta", fill={1: 7})
    assert c is not a and c.shape == (3,)
    assert ints_on((1, 2, 3), "cpu", fill={1: 7}).tolist() == [1, 7, 3]
    assert seed_tensor((5, 6), "cpu").tolist() == [5, 6]
    assert seed_tensor((0, 0), "meta") is seed_tensor((0, 0), "meta")
