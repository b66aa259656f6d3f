"""Memory measurement, memory estimates and the hardware probes on an accelerator (CUDA).
Skipped without CUDA (see the `accel` fixture in tests/conftest.py)."""
import pytest
import torch

import fewbits as fb
from fewbits import hardware
from fewbits.memory import estimate_memory, measure_inference, measure_peak_memory, measure_training_step

from test_memory import _llama


def test_measurement_sees_the_device_allocator(accel):
    def work():
        return torch.ones(1 << 20, device=accel) * 2  # 4 MiB kept, one 4 MiB temporary

    result, m = measure_peak_memory(work, device=accel)
    assert result.device.type == accel.type
    assert m.peak >= 8 * 2 ** 20 - 1024 if accel.type == "cuda" else m.peak >= 4 * 2 ** 20


@pytest.mark.parametrize("policy, batch, seq", [("fp32", 2, 64), ("bf16-mixed", 2, 64), ("fp16-mixed", 2, 64),
                                                ("bf16-pure", 1, 16)])
def test_training_estimate_on_device(policy, batch, seq, accel):
    """The estimate for device="cuda" against the CUDA allocator's peak of a real AdamW step."""
    model = _llama().to(accel)
    ids = torch.randint(0, 2000, (batch, seq), generator=torch.Generator().manual_seed(0)).to(accel)
    est = estimate_memory(model, mode="training", policy=policy, batch=batch, seq_len=seq, device=accel.type)
    measured = measure_training_step(model, dict(input_ids=ids, labels=ids, use_cache=False), policy)
    assert est.total == pytest.approx(measured.peak, rel=0.10), (est.as_dict(), measured)


@pytest.mark.parametrize("scheme, policy", [("fp32", None), ("bf16", None), ("fp16", None), (None, "bf16-mixed")])
def test_inference_estimate_on_device(scheme, policy, accel):
    model = _llama(tie_word_embeddings=True).to(accel)
    ids = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(0)).to(accel)
    est = estimate_memory(model, scheme=scheme, policy=policy, batch=2, seq_len=64, device=accel.type)
    measured = measure_inference(model, dict(input_ids=ids), scheme=scheme, policy=policy)
    assert est.total == pytest.approx(measured.peak, rel=0.10), (est.as_dict(), measured)


def test_hardware_probes_on_device(accel):
    bw = hardware.measure_bandwidth(buffer_mb=64, budget_s=0.2, device=str(accel))
    assert bw.copy_gbs > 0 and bw.read_gbs > 0
    for dtype in ("fp32", "tf32", "bf16", "fp16", "fp8", "int8"):
        ok, why = hardware.availability(dtype, str(accel))
        if ok:
            speed = hardware.measure_matmul(dtype, budget_s=0.2, device=str(accel), max_n=1024)
            assert speed.available and speed.gflops > 0, (dtype, speed)
