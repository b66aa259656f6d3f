"""Quantization on an accelerator (CUDA): quantize() gives the CPU's codes and scales bit for
bit, and the quantized modules move between devices and run there. Skipped without CUDA (see
the `accel` fixture in tests/conftest.py)."""
import copy

import pytest
import torch
from torch import nn

import fewbits as fb
from fewbits.quant.modules import available_kernels, bf16_blocks


def _weight(rows=96, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[3, 17] = 0.9  # an outlier
    return w


@pytest.mark.parametrize("scheme", fb.list_schemes())
def test_quantize_equals_cpu(scheme, accel):
    w = _weight()
    with fb.use_backend("eager"):
        qc = fb.quantize(w, scheme)
        qd = fb.quantize(w.to(accel), scheme)
    assert qd.device.type == accel.type
    sc, sd = qc.state_dict(), qd.state_dict()
    assert sc.keys() == sd.keys()
    for key in sc:
        if isinstance(sc[key], torch.Tensor):
            assert torch.equal(sd[key].cpu(), sc[key]), f"{scheme}: {key} differs"
        else:
            assert sd[key] == sc[key], key
    deq = qd.dequantize()
    assert deq.device.type == accel.type
    assert torch.equal(deq.cpu(), qc.dequantize()), f"{scheme}: dequantize differs"


LINEAR_SCHEMES = ["int8", "int4", "int4_asym", "q4_1", "nf4", "nf4_dq", "mxfp4", "nvfp4", "fp8", "mxfp8",
                  "int3", "w8a8", "bf16", "fp16"]


@pytest.mark.parametrize("scheme", LINEAR_SCHEMES)
def test_quant_linear_moves_and_runs(scheme, accel):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96)
    ql = fb.QuantLinear.from_linear(lin, scheme)
    x = torch.randn(40, 256)
    with torch.no_grad():
        y_cpu = ql(x)
        qd = copy.deepcopy(ql).to(accel)
        assert qd.qweight.device.type == accel.type and qd.bias.device.type == accel.type
        assert qd.kernel in available_kernels(scheme, (96, 256), accel)
        for rows in (1, 5, 40):
            xd = x[:rows].to(accel)
            y = qd(xd)
            assert y.device.type == accel.type and y.shape == (rows, 96)
            ref = qd.reference_forward(xd)
            # kernels with bfloat16 activations differ from the float32 reference by bf16 rounding
            # (on a CPU with hardware bf16 so do batches beyond 8 rows of every weight-only
            # kernel: bf16 blocks; FEWBITS_TEST_DEVICE=cpu runs this file there)
            bf16_batch = accel.type == "cpu" and rows > 8 and bf16_blocks(xd)
            tol = 1e-2 if qd.kernel in ("bf16", "int4pack", "int8pack") or bf16_batch else 1e-5
            assert float((y - ref).norm() / ref.norm()) < tol, qd.kernel
            # the CPU reference gives the same numbers within float32 GEMM differences
            torch.testing.assert_close(ref.cpu(), ql.reference_forward(x[:rows]), rtol=1e-4, atol=1e-5)
        back = qd.cpu()
    # back on the CPU: the CPU's kernel again, bit for bit the same output
    assert back.kernel == ql.kernel
    assert torch.equal(back.qweight.codes, ql.qweight.codes)
    with torch.no_grad():
        assert torch.equal(back(x), y_cpu)


def test_kernels_off_the_cpu(accel):
    if accel.type != "cuda":
        pytest.skip("the CUDA kernel list")
    assert available_kernels("w8a8", (96, 256), accel)[0] == "w8a8_int_mm"
    assert available_kernels("w8a8", (90, 256), accel) == ["dequant"]  # cuBLASLt wants multiples of 8
    assert available_kernels("bf16", (96, 256), accel) == ["bf16", "dequant"]
    assert available_kernels("int4", (96, 256), accel) == ["dequant"]


def test_quant_linear_built_on_device(accel):
    torch.manual_seed(1)
    lin = nn.Linear(128, 64).to(accel)
    for scheme in ("nf4", "int4", "w8a8"):
        ql = fb.QuantLinear.from_linear(lin, scheme)
        assert ql.qweight.device.type == accel.type
        x = torch.randn(3, 128, device=accel)
        with torch.no_grad():
            y, ref = ql(x), ql.reference_forward(x)
        tol = 1e-2 if ql.kernel in ("bf16", "int4pack", "int8pack") else 1e-5
        assert float((y - ref).norm() / ref.norm()) < tol, ql.kernel
        err = (ql.qweight.dequantize() - lin.weight.detach()).abs().max()
        assert float(err) < 0.2 * float(lin.weight.detach().abs().max())


def test_quant_embedding_moves(accel):
    torch.manual_seed(2)
    emb = nn.Embedding(100, 64, padding_idx=0)
    qe = fb.QuantEmbedding.from_embedding(emb, "nf4")
    ids = torch.tensor([[0, 5, 99], [7, 7, 1]])
    want = qe(ids)
    qd = copy.deepcopy(qe).to(accel)
    got = qd(ids.to(accel))
    assert got.device.type == accel.type
    assert torch.equal(got.cpu(), want)
    assert torch.equal(qd.reference_forward(ids.to(accel)).cpu(), qe.reference_forward(ids))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64))


def test_quantize_model_and_save_on_device(accel, tmp_path):
    model = _mlp().to(accel)
    x = torch.randn(8, 128, device=accel)
    with torch.no_grad():
        y_float = model(x)
    fb.quantize_model(model, "nf4")
    with torch.no_grad():
        y = model(x)
    assert y.device.type == accel.type
    assert float((y - y_float).norm() / y_float.norm()) < 0.2
    path = tmp_path / "m.safetensors"
    fb.save(model, path)
    loaded = fb.load(path, _mlp(seed=5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x.cpu()), y.cpu(), rtol=1e-4, atol=1e-5)


def test_gptq_on_device(accel):
    """GPTQ on the device: its Hessians and updates run there; the result is as good as on the CPU."""
    model_cpu = _mlp(seed=3)
    model_dev = copy.deepcopy(model_cpu).to(accel)
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(32, 128, generator=g) for _ in range(4)]
    x = torch.randn(64, 128, generator=g)
    with torch.no_grad():
        y_float = model_cpu(x)
    fb.quantize_model(model_cpu, "int4", method="gptq", calibration=calib)
    fb.quantize_model(model_dev, "int4", method="gptq", calibration=[c.to(accel) for c in calib])
    assert model_dev[0].qweight.device.type == accel.type
    with torch.no_grad():
        e_cpu = float((model_cpu(x) - y_float).norm() / y_float.norm())
        e_dev = float((model_dev(x.to(accel)).cpu() - y_float).norm() / y_float.norm())
    assert e_dev < 1.2 * e_cpu + 1e-4, (e_dev, e_cpu)
