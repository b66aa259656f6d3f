"""QuantLinear / QuantEmbedding: every fast kernel against the slow reference
F.linear(x, qweight.dequantize()), with tolerances derived from each kernel's arithmetic; the
packed layouts; honest byte counts; lookups; errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fewbits.quant import get_scheme, list_schemes, quantize
from fewbits.quant import lowbit_ops as ops
from fewbits.quant import scales as sc
from fewbits.quant import modules as qm
from fewbits.quant.linear_kernels import base as kernel_base
from fewbits.quant.linear_kernels.rows import RowDecoder
from fewbits.quant.modules import KernelQuantizedTensor, QuantEmbedding, QuantLinear, available_kernels

pytestmark = pytest.mark.usefixtures("eager_kernels")

BF16_EPS = 2.0 ** -8  # bfloat16 keeps 8 significant bits: rounding moves a value by <= 2^-9 of it
ALL_SCHEMES = list_schemes()


def _linear(out_features=64, in_features=96, seed=0, bias=True):
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():  # an outlier row and column, as real weights have
        lin.weight[3] *= 8
        lin.weight[:, 5] *= 4
    return lin


def _x(shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------
# tolerances
# ---------------------------------------------------------------------------------------------
def weight_error_bound(qt) -> torch.Tensor:
    """Per-weight bound B with |w_kernel - w| <= 2^-9 * B for kernels that hold the scales (and
    zeros) in bfloat16: int4pack reads w = (u - 8) * bf16(s) + bf16((8 - zp) * s), so
    B = (|u - 8| + |8 - zp|) * s (= |w| when symmetric); the int8 kernel's bf16 scale gives |w|."""
    w = qt.dequantize(torch.float32)
    s = qt.scheme
    if s.symmetric or s.format.bits != 4:
        return w.abs()
    n, k = qt.shape
    q = qt.int_codes()[:, :k].to(torch.float32) if s.granularity != "tensor" else qt.int_codes().reshape(n, k).float()
    sv = qt.scale_values()
    if s.zero_point == "float":  # int4pack reads w = (u - 8) * bf16(s) + bf16(8 * s + min)
        zero = 8 * sv + qt.minimum_values()
        if s.granularity == "group":
            zero = zero.repeat_interleave(s.group_size, dim=1)[:, :k]
            sv = sv.repeat_interleave(s.group_size, dim=1)[:, :k]
        return (q - 8).abs() * sv + zero.abs()
    zp = qt.zero_point_values().to(torch.float32)
    if s.granularity == "group":
        zp = zp.repeat_interleave(s.group_size, dim=1)[:, :k]
        sv = sv.repeat_interleave(s.group_size, dim=1)[:, :k]
    return ((q - 8).abs() + (8 - zp).abs()) * sv


def assert_close_to_reference(module: QuantLinear, x: torch.Tensor):
    """The module's output against its reference, within the error its kernel's arithmetic
    allows (see fewbits.quant.lowbit_ops):
    - bf16 activations / scales / results (int4pack, int8pack, bf16): each of x, the weight's
      scale (and zero) and the result is rounded to bfloat16 once, so
      |y - ref| <= 2^-9 * (|x| @ (|W| + B).T) + 2^-9 * |y| (+ second-order terms; 2^-8 covers them);
      dequant beyond LUT4_MAX_BATCH rows on CPUs with hardware bf16 (its weight blocks and x
      rounded to bfloat16 for the GEMM, the result too) has the same bound;
    - exact integer products (w8a8_*) and float32 decoding (dequant): only float32 summation
      order differs, |y - ref| <= K * 2^-24 * (|x| @ |W|.T) per output.
    """
    y = module(x)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], module.out_features)
    xf = x.float().reshape(-1, module.in_features)
    ref = module.reference_forward(x.float()).reshape(-1, module.out_features)
    yf = y.float().reshape(-1, module.out_features)
    qt = module.qweight
    w_abs = qt.dequantize(torch.float32).abs()
    if module.scheme.activations is not None:
        xf = quantize(xf, module.scheme.activations).dequantize()
    mag = xf.abs() @ w_abs.T
    bias = module.bias.abs().float() if module.bias is not None else 0
    bf16_batch = (module.kernel == "dequant" and xf.shape[0] > qm.LUT4_MAX_BATCH and ops.fast_bf16_matmul()
                  and module.scheme.activations is None)  # blocks decoded to bf16 for its GEMM
    if module.kernel in ("int4pack", "int8pack", "bf16") or x.dtype != torch.float32 or bf16_batch:
        bound = weight_error_bound(qt) if module.kernel == "int4pack" else w_abs
        tol = BF16_EPS * (xf.abs() @ (w_abs + bound).T + ref.abs() + bias)
    else:
        tol = module.in_features * 2.0 ** -23 * (mag + bias) + 1e-30
    err = (yf - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{module.kernel}: error {err.max().item():.3e} exceeds the bound (ratio {worst:.2f})"
    return y


# ---------------------------------------------------------------------------------------------
# which kernel runs what
# ---------------------------------------------------------------------------------------------
def test_auto_picks_torchs_kernels_here():
    """fewbits' 4-bit C kernels where they are built (they beat tinygemm and compute the weights
    exactly), torch's kernels for the rest; q4_k's two-level scales go to introw.c where it is
    built (its one-row kernel reads them as stored), else to tinygemm."""
    from fewbits.kernels import native
    if ops.int4pack_layout() is None:
        pytest.skip("this torch has no int4 CPU packing")
    int4 = "dequant" if native.library() is not None else "int4pack"
    want = {"int4": int4, "int4_asym": int4, "q4_1": int4, "int4_g32": int4, "int4_channel": int4, "q4_0": int4,
            "q4_k": int4,
            "int8": "int8pack", "int8_tensor": "int8pack", "bf16": "bf16", "nf4": "dequant", "mxfp4": "dequant",
            "nvfp4": "dequant", "fp8": "dequant", "fp16": "dequant", "int3": "dequant",
            "w8a8": ("w8a8_amx" if native.library() is not None and native.amx_w8a8_ready(native.library())
                     else "w8a8_vnni" if native.library() is not None and native.vnni_w8a8_ready(native.library())
                     else "w8a8_onednn" if ops.onednn_int8_available() and qm.cpu_int8_gemm_exact("w8a8_onednn")
                     else "w8a8_int_mm" if qm.cpu_int8_gemm_exact("w8a8_int_mm") else "dequant"),
            "w4a8": "w4a8" if native.library() is not None and native.library().fb_w4a8_vectorized() else "dequant"}
    for name, kernel in want.items():
        assert available_kernels(name, (64, 256))[0] == kernel, name
        assert QuantLinear.from_linear(_linear(64, 256), name).kernel == kernel


def test_shapes_the_kernels_cannot_take_fall_back():
    assert "int4pack" not in available_kernels("int4", (40, 256))        # N % 16
    assert "int4pack" not in available_kernels(get_scheme("int4").with_(group_size=16), (64, 256))
    assert "int8pack" not in available_kernels("int8", (64, 100))        # K % 16 (torch reads past the row)
    assert available_kernels("int8", (64, 100))[0] == "dequant"
    assert available_kernels(get_scheme("int8").with_(axis=1), (64, 96)) == ["dequant", "dequant_fp32"]
    act_percentile = get_scheme("w8a8").activations.with_(scale_method="percentile")
    assert available_kernels(get_scheme("w8a8").with_(activations=act_percentile), (64, 96)) == ["dequant"]
    with pytest.raises(ValueError, match="cannot run"):
        QuantLinear.from_linear(_linear(64, 100), "int8", kernel="int8pack")
    with pytest.raises(ValueError, match="kernel must be"):
        QuantLinear.from_linear(_linear(), "int8", kernel="fastest")


# ---------------------------------------------------------------------------------------------
# every kernel against the reference
# ---------------------------------------------------------------------------------------------
def _cases():
    out = []
    for name in ALL_SCHEMES:
        for shape in [(64, 96), (48, 256), (32, 200)]:
            for kernel in available_kernels(name, shape):
                out.append(pytest.param(name, shape, kernel, id=f"{name}-{shape[0]}x{shape[1]}-{kernel}"))
    return out


@pytest.mark.parametrize("name,shape,kernel", _cases())
def test_kernel_matches_reference(name, shape, kernel):
    lin = _linear(*shape, seed=shape[1])
    m = QuantLinear.from_linear(lin, name, kernel=kernel)
    assert m.kernel == kernel
    for xshape in [(1, shape[1]), (7, shape[1]), (2, 3, shape[1])]:
        assert_close_to_reference(m, _x(xshape, seed=len(xshape)))


@pytest.mark.parametrize("kernel", ["int4pack", "int8pack", "bf16", "w8a8_onednn", "w8a8_int_mm", "dequant"])
def test_bfloat16_and_float16_inputs(kernel):
    scheme = {"int4pack": "int4_asym", "int8pack": "int8", "bf16": "bf16", "w8a8_onednn": "w8a8",
              "w8a8_int_mm": "w8a8", "dequant": "nf4"}[kernel]
    if kernel not in available_kernels(scheme, (64, 128)):
        pytest.skip(f"{kernel} is not available here")
    m = QuantLinear.from_linear(_linear(64, 128), scheme, kernel=kernel)
    for dtype in (torch.bfloat16, torch.float16):
        assert_close_to_reference(m, _x((5, 128), dtype))
    bf16_model = QuantLinear.from_linear(_linear(64, 128).to(torch.bfloat16), scheme, kernel=kernel)
    assert bf16_model.dtype == torch.bfloat16 and bf16_model.bias.dtype == torch.bfloat16
    assert_close_to_reference(bf16_model, _x((5, 128), torch.bfloat16))


def test_dequant_path_decodes_exactly_what_dequantize_gives(monkeypatch):
    """The decoder's float32 blocks are bit-identical to QuantizedTensor.dequantize(), for every
    preset, also over padded groups and widths that straddle bytes, and blocks of rows combine to
    the same product."""
    torch.manual_seed(0)
    for name in ALL_SCHEMES:
        for shape in [(24, 100), (17, 64)]:
            qt = quantize(torch.randn(shape) * 3, name)
            dec = RowDecoder(qt)
            scales, zps = dec.params()
            full = dec.block(0, shape[0], scales, zps)
            assert torch.equal(full, qt.dequantize(torch.float32)), (name, shape)
            assert torch.equal(dec.block(5, 9, scales, zps), full[5:9]), (name, shape)
    monkeypatch.setattr(kernel_base, "_ROW_BLOCK_VALUES", 300)  # several row blocks per call
    m = QuantLinear.from_linear(_linear(64, 96), "nf4")
    assert kernel_base.rows_per_block(96, 4) < 64
    x = _x((6, 96))
    assert torch.allclose(m(x), m.reference_forward(x), rtol=0, atol=1e-5)


FOUR_BIT = [n for n in ALL_SCHEMES if get_scheme(n).format.bits == 4 and get_scheme(n).symmetric
            and get_scheme(n).activations is None]


@pytest.mark.parametrize("name", FOUR_BIT)
def test_fused_4bit_matmul_matches_reference(name, monkeypatch):
    """The fused C matmul of the dequant path (4-bit codes decoded in registers) against the
    reference: batches across its 8-row chunks and up to LUT4_MAX_BATCH, per-tensor, per-channel
    and group scales, padded rows; and that it is the path that ran (where it can be built)."""
    from fewbits.kernels import native
    if native.library() is None:
        pytest.skip(native.status()["reason"])
    calls = []
    real = native.Lut4Weight.matmul
    monkeypatch.setattr(native.Lut4Weight, "matmul", lambda self, lib, x: calls.append(x.shape) or real(self, lib, x))
    used = 0
    for shape in [(64, 96), (48, 256), (32, 200)]:
        m = QuantLinear.from_linear(_linear(*shape, seed=shape[1]), name, kernel="dequant")
        for rows in (1, 9, qm.LUT4_MAX_BATCH):
            before = len(calls)
            assert_close_to_reference(m, _x((rows, shape[1]), seed=rows))
            used += len(calls) > before
        x = _x((5, shape[1]))
        fused = m(x)
        with native.turned_off():  # the torch path: the same up to float32 summation order
            torch.testing.assert_close(fused, m(x), rtol=1e-5, atol=1e-5 * float(fused.abs().max()))
    if name in ("nf4", "mxfp4", "nf4_dq", "int4_g32"):
        assert used, f"{name}: the fused matmul never ran"
    n_big = qm.LUT4_MAX_BATCH + 1  # beyond it: blocks decoded by C, then a GEMM
    decodes = []
    real_decode = native.Lut4Weight.decode
    monkeypatch.setattr(native.Lut4Weight, "decode",
                        lambda self, lib, r0, r1, dtype=torch.float32, out=None: decodes.append((r0, r1)) or real_decode(
                            self, lib, r0, r1, dtype, out))
    m = QuantLinear.from_linear(_linear(64, 256), name, kernel="dequant_fp32")
    before = len(calls)
    assert_close_to_reference(m, _x((n_big, 256)))
    assert len(calls) == before and (decodes or not m._prepared.decoder.lut4)


FOUR_BIT_ALL = [n for n in ALL_SCHEMES if get_scheme(n).format.bits == 4 and get_scheme(n).activations is None]


@pytest.mark.parametrize("name", FOUR_BIT_ALL)
def test_c_decode_of_4bit_codes_is_dequantize_bit_for_bit(name):
    """The weight the 4-bit C kernels read (scales as stored in float32 / float16, MX / NVFP4
    scale codes, integer zero points, float minimums, two-level k-quant scales) decodes to
    dequantize()'s float32 weight bit for bit, and to its bfloat16 rounding."""
    from fewbits.kernels import native
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    for shape in [(64, 96), (48, 256), (32, 200), (17, 512)]:
        lin = _linear(*shape, seed=shape[1])
        m = QuantLinear.from_linear(lin, name, kernel="dequant")
        if m._prepared.decoder is None or not m._prepared.decoder.lut4:
            continue
        w = m._prepared.lut4_weight(lib)
        ref = m.qweight.dequantize(torch.float32)
        got = w.decode(lib, 0, shape[0])[:, : shape[1]]
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (name, shape)
        part = w.decode(lib, 5, 9)[:, : shape[1]]
        assert torch.equal(part, ref[5:9])
        b = w.decode(lib, 0, shape[0], torch.bfloat16)[:, : shape[1]]
        assert torch.equal(b.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16)), (name, shape)
        x = _x((3, shape[1]))  # the fused matmul reads the same weight
        torch.testing.assert_close(w.matmul(lib, x), x @ ref.t(), rtol=1e-5, atol=1e-5)


def test_w8a8_activation_quantization_equals_quantize_exactly():
    """The fused activation quantizer gives quantize()'s codes and scales bit for bit: ties
    (x * 127 / amax exactly halfway), a zero row, bf16 and fp16 scale formats, per tensor."""
    x = _x((10, 64)) * 5
    x[2] = 0.0
    x[4, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1 -> ties to even
    x[4, 4:] = 0.25
    x[7] = -x[7].abs()  # the extreme is negative
    x[9] = 2e-38  # amax / 127 is subnormal: 1 / scale overflows, the codes saturate
    act = get_scheme("w8a8").activations
    for a in [act, act.with_(scale_format="bf16"), act.with_(scale_format="fp16"), act.with_(granularity="tensor")]:
        for rows in (x, x[3:9]):  # with a zero row (scale 0 read as 1) and without
            qt = quantize(rows, a)
            for saturate in (True, a.scale_format != "fp32"):
                q, s = ops.quantize_rows_int8(rows, a.granularity == "channel",
                                              lambda v: sc.round_scales(v, a.scale_format), saturate=saturate)
                assert torch.equal(q.to(torch.int64), qt.int_codes().reshape(rows.shape)), a.label
                assert torch.equal(s, qt.scale_values().reshape(-1)), a.label
                q_u8, _ = ops.quantize_rows_int8(rows, a.granularity == "channel",
                                                 lambda v: sc.round_scales(v, a.scale_format), saturate, offset=True)
                assert q_u8.dtype == torch.uint8 and torch.equal(q_u8.to(torch.int64) - 128, q.to(torch.int64))
    with pytest.raises(ValueError, match="NaN or inf"):
        QuantLinear.from_linear(_linear(16, 64), "w8a8")(torch.full((2, 64), float("inf")))


def test_w8a8_is_exact_where_onednn_int8_saturates():
    # oneDNN's int8 GEMM without VNNI (AVX2-only CPUs: AMD EPYC Rome/Milan) saturates pairs of
    # products in int16; ONEDNN_MAX_CPU_ISA=AVX2 makes this CPU do the same. w8a8 must then run a
    # kernel that is exact (it ran them: 20 % of the largest output off).
    import os
    import subprocess
    import sys
    code = """
import torch
from torch import nn
from fewbits.quant.modules import QuantLinear, available_kernels
torch.manual_seed(0)
lin = nn.Linear(256, 64)
x = torch.randn(32, 256) * 3
for kernel in available_kernels("w8a8", (64, 256)):
    m = QuantLinear.from_linear(lin, "w8a8", kernel=kernel)
    with torch.no_grad():
        ref, got = m.reference_forward(x), m(x)
    print(kernel, float((got - ref).abs().max() / ref.abs().max()))
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    errors = dict(line.split() for line in r.stdout.splitlines())
    assert "dequant" in errors
    assert all(float(e) < 1e-5 for e in errors.values()), errors  # every kernel offered is exact


def _vpmaddubsw_gemm(u8: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(u8 - 128) @ w.T the way oneDNN without VNNI sums it: uint8 x int8 products added in
    pairs into a saturating int16, then in int32, less the 128 * sum(w) compensation."""
    u, w = u8.to(torch.int64), w.to(torch.int64)
    if u.shape[1] % 2:
        u, w = nn.functional.pad(u, (0, 1)), nn.functional.pad(w, (0, 1))
    pairs = (u[:, None, :] * w[None, :, :]).view(u.shape[0], w.shape[0], -1, 2).sum(-1)
    return (pairs.clamp(-32768, 32767).sum(-1) - 128 * w.sum(-1)).to(torch.int32)


@pytest.mark.parametrize("kernel", ["w8a8_onednn", "w8a8_int_mm"])
@pytest.mark.parametrize("saturates", [lambda m, k: m > 32, lambda m, k: k % 64 != 0],
                         ids=["many rows", "K off 64"])
def test_the_int8_gemm_probe_catches_a_kernel_that_saturates_only_on_some_shapes(monkeypatch, kernel, saturates):
    # oneDNN picks kernels by shape: one that saturates only for many rows (brgemm) or a K tail
    # must not slip past a probe of 1 and 32 rows with K = 64
    def gemm(u8, w):
        exact = (u8.to(torch.int64) - 128) @ w.to(torch.int64).t()
        return _vpmaddubsw_gemm(u8, w) if saturates(*u8.shape) else exact.to(torch.int32)

    monkeypatch.setattr(ops, "onednn_prepack_int8", lambda w: w)
    monkeypatch.setattr(ops, "int8_int8_matmul_onednn", lambda u8, w, s: gemm(u8, w).float() * s)
    monkeypatch.setattr(ops, "int8_int8_matmul", lambda q, w: gemm((q.to(torch.int16) + 128).to(torch.uint8), w))
    probe = qm.cpu_int8_gemm_exact.__wrapped__  # not the per-process answer of the real kernels
    assert probe(kernel) is False
    monkeypatch.setattr(ops, "int8_int8_matmul", lambda q, w: (q.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32))
    monkeypatch.setattr(ops, "int8_int8_matmul_onednn", lambda u8, w, s: (
        (u8.to(torch.int64) - 128) @ w.to(torch.int64).t()).float() * s)
    assert probe(kernel) is True  # an exact GEMM passes


def test_the_int8_gemm_probe_passes_onednn_here_with_vnni():
    # the fast path stays on where oneDNN has VNNI/AMX (the probe's larger shapes included)
    import os
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        flags = set()
    if os.environ.get("ONEDNN_MAX_CPU_ISA") or not {"avx512_vnni", "avx_vnni", "amx_int8"} & flags:
        pytest.skip("no VNNI for oneDNN here: its int8 GEMM saturates and is rightly refused")
    assert qm.cpu_int8_gemm_exact("w8a8_int_mm")
    assert not ops.onednn_int8_available() or qm.cpu_int8_gemm_exact("w8a8_onednn")


def test_w8a8_kernels_agree_with_each_other():
    kernels = [k for k in ("w8a8_onednn", "w8a8_int_mm") if k in available_kernels("w8a8", (64, 96))]
    if len(kernels) < 2:
        pytest.skip("oneDNN int8 is not available here")
    lin = _linear(64, 96)
    a, b = (QuantLinear.from_linear(lin, "w8a8", kernel=k) for k in kernels)
    x = _x((11, 96))
    assert torch.allclose(a(x), b(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# layouts and bytes
# ---------------------------------------------------------------------------------------------
def test_int4_packed_layout_round_trips():
    if ops.int4pack_layout() is None:
        pytest.skip("this torch has no int4 CPU packing")
    g = torch.Generator().manual_seed(3)
    for n in (16, 48, 64, 80, 144, 176):  # whole blocks and every partial-block size
        u = torch.randint(0, 16, (n, 64), generator=g, dtype=torch.int32)
        assert torch.equal(ops.unpack_int4(ops.pack_int4(u), n, 64), u.to(torch.uint8)), n


@pytest.mark.parametrize("name", ["int4", "int4_asym", "q4_1", "int4_g32", "int4_channel", "w8a8"])
def test_kernel_layouts_hold_the_codes_once_and_give_them_back_bit_identical(name):
    lin = _linear(64, 200 if name == "int4_channel" else 256)
    qt = quantize(lin.weight.detach(), name)
    m = QuantLinear(qt, lin.bias)
    if m.kernel not in ("int4pack", "w8a8_onednn", "w8a8_amx", "w8a8_vnni"):
        pytest.skip(f"{m.kernel} keeps the codes as they are")
    held = m.qweight
    assert isinstance(held, KernelQuantizedTensor) and held.codes_derived
    for key, t in qt.state_dict().items():
        assert torch.equal(held.state_dict()[key], t), key
    assert torch.equal(held.dequantize(), qt.dequantize())
    assert torch.equal(held.plain().codes, qt.codes)
    # the bytes held: the kernel's packed weight instead of the codes, plus its extras
    kt = held.kernel_tensors
    others = qt.nbytes - qt.codes.nbytes
    if m.kernel == "int4pack":
        # 4 bits per value, no unpacked copy (in_features 200 per channel is padded to 224:
        # tinygemm's groups are multiples of 32)
        assert kt["weight"].nbytes == 64 * (224 if name == "int4_channel" else 256) // 2
        assert held.nbytes == others + kt["weight"].nbytes + kt["scales_and_zeros"].nbytes
    elif m.kernel in ("w8a8_amx", "w8a8_vnni"):  # the AMX panels (whole 32-column blocks, 64-value k blocks) and 128 x row sums
        assert kt["panels"].nbytes == 64 * 256 and kt["colsum128"].nbytes == 4 * 64
        assert held.nbytes == others + kt["panels"].nbytes + kt["colsum128"].nbytes  # the scales: a view of qt's
    else:
        assert held.nbytes == others + ops.onednn_prepacked_nbytes(64, 256)


def test_int4_g128_weight_is_at_most_a_sixth_of_fp32():
    lin = _linear(256, 1024)
    m = QuantLinear.from_linear(lin, "int4")
    fp32_bytes = lin.weight.nbytes
    assert m.nbytes <= fp32_bytes / 6
    assert m.nbytes >= m.in_features * m.out_features // 2  # nothing is hidden: the codes alone are K*N/2


@pytest.mark.parametrize("name,kernel", [("int8", "int8pack"), ("bf16", "bf16"), ("w8a8", "w8a8_int_mm")])
def test_views_of_the_codes_are_not_counted_twice(name, kernel):
    if kernel not in available_kernels(name, (64, 128)):
        pytest.skip(f"{kernel} is not available here")
    lin = _linear(64, 128)
    qt = quantize(lin.weight.detach(), name)
    m = QuantLinear(qt, lin.bias, kernel=kernel)
    extra = {"int8pack": 64 * 2, "bf16": 0, "w8a8_int_mm": 0}[kernel]  # int8pack's bf16 scales
    assert m.nbytes == qt.nbytes + extra
    assert not m.qweight.codes_derived


# ---------------------------------------------------------------------------------------------
# module behaviour
# ---------------------------------------------------------------------------------------------
def test_bias_none_empty_batch_and_repr():
    lin = _linear(32, 64, bias=False)
    m = QuantLinear.from_linear(lin, "int4_g32")
    assert m.bias is None
    x = _x((3, 64))
    assert torch.allclose(m(x), m.reference_forward(x), atol=0.1)
    assert m(torch.zeros(0, 64)).shape == (0, 32)
    assert m(torch.zeros(2, 0, 64)).shape == (2, 0, 32)
    text = repr(m)
    assert "int4_g32" in text and "kernel=" in text and "nbytes=" in text


def test_gradient_flows_to_the_input_through_the_reference():
    m = QuantLinear.from_linear(_linear(32, 64), "int4")
    x = _x((4, 64)).requires_grad_()
    m(x).sum().backward()
    w = m.qweight.dequantize()
    assert torch.allclose(x.grad, w.sum(0).expand(4, 64))
    assert not any(p.requires_grad for p in m.parameters())


def test_constructor_errors():
    qt = quantize(torch.randn(16, 32), "int8")
    with pytest.raises(TypeError, match="QuantizedTensor"):
        QuantLinear(torch.randn(16, 32))
    with pytest.raises(ValueError, match="2-d"):
        QuantLinear(quantize(torch.randn(2, 16, 32), "int8"))
    with pytest.raises(ValueError, match="bias must have shape"):
        QuantLinear(qt, torch.zeros(15))
    with pytest.raises(TypeError, match="bias"):
        QuantLinear(qt, torch.zeros(16, dtype=torch.int64))
    with pytest.raises(TypeError, match="nn.Linear"):
        QuantLinear.from_linear(nn.Conv1d(2, 2, 1), "int8")
    m = QuantLinear(qt)
    with pytest.raises(ValueError, match="in_features=32"):
        m(torch.randn(3, 31))
    with pytest.raises(TypeError, match="float tensor"):
        m(torch.ones(3, 32, dtype=torch.int64))


def test_a_held_kernel_tensor_builds_a_new_module():
    lin = _linear(64, 256)
    a = QuantLinear.from_linear(lin, "int4")
    b = QuantLinear.from_quantized(a.qweight, lin.bias, kernel="dequant")
    x = _x((2, 256))
    assert torch.allclose(b(x), a.reference_forward(x), atol=1e-5)
    assert torch.equal(b.qweight.codes, a.qweight.codes)


def test_quantize_model_uses_these_modules():
    from fewbits.quant.model import is_quantized, model_nbytes, quantize_model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = _x((3, 64))
    want = model(x)
    quantize_model(model, {"0": "int4_g32", "2": "w8a8"})
    assert isinstance(model[0], QuantLinear) and is_quantized(model[0]) and is_quantized(model[2])
    with torch.no_grad():
        got = model(x)
        h = assert_close_to_reference(model[0], x)
        assert_close_to_reference(model[2], torch.relu(h))
    assert (got - want).norm() < 0.2 * want.norm()  # and the quantized model still computes the model
    sizes = model_nbytes(model)
    assert sizes["quantized"] == model[0].nbytes + model[2].nbytes


# ---------------------------------------------------------------------------------------------
# QuantEmbedding
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_embedding_lookup_equals_the_dequantized_table(name):
    torch.manual_seed(0)
    emb = nn.Embedding(37, 40)  # 40 * 3 bits: int3 rows do not start on whole bytes
    qe = QuantEmbedding.from_embedding(emb, name)
    ids = torch.tensor([[0, 5, 36, 5], [2, 2, 9, 30]])
    got = qe(ids)
    assert got.shape == (2, 4, 40) and got.dtype == torch.float32
    assert torch.equal(got, qe.reference_forward(ids))
    assert torch.equal(qe(torch.tensor(7)), qe.qweight.dequantize()[7])
    assert qe(torch.zeros(0, dtype=torch.int64)).shape == (0, 40)


def test_embedding_options_and_errors():
    emb = nn.Embedding(10, 16, padding_idx=-1)
    qe = QuantEmbedding.from_embedding(emb, "int8")
    assert qe.padding_idx == 9 and "padding_idx=9" in repr(qe)
    assert qe.nbytes == qe.qweight.nbytes
    assert qe(torch.tensor([1, 2], dtype=torch.int32)).shape == (2, 16)
    with pytest.raises(IndexError, match="out of range"):
        qe(torch.tensor([10]))
    with pytest.raises(IndexError, match="out of range"):
        qe(torch.tensor([-1]))
    with pytest.raises(TypeError, match="integer tensor"):
        qe(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="max_norm"):
        QuantEmbedding.from_embedding(nn.Embedding(10, 16, max_norm=1.0), "int8")
    with pytest.raises(TypeError, match="nn.Embedding"):
        QuantEmbedding.from_embedding(nn.Linear(2, 2), "int8")
    bf = QuantEmbedding.from_embedding(nn.Embedding(10, 16).to(torch.bfloat16), "int4")
    assert bf(torch.tensor([3])).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["w8a8", "int4", "nf4"])
def test_copies_and_pickles_rebuild_the_kernel(name):
    import copy
    import io
    m = QuantLinear.from_linear(_linear(32, 64), name)
    x = _x((2, 64))
    twin = copy.deepcopy(m)
    assert twin.kernel == m.kernel and torch.equal(twin(x), m(x))
    assert type(copy.deepcopy(m.qweight)) is type(quantize(torch.zeros(1, 1), "int8"))  # a plain copy
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), m(x)) and loaded.nbytes == m.nbytes


@pytest.mark.parametrize("name", ["int8", "int8_tensor", "nf4", "int4", "q4_1", "nvfp4", "fp8"])
@pytest.mark.parametrize("extra", [5, "tiles"])
def test_batches_run_in_bf16_blocks_on_cpus_with_hardware_bf16(name, extra, monkeypatch):
    """Beyond LUT4_MAX_BATCH float32 rows, weight-only layers multiply in bf16 where the CPU has
    hardware bf16 (qm.bf16_blocks): bf16(dequantize()) (bit for bit: tests/kernels/
    test_lut4_isa.py), or for int8 the codes themselves (exact) with the scales applied after;
    the result within the bf16 bound. Batches tile_batch allows on AMX tiles where the build has
    them (tests/kernels/test_tiles.py), else (and beyond) blocks for oneDNN's bf16 GEMM. With
    kernel="dequant_fp32" the batch stays in float32."""
    from fewbits.kernels import native
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    m = QuantLinear.from_linear(_linear(64, 256), name)
    rows = qm.LUT4_MAX_BATCH + 5 if extra == 5 else qm.tile_limit() // 256 + 3
    x = _x((rows, 256))
    assert qm.bf16_blocks(x) == ops.fast_bf16_matmul()
    calls, tiled = [], []
    real = native.int8_rows_bf16
    monkeypatch.setattr(native, "int8_rows_bf16", lambda *a, **k: calls.append(a[2:4]) or real(*a, **k))
    for cls in (native.Int8Weight, native.Lut4Weight):
        monkeypatch.setattr(cls, "tile_matmul", lambda self, *a, _f=cls.tile_matmul: tiled.append(1) or _f(self, *a))
    assert_close_to_reference(m, x)
    tiles = ops.fast_bf16_matmul() and native.tiles(lib) and qm.tile_batch(rows, 256)
    m._forward_eager(x)  # the general path (forward's own tile call: tests/quant/test_tile_path.py)
    if m.kernel == "int8pack" or m._prepared.decoder is not None and m._prepared.decoder.lut4:
        assert bool(tiled) == (ops.fast_bf16_matmul() and qm.tile_batch(rows, 256))
    if m.kernel == "int8pack":
        assert bool(calls) == (ops.fast_bf16_matmul() and not tiles)
        if calls:  # the int8 codes, exactly
            q = m._qweight.kernel_tensors["weight"]
            assert torch.equal(real(lib, q, 3, 9).float(), q[3:9].float())
    exact = QuantLinear.from_linear(_linear(64, 256), name, kernel="dequant_fp32")
    y = exact(x)
    tol = 256 * 2.0 ** -23 * (x.abs() @ exact.qweight.dequantize(torch.float32).abs().t()) + 1e-6
    assert bool(((y - exact.reference_forward(x)).abs() <= tol + exact.bias.abs()).all())


def test_nbytes_counts_what_a_kernel_derives_and_holds():
    """Parameters a kernel keeps in a form of its own (int4_asym's zero points as float32 for the
    C kernels, a per-tensor scale repeated per row) are counted in nbytes; views of what the
    QuantizedTensor stores are not counted twice."""
    from fewbits.kernels import native
    if native.library() is None:
        pytest.skip(native.status()["reason"])
    asym = QuantLinear.from_linear(_linear(64, 256), "int4_asym")
    assert asym.kernel == "dequant"
    groups = 256 // get_scheme("int4_asym").group_size
    assert asym.nbytes == asym.qweight.nbytes + 4 * 64 * groups
    nf4 = QuantLinear.from_linear(_linear(64, 256), "nf4")
    assert nf4.nbytes == nf4.qweight.nbytes  # float32 scales read as stored
    per_tensor = QuantLinear.from_linear(_linear(64, 256), "int8_tensor")
    if per_tensor.kernel == "int8pack":
        assert per_tensor.nbytes >= per_tensor.qweight.nbytes + 4 * 64


def test_the_4bit_kernels_refuse_tensors_off_the_cpu():
    from fewbits.kernels import native
    table = torch.zeros(16)
    with pytest.raises(ValueError, match="CPU"):
        native.Lut4Weight(torch.zeros(64, dtype=torch.uint8, device="meta"), torch.ones(2, 1), table, 2, 64, 64)
    with pytest.raises(ValueError, match="CPU"):
        native.Lut4Weight(torch.zeros(64, dtype=torch.uint8), torch.ones(2, 1, device="meta"), table, 2, 64, 64)
