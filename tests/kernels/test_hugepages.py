"""kernels/hugepages.py: collapse() moves only whole 2 MiB pages inside a tensor onto huge pages,
keeps every value, and the prepared weights that call it compute the same bits."""
from __future__ import annotations

import sys

import pytest
import torch

from fewbits.kernels import hugepages, native
from fewbits.quant.modules import QuantLinear

MiB = 1 << 20


def _anon_huge_kib(address: int) -> int | None:
    """AnonHugePages (KiB) of the mapping holding `address`, from /proc/self/smaps."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def test_huge_range_is_inside_the_tensor():
    t = torch.empty(9 * MiB + 123, dtype=torch.uint8)
    start, length = hugepages.huge_range(t)
    a, n = t.data_ptr(), t.numel()
    assert start % hugepages.HUGE_PAGE == 0 and length % hugepages.HUGE_PAGE == 0
    assert a <= start and start + length <= a + n
    assert length >= 6 * MiB  # 9 MiB hold at least 3 whole aligned 2 MiB pages wherever they start
    small = torch.empty(MiB, dtype=torch.uint8)
    assert hugepages.huge_range(small)[1] == 0
    assert hugepages.collapse(small) == 0


def test_collapse_keeps_values_and_touches_nothing_else():
    g = torch.Generator().manual_seed(0)
    whole = torch.randint(0, 256, (12 * MiB,), dtype=torch.uint8, generator=g)
    before = whole.clone()
    part = whole[MiB + 7: 11 * MiB + 5]  # a view: its huge pages lie inside its own bytes only
    moved = hugepages.collapse(part)
    assert moved == 0 or moved == hugepages.huge_range(part)[1]
    assert torch.equal(whole, before)
    if moved and sys.platform.startswith("linux"):
        kib = _anon_huge_kib(hugepages.huge_range(part)[0])
        assert kib is None or kib >= 2048  # the kernel said yes: the mapping holds huge pages


def test_turned_off_and_not_applicable(monkeypatch):
    t = torch.empty(8 * MiB, dtype=torch.uint8).fill_(1)
    monkeypatch.setenv("FEWBITS_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    assert hugepages.collapse(t) == 0
    monkeypatch.delenv("FEWBITS_HUGE_PAGES")
    assert hugepages.collapse(t[::2]) == 0  # not contiguous
    assert hugepages.collapse("not a tensor") == 0  # type: ignore[arg-type]


@pytest.mark.skipif(native.library() is None, reason="needs the native library")
@pytest.mark.parametrize("scheme", ["int4", "w4a8", "int8"])
def test_prepared_weights_give_the_same_bits_with_and_without(monkeypatch, scheme):
    torch.manual_seed(0)
    lin = torch.nn.Linear(2048, 2560, bias=False)  # int4: 2.5 MiB of codes, int8: 5 MiB
    x = torch.randn(1, 2048)
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FEWBITS_HUGE_PAGES", flag)
        q = QuantLinear.from_linear(lin, scheme)
        with torch.inference_mode():
            out[flag] = (q(x), q(x.expand(3, -1).contiguous()), q.reference_forward(x))
    for a, b in zip(out["0"], out["1"]):
        assert torch.equal(a, b)
