"""torch.compile over models with quantized layers: each QuantLinear is one torch.library custom
op (fewbits::quant_linear), so the graph around it compiles whole (fullgraph=True works, no graph
breaks) and the compiled model computes what the eager one does, bit for bit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fewbits.quant.modules import QuantLinear, quant_linear_op


def _model(scheme: str) -> nn.Module:
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(256, 512), nn.Linear(512, 256)
    return nn.Sequential(QuantLinear.from_linear(lin1, scheme), nn.ReLU(), QuantLinear.from_linear(lin2, scheme)).eval()


@pytest.mark.parametrize("scheme", ["int4", "nf4", "int8", "w8a8", "w4a8", "q4_k", "bf16", "fp8"])
def test_a_compiled_model_equals_the_eager_one_without_graph_breaks(scheme):
    model = _model(scheme)
    with torch.inference_mode():
        for rows in (3, 20):  # the fused path and the bf16 blocks / GEMM path
            x = torch.randn(rows, 256)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(x)
            assert explained.graph_break_count == 0, explained.break_reasons
            torch._dynamo.reset()
            assert torch.equal(torch.compile(model, fullgraph=True)(x), model(x)), (scheme, rows)


def test_the_op_is_the_layers_forward_and_checks_as_a_custom_op():
    model = _model("nf4")
    layer = model[0]
    x = torch.randn(5, 256)
    with torch.inference_mode():
        assert torch.equal(quant_linear_op(x, layer._handle_tensor, 512), layer(x))
    torch.library.opcheck(quant_linear_op, (x, layer._handle_tensor, 512),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="outputs"):
        quant_linear_op(x, layer._handle_tensor, 7)
    handle = layer._handle_tensor.clone()
    del model, layer
    with pytest.raises(RuntimeError, match="no longer exists"):
        quant_linear_op(x, handle, 512)


def test_identical_layers_share_one_compiled_graph():
    """The handle reaches the compiled code as a tensor input, not as a guarded constant:
    compiling each of 10 identical blocks separately compiles one frame, not one per layer (the
    recompile limit would leave the rest uncompiled)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(QuantLinear.from_linear(nn.Linear(64, 64), "int4_g32"), nn.ReLU()) for _ in range(10)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(2, 64)
    with torch.inference_mode():
        for b in blocks:
            b.compile()
            want = b._orig_mod(x) if hasattr(b, "_orig_mod") else None
            y = b(x)
            if want is not None:
                assert torch.equal(y, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_trainable_bias_keeps_its_gradient_under_compile():
    lin = nn.Linear(64, 32)
    m = QuantLinear.from_linear(lin, "nf4")
    m.bias.requires_grad_(True)
    torch._dynamo.reset()
    y = torch.compile(m)(torch.randn(3, 64))
    y.sum().backward()
    assert m.bias.grad is not None and torch.equal(m.bias.grad, torch.full((32,), 3.0))


def test_export_is_refused_clearly():
    m = nn.Sequential(QuantLinear.from_linear(nn.Linear(64, 32), "int8"))
    with pytest.raises(Exception, match="torch.export of a QuantLinear is not supported"):
        torch.export.export(m, (torch.randn(2, 64),))


def test_the_module_can_be_imported_twice():
    import subprocess
    import sys

    code = ("import importlib, torch, fewbits.quant.modules as m\n"
            "importlib.reload(m)\n"
            "from torch import nn\n"
            "layer = m.QuantLinear.from_linear(nn.Linear(64, 32), 'int4_g32')\n"
            "x = torch.randn(2, 64)\n"
            "assert torch.equal(m.quant_linear_op(x, layer._handle_tensor, 32), layer(x))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
