"""fb.save / fb.load: round trips bit for bit, clear errors on bad files with the model left as it
was, atomic writes."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fewbits as fb
from fewbits.quant import QuantizedTensor, get_scheme, quantize
from fewbits.files import safetensors_format as qio
from fewbits.files import FileFormatError
from fewbits.quant.model import is_quantized, quantize_model, quantized_module
from fewbits.quant.modules import QuantEmbedding, QuantLinear

ROUND_TRIP_SCHEMES = ["int4", "int4_asym", "q4_1", "nf4_dq", "mxfp4", "nvfp4", "w8a8", "bf16"]


# ---------------------------------------------------------------------------------------------
# a tiny model and its quantized form
# ---------------------------------------------------------------------------------------------
class TinyModel(nn.Module):
    # dims where int4/int8/w8a8/bf16 get torch's fast kernels (codes kept in the kernel's layout)
    # except in the head (12 outputs), which takes the dequantize path
    def __init__(self, vocab=50, dim=64, hidden=96, out=12, tie=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.up = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.head = nn.Linear(dim, vocab if tie else out)
        if tie:
            self.head.weight = self.emb.weight
        self.register_buffer("offset", torch.linspace(-1, 1, dim))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, idx):
        h = self.emb(idx) + self.offset
        h = h + self.down(F.gelu(self.norm(self.up(h))))
        return self.head(h)


def fresh_model(seed=1, **kw) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel(**kw)


def quantize_tiny(model, scheme, **kw):
    return quantize_model(model, scheme, **kw)


def trained_quantized(scheme, **kw):
    """A quantized model whose float tensors differ from a fresh skeleton's (seed 0 vs seed 1)."""
    model = fresh_model(seed=0, **kw)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.offset.mul_(3)
    return quantize_tiny(model, scheme)


TOKENS = torch.tensor([[1, 5, 9, 0, 49], [3, 3, 7, 2, 11]])


def snapshot(model):
    """Everything load() may change: the module types and every tensor (cloned)."""
    return ([(n, type(m)) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def assert_unchanged(model, snap):
    types, state = snap
    assert [(n, type(m)) for n, m in model.named_modules()] == types
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.equal(now[k], state[k]), k


def assert_same_qweight(a: QuantizedTensor, b: QuantizedTensor):
    assert a.scheme == b.scheme and a.shape == b.shape and a.dtype == b.dtype
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def quantized_layers(model):
    return {n: m.qweight for n, m in model.named_modules() if is_quantized(m)}


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ROUND_TRIP_SCHEMES)
def test_model_round_trip_is_bit_identical(tmp_path, scheme):
    saved = trained_quantized(scheme)
    path = tmp_path / "model.safetensors"
    fb.save(saved, path)
    skeleton = fresh_model(seed=1)
    assert not torch.equal(skeleton(TOKENS), saved(TOKENS))
    loaded = fb.load(path, model=skeleton)
    assert loaded is skeleton
    want, got = quantized_layers(saved), quantized_layers(loaded)
    assert want.keys() == got.keys() == {"up", "down", "head"}
    for name in want:
        assert type(loaded.get_submodule(name)) is QuantLinear
        assert loaded.get_submodule(name).kernel == saved.get_submodule(name).kernel
        assert_same_qweight(want[name], got[name])
    assert torch.equal(loaded.up.bias, saved.up.bias) and loaded.down.bias is None
    assert torch.equal(loaded.norm.weight, saved.norm.weight) and torch.equal(loaded.offset, saved.offset)
    assert torch.equal(loaded(TOKENS), saved(TOKENS))


def test_mixed_schemes_and_quantized_embedding_round_trip(tmp_path):
    saved = fresh_model(seed=0)
    quantize_tiny(saved, {"up": "nf4", "down": "int8", "emb": "int4_asym_g32", "head": None}, embeddings=True)
    assert saved.down.kernel == "int8pack"
    path = tmp_path / "mixed.safetensors"
    fb.save(saved, path)
    loaded = fb.load(path, model=fresh_model(seed=1))
    assert isinstance(loaded.head, nn.Linear) and torch.equal(loaded.head.weight, saved.head.weight)
    for name, qw in quantized_layers(saved).items():
        assert_same_qweight(qw, quantized_layers(loaded)[name])
    assert isinstance(loaded.emb, QuantEmbedding) and loaded.emb.padding_idx == 0
    assert torch.equal(loaded(TOKENS), saved(TOKENS))


def test_header_metadata_is_described(tmp_path):
    path = tmp_path / "m.safetensors"
    fb.save(trained_quantized("int4_asym"), path)
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["format"] == "fewbits" and meta["version"] == "1" and meta["content"] == "model"
    q = json.loads(meta["quantized"])
    assert q["up"]["scheme"] == get_scheme("int4_asym").to_dict()
    assert q["up"]["shape"] == [96, 64] and q["up"]["dtype"] == "float32" and q["up"]["module"] == "linear"
    assert {"up.qweight.codes", "up.qweight.scales", "up.qweight.zero_points", "up.bias",
            "norm.weight", "offset", "emb.weight"} <= keys
    assert "up.weight" not in keys and "scratch" not in keys  # non-persistent buffers stay out


def test_tied_float_weights_are_stored_once_and_stay_tied(tmp_path):
    saved = fresh_model(seed=0, tie=True)
    quantize_tiny(saved, "int4", skip="head")
    path = tmp_path / "tied.safetensors"
    fb.save(saved, path)
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["aliases"]) == {"head.weight": "emb.weight"}
    loaded = fb.load(path, model=fresh_model(seed=1, tie=True))
    assert loaded.head.weight is loaded.emb.weight
    assert torch.equal(loaded(TOKENS), saved(TOKENS))


def test_meta_device_skeleton_takes_the_loaded_tensors(tmp_path):
    saved = trained_quantized("nf4_dq", tie=True)
    path = tmp_path / "m.safetensors"
    fb.save(saved, path)
    with torch.device("meta"):
        skeleton = TinyModel(tie=True)
    fb.load(path, model=skeleton)
    skeleton.scratch = torch.zeros(3)  # non-persistent buffers are the skeleton's own business
    assert skeleton.emb.weight.device.type == "cpu" and isinstance(skeleton.emb.weight, nn.Parameter)
    assert torch.equal(skeleton(TOKENS), saved(TOKENS))


def test_single_tensor_and_dict_round_trip(tmp_path):
    torch.manual_seed(3)
    x = torch.randn(5, 100, dtype=torch.bfloat16)
    for scheme in ROUND_TRIP_SCHEMES + ["int3", "fp8", "mxfp6"]:
        q = quantize(x, scheme)
        fb.save(q, tmp_path / "t.safetensors")
        back = fb.load(tmp_path / "t.safetensors")
        assert_same_qweight(q, back)
        assert torch.equal(back.dequantize(), q.dequantize())
    items = {"a": quantize(x, "nvfp4"), "b.c": quantize(x.float(), "int4"), "plain": torch.arange(6)}
    fb.save(items, str(tmp_path / "d.safetensors"))
    back = fb.load(str(tmp_path / "d.safetensors"))
    assert list(back) == ["a", "b.c", "plain"]
    assert_same_qweight(items["a"], back["a"])
    assert_same_qweight(items["b.c"], back["b.c"])
    assert torch.equal(back["plain"], items["plain"])
    # the same objects under two names are stored twice (a dict has no tied names to restore)
    q, t = items["a"], torch.arange(4.0)
    fb.save({"q1": q, "q2": q, "t1": t, "t2": t, "view": t[1:3]}, tmp_path / "d.safetensors")
    back = fb.load(tmp_path / "d.safetensors")
    assert_same_qweight(back["q1"], q)
    assert_same_qweight(back["q2"], q)
    assert torch.equal(back["t2"], t) and torch.equal(back["view"], t[1:3])


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="nn.Module, a QuantizedTensor"):
        fb.save([1, 2], tmp_path / "x")
    q = quantize(torch.randn(4, 8), "int8")
    with pytest.raises(ValueError, match="same key"):
        fb.save({"a": q, "a.codes": torch.zeros(1)}, tmp_path / "x")
    with pytest.raises(TypeError, match="non-empty strings"):
        fb.save({"": q}, tmp_path / "x")
    assert os.listdir(tmp_path) == []


def test_load_asks_for_the_model_or_refuses_one(tmp_path):
    fb.save(trained_quantized("int4"), tmp_path / "m")
    fb.save(quantize(torch.randn(4, 8), "int8"), tmp_path / "t")
    with pytest.raises(ValueError, match="pass model="):
        fb.load(tmp_path / "m")
    with pytest.raises(ValueError, match="without model="):
        fb.load(tmp_path / "t", model=fresh_model())
    with pytest.raises(ValueError, match="freshly constructed"):
        fb.load(tmp_path / "m", model=trained_quantized("int4"))
    with pytest.raises(FileNotFoundError):
        fb.load(tmp_path / "nothing-here")


# ---------------------------------------------------------------------------------------------
# bad files: a clear error, and the model exactly as it was
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "good.safetensors"
    fb.save(trained_quantized("nf4_dq"), path)
    return path


def header_length(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def expect_failure(path, match, model=None):
    model = model if model is not None else fresh_model(seed=1)
    snap = snapshot(model)
    with pytest.raises(FileFormatError, match=match) as info:
        fb.load(path, model=model)
    assert os.fspath(path) in str(info.value)
    assert_unchanged(model, snap)
    return info.value


def test_truncated_files(model_file, tmp_path):
    data = model_file.read_bytes()
    bad = tmp_path / "truncated.safetensors"
    for cut in (0, 4, 8, 100, header_length(data) - 1, header_length(data) + 10, len(data) - 1):
        bad.write_bytes(data[:cut])
        expect_failure(bad, "not a readable safetensors file")


def test_every_flipped_header_byte_is_caught(tmp_path):
    path = tmp_path / "t.safetensors"
    fb.save(quantize(torch.randn(6, 40), "int4_asym"), path)
    data = path.read_bytes()
    bad = tmp_path / "flipped.safetensors"
    for i in range(header_length(data)):
        for mask in (0x01,) if i % 5 else (0x01, 0x40):
            flipped = bytearray(data)
            flipped[i] ^= mask
            bad.write_bytes(bytes(flipped))
            with pytest.raises(FileFormatError):
                fb.load(bad)


def test_flipped_bytes_in_a_model_file(model_file, tmp_path):
    data = model_file.read_bytes()
    bad = tmp_path / "flipped.safetensors"
    header = header_length(data)
    text = data[:header]
    # a scheme field, a shape digit, a tensor name, the checksum, then a code byte in the data
    for pos in (text.index(b'group_size\\": ') + 14, text.index(b'"shape":[') + 9, text.index(b"up.qweight.codes"),
                text.index(b"sha256:") + 20, header + 5, len(data) - 3):
        flipped = bytearray(data)
        flipped[pos] ^= 0x04
        bad.write_bytes(bytes(flipped))
        expect_failure(bad, "corrupted|not a readable|bad|malformed|must be|does not match")
    flipped = bytearray(data)
    flipped[header + 5] ^= 0x04
    bad.write_bytes(bytes(flipped))
    expect_failure(bad, "checksum mismatch")


def test_garbage(tmp_path):
    bad = tmp_path / "garbage.safetensors"
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 100, 5000):
        bad.write_bytes(bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist()))
        expect_failure(bad, "not a readable safetensors file")
    bad.write_bytes(struct.pack("<Q", 20) + b'{"a": not json !!!}' + b" ")
    expect_failure(bad, "not a readable safetensors file")


def test_plain_safetensors_file_is_not_a_fewbits_file(tmp_path):
    from safetensors.torch import save_file
    plain = tmp_path / "plain.safetensors"
    save_file(dict(fresh_model(seed=0).state_dict()), str(plain))
    expect_failure(plain, "not a fewbits file")
    save_file({"x": torch.zeros(2)}, str(plain), metadata={"format": "pt"})
    with pytest.raises(FileFormatError, match="not a fewbits file"):
        fb.load(plain)


def rewrite(src, dst, change_metadata=None, change_tensors=None, fix_checksum=True):
    """Copy a fewbits file with edited metadata/tensors (checksum recomputed, as a writer would)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(src), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    if change_metadata:
        change_metadata(meta)
    if change_tensors:
        change_tensors(tensors)
    if fix_checksum:
        meta["checksum"] = qio._checksum(meta, tensors)
    save_file(tensors, str(dst), metadata=meta)


def test_version_from_the_future(model_file, tmp_path):
    bad = tmp_path / "future.safetensors"
    rewrite(model_file, bad, lambda m: m.update(version="2"))
    expect_failure(bad, "format version 2 is newer")
    rewrite(model_file, bad, lambda m: m.update(version="one"))
    expect_failure(bad, "bad format version")


def test_model_of_another_shape(model_file):
    err = expect_failure(model_file, "does not match the model", model=fresh_model(dim=48))
    assert "(96, 64) in the file" in str(err) and "(96, 48) in the model" in str(err)
    # another architecture: a missing layer and an extra one
    model = fresh_model()
    model.extra = nn.Linear(3, 3)
    del model.down
    err = expect_failure(model_file, "does not match the model", model=model)
    assert "no module 'down'" in str(err) and "missing tensor 'extra.weight'" in str(err)
    # another dtype: bf16 float tensors would silently lose bits
    expect_failure(model_file, "bfloat16", model=fresh_model().to(torch.bfloat16))
    # a Linear where the file has an Embedding
    model = fresh_model()
    model.up = nn.Embedding(96, 64)
    expect_failure(model_file, "'up' is a Embedding in the model", model=model)
    # a bias the file lacks
    model = fresh_model()
    model.down = nn.Linear(96, 64, bias=True)
    expect_failure(model_file, "the model has a bias, the file has none", model=model)


def test_mismatched_scheme_or_tensors(model_file, tmp_path):
    bad = tmp_path / "bad.safetensors"

    def scheme_change(**changes):
        def edit(meta):
            q = json.loads(meta["quantized"])
            q["up"]["scheme"].update(changes)
            meta["quantized"] = json.dumps(q)
        return edit

    rewrite(model_file, bad, scheme_change(group_size=32))
    expect_failure(bad, "dq_codes must be")
    rewrite(model_file, bad, scheme_change(double_quant=False))
    expect_failure(bad, "missing scales; unexpected dq_codes, dq_offset, dq_scales")
    rewrite(model_file, bad, scheme_change(mode="nearest"))
    expect_failure(bad, "bad scheme: mode must be")
    rewrite(model_file, bad, scheme_change(colour="red"))
    expect_failure(bad, "unknown scheme fields: colour")
    rewrite(model_file, bad, change_tensors=lambda t: t.update({"stray": torch.zeros(2)}))
    expect_failure(bad, "tensors the model does not have: 'stray'")
    rewrite(model_file, bad, change_tensors=lambda t: t.pop("norm.bias"))
    expect_failure(bad, "missing tensor 'norm.bias'")
    rewrite(model_file, bad, change_tensors=lambda t: t.update({"norm.bias": t["norm.bias"].double()}))
    expect_failure(bad, "'norm.bias': float64")
    rewrite(model_file, bad, change_tensors=lambda t: t.update({"up.qweight.zero_points": torch.zeros(8, dtype=torch.uint8)}))
    expect_failure(bad, "unexpected zero_points")
    rewrite(model_file, bad, lambda m: m.update(quantized="{not json"))
    expect_failure(bad, "'quantized' entry is not valid JSON")
    rewrite(model_file, bad, lambda m: m.update(checksum="sha256:00"), fix_checksum=False)
    expect_failure(bad, "checksum mismatch")


def test_failure_while_building_modules_leaves_the_model(model_file, monkeypatch):
    calls = []

    def flaky(module, qweight):
        calls.append(module)
        if len(calls) == 3:
            raise RuntimeError("no kernel for this layer")
        return quantized_module(module, qweight)

    monkeypatch.setattr(qio, "quantized_module", flaky)
    expect_failure(model_file, "cannot build the quantized module '(up|down|head)': no kernel")


# ---------------------------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------------------------
def crash_midway(monkeypatch):
    real = qio._write_safetensors

    def writer(tensors, path, metadata):
        real(tensors, path, metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(qio, "_write_safetensors", writer)


def test_crash_during_write_leaves_no_file(tmp_path, monkeypatch):
    crash_midway(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        fb.save(trained_quantized("int4"), tmp_path / "m.safetensors")
    with pytest.raises(OSError, match="simulated"):
        fb.save(quantize(torch.randn(4, 8), "int8"), tmp_path / "t.safetensors")
    assert os.listdir(tmp_path) == []


def test_crash_during_overwrite_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    fb.save(trained_quantized("int4"), path)
    before = path.read_bytes()
    crash_midway(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        fb.save(trained_quantized("nvfp4"), path)
    assert os.listdir(tmp_path) == ["m.safetensors"] and path.read_bytes() == before
    monkeypatch.undo()
    fb.save(trained_quantized("nvfp4"), path)  # a write that completes replaces it
    assert path.read_bytes() != before and os.listdir(tmp_path) == ["m.safetensors"]


def test_saved_file_has_an_ordinary_mode(tmp_path):
    fb.save(quantize(torch.randn(4, 8), "int8"), tmp_path / "t.safetensors")
    (tmp_path / "plain").write_bytes(b"")
    assert os.stat(tmp_path / "t.safetensors").st_mode == os.stat(tmp_path / "plain").st_mode
