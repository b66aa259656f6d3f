"""Training on an accelerator (CUDA): every policy trains the digits MLP there as it does on the
CPU (fp16 runs as a native dtype on CUDA, emulated on the CPU), the loss scaler sees device
gradients, and checkpoints move between devices. Skipped without CUDA (see the `accel`
fixture in tests/conftest.py)."""
import math

import pytest
import torch
from torch import nn

from fewbits.train import Engine, LossScaler
from helpers_train import digits, mlp

POLICIES = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "bf16-pure-sr", "bf16-pure-kahan", "fp8-hybrid"]


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
