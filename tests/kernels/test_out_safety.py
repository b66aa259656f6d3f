"""fb.round(..., out=...) never writes where it must not: read-only numpy arrays (setflags, bytes,
read-only mmap) and an out that partly overlaps x are refused before anything is written; exact
aliasing (in place) and views that share no element with x stay allowed (issue 12, item 3)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import fewbits as fb


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# read-only numpy arrays
# ---------------------------------------------------------------------------------------------
def test_setflags_read_only_out_is_refused():
    a = np.linspace(-3, 3, 16, dtype=np.float32)
    a.setflags(write=False)
    before = a.copy()
    with pytest.raises(ValueError, match="read-only numpy array"):
        fb.round(a, "fp4", out=a)
    with pytest.raises(ValueError, match="read-only"):
        fb.round(before, "fp4", out=a)
    assert np.array_equal(a, before)
    assert np.array_equal(fb.round(a, "fp4"), fb.round(before, "fp4"))  # a read-only input is fine


def test_bytes_backed_out_is_refused_and_the_bytes_object_unchanged():
    data = np.array([1.3, 2.7, -0.2, 5.1], dtype=np.float32).tobytes()
    a = np.frombuffer(data, dtype=np.float32)
    with pytest.raises(ValueError, match="read-only"):
        fb.round(a, "fp4", out=a)
    assert data == np.array([1.3, 2.7, -0.2, 5.1], dtype=np.float32).tobytes()


def test_read_only_mmap_out_is_refused(tmp_path):
    """Writing into a read-only mmap killed the interpreter (SIGSEGV): run it in a child."""
    path = tmp_path / "values.f32"
    np.linspace(-3, 3, 1024, dtype=np.float32).tofile(path)
    code = textwrap.dedent(f"""
        import mmap, numpy as np, fewbits as fb
        with open({str(path)!r}, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        a = np.frombuffer(m, dtype=np.float32)
        b = np.memmap({str(path)!r}, dtype=np.float32, mode="r")
        for arr in (a, b):
            try:
                fb.round(arr, "fp4", out=arr)
            except ValueError as e:
                assert "read-only" in str(e), e
            else:
                raise SystemExit("no error")
        print("refused")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "refused" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    assert np.array_equal(np.fromfile(path, dtype=np.float32), np.linspace(-3, 3, 1024, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# overlap between out and x
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_partly_overlapping_out_is_refused(backend):
    """The issue's repro: 1994 of 4096 values came out wrong on the float32 path."""
    b = randn(4104)
    before = b.clone()
    with fb.kernels.use_backend(backend):
        with pytest.raises(ValueError, match="shares memory with x"):
            fb.round(b[:4096], "e4m3", out=b[8:])
        with pytest.raises(ValueError, match="shares memory with x"):
            fb.round(b[8:], "e4m3", out=b[:4096])
    assert torch.equal(b, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_same_memory_other_strides_is_refused(dtype):
    m = randn(6, 6).to(dtype)
    before = m.clone()
    with pytest.raises(ValueError, match="shares memory with x"):
        fb.round(m, "e4m3", out=m.t())  # every element shared, at other positions
    with pytest.raises(ValueError, match="shares memory with x"):
        fb.round(m[:, :4], "e4m3", out=m[:, 2:])
    with pytest.raises(ValueError, match="shares memory with x"):
        fb.round(m.reshape(-1)[:18].reshape(3, 6), "e4m3", out=m.reshape(-1)[1:19].reshape(3, 6))
    assert torch.equal(m, before)


def test_numpy_overlap_is_refused_too():
    a = randn(4104).numpy()
    before = a.copy()
    with pytest.raises(ValueError, match="shares memory with x"):
        fb.round(a[:4096], "e4m3", out=a[8:])
    with pytest.raises(ValueError, match="shares memory with x"):
        fb.round(a[:4096], "e4m3", out=torch.from_numpy(a)[8:])  # numpy x, torch out on the same memory
    with pytest.raises(ValueError, match="shares memory with x"):
        fb.round(a[::-1][:4096], "e4m3", out=a[:4096])  # negative strides
    assert np.array_equal(a, before)


def test_expanded_out_is_refused():
    x = randn(5, 12)
    base = torch.zeros(1, 12)
    with pytest.raises(ValueError, match="share memory"):
        fb.round(x, "e4m3", out=base.expand(5, 12))
    e = randn(1, 12).expand(5, 12)
    with pytest.raises(ValueError, match="share memory"):
        fb.round(e, "e4m3", out=e)
    assert torch.equal(base, torch.zeros(1, 12))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_in_place_and_disjoint_views_stay_allowed(dtype):
    x = randn(8, 12).to(dtype)
    want = fb.round(x, "e4m3")
    y = x.clone()
    assert fb.round(y, "e4m3", out=y) is y and torch.equal(y, want)  # in place
    base = x.clone()
    v = base.t()
    fb.round(v, "e4m3", out=v)  # in place on a non-contiguous view
    assert torch.equal(base, want)
    # interleaved views: their byte ranges intersect, no element is shared
    base = torch.stack([x, torch.zeros_like(x)], dim=-1)  # [..., 0] holds x, [..., 1] the results
    fb.round(base[..., 0], "e4m3", out=base[..., 1])
    assert torch.equal(base[..., 1], want) and torch.equal(base[..., 0], x)
    # neighbours in one buffer
    buf = torch.cat([x.reshape(-1), torch.zeros(96, dtype=dtype)])
    fb.round(buf[:96], "e4m3", out=buf[96:])
    assert torch.equal(buf[96:], want.reshape(-1))


def test_numpy_in_place_and_disjoint_views_stay_allowed():
    x = randn(8, 12).numpy()
    want = fb.round(x, "e4m3")
    y = x.copy()
    fb.round(y, "e4m3", out=y)
    assert np.array_equal(y, want)
    pair = np.stack([x, np.zeros_like(x)], axis=-1)
    fb.round(pair[..., 0], "e4m3", out=pair[..., 1])
    assert np.array_equal(pair[..., 1], want)
    yb = x.astype(">f4")  # wrapped by a copy: in place still writes back
    fb.round(yb, "e4m3", out=yb)
    assert np.array_equal(yb.astype(np.float32), want)
