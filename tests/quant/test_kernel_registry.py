"""QuantLinear's kernel registry (fewbits.quant.linear_kernels): every kernel once, each family a
module of its own, the choice made in one place (registry.ORDER) and documented as a table in
docs/architecture.md that matches available_kernels on this machine; QuantLinear itself names
no kernel; and a new family joins with one line of ORDER."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fewbits.kernels import native
from fewbits.quant import KERNELS, list_schemes, quantize
from fewbits.quant import modules as qm
from fewbits.quant.linear_kernels import base, registry
from fewbits.quant.modules import QuantLinear, available_kernels

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
SHAPE = (4096, 4096)


def _documented() -> dict[str, list[list[str]]]:
    """scheme -> [Xeon with AMX, AVX-512 without AMX, without the native library] kernel lists."""
    text = DOC.read_text()
    start = text.index("<!-- kernel table:")
    end = text.index("<!-- end of kernel table -->")
    rows = [line for line in text[start:end].splitlines() if line.startswith("| `")]
    table = {}
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        table[cells[0].strip("`")] = [re.findall(r"`([a-z0-9_]+)`", c) for c in cells[1:]]
    return table


def test_every_kernel_is_in_the_registry_once_each_a_module_of_its_own():
    names = [k.name for k, _ in registry.ORDER]
    assert set(names) == set(KERNELS) == set(registry.names())
    assert len(KERNELS) == len(set(KERNELS)) == 11
    for k, where in registry.ORDER:
        assert isinstance(k, base.LinearKernel)
        assert where is None or callable(where)
        module = type(k).__module__
        assert module.startswith("fewbits.quant.linear_kernels.") and module.rsplit(".", 1)[1] not in (
            "base", "registry", "rows"), (k, module)
        assert registry.kernel(k.name) is k
    with pytest.raises(KeyError):
        registry.kernel("no_such_kernel")


def test_the_documented_table_is_what_available_kernels_gives_for_every_scheme():
    table = _documented()
    assert sorted(table) == sorted(list_schemes())
    lib = native.library()
    if lib is None:
        column = None
    elif native.amx_w8a8_ready(lib):
        column = 0  # Xeon with AMX
    elif native.vnni_w8a8_ready(lib):
        column = 1  # AVX-512 without AMX
    else:
        column = None  # another CPU: only the order is checked
    for scheme, documented in table.items():
        here = available_kernels(scheme, SHAPE)
        with native.turned_off():
            off = available_kernels(scheme, SHAPE)
        assert off == documented[2], (scheme, off)
        if column is not None:
            assert here == documented[column], (scheme, here)
        every = list(dict.fromkeys(documented[0] + documented[1] + documented[2]))
        # wherever this CPU runs, its kernels come in the documented order
        assert set(here) <= set(every) and sorted(here, key=every.index) == here, (scheme, here)


def test_auto_picks_the_first_available_kernel_and_names_only_those():
    lin = torch.nn.Linear(64, 32)
    for scheme in list_schemes():
        qt = quantize(lin.weight.detach(), scheme)
        possible = available_kernels(scheme, (32, 64))
        assert QuantLinear(qt).kernel == possible[0]
        refused = [k for k in KERNELS if k not in possible]
        for k in refused[:1]:
            with pytest.raises(ValueError, match="cannot run"):
                QuantLinear(qt, kernel=k)


def test_quantlinear_names_no_kernel():
    """QuantLinear's code holds no kernel-specific branch: no kernel's name and no C function
    appears in it; every kernel is reached through the registry."""
    source = inspect.getsource(qm.QuantLinear)
    for name in KERNELS:
        assert f'"{name}"' not in source and f"'{name}'" not in source, name
    assert "fb_" not in source and "Lut4Weight" not in source and "Int8Panels" not in source


class _Fp32Reference(base.LinearKernel):
    """A toy family: F.linear with the dequantized weight, for any scheme on any device."""

    name = "toy_fp32"

    def can_run(self, s, shape, device):
        return s.activations is None

    def prepare(self, qt):
        class Held(base.PreparedWeight):
            def forward(self, x2d, bias, dtype):
                return base.with_bias(F.linear(x2d, self.qweight.dequantize(x2d.dtype)), bias, dtype)
        return Held(qt)


def test_a_new_family_joins_with_one_line_of_the_order(monkeypatch):
    toy = _Fp32Reference()
    monkeypatch.setattr(registry, "ORDER", registry.ORDER + ((toy, None),))
    assert available_kernels("nf4", (32, 64))[-1] == "toy_fp32"
    assert available_kernels("w8a8", (32, 64))[-1] != "toy_fp32"
    lin = torch.nn.Linear(64, 32)
    q = QuantLinear.from_linear(lin, "nf4", kernel="toy_fp32")
    assert q.kernel == "toy_fp32" and q._row is None and q._tiles is None
    x = torch.randn(5, 64)
    assert torch.equal(q(x), q.reference_forward(x))
    assert QuantLinear.from_linear(lin, "nf4").kernel != "toy_fp32"  # auto: the first in ORDER
