"""Training on an accelerator (CUDA): every policy trains the digits MLP there as it does on the
CPU (fp16 runs as a native dtype on CUDA, emulated on the CPU; int8 and FP8 GEMMs natively where
the hardware has them), a linear layer's native low-precision GEMMs on the device match the CPU's
emulation of them, the loss scaler sees device gradients, and checkpoints move between devices.
Skipped without CUDA (see the `accel` fixture in tests/conftest.py)."""
import math

import pytest
import torch
from torch import nn

from fewbits.train import Engine, LossScaler
from helpers_train import digits, mlp

POLICIES = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "bf16-pure-sr", "bf16-pure-kahan", "fp8-hybrid",
            "fp8-hybrid-current", "fp8-rowwise", "int8-mixed", "int8-mixed-gw8"]


def _train(policy, device, steps=120, seed=0):
    x, y = digits()
    x, y = x.to(device), y.to(device)
    model = mlp(64, seed).to(device)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=3e-3), policy, seed=seed)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (128,), generator=g).to(device)
        loss = nn.functional.cross_entropy(model(x[idx]).float(), y[idx])
        engine.train_step(loss)
        losses.append(float(loss.detach()))
    return sum(losses[-20:]) / 20, model, engine


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_trains_as_on_cpu(policy, accel):
    dev_loss, model, _ = _train(policy, accel)
    cpu_loss, _, _ = _train(policy, "cpu")
    assert all(p.device.type == accel.type for p in model.parameters())
    assert math.isfinite(dev_loss)
    assert dev_loss < 0.6, dev_loss  # from ~2.3 at the start
    assert abs(dev_loss - cpu_loss) < 0.1 + 0.2 * cpu_loss, (dev_loss, cpu_loss)


# ---------------------------------------------------------------------------------------------
# a linear layer's GEMMs: native on the device against the CPU's emulation
# ---------------------------------------------------------------------------------------------
# rows 48, in 256, out 32: every dimension of the three GEMMs a multiple of 16 (cuBLASLt's FP8
# and int8 GEMMs take them natively, none falls back)
ROWS, IN, OUT = 48, 256, 32


def _linear_passes(policy, device, gemm, passes=2):
    """Two forward/backward passes of one nn.Linear under Engine(gemm=...) on `device` (the same
    weights, inputs and output gradients on every device; the second pass's inputs are 4x larger,
    so delayed scaling reads a history). Returns [(y, dx, {param: grad})] on the CPU, and the engine."""
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT).to(device)
    try:
        engine = Engine(layer, torch.optim.SGD(layer.parameters(), lr=0.1), policy, gemm=gemm)
    except ValueError as exc:  # gemm="native" where the device has no such GEMMs
        pytest.skip(str(exc))
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(passes):
        x = (torch.randn(ROWS, IN, generator=g) * 4 ** i).to(device).requires_grad_()
        t = torch.randn(ROWS, OUT, generator=g).to(device)
        y = layer(x)
        engine.backward((y.float() * t).sum())
        grads = {n: gr.detach().cpu().clone() for n, gr in engine._grads()}
        out.append((y.detach().cpu(), x.grad.cpu(), grads))
        engine.zero_grad()
    return out, engine


def _within_fp8_bound(a, b):
    """|a - b| <= 2^-6 |b| + 2^-12 max|b|: both sides sum the same exact products in float32 (FP8
    values times power-of-two scales are exact in bf16 and their products in float32), in different
    orders, and round once or twice to bf16 (a bias added before or after the rounding): two bf16
    ulps, plus a float32 term for sums that cancel."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= b.abs() * 2 ** -6 + b.abs().max() * 2 ** -12).all())


@pytest.mark.parametrize("policy", ["int8-mixed", "int8-mixed-gw8", "fp8-hybrid", "fp8-hybrid-current", "fp8-rowwise"])
def test_native_gemm_matches_cpu_emulation(policy, accel):
    """Engine(gemm="native") on the accelerator against Engine(gemm="emulated") on the CPU, one
    linear layer, forward and both backward GEMMs. int8: bit for bit (exact int32 sums, the same
    float32 epilogue) for the output, the input gradient and an int8 weight gradient; the bias
    gradient (a bf16 sum over rows) and int8-mixed's bf16 weight-gradient GEMM within the FP8
    bound. FP8 (per-tensor delayed and current, row-wise): every result within _within_fp8_bound."""
    native, eng = _linear_passes(policy, accel, "native")
    emulated, eng_cpu = _linear_passes(policy, "cpu", "emulated")
    assert eng.gemm_route is not None and eng.gemm_route.native, eng.gemm_path
    assert eng.gemm_route.counts["emulated"] == 0 and eng.gemm_route.counts["native"] > 0, eng.gemm_route.counts
    assert eng_cpu.gemm_route is None or not eng_cpu.gemm_route.native, eng_cpu.gemm_path
    exact_int8 = policy.startswith("int8")
    for (y_n, dx_n, g_n), (y_e, dx_e, g_e) in zip(native, emulated):
        assert y_n.dtype == y_e.dtype and set(g_n) == set(g_e) == {"weight", "bias"}
        pairs = [("y", y_n, y_e, exact_int8), ("dx", dx_n, dx_e, exact_int8),
                 ("bias grad", g_n["bias"], g_e["bias"], False),
                 ("weight grad", g_n["weight"], g_e["weight"], policy == "int8-mixed-gw8")]
        for what, a, b, exact in pairs:
            assert torch.isfinite(a).all() and b.abs().max() > 0, what
            if exact:
                assert torch.equal(a, b), (policy, what, (a.float() - b.float()).abs().max())
            else:
                assert _within_fp8_bound(a, b), (policy, what, (a.float() - b.float()).abs().max(), b.abs().max())


def test_fp16_is_native_on_cuda(accel):
    if accel.type != "cuda":
        pytest.skip("fp16 is emulated on the CPU")
    _, model, _ = _train("fp16-mixed", accel, steps=3)
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_loss_scaler_sees_device_overflow(accel):
    model = nn.Linear(4, 2).to(accel)
    scaler = LossScaler(init_scale=2.0 ** 10)
    scaler.scale_loss(model(torch.ones(1, 4, device=accel)).sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert scaler.unscale_(grads) is False
    assert torch.equal(model.bias.grad.cpu(), torch.ones(2))  # unscaled in place on the device
    model.weight.grad[0, 0] = float("inf")
    assert scaler.unscale_(grads) is True  # found the inf
    scaler.update(True)
    assert scaler.scale == 2.0 ** 9


def test_checkpoint_moves_between_devices(accel):
    _, model, engine = _train("bf16-mixed", accel, steps=5)
    state = engine.state_dict()
    model_cpu = mlp(64, 0)
    eng_cpu = Engine(model_cpu, torch.optim.AdamW(model_cpu.parameters(), lr=3e-3), "bf16-mixed")
    eng_cpu.load_state_dict(state)
    for p_cpu, p_dev in zip(model_cpu.parameters(), model.parameters()):
        assert p_cpu.device.type == "cpu"
        assert torch.equal(p_cpu.detach().float(), p_dev.detach().float().cpu())
