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


HP = hugepages.HUGE_PAGE  # 2 MiB on x86-64; 32 / 512 MiB on arm64 kernels with 16 / 64 KiB pages
big_pages = pytest.mark.skipif(HP > 2 * MiB, reason=f"huge pages of {HP >> 20} MiB: too large to test here")


def test_huge_range_is_inside_the_tensor():
    t = torch.empty(4 * HP + 123, dtype=torch.uint8)
    start, length = hugepages.huge_range(t)
    a, n = t.data_ptr(), t.numel()
    assert start % HP == 0 and length % HP == 0
    assert a <= start and start + length <= a + n
    assert length >= 3 * HP  # 4 pages and a bit hold at least 3 whole aligned pages wherever they start
    small = torch.empty(HP // 2, dtype=torch.uint8)
    assert hugepages.huge_range(small)[1] == 0
    assert hugepages.collapse(small) == 0
    assert hugepages.huge_range(t[::2])[1] == 0  # not one span of bytes


@big_pages
def test_collapse_keeps_values_and_touches_nothing_else():
    g = torch.Generator().manual_seed(0)
    whole = torch.randint(0, 256, (12 * MiB,), dtype=torch.uint8, generator=g)
    before = whole.clone()
    part = whole[MiB + 7: 11 * MiB + 5]  # a view: its huge pages lie inside its own bytes only
    start, length = hugepages.huge_range(part)
    moved = hugepages.collapse(part)
    assert moved in (0, length)
    assert torch.equal(whole, before)
    if moved and sys.platform.startswith("linux"):
        kib = _anon_huge_kib(start)
        assert kib is None or kib >= length // 1024  # the kernel said yes: the mapping holds them


def test_turned_off_and_not_applicable(monkeypatch):
    t = torch.empty(8 * MiB, dtype=torch.uint8).fill_(1)
    monkeypatch.setenv("FEWBITS_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    assert hugepages.collapse(t) == 0
    monkeypatch.delenv("FEWBITS_HUGE_PAGES")
    assert hugepages.collapse(t[::2]) == 0  # not contiguous
    assert hugepages.collapse("not a tensor") == 0  # type: ignore[arg-type]


def _spy(monkeypatch) -> list:
    """The (bytes with a whole huge page inside, result) of every collapse() call from here on."""
    calls, real = [], hugepages.collapse

    def spy(t):
        r = real(t)
        calls.append((hugepages.huge_range(t)[1] if isinstance(t, torch.Tensor) else 0, r))
        return r
    monkeypatch.setattr(hugepages, "collapse", spy)
    return calls


@big_pages
@pytest.mark.skipif(native.library() is None, reason="needs the native library")
@pytest.mark.parametrize("scheme", ["int4", "w4a8", "int8", "w8a8"])
def test_prepared_weights_give_the_same_bits_with_and_without(monkeypatch, scheme):
    torch.manual_seed(0)
    lin = torch.nn.Linear(2048, 4608, bias=False)  # int4: 4.5 MiB of codes, a whole 2 MiB page wherever they lie
    x = torch.randn(1, 2048)
    out = {}
    calls = _spy(monkeypatch)
    for flag in ("0", "1"):
        monkeypatch.setenv("FEWBITS_HUGE_PAGES", flag)
        calls.clear()
        q = QuantLinear.from_linear(lin, scheme)
        with torch.inference_mode():
            out[flag] = (q(x), q(x.expand(3, -1).contiguous()), q.reference_forward(x))
        if flag == "1" and q.row_kernel() is not None:  # a one-row C kernel: its codes were offered
            assert any(length > 0 for length, _ in calls)
    for a, b in zip(out["0"], out["1"]):
        assert torch.equal(a, b)


@pytest.mark.skipif(native.library() is None, reason="needs the native library")
def test_a_weight_built_per_call_is_not_collapsed_per_call(monkeypatch):
    """nf4_dq's lut4 weight is rebuilt at every call (its scales are derived): no madvise per call."""
    calls = _spy(monkeypatch)
    q = QuantLinear.from_linear(torch.nn.Linear(1024, 1024, bias=False), "nf4_dq")
    with torch.inference_mode():
        for _ in range(3):
            q(torch.randn(1, 1024))
    assert len(calls) <= 1


def test_the_page_size_falls_back_on_a_bad_or_missing_sysfs_file(monkeypatch, tmp_path):
    import builtins
    real_open = builtins.open
    for text in ("", "abc\n", "0\n", "-4096\n", None):
        def fake_open(path, *a, text=text, **k):
            if str(path).endswith("hpage_pmd_size"):
                if text is None:
                    raise FileNotFoundError(path)
                f = tmp_path / "size"
                f.write_text(text)
                return real_open(f, *a, **k)
            return real_open(path, *a, **k)
        monkeypatch.setattr(builtins, "open", fake_open)
        assert hugepages._pmd_size() == 2 << 20
    monkeypatch.setattr(builtins, "open", real_open)
