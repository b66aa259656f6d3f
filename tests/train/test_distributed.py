"""DDP with 2 gloo processes on loopback: policies work, and the compressed comm hook averages
gradients identically on every rank while sending a quarter (fp8) or half (bf16) of fp32's bytes."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from fewbits.train.distributed import CompressedComm


def _worker(rank, world, store, configs, out_dir):
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fewbits as fb
    from fewbits.train import Engine
    from fewbits.train.distributed import CompressedComm, compressed_allreduce_hook
    from fewbits.study.tasks import digits_data

    torch.set_num_threads(1)
    # a file store: no TCP port to pick and lose to another process between picking and binding
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with fb.use_backend("eager"):
            for policy, fmt in configs:
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                engine = Engine(model, opt, policy)
                ddp = DDP(model)
                state = None
                if fmt:
                    state = CompressedComm(fmt, error_feedback=True)
                    ddp.register_comm_hook(state, compressed_allreduce_hook)
                x, y = digits_data()
                g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
                losses = []
                for _ in range(25):
                    idx = torch.randint(0, x.shape[0], (64,), generator=g)
                    loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx])
                    engine.train_step(loss)
                    losses.append(float(loss.detach()))
                masters = torch.cat([t.reshape(-1).float() for _, t in engine.master_parameters()])
                torch.save({"masters": masters, "losses": losses,
                            "compression": state.compression if state else None},
                           os.path.join(out_dir, f"{policy}-{fmt}-rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other still talks to it (can SIGABRT)
    finally:
        dist.destroy_process_group()


CONFIGS = [("bf16-mixed", None, None), ("bf16-pure-sr", "bf16", 0.5), ("fp8-hybrid", "fp8_e5m2", 0.25)]


@pytest.mark.slow  # two processes importing torch: ~20 s on 2 busy cores
def test_ddp_two_gloo_processes(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), [c[:2] for c in CONFIGS], str(tmp_path)), nprocs=2, join=True)
    for policy, fmt, ratio in CONFIGS:
        r0, r1 = (torch.load(tmp_path / f"{policy}-{fmt}-rank{r}.pt") for r in range(2))
        assert torch.equal(r0["masters"], r1["masters"]), policy  # the ranks stay in lock step
        for r in (r0, r1):
            assert sum(r["losses"][-5:]) / 5 < 0.8 * r["losses"][0], (policy, r["losses"])
        if ratio:
            assert abs(r0["compression"] - ratio) < 0.01


def test_hook_in_one_process_group(tmp_path):
    """The hook under DDP with a world of one (in this process): the averaged gradient of one rank
    is its own gradient as it arrives after the trip through scaled fp8."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fewbits as fb
    from fewbits.train import Engine
    from fewbits.train.distributed import compressed_allreduce_hook
    from fewbits.train.fp8 import pow2_scale

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        ref = nn.Linear(8, 4)
        ref.load_state_dict(model.state_dict())
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), "fp32")
        ddp = DDP(model)
        state = CompressedComm("fp8_e4m3")
        ddp.register_comm_hook(state, compressed_allreduce_hook)
        x = torch.randn(16, 8)
        ref(x).pow(2).mean().backward()
        engine.backward(ddp(x).pow(2).mean())
        exact = torch.cat([ref.weight.grad.reshape(-1), ref.bias.grad])
        got = torch.cat([model.weight.grad.reshape(-1), model.bias.grad])
        scale = pow2_scale(float(exact.abs().max()), 448.0)
        assert torch.equal(got, fb.round(exact * scale, "fp8_e4m3", overflow="saturate") / scale)
        assert state.bytes_fp32 == 36 * 4 and state.bytes_sent == 36 + 4
    finally:
        dist.destroy_process_group()


def test_compress_roundtrip_and_errors():
    g = torch.randn(1000) * 1e-6
    st = CompressedComm("fp8_e5m2")
    payload, sent = st.compress(g)
    assert payload.dtype == torch.uint8 and payload.numel() == 1004
    assert torch.equal(st.decompress(payload, 1000), sent)
    assert ((sent - g).abs() <= g.abs() * 0.125 + 1e-12).all()  # e5m2: 2 mantissa bits, scaled into range
    with pytest.raises(ValueError, match="travel"):
        CompressedComm("tf32")
