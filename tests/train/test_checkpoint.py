"""A run resumed from a checkpoint is bit-identical to an uninterrupted one."""
import pytest
import torch
from helpers_train import digits, mlp
from torch import nn

from fewbits.train import Engine, Telemetry, load_checkpoint, save_checkpoint


def data(n):
    x, y = digits()
    g = torch.Generator().manual_seed(3)
    return [(x[i], y[i]) for i in (torch.randint(0, x.shape[0], (32,), generator=g) for _ in range(n))]


def make(policy):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, Engine(model, opt, policy, telemetry=Telemetry(every=2), seed=11)


def run(model, engine, batches):
    for x, y in batches:
        engine.train_step(nn.functional.cross_entropy(model(x), y))


def snapshot(model, engine):
    return [t.clone() for t in model.state_dict().values()] + [t.clone() for _, t in engine.master_parameters()]


@pytest.mark.parametrize("policy", ["bf16-pure-sr", "bf16-pure-kahan", "fp8-hybrid", "mxfp8",
                                    "bf16-mixed-8bit-adam", "fp16-mixed"])
def test_resume_is_bit_identical(policy, tmp_path):
    batches = data(6)
    model, eng = make(policy)
    run(model, eng, batches)
    expected = snapshot(model, eng)
    expected_scales = list(eng.scaler.history)

    model, eng = make(policy)
    run(model, eng, batches[:3])
    save_checkpoint(eng, tmp_path / "ck.pt", extra={"next_batch": 3})
    model2, eng2 = make(policy)
    extra = load_checkpoint(eng2, tmp_path / "ck.pt")
    assert extra == {"next_batch": 3} and eng2.step_count == 3
    run(model2, eng2, batches[3:])
    got = snapshot(model2, eng2)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert eng2.scaler.history == expected_scales


def test_refuses_foreign_or_mismatched_checkpoints(tmp_path):
    model, eng = make("bf16-mixed")
    run(model, eng, data(1))
    save_checkpoint(eng, tmp_path / "ck.pt")
    _, other = make("bf16-pure")
    with pytest.raises(ValueError, match="policy"):
        load_checkpoint(other, tmp_path / "ck.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(eng, tmp_path / "junk.pt")
