"""Training state under hostile use (issue 12, item 4): saving never changes the live state, a
checkpoint that does not fit or is corrupted never changes the engine, every policy skips a step
that met inf/NaN before a saturating cast, and a plain loss.backward()/optimizer.step() fails loudly."""
import copy
import math

import pytest
import torch
from helpers_train import digits, mlp
from torch import nn

from fewbits.train import PRESETS, CheckpointError, Engine, Telemetry, load_checkpoint, read_checkpoint, save_checkpoint
from fewbits.train import checkpoint as ckpt


def batches(n, seed=3, batch=32):
    x, y = digits()
    g = torch.Generator().manual_seed(seed)
    return [(x[i], y[i]) for i in (torch.randint(0, x.shape[0], (batch,), generator=g) for _ in range(n))]


def make(policy, hidden=64, opt=torch.optim.AdamW):
    model = mlp(hidden)
    return model, Engine(model, opt(model.parameters(), lr=3e-3), policy, telemetry=Telemetry(every=2), seed=5)


def run(model, engine, data):
    for x, y in data:
        engine.train_step(nn.functional.cross_entropy(model(x), y))


def same(a, b) -> bool:
    """Bit-identical nested states (tensors by dtype, shape and bytes; NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def full_state(model, engine):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "engine": engine.state_dict()}


# --- saving never changes the live state ------------------------------------------------------
@pytest.mark.parametrize("policy", ["bf16-mixed-8bit-adam", "bf16-mixed", "fp8-hybrid", "bf16-pure-kahan"])
def test_saving_never_changes_the_live_state(policy, tmp_path):
    data = batches(4)
    model, eng = make(policy)
    run(model, eng, data)
    expected = full_state(model, eng)

    model, eng = make(policy)
    run(model, eng, data[:2])
    snapshot = eng.state_dict()
    frozen = copy.deepcopy(snapshot)
    save_checkpoint(eng, tmp_path / "ck.pt")
    run(model, eng, data[2:])  # under 8-bit Adam this failed: the packed moments had become None
    assert same(full_state(model, eng), expected)
    assert same(snapshot, frozen)  # and a state dict is a copy: later steps do not change it


# --- a checkpoint that does not fit changes nothing -------------------------------------------
def _trained(policy, hidden=64, opt=torch.optim.AdamW, seed=1):
    model, eng = make(policy, hidden, opt)
    run(model, eng, batches(2, seed=seed))
    return model, eng


def _refused(model, eng, path, match):
    before = full_state(model, eng)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(eng, path)
    assert same(full_state(model, eng), before)
    assert eng.train_step(nn.functional.cross_entropy(model(batches(1)[0][0]), batches(1)[0][1]))


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-mixed", "bf16-mixed-8bit-adam"])
def test_checkpoint_of_another_model_changes_nothing(policy, tmp_path):
    model, eng = _trained(policy, hidden=32)
    save_checkpoint(eng, tmp_path / "other.pt")
    model, eng = _trained(policy, seed=2)  # the same layers, another hidden width: the last bias would fit
    _refused(model, eng, tmp_path / "other.pt", "another model")


def _crafted(tmp_path, monkeypatch, eng, edit):
    """A checkpoint with a valid digest whose state `edit` changed (as a foreign writer might)."""
    state = ckpt.engine_state(eng)
    edit(state)
    monkeypatch.setattr(ckpt, "engine_state", lambda engine, **kw: state)
    save_checkpoint(eng, tmp_path / "crafted.pt")
    monkeypatch.undo()
    return tmp_path / "crafted.pt"


def _set_optimizer_state(state, value):
    state["optimizer"]["state"][0]["exp_avg"] = value


@pytest.mark.parametrize("edit, match", [
    (lambda s: s["masters"].__setitem__(0, torch.zeros(3, 3)), "master"),
    (lambda s: s.pop("masters"), "missing \\['masters'\\]"),
    (lambda s: s.__setitem__("masters", s["masters"][:-1]), "master weights"),
    (lambda s: s["model"].__setitem__("0.weight", s["model"]["0.weight"].float()), "0.weight"),
    (lambda s: s["model"].pop("2.bias"), "missing \\['2.bias'\\]"),
    (lambda s: _set_optimizer_state(s, torch.zeros(7, 7)), "exp_avg"),
    (lambda s: s["optimizer"]["param_groups"][0]["params"].pop(), "group 0"),
    (lambda s: s["optimizer"]["param_groups"][0].pop("lr"), "lacks the settings \\['lr'\\]"),
    (lambda s: s.__setitem__("optimizer_kind", "torch.optim.sgd.SGD"), "optimizer"),
    (lambda s: s["scaler"].__setitem__("scale", "big"), "loss scaler"),
    (lambda s: s["generators"].__setitem__("cast", torch.zeros(3, dtype=torch.uint8)), "generator"),
    (lambda s: s["slots"].append([["0", 0, 0, "forward"], {"history": "x"}]), "slot"),
    (lambda s: s.__setitem__("step_count", -1), "step_count"),
    (lambda s: s.__setitem__("surprise", 1), "unexpected \\['surprise'\\]"),
])
def test_checkpoint_that_does_not_fit_changes_nothing(edit, match, tmp_path, monkeypatch):
    model, eng = _trained("fp8-hybrid")
    path = _crafted(tmp_path, monkeypatch, eng, edit)
    model, eng = _trained("fp8-hybrid", seed=2)  # another state: an overwrite would show
    _refused(model, eng, path, match)
    state = ckpt.engine_state(eng)  # the in-memory API checks the same way
    edit(state)
    before = full_state(model, eng)
    with pytest.raises(CheckpointError, match=match):
        eng.load_state_dict(state)
    assert same(full_state(model, eng), before)


def test_checkpoint_of_another_optimizer_or_policy_changes_nothing(tmp_path):
    model, eng = _trained("bf16-mixed", opt=torch.optim.Adam)
    save_checkpoint(eng, tmp_path / "adam.pt")
    model, eng = _trained("bf16-mixed", seed=2)
    _refused(model, eng, tmp_path / "adam.pt", "Adam")
    model, eng = _trained("bf16-pure", seed=2)
    _refused(model, eng, tmp_path / "adam.pt", "policy")


def test_packed_states_are_checked(tmp_path, monkeypatch):
    model, eng = _trained("bf16-mixed-8bit-adam")

    def shrink(state):
        d = state["packed_states"][0]["exp_avg_sq"]
        d["data"] = d["data"][:-256]
    path = _crafted(tmp_path, monkeypatch, eng, shrink)
    model, eng = _trained("bf16-mixed-8bit-adam", seed=2)
    _refused(model, eng, path, "exp_avg_sq")


# --- integrity ---------------------------------------------------------------------------------
def test_corrupted_checkpoints_never_load(tmp_path):
    model, eng = _trained("fp8-hybrid", hidden=16)
    path = tmp_path / "ck.pt"
    save_checkpoint(eng, path, extra={"next_batch": 2})
    good = path.read_bytes()
    model, eng = _trained("fp8-hybrid", hidden=16, seed=2)
    before = full_state(model, eng)
    bad = tmp_path / "bad.pt"
    n = len(good)
    for i in range(64):  # single-bit flips spread over the whole file, header included
        pos = min(n - 1, i * n // 64 + (i * 7919) % max(1, n // 64))
        flipped = bytearray(good)
        flipped[pos] ^= 1 << (i % 8)
        bad.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError):
            load_checkpoint(eng, bad)
    for cut in (0, 1, 24, ckpt.HEADER_SIZE - 1, ckpt.HEADER_SIZE, ckpt.HEADER_SIZE + 1, n // 2, n - 1):
        bad.write_bytes(good[:cut])
        with pytest.raises(CheckpointError):
            load_checkpoint(eng, bad)
    bad.write_bytes(good + b"\0")
    with pytest.raises(CheckpointError):
        load_checkpoint(eng, bad)
    assert same(full_state(model, eng), before)
    assert load_checkpoint(eng, path) == {"next_batch": 2}  # the intact file still loads
    assert read_checkpoint(path)["step_count"] == 2


def test_unreadable_paths(tmp_path):
    _, eng = _trained("bf16-mixed", hidden=16)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(eng, tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_checkpoint(eng, tmp_path)
    torch.save({"format": ckpt.FORMAT_TAG}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="no fewbits header"):
        load_checkpoint(eng, tmp_path / "plain.pt")


def test_a_failed_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    _, eng = _trained("bf16-mixed", hidden=16)
    save_checkpoint(eng, tmp_path / "ck.pt")
    good = (tmp_path / "ck.pt").read_bytes()
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(eng, tmp_path / "ck.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"] and (tmp_path / "ck.pt").read_bytes() == good


# --- every policy skips a step that met inf/NaN -----------------------------------------------
class _Bomb(nn.Module):
    """Identity, except that when armed it puts `value` into the activation (forward) or into the
    gradient flowing back through it (backward)."""

    def __init__(self):
        super().__init__()
        self.forward_value = self.backward_value = None

    def forward(self, h):
        if self.forward_value is not None:
            h = h.clone()
            h[0, 0] = self.forward_value
        if self.backward_value is not None and h.requires_grad:
            value = self.backward_value
            h.register_hook(lambda g: _put_first(g, value))
        return h


def _put_first(g, value):
    g = g.clone()
    g[0, 0] = value
    return g


def _bomb_net(policy):
    torch.manual_seed(0)
    bomb = _Bomb()
    # between two Linears: what it puts in meets the next one's input and the previous one's output gradient
    model = nn.Sequential(nn.Linear(64, 32), bomb, nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    return model, bomb, Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy)


@pytest.mark.parametrize("where", ["input", "activation", "gradient"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("policy", sorted(PRESETS))
def test_every_policy_skips_a_step_that_met_inf_or_nan(policy, value, where):
    model, bomb, eng = _bomb_net(policy)
    (x, y), = batches(1)
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))
    before = full_state(model, eng)
    if where == "input":
        x = x.clone()
        x[0, 0] = value
    elif where == "activation":
        bomb.forward_value = value
    else:
        bomb.backward_value = value
    assert eng.train_step(nn.functional.cross_entropy(model(x), y)) is False
    after = full_state(model, eng)
    assert same(after["model"], before["model"]) and same(after["engine"]["masters"], before["engine"]["masters"])
    assert same(after["engine"]["optimizer"], before["engine"]["optimizer"])
    assert eng.skipped_steps == 1 and not eng.last_step["stepped"]
    bomb.forward_value = bomb.backward_value = None
    (x, y), = batches(1, seed=9)
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))  # and training goes on


def _with_inf(x: torch.Tensor) -> torch.Tensor:
    bad = x.clone()
    bad[3, 5] = math.inf
    return bad


@pytest.mark.parametrize("policy", ["fp8-hybrid", "mxfp8", "fp8-hybrid-unscaled"])
def test_fp8_skip_names_the_cast_and_evaluation_does_not_count(policy):
    model, bomb, eng = _bomb_net(policy)
    (x, y), = batches(1)
    bad = _with_inf(x)
    with torch.no_grad():  # an evaluation batch holding inf is not part of the next step
        model(bad)
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))
    assert eng.train_step(nn.functional.cross_entropy(model(bad), y)) is False
    assert eng.last_step["nonfinite_cast"].startswith("0.")  # the first Linear's input cast


# --- a plain backward/step fails loudly -------------------------------------------------------
@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure", "fp8-hybrid", "fp16-mixed"])
def test_plain_backward_and_step_fail_loudly(policy):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng = Engine(model, opt, policy)
    (x, y), = batches(1)
    nn.functional.cross_entropy(model(x), y).backward()
    before = full_state(model, eng)  # (the forward pass itself moved the FP8 amax histories)
    with pytest.raises(RuntimeError, match="engine.backward"):
        opt.step()
    with pytest.raises(RuntimeError, match="engine.backward"):
        eng.step()
    assert same(full_state(model, eng), before)
    eng.zero_grad()
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))  # the engine's own way works


def test_plain_training_under_fp32_still_works():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Engine(model, opt, "fp32")  # nothing under the engine's care: the parameters are the model's
    (x, y), = batches(1)
    w = model[0].weight.detach().clone()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert not torch.equal(model[0].weight, w)


# --- the DDP comm hook is a saturating cast of gradients too ----------------------------------
@pytest.mark.parametrize("fmt", ["fp8_e5m2", "fp8_e4m3", "int8", "bf16"])
def test_compressed_comm_sends_a_nonfinite_bucket_as_nonfinite(fmt):
    from fewbits.train.distributed import CompressedComm
    st = CompressedComm(fmt)
    g = torch.randn(300)
    g[7] = math.inf
    payload, sent = st.compress(g)
    received = st.decompress(payload, g.numel())
    assert not torch.isfinite(received).all() and torch.equal(received.isnan(), sent.isnan())


def test_ddp_hook_skips_an_inf_gradient_step_and_keeps_no_residual(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fewbits.train.distributed import CompressedComm, compressed_allreduce_hook

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
        ddp = DDP(model)
        state = CompressedComm("fp8_e5m2", error_feedback=True)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
        x = torch.randn(16, 8)
        w = model.weight.detach().clone()
        out = ddp(x)
        out.register_hook(lambda g: _put_first(g, math.inf))
        assert engine.train_step(out.pow(2).mean()) is False  # (sent saturated to e5m2's max, it stepped)
        assert torch.equal(model.weight.detach(), w)
        assert all(torch.isfinite(r).all() for r in state.residuals.values())
        assert engine.train_step(ddp(x).pow(2).mean())
        assert torch.isfinite(model.weight).all() and not torch.equal(model.weight.detach(), w)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("opt", [lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
                                 lambda p, lr: torch.optim.Adafactor(p, lr=lr)])
def test_the_checks_accept_other_optimizers_states(opt, tmp_path):
    """SGD's momentum buffers and Adafactor's factored (row, column) states pass the shape checks."""
    model, eng = _trained("bf16-mixed", opt=opt)
    save_checkpoint(eng, tmp_path / "ck.pt")
    model2, eng2 = make("bf16-mixed", opt=opt)
    load_checkpoint(eng2, tmp_path / "ck.pt")
    assert same(full_state(model2, eng2), full_state(model, eng))


# --- a forward's checks belong to the step that back-propagates it ---------------------------
@pytest.mark.parametrize("policy", ["fp8-hybrid", "mxfp8", "fp8-hybrid-unscaled"])
def test_a_forward_never_back_propagated_does_not_count_for_the_next_step(policy):
    model, bomb, eng = _bomb_net(policy)
    (x, y), = batches(1)
    bad = _with_inf(x)
    eng.model(bad)  # grad enabled, never back-propagated: the next step skipped on it
    assert eng.train_step(nn.functional.cross_entropy(model(x), y)), eng.last_step
    out = model(bad)  # nor does one between the step's forward and its backward
    loss = nn.functional.cross_entropy(model(x), y)
    del out
    assert eng.train_step(loss)


@pytest.mark.parametrize("policy", ["fp8-hybrid", "fp16-mixed"])
def test_grad_enabled_forwards_without_backward_do_not_pile_up(policy):
    model, bomb, eng = _bomb_net(policy)
    (x, y), = batches(1)
    for _ in range(50):  # an evaluation loop with grad enabled that never steps
        model(x)
    assert eng._cast_flags == [] and eng._fwd_flags == []  # (200 cast checks had piled up under fp8)
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))


@pytest.mark.parametrize("policy", ["fp8-hybrid", "mxfp8"])
def test_every_back_propagated_forward_counts(policy):
    model, bomb, eng = _bomb_net(policy)
    (x, y), = batches(1)
    bad = _with_inf(x)
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))
    # two forwards in one loss: the first one's inf counts although a forward came after it
    loss = nn.functional.cross_entropy(model(bad), y) + nn.functional.cross_entropy(model(x), y)
    assert eng.train_step(loss) is False and eng.last_step["nonfinite_cast"].startswith("0.")
    # gradient accumulation: each micro-batch's checks join the step at its own backward
    eng.backward(nn.functional.cross_entropy(model(bad), y))
    eng.backward(nn.functional.cross_entropy(model(x), y))
    assert eng.step() is False
    eng.zero_grad()
    # zero_grad between the forward and its backward does not lose the forward's checks
    loss = nn.functional.cross_entropy(model(bad), y)
    eng.zero_grad()
    assert eng.train_step(loss) is False
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))


# --- saving and loading hold no second copy of the state --------------------------------------
class _NewTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of tensors copied into new memory (clone, .to copies) while active."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default):
            self.nbytes += out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-mixed-8bit-adam"])
def test_checkpoints_are_saved_and_loaded_without_a_second_copy_of_the_state(policy, tmp_path):
    import tracemalloc
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(384, 384) for _ in range(12)])
    eng = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy)
    eng.train_step(model(torch.randn(4, 384)).pow(2).mean())
    expected = full_state(model, eng)
    path = tmp_path / "ck.pt"
    tracemalloc.start()
    try:
        with _NewTensors() as copies:
            save_checkpoint(eng, path)
        saved_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        with _NewTensors() as load_copies:
            load_checkpoint(eng, path)
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = path.stat().st_size  # 14-25 MB: the state was cloned and the whole file held as bytes
    assert copies.nbytes == 0 and saved_peak < size / 4  # what is left: a chunk of the hash
    assert load_copies.nbytes == 0 and load_peak < size / 4
    assert same(full_state(model, eng), expected)
    assert eng.train_step(model(torch.randn(4, 384)).pow(2).mean())


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp32"])
def test_a_second_engine_over_the_same_model_or_optimizer_is_refused(policy):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng = Engine(model, opt, policy)
    other_model = mlp()
    for m, o in ((model, opt), (model, torch.optim.SGD(other_model.parameters(), lr=0.1)),
                 (other_model, opt)):
        with pytest.raises(RuntimeError, match="already under a fewbits Engine"):
            Engine(m, o, policy)
    (x, y), = batches(1)
    assert eng.train_step(nn.functional.cross_entropy(model(x), y))  # the first one is unharmed
    fresh = mlp()
    Engine(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), policy)  # a new model and optimizer: fine
