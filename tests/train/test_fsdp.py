"""FSDP2 (torch.distributed.fsdp.fully_shard) under fewbits policies, via
fully_shard_with_policy: the sharded fp32 parameters are the masters, FSDP2 all-gathers them as
the bf16 working copy, and the Engine on the sharded model does the emulated casts (fp8).
Checked against the ordinary single-process Engine: exactly with a world of one (in this
process), to a tolerance with 2 gloo processes on loopback (each rank its half of the batch)."""
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from fewbits.train import Engine, Policy
from fewbits.train.distributed import fully_shard_with_policy


# FSDP2 warns that the root's output is a view (the Engine's straight-through cast of the last
# matmul); the Engine's root hook copies it to fp32 out of place, so nothing in-place touches it.
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10))


def _batches(world, steps, per_rank):
    """Each rank's row indices for every step (rank r draws from generator 100 + r)."""
    from fewbits.study.tasks import digits_data
    x, _ = digits_data()
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    return [[torch.randint(0, x.shape[0], (per_rank,), generator=g) for g in gens] for _ in range(steps)]


def _train_single(policy, batches, per_rank_backward=False):
    """The reference: the plain Engine in one process on every rank's rows. per_rank_backward:
    one backward per rank's rows with its loss halved, accumulated in the Engine's fp32 gradient
    buffer — the sum FSDP2 reduce-scatters in fp32 and divides by the world size (exact: halving
    is exact in binary); else one backward over all rows."""
    from fewbits.study.tasks import digits_data
    x, y = digits_data()
    model = _model()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy)
    losses = []
    for per_rank in batches:
        if per_rank_backward:
            rank_losses = [nn.functional.cross_entropy(model(x[idx]), y[idx]) for idx in per_rank]
            for loss in rank_losses:
                engine.backward(loss / len(per_rank))
            loss = rank_losses[0]  # the loss rank 0 reports
            engine.step()
            engine.zero_grad()
        else:
            idx = torch.cat(per_rank)  # equal halves: the mean over all rows = the mean of the ranks' means
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            engine.train_step(loss)
        losses.append(float(loss.detach()))
    masters = dict(engine.master_parameters())  # low-precision entries first, fp32-kept after
    return torch.cat([masters[n].reshape(-1).float() for n in sorted(masters)]), losses


def _train_sharded(policy, batches, rank, units=False):
    """fully_shard_with_policy + Engine; returns (gathered fp32 params, losses, what the layers saw,
    formats of the engine's casts)."""
    from fewbits.study.tasks import digits_data
    x, y = digits_data()
    model = _model()
    seen = []
    for m in (model[0], model[1]):
        # fully_shard renames the class FSDP<name>
        m.register_forward_hook(lambda mod, a, o: seen.append(
            (type(mod).__name__.removeprefix("FSDP"), a[0].dtype, mod.weight.dtype)))
    engine_policy = fully_shard_with_policy(model, policy, units=(model[0], model[3]) if units else ())
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), engine_policy)
    losses = []
    for per_rank in batches:
        idx = per_rank[rank]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        engine.train_step(loss)
        losses.append(float(loss.detach()))
    params = dict(model.named_parameters())
    full = torch.cat([params[n].detach().full_tensor().reshape(-1).float() for n in sorted(params)])
    formats = sorted({(k[-1], s.fmt.name) for k, s in engine.slots.items()})
    return full, losses, sorted(set(seen), key=str), formats


def test_one_process_matches_plain_engine_exactly(tmp_path):
    """A world of one: FSDP2's bf16 all-gather + fp32 reduce is the Engine's bf16 working copy +
    fp32 gradient buffer, so the two trainings agree to the bit (bf16-mixed and fp8-hybrid)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        batches = _batches(1, 6, 32)
        for policy, units in (("bf16-mixed", False), ("fp8-hybrid", True), ("bf16-pure", False),
                              ("bf16-pure-kahan", True)):
            full, losses, seen, formats = _train_sharded(policy, batches, 0, units)
            ref, ref_losses = _train_single(policy, batches)
            assert torch.equal(full, ref), (policy, float((full - ref).abs().max()))
            assert losses == ref_losses
            assert ("Linear", torch.bfloat16, torch.bfloat16) in seen  # bf16 compute
            assert ("LayerNorm", torch.bfloat16, torch.float32) in seen  # fp32 weights, bf16 input as it is
            assert formats == ([("backward", "fp8_e5m2"), ("forward", "fp8_e4m3")] if policy == "fp8-hybrid" else [])
    finally:
        dist.destroy_process_group()


def _worker(rank, world, store, policies, steps, out_dir):
    import torch.distributed as dist

    import fewbits as fb

    torch.set_num_threads(1)
    # a file store: no TCP port to pick and lose to another process between picking and binding
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with fb.use_backend("eager"):
            batches = _batches(world, steps, 64)
            for i, policy in enumerate(policies):
                full, losses, seen, formats = _train_sharded(policy, batches, rank)
                torch.save({"full": full, "losses": losses, "seen": seen, "formats": formats},
                           os.path.join(out_dir, f"{i}-rank{rank}.pt"))
        torch.save(_scaler_verdicts(rank, world), os.path.join(out_dir, f"scaler-rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


def _scaler_verdicts(rank, world):
    """LossScaler.unscale_ on a sharded gradient whose only inf lies in rank 1's shard: every rank
    must report the overflow (and none when there is none); the finite shards are unscaled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fewbits.train.scaler import LossScaler
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for poison in (False, True):
        local = torch.full((4,), 8.0)
        if poison and rank == 1:
            local[2] = float("inf")
        grad = DTensor.from_local(local, mesh, [Shard(0)])
        out.append((LossScaler("static", init_scale=4.0).unscale_([grad]), float(grad.to_local()[0])))
    return out


STEPS = 25
# (policy, largest |sharded - reference| allowed after STEPS AdamW steps, weights up to ~1.25).
# Stateless casts are exact against one backward per rank's rows; delayed fp8 scaling keeps an amax
# history per rank (each sees its own activations) where the reference keeps one for both halves.
CASES = [("bf16-mixed", 0.0), (Policy.preset("fp8-hybrid").replace(name="fp8-current", fp8_recipe="current"), 0.0),
         ("fp8-hybrid", 0.03),
         # dynamic loss scaling (growing every 5 steps): scaling by powers of two is exact
         (Policy.preset("bf16-mixed").replace(name="bf16-scaled", loss_scaling="dynamic", growth_interval=5), 0.0),
         # no master: bf16 shards, the update landed in them by the Engine. FSDP2 stores the
         # fp32-reduced gradient in bf16, as the reference's bf16 grad_accum rounds its sum: exact.
         # Stochastic rounding draws a stream of random words per rank: as close as a rerun.
         ("bf16-pure", 0.0), ("bf16-pure-kahan", 0.0), ("bf16-pure-sr", 0.1)]


@pytest.mark.slow  # two processes importing torch: ~15 s on 2 busy cores
def test_fsdp2_two_gloo_processes(tmp_path):
    policies = [p for p, _ in CASES]
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), policies, STEPS, str(tmp_path)), nprocs=2, join=True)
    batches = _batches(2, STEPS, 64)
    for i, (policy, tol) in enumerate(CASES):
        r0, r1 = (torch.load(tmp_path / f"{i}-rank{r}.pt") for r in range(2))
        assert torch.equal(r0["full"], r1["full"]), policy  # one model, whichever rank gathers it
        for r in (r0, r1):
            assert sum(r["losses"][-5:]) / 5 < 0.8 * r["losses"][0], (policy, r["losses"])
            assert ("Linear", torch.bfloat16, torch.bfloat16) in r["seen"]  # bf16 all-gather and compute
            assert ("LayerNorm", torch.bfloat16, torch.float32) in r["seen"]  # its own fp32 unit, bf16 input
        fp8 = "fp8" in (policy if isinstance(policy, str) else policy.name)
        assert r0["formats"] == ([("backward", "fp8_e5m2"), ("forward", "fp8_e4m3")] if fp8 else [])
        ref, ref_losses = _train_single(policy, batches, per_rank_backward=True)
        diff = float((r0["full"] - ref).abs().max())
        assert diff <= tol, (policy, diff)
        if tol == 0.0:
            assert r0["losses"] == ref_losses  # rank 0's loss: the reference's first half
        # one backward over the whole batch: bf16 rounds the sum of 128 rows' gradients, not two of 64
        whole, _ = _train_single(policy, batches)
        assert float((r0["full"] - whole).abs().max()) < 0.1
    for r in range(2):  # the ranks agree on an overflow seen in one rank's shard only
        assert torch.load(tmp_path / f"scaler-rank{r}.pt") == [(False, 2.0), (True, 2.0)]


def _resume_worker(rank, world, store, out_dir):
    """For each policy: 6 steps straight, and 3 steps + checkpoint (each rank its own file) + a
    fresh sharded model and engine loading it + 3 steps: the two must end bit-identical."""
    import torch.distributed as dist

    from fewbits.study.tasks import digits_data

    torch.set_num_threads(1)
    # a file store: no TCP port to pick and lose to another process between picking and binding
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        x, y = digits_data()
        batches = _batches(world, 6, 32)
        for policy in (Policy.preset("bf16-mixed").replace(name="bf16-scaled", loss_scaling="dynamic",
                                                           growth_interval=2),
                       Policy.preset("bf16-pure-sr"), Policy.preset("bf16-pure-kahan")):
            _resume_one(rank, policy, x, y, batches, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _resume_one(rank, policy, x, y, batches, out_dir):
    import fewbits as fb
    from fewbits.train import load_checkpoint, save_checkpoint

    def fresh():
        model = _model()
        pol = fully_shard_with_policy(model, policy)
        return model, Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pol)

    def train(model, engine, steps):
        for per_rank in steps:
            idx = per_rank[rank]
            engine.train_step(nn.functional.cross_entropy(model(x[idx]), y[idx]))

    def gathered(model):
        params = dict(model.named_parameters())
        return torch.cat([params[n].detach().full_tensor().float().reshape(-1) for n in sorted(params)])

    with fb.use_backend("eager"):
        model, engine = fresh()
        train(model, engine, batches)
        straight = gathered(model)
        model, engine = fresh()
        train(model, engine, batches[:3])
        path = os.path.join(out_dir, f"ck-{policy.name}-rank{rank}.pt")
        save_checkpoint(engine, path)
        model, engine = fresh()
        load_checkpoint(engine, path)
        train(model, engine, batches[3:])
        resumed = gathered(model)
    torch.save({"equal": torch.equal(straight, resumed), "scale": engine.scaler.scale,
                "steps": engine.step_count}, os.path.join(out_dir, f"resume-{policy.name}-rank{rank}.pt"))


@pytest.mark.slow  # two processes importing torch
def test_fsdp2_sharded_checkpoint_resumes_bit_identically(tmp_path):
    mp.spawn(_resume_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for name, scale in (("bf16-scaled", 2.0 ** 19), ("bf16-pure-sr", 1.0), ("bf16-pure-kahan", 1.0)):
        for r in range(2):
            res = torch.load(tmp_path / f"resume-{name}-rank{r}.pt")
            assert res["equal"] and res["steps"] == 6 and res["scale"] == scale, (name, res)


def test_unsupported_policies_raise():
    for policy, what in (("fp16-mixed", "weights=fp16 is not a native dtype"),
                         ("bf16-mixed-8bit-adam", "optimizer_states"),
                         (Policy.preset("bf16-mixed").replace(master="bf16"), "master=bf16"),
                         (Policy.preset("bf16-mixed").replace(grad_accum="bf16"), "grad_accum=bf16")):
        with pytest.raises(ValueError, match=what):
            fully_shard_with_policy(_model(), policy)
    with pytest.raises(TypeError, match="policy"):
        fully_shard_with_policy(_model(), 3)
