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


@pytest.mark.parametrize("scheme", ["int4", "nf4", "int8", "w8a8", "q4_k", "bf16", "fp8"])
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
        assert torch.equal(quant_linear_op(x, layer._handle), layer(x))
    torch.library.opcheck(quant_linear_op, (x, layer._handle),
                          test_utils=("test_schema", "test_faketensor"))
    handle = layer._handle
    del model, layer
    with pytest.raises(RuntimeError, match="no longer exists"):
        quant_linear_op(x, handle)
