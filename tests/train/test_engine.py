"""The engine with any module and optimizer: fp32 identity, master/working copies, skipping
non-finite steps, gradient accumulation, fp32-kept modules, optimizer-state formats."""
import math

import pytest
import torch
from helpers_train import digits, mlp
from torch import nn

import fewbits as fb
from fewbits.train import Engine, Telemetry, pack_state
from fewbits.train.optim import land_update


def batches(n, seed=0, batch=32):
    x, y = digits()
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        yield x[idx], y[idx]


def test_fp32_policy_is_plain_training_bit_for_bit():
    ref = mlp()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for x, y in batches(5):
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
    model = mlp()
    eng = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "fp32")
    assert eng.entries == [] and not eng.needs_mode
    for x, y in batches(5):
        assert eng.train_step(nn.functional.cross_entropy(model(x), y))
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.AdamW(p, lr=1e-3),
                                      lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                                      lambda p: torch.optim.Adagrad(p, lr=0.01)])
def test_bf16_mixed_keeps_fp32_masters_and_bf16_working_copy(make_opt):
    model = mlp()
    opt = make_opt(model.parameters())
    masters = list(opt.param_groups[0]["params"])
    eng = Engine(model, opt, "bf16-mixed")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in masters)
    for x, y in batches(4):
        out = model(x)
        assert out.dtype == torch.float32  # the loss is computed in fp32
        assert eng.train_step(nn.functional.cross_entropy(out, y))
        for e in eng.entries:  # working copy = master rounded to bf16 (nearest even)
            assert torch.equal(e.working.detach(), fb.round(e.master.detach(), "bf16").bfloat16())
    # an update smaller than bf16's spacing survives in the master
    assert any(not torch.equal(e.master.detach(), e.working.detach().float()) for e in eng.entries)


def test_nonfinite_batch_never_touches_masters():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng = Engine(model, opt, "bf16-mixed")
    (x, y), = batches(1)
    eng.train_step(nn.functional.cross_entropy(model(x), y))
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    state_before = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    bad = x.clone()
    bad[0, 0] = math.nan
    assert eng.train_step(nn.functional.cross_entropy(model(bad), y)) is False
    assert eng.skipped_steps == 1 and eng.last_step["overflow_params"]
    for p, b in zip(opt.param_groups[0]["params"], before):
        assert torch.equal(p, b)
    for k, v in opt.state[opt.param_groups[0]["params"][0]].items():
        assert torch.equal(v, state_before[k])
    assert eng.train_step(nn.functional.cross_entropy(model(x), y)) is True  # and training goes on


def test_gradient_accumulation_equals_one_big_batch():
    (x, y), = batches(1, batch=64)
    a = mlp()
    ea = Engine(a, torch.optim.SGD(a.parameters(), lr=0.1), "bf16-mixed")
    ea.backward(nn.functional.cross_entropy(a(x), y))
    ea.step()
    b = mlp()
    eb = Engine(b, torch.optim.SGD(b.parameters(), lr=0.1), "bf16-mixed")
    for half in (slice(0, 32), slice(32, 64)):
        eb.backward(nn.functional.cross_entropy(b(x[half]), y[half]) / 2)
    eb.step()
    for pa, pb in zip(ea.master_parameters(), eb.master_parameters()):
        torch.testing.assert_close(pa[1], pb[1], atol=2e-3, rtol=0)  # bf16 compute, different sums


class TinyNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.norm(self.fc(x))
        assert h.dtype == self.head.weight.dtype  # back in the compute dtype after the fp32 norm
        return self.head(h)


def test_norms_stay_fp32_and_tied_weights_share_one_copy():
    torch.manual_seed(0)
    net = TinyNormNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    eng = Engine(net, opt, "bf16-pure")
    assert net.norm.weight.dtype == torch.float32 and net.fc.weight.dtype == torch.bfloat16
    assert eng.train_step(net(torch.randn(8, 16)).pow(2).mean())
    # tied: an embedding and a head sharing one matrix keep sharing it
    emb = nn.Embedding(10, 16)
    head = nn.Linear(16, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    eng2 = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed")
    assert model[0].weight is model[1].weight and len(eng2.entries) == 1
    assert eng2.train_step(model(torch.tensor([1, 2, 3])).float().logsumexp(-1).mean())


class _OwnNorm(nn.LayerNorm):
    def forward(self, x):
        assert x.dtype == torch.float32  # a forward of its own: fed fp32 as every fp32-kept module
        return super().forward(x)


def test_layernorm_takes_bf16_input_as_is_on_cpu():
    """torch's CPU LayerNorm computes in fp32 from a bf16 input with its fp32 weights: the Engine
    skips the casts around it, with results equal to the casts' up to the order of the sums;
    a subclass with a forward of its own still gets its input cast to fp32."""
    torch.manual_seed(0)
    net = TinyNormNet()
    seen = []
    net.norm.register_forward_hook(lambda m, a, o: seen.append((a[0].dtype, o.dtype)))
    Engine(net, torch.optim.SGD(net.parameters(), lr=0.1), "bf16-mixed")
    x = torch.randn(64, 16) * 3
    y = net(x)
    assert seen == [(torch.bfloat16, torch.bfloat16)] and net.norm.weight.dtype == torch.float32
    h = net.fc(x.bfloat16())
    via_fp32 = net.head(nn.functional.layer_norm(h.float(), (16,), net.norm.weight, net.norm.bias).bfloat16())
    torch.testing.assert_close(y, via_fp32.float(), atol=2e-2, rtol=1e-2)
    own = nn.Sequential(nn.Linear(16, 16), _OwnNorm(16), nn.Linear(16, 4))
    Engine(own, torch.optim.SGD(own.parameters(), lr=0.1), "bf16-mixed")
    own(x)


def test_fp16_emulated_values_are_fp16():
    model = mlp()
    eng = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-mixed")
    assert eng.compute_dtype == torch.float32 and eng.cast_forward and eng.cast_activations
    for x, y in batches(3):
        eng.train_step(nn.functional.cross_entropy(model(x), y))
    for p in model.parameters():
        assert torch.equal(p.detach(), fb.round(p.detach(), "fp16"))


def test_stochastic_and_kahan_updates_accumulate_small_steps():
    w = torch.full((10000,), 1.0, dtype=torch.bfloat16)
    target = 1.0 + 100 * 1e-4
    for rule in ("nearest", "stochastic", "kahan"):
        stored = w.clone()
        comp = torch.zeros_like(stored)
        gen = torch.Generator().manual_seed(0)
        for _ in range(100):
            land_update(stored, stored.float() + 1e-4, "bf16", rule, comp, gen)
        mean = stored.float().mean().item()
        if rule == "nearest":
            assert mean == 1.0  # 1e-4 is under half of bf16's spacing at 1 (2^-7): every update lost
        elif rule == "stochastic":
            assert abs(mean - target) < 2e-4, mean  # unbiased: the mean lands on 1.01
        else:
            # the weights hold the nearest bf16 value, the compensation what it could not
            assert stored[0].item() == 1.0078125
            # (the bf16 compensation is itself rounded each step: a small drift, not a loss)
            assert abs((stored.float() + comp.float()).mean().item() - target) < 5e-4


def test_blockwise_states_pack_exactly_enough():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(1000, generator=g) * 1e-3
    v = torch.rand(1000, generator=g) ** 4 * 1e-6
    pm, pv = pack_state(m, "int8_blockwise"), pack_state(v, "int8_blockwise")
    assert not pm.unsigned and pv.unsigned and pm.nbytes < m.numel() * 4 / 3.5
    um, uv = pm.unpack(), pv.unpack()
    blocks = torch.nn.functional.pad(m, (0, 24)).reshape(-1, 256).abs().amax(1)
    err = (um - m).abs().reshape(-1)
    bound = (blocks / 127 / 2).repeat_interleave(256)[:1000]
    assert (err <= bound * (1 + 1e-6)).all()
    nz = v > 1e-4 * v.max()  # relative precision of a 4-bit-mantissa float where not subnormal
    assert ((uv[nz] - v[nz]).abs() <= v[nz] * 2 ** -4).all()
    for fmt in ("bf16", "fp8_e4m3", "tf32"):
        p = pack_state(m, fmt)
        assert torch.equal(p.unpack(), fb.round(m, fmt))


def test_8bit_optimizer_states_train_and_save_memory():
    final = {}
    for policy in ("bf16-mixed", "bf16-mixed-8bit-adam"):
        model = mlp(hidden=128)
        eng = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy)
        for x, y in batches(60, batch=64):
            eng.train_step(nn.functional.cross_entropy(model(x), y))
        x, y = next(iter(batches(1, seed=5, batch=512)))
        final[policy] = nn.functional.cross_entropy(model(x), y).item()
    mem = eng.memory_bytes()
    n = sum(e.master.numel() for e in eng.entries)
    assert mem["optimizer_states"] < 2 * n * 1.1 + 1000  # two 1-byte states (+ scales, step counters)
    assert final["bf16-mixed-8bit-adam"] < 1.05 * final["bf16-mixed"], final


def test_bad_input():
    model = mlp()
    with pytest.raises(TypeError, match="optimizer"):
        Engine(model, None, "bf16-mixed")
    with pytest.raises(ValueError, match="unknown policy preset"):
        Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf17-mixed")
    with pytest.raises(ValueError, match="one-element"):
        Engine(model, torch.optim.SGD(model.parameters(), lr=0.1)).backward(torch.ones(3))


def test_telemetry_observes_native_bf16_steps_too():
    model = mlp()
    tel = Telemetry(every=2, sqnr=True)
    eng = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "fp8-hybrid", telemetry=tel)
    for x, y in batches(4):
        eng.train_step(nn.functional.cross_entropy(model(x), y))
    roles = {r["role"] for r in tel.rows}
    assert {"forward", "backward", "weight_grad", "weights", "update"} <= roles
    assert {r["step"] for r in tel.rows} == {0, 2}
    fwd = [r for r in tel.rows if r["role"] == "forward"]
    assert all(r["format"] == "fp8_e4m3" and r["sqnr_db"] > 25 for r in fwd)  # e4m3: ~32 dB
    assert any(r["sqnr_db"] < 40 for r in fwd)
    assert all(r["layer"].startswith(("0#", "2#")) for r in fwd)
