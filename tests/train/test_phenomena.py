"""The mixed-precision phenomena, reproduced on a small MLP trained on scikit-learn's digits.

(a) and (c) need gradients near the bottom of a 16- or 8-bit format's range. Real models get
there by averaging the loss over many tokens (gradients scale like 1/N); here the loss that is
back-propagated is multiplied by a small power of two and SGD's learning rate by its inverse, so
fp32 training is unchanged (exactly: powers of two) while the gradients shrink into the range
where fp16 and fp8 flush them.
"""
import torch
from helpers_train import train_digits

import fewbits as fb


def sgd_for(mult):
    return lambda params: torch.optim.SGD(params, lr=0.1 / mult, momentum=0.9)


def test_a_fp16_without_loss_scaling_flushes_gradients_and_dynamic_scaling_recovers():
    mult = 2.0 ** -16
    ref, _, _ = train_digits("fp32", 150, sgd_for(mult), mult)
    unscaled, e_unscaled, _ = train_digits("fp16-mixed-unscaled", 150, sgd_for(mult), mult)
    scaled, e_scaled, _ = train_digits("fp16-mixed", 150, sgd_for(mult), mult)
    # most gradient values entering the backward matmuls became zero in fp16
    assert e_unscaled.telemetry.summary()["underflow_fraction"] > 0.5
    assert e_scaled.telemetry.summary()["underflow_fraction"] < 0.1
    assert unscaled > 1.5 * ref           # trains clearly worse (measured: 0.225 vs 0.094)
    assert abs(scaled - ref) < 0.03 * ref  # loss scaling gives fp32's loss back (measured: 0.0939)
    assert e_scaled.scaler.scale == 2.0 ** 16 and e_scaled.skipped_steps == 0


def test_b_bf16_weights_without_master_lose_small_updates():
    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731
    losses, lost = {}, {}
    for p in ("fp32", "bf16-mixed", "bf16-pure", "bf16-pure-sr", "bf16-pure-kahan"):
        final, eng, hist = train_digits(p, 300, adam)
        losses[p], lost[p] = final, eng.telemetry.lost_update_fraction()
        start = hist[0]
    progress = {p: start - v for p, v in losses.items()}
    # most updates vanish in bf16 storage and training makes a fraction of fp32's progress
    assert lost["bf16-pure"] > 0.6 and lost["bf16-mixed"] == 0.0
    assert progress["bf16-pure"] < 0.5 * progress["fp32"]          # measured: 2.252 vs 2.010 (start 2.31)
    for p in ("bf16-mixed", "bf16-pure-sr", "bf16-pure-kahan"):   # measured: within 0.1%
        assert abs(losses[p] - losses["fp32"]) < 0.02 * losses["fp32"], (p, losses)


def test_c_fp8_hybrid_needs_scaling():
    mult = 2.0 ** -10
    bf16, _, _ = train_digits("bf16-mixed", 150, sgd_for(mult), mult)
    fp8, e_fp8, _ = train_digits("fp8-hybrid", 150, sgd_for(mult), mult)
    mx, _, _ = train_digits("mxfp8", 150, sgd_for(mult), mult)
    unscaled, e_unscaled, _ = train_digits("fp8-hybrid-unscaled", 150, sgd_for(mult), mult)
    assert abs(fp8 - bf16) < 0.05 * bf16, (fp8, bf16)   # measured 0.0953 vs 0.0938
    assert abs(mx - bf16) < 0.05 * bf16, (mx, bf16)     # measured 0.0963
    assert unscaled > 3 * bf16                          # measured 2.31: E5M2 flushed every gradient
    assert e_unscaled.telemetry.summary()["underflow_fraction"] > 0.9
    assert e_fp8.telemetry.summary()["underflow_fraction"] < 0.05


def test_d_fp16_forward_overflow_is_detected_and_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
        model[2].weight.fill_(300.0)  # 8 inputs of 240 x 300 each: far beyond fp16's 65504
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = fb.train.Engine(model, opt, "fp16-mixed")
    masters = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    x = torch.full((2, 8), 30.0)
    out = model(x)
    assert torch.isinf(out).any()
    stepped = engine.train_step(out.float().pow(2).mean())
    assert not stepped and engine.skipped_steps == 1
    assert engine.last_step["overflow_layer"] == "2"
    assert engine.overflows[0]["overflow_layer"] == "2"
    for p, m in zip(opt.param_groups[0]["params"], masters):  # the masters were not touched
        assert torch.equal(p.detach(), m)
    assert engine.scaler.scale == 2.0 ** 15
