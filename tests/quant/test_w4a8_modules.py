"""The w4a8 scheme and QuantLinear's w4a8 kernel: int4 weights in groups of 32 and dynamic int8
activations in blocks of 32 (csrc/w4a8.c). The kernel's exact arithmetic is tested in
tests/kernels/test_w4a8.py; here: the activations it quantizes are quantize()'s, its result is the
reference (F.linear of the dequantized activations and weight) up to float32 rounding, batches
beyond W4A8_MAX_BATCH, bias and dtypes, bad input, state and copies."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

from fewbits.kernels import native
from fewbits.quant import QuantizedTensor, get_scheme, quantize
from fewbits.quant import lowbit_ops as ops, modules as qm
from fewbits.quant.modules import QuantLinear, available_kernels


def _vectorized() -> bool:
    lib = native.library()
    return lib is not None and bool(lib.fb_w4a8_vectorized())


needs_kernel = pytest.mark.skipif(not _vectorized(), reason="the w4a8 C kernel is not vectorized here (no AVX512-VNNI)")

ACT = get_scheme("w4a8").activations
Q4_1_A8 = get_scheme("q4_1").with_(activations=ACT)           # uint4 + float minimum, fp16 parameters
BF16_A8 = get_scheme("w4a8").with_(scale_format="bf16")
FP32_A8 = get_scheme("w4a8").with_(scale_format="fp32")


def _linear(n, k, bias=False, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def _bound(q: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """float32-rounding bound of F.linear(xd, wd): a few ulps of sum |xd| |wd| per output."""
    xd = quantize(x.reshape(-1, q.in_features), ACT).dequantize().double()
    wd = q.qweight.dequantize().double()
    return 4 * q.in_features * 2.0 ** -24 * (xd.abs() @ wd.abs().T) + 1e-30


def test_the_scheme():
    s = get_scheme("w4a8")
    assert (s.format.name, s.granularity, s.group_size, s.symmetric, s.scale_format, s.scale_method) == \
        ("int4", "group", 32, True, "fp16", "gguf")
    a = s.activations
    assert (a.format.name, a.granularity, a.group_size, a.scale_format) == ("int8", "group", 32, "fp32")
    assert "activations int8 dynamic per block of 32" in s.describe()
    w = torch.randn(64, 256)
    a, b = quantize(w, s), quantize(w, "q4_0")  # the weights are GGUF Q4_0's, bit for bit
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert "activations int8 dynamic per token" in get_scheme("w8a8").describe()


@needs_kernel
@pytest.mark.parametrize("scheme", ["w4a8", FP32_A8, Q4_1_A8, BF16_A8],
                         ids=["int4 fp16", "int4 fp32", "q4_1 fp16 + min", "int4 bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, qm.W4A8_MAX_BATCH])
@pytest.mark.parametrize("k", [576, 128, 32, 4096])
def test_small_batches_are_the_reference_up_to_float32_rounding(scheme, rows, k):
    q = QuantLinear.from_linear(_linear(80, k, seed=rows), scheme)
    assert q.kernel == "w4a8"
    x = torch.randn(rows, k) * 3
    with torch.no_grad():
        y, ref = q(x), q.reference_forward(x)
    assert ((y.double() - ref.double()).abs() <= _bound(q, x)).all()


@needs_kernel
def test_the_activations_are_quantized_as_quantize_does():
    """fb_w4a8_linear's own quantizer against matmul() on quantize()'s codes and scales: the
    same bits (zeros, tiny and huge blocks included)."""
    q = QuantLinear.from_linear(_linear(64, 256), "w4a8")
    x = torch.randn(3, 256)
    x[0, :32] = 0.0
    x[1, 32:64] *= 1e-30
    x[2, 64:96] *= 1e30
    qx = quantize(x, ACT)
    codes = qx.codes.view(torch.int8).view(3, 256)
    scales = qx.scales.view(3, 8).float()
    lib = native.library()
    assert torch.equal(q._prepared.w.linear(lib, x), q._prepared.w.matmul(lib, codes, scales))


@needs_kernel
def test_the_dequantized_activations_of_batches_are_quantizes():
    lib = native.library()
    x = torch.randn(20, 576) * 4
    x[0, :32] = 0.0
    x[1, 32:64] *= 1e-30
    x[2, 64:96] *= 1e30
    assert torch.equal(native.w4a8_dequantized_x(lib, x), quantize(x, ACT).dequantize())
    assert torch.equal(native.w4a8_dequantized_x(lib, x[:, :288]), quantize(x[:, :288], ACT).dequantize())
    want = quantize(x, ACT).dequantize().to(torch.bfloat16)  # rounded in the same pass (equal values:
    assert torch.equal(native.w4a8_dequantized_x(lib, x, torch.bfloat16), want)  # an all-zero block may give -0)
    wide = torch.randn(3, 16416)  # rows longer than the C code's stack buffers (16384)
    assert torch.equal(native.w4a8_dequantized_x(lib, wide), quantize(wide, ACT).dequantize())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.w4a8_dequantized_x(lib, x, torch.float16)
    x[5, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        native.w4a8_dequantized_x(lib, x)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.w4a8_dequantized_x(lib, torch.randn(2, 40))


@needs_kernel
@pytest.mark.parametrize("rows", [qm.W4A8_MAX_BATCH + 1, 64, 130])
def test_batches_run_dequants_blocks_on_the_quantized_activations(rows):
    q = QuantLinear.from_linear(_linear(96, 576, seed=rows), "w4a8")
    x = torch.randn(rows, 576)
    with torch.no_grad():
        y, ref = q(x), q.reference_forward(x)
    if qm.bf16_blocks(x):  # bf16 of the dequantized activations and weight, float32 sums rounded to bf16
        xd = quantize(x, ACT).dequantize().bfloat16().double()
        wd = q.qweight.dequantize().bfloat16().double()
        exact = xd @ wd.T
        assert ((y.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-5 * (xd.abs() @ wd.abs().T)).all()
    else:
        assert ((y.double() - ref.double()).abs() <= _bound(q, x)).all()


@needs_kernel
def test_bias_dtypes_and_leading_dimensions():
    q = QuantLinear.from_linear(_linear(48, 64, bias=True), "w4a8")
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        y, ref = q(x), q.reference_forward(x)
        assert y.shape == (2, 3, 48)
        assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
        for dt in (torch.bfloat16, torch.float16):
            yd = q(x.to(dt))
            assert yd.dtype == dt
            assert torch.allclose(yd.float(), q.reference_forward(x.to(dt)).float(), atol=2e-2, rtol=2e-2)
        assert q(torch.randn(0, 64)).shape == (0, 48)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 20])
def test_nonfinite_activations_are_refused(rows):
    q = QuantLinear.from_linear(_linear(32, 64), "w4a8")
    x = torch.randn(rows, 64)
    x[0, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        q(x)
    x[0, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        q(x)


def test_schemes_the_kernel_cannot_take_run_dequant():
    assert "w4a8" not in available_kernels(get_scheme("w4a8").with_(group_size=64), (64, 256))
    assert "w4a8" not in available_kernels(get_scheme("w4a8").with_(activations=ACT.with_(scale_format="fp16")),
                                           (64, 256))
    assert "w4a8" not in available_kernels(get_scheme("w4a8").with_(activations=ACT.with_(group_size=64)), (64, 256))
    assert "w4a8" not in available_kernels(get_scheme("int4_asym_g32").with_(activations=ACT), (64, 256))  # int zero point
    assert "w4a8" not in available_kernels("int4_g32", (64, 256))                                       # weight-only
    assert available_kernels("w4a8", (64, 256))[-1] == "dequant"
    with native.turned_off():
        assert available_kernels("w4a8", (64, 256)) == ["dequant"]


@needs_kernel
def test_state_copies_and_the_dequant_kernel_agree():
    lin = _linear(64, 128)
    q = QuantLinear.from_linear(lin, "w4a8")
    x = torch.randn(3, 128)
    with torch.no_grad():
        y = q(x)
        for other in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
            assert other.kernel == "w4a8"
            assert torch.equal(other(x), y)
        fresh = QuantLinear.empty("w4a8", (64, 128), device="cpu")
        fresh.load_state_dict(q.state_dict())
        assert torch.equal(fresh(x), y)
        d = QuantLinear.from_linear(lin, "w4a8", kernel="dequant")
        assert isinstance(d.qweight, QuantizedTensor)
        assert torch.allclose(d(x), y, atol=1e-5, rtol=1e-5)
    assert q.nbytes == d.nbytes  # the kernel reads the codes and scales as stored: nothing of its own


@needs_kernel
def test_a_w4a8_layer_runs_with_the_native_library_turned_off():
    q = QuantLinear.from_linear(_linear(64, 128), "w4a8")
    x = torch.randn(3, 128)
    with torch.no_grad(), native.turned_off():
        y = q(x)
    with torch.no_grad():
        ref = q.reference_forward(x)
    assert ((y.double() - ref.double()).abs() <= _bound(q, x)).all()


@needs_kernel
@pytest.mark.parametrize("shape", [(4, 128), (2, 3, 128)])
def test_broadcast_inputs_are_taken(shape):
    q = QuantLinear.from_linear(_linear(64, 128), "w4a8")
    x = torch.randn(128).expand(*shape)  # stride 0 over the rows, as broadcasting makes them
    with torch.no_grad():
        assert torch.equal(q(x), q(x.contiguous()))


@needs_kernel
@pytest.mark.skipif(not ops.fast_bf16_matmul(), reason="the defect shows where bf16_blocks() is true")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_float16_and_float64_batches_are_not_multiplied_in_bfloat16(dtype):
    lin = _linear(96, 576, seed=1)
    q = QuantLinear.from_linear(lin, "w4a8")
    x = torch.randn(64, 576).to(dtype)
    xd = quantize(x.double(), ACT).dequantize().double()
    wd = q.qweight.dequantize().double()
    exact, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    with torch.no_grad():
        err = (q(x).double() - exact).abs()
    # float16: its own rounding of the result and of the operands (the dequant kernel: ~1e-4 mag);
    # float64: float32 arithmetic at worst (~2e-8 mag). bfloat16 blocks give ~7e-4 mag.
    tol = (2.0 ** -11 * exact.abs() + 2e-4 * mag) if dtype == torch.float16 else 1e-6 * mag
    assert (err <= tol).all()


@needs_kernel
def test_a_layer_without_outputs():
    q = QuantLinear.from_linear(nn.Linear(256, 0), "w4a8")
    with torch.no_grad():
        assert q(torch.randn(2, 256)).shape == (2, 0)
