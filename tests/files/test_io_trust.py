"""Hostile files and interrupted saves (issue 12, item 5): aligned kernel weights, codes checked
against their format at load, a strict metadata schema (every malformed file is a
FileFormatError), and no temporary files left behind by failed or killed saves."""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import fewbits as fb
from fewbits import atomic
from fewbits.formats import FloatFormat, LookupFormat
from fewbits.quant import QuantScheme, QuantizedTensor, quantize
from fewbits.quant.model import quantize_model
from fewbits.files import safetensors_format as qio
from fewbits.quant import lowbit_ops as ops
from fewbits.files import FileFormatError
from fewbits.quant.modules import QuantLinear

from test_io import assert_unchanged, fresh_model, rewrite, snapshot, trained_quantized

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_child(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: a crash there (SIGSEGV) fails the test instead of
    killing pytest."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests", "files"),
                                                        os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `t` starting `offset` bytes past a 64-byte boundary, inside a larger buffer (as
    safetensors hands tensors back: data_ptr() % 64 == 40 was seen on SmolLM2)."""
    nbytes = t.numel() * t.element_size()
    buf = torch.zeros(nbytes + 128, dtype=torch.uint8)
    start = (offset - buf.data_ptr()) % 64
    view = buf[start:start + nbytes].view(t.dtype).view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 64 == offset
    return view


# ---------------------------------------------------------------------------------------------
# alignment: torch's _weight_int8pack_mm crashes on weights (and activations) off a 64-byte line
# ---------------------------------------------------------------------------------------------
needs_int8pack = pytest.mark.skipif(not ops.int8pack_available(), reason="torch has no _weight_int8pack_mm here")


def test_aligned_is_a_no_op_on_aligned_tensors_and_copies_the_rest():
    t = torch.arange(100, dtype=torch.int16)
    assert ops.aligned(t) is t
    for offset in (2, 8, 40):
        v = at_offset(t, offset)
        a = ops.aligned(v)
        assert a.data_ptr() % ops.KERNEL_ALIGNMENT == 0 and torch.equal(a, t) and a.is_contiguous()
    strided = torch.arange(24.0).view(4, 6).t()
    assert ops.aligned(strided).is_contiguous() and torch.equal(ops.aligned(strided), strided)


@needs_int8pack
def test_int8pack_weights_built_from_unaligned_codes_are_aligned():
    torch.manual_seed(0)
    qt = quantize(torch.randn(192, 576), "int8")
    sd = {k: at_offset(v, 40) for k, v in qt.state_dict().items()}
    layer = QuantLinear(QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype, sd))
    assert layer.kernel == "int8pack"
    for name, t in layer.qweight.kernel_tensors.items():
        assert t.data_ptr() % 64 == 0, name
    # the weight is a view of the (aligned) codes the layer holds, and the unaligned buffer it
    # was built from is not retained: no second copy is held
    codes = layer.qweight.codes
    weight = layer.qweight.kernel_tensors["weight"]
    assert weight.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
    assert codes.untyped_storage().data_ptr() != sd["codes"].untyped_storage().data_ptr()
    assert layer.nbytes == QuantLinear(qt).nbytes


@needs_int8pack
def test_forward_with_unaligned_int8_weight_and_activations_does_not_crash():
    child = run_child("""
        import torch
        from fewbits.quant import QuantizedTensor, quantize
        from fewbits.quant.modules import QuantLinear
        from test_io_trust import at_offset
        torch.manual_seed(0)
        qt = quantize(torch.randn(192, 576), "int8")
        unaligned = QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype,
                                                    {k: at_offset(v, 40) for k, v in qt.state_dict().items()})
        layer, good = QuantLinear(unaligned), QuantLinear(qt)
        assert layer.kernel == good.kernel == "int8pack"
        x = torch.randn(8, 576)
        assert torch.equal(layer(x), good(x))            # 4 rows and more crashed on AMX
        xb = at_offset(x.to(torch.bfloat16), 40)        # bfloat16 activations at an offset
        assert torch.equal(layer(xb), good(x.to(torch.bfloat16)))
        print("forward ok")
    """)
    assert child.returncode == 0 and "forward ok" in child.stdout, (child.returncode, child.stderr[-2000:])


@needs_int8pack
def test_int8_model_loaded_from_a_file_runs(tmp_path):
    # safetensors gives tensors at arbitrary offsets; the loaded int8pack weights must be aligned
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 192), nn.Linear(192, 576))
    quantize_model(model, "int8")
    fb.save(model, tmp_path / "int8.safetensors")
    loaded = fb.load(tmp_path / "int8.safetensors", model=nn.Sequential(nn.Linear(576, 192), nn.Linear(192, 576)))
    for layer in loaded:
        assert layer.kernel == "int8pack"
        assert all(t.data_ptr() % 64 == 0 for t in layer.qweight.kernel_tensors.values())
    child = run_child(f"""
        import torch, fewbits as fb
        from torch import nn
        torch.manual_seed(0)
        skeleton = nn.Sequential(nn.Linear(576, 192), nn.Linear(192, 576))
        m = fb.load({str(tmp_path / "int8.safetensors")!r}, model=skeleton)
        y = m(torch.randn(16, 576))
        assert torch.isfinite(y).all()
        print("forward ok")
    """)
    assert child.returncode == 0 and "forward ok" in child.stdout, (child.returncode, child.stderr[-2000:])


# ---------------------------------------------------------------------------------------------
# codes outside their format are refused at load
# ---------------------------------------------------------------------------------------------
TEN = LookupFormat("ten", values=[-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5])  # 4 bits, 10 codes


def _set_codes(key, value):
    def change(tensors):
        tensors[key] = torch.full_like(tensors[key], value)
    return change


def test_codes_beyond_the_codebook_are_refused(tmp_path):
    scheme = QuantScheme(TEN, "group", group_size=32)
    qt = quantize(torch.randn(4, 64), scheme)
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    fb.save(qt, good)
    fb.load(good)
    rewrite(good, bad, change_tensors=_set_codes("tensor.codes", 0xAB))  # codes 11 and 10 -- checksum valid
    with pytest.raises(FileFormatError, match="code 11 is outside the codebook ten of 10 values"):
        fb.load(bad)
    rewrite(good, bad, change_tensors=_set_codes("tensor.codes", 0x09))  # 9 and 0: fine
    assert torch.isfinite(fb.load(bad).dequantize()).all()


def test_model_with_codes_beyond_the_codebook_leaves_the_model(tmp_path):
    saved = fresh_model(seed=0)
    quantize_model(saved, QuantScheme(TEN, "group", group_size=32))
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    fb.save(saved, good)
    rewrite(good, bad, change_tensors=_set_codes("up.qweight.codes", 0xFF))
    model = fresh_model(seed=1)
    snap = snapshot(model)
    with pytest.raises(FileFormatError, match="'up': code 15 is outside"):
        fb.load(bad, model=model)
    assert_unchanged(model, snap)


def test_wide_codes_beyond_a_12_bit_format_are_refused(tmp_path):
    fmt = FloatFormat(exp_bits=5, man_bits=6, specials="fn")  # 12 bits, stored in 16-bit words
    qt = quantize(torch.randn(3, 40), QuantScheme(fmt, "channel"))
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    fb.save(qt, good)
    fb.load(good)
    rewrite(good, bad, change_tensors=_set_codes("tensor.codes", 0x1000))
    with pytest.raises(FileFormatError, match="code 4096 is outside the format"):
        fb.load(bad)


# ---------------------------------------------------------------------------------------------
# malformed metadata: always FileFormatError, never RecursionError / TypeError / KeyError
# ---------------------------------------------------------------------------------------------
def _edit_json(key, edit):
    def change(meta):
        value = json.loads(meta[key])
        value = edit(value)
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    return change


def expect_malformed(path, model=None, match=None):
    if model is None:
        with pytest.raises(FileFormatError, match=match):
            fb.load(path)
        return
    snap = snapshot(model)
    with pytest.raises(FileFormatError, match=match):
        fb.load(path, model=model)
    assert_unchanged(model, snap)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.safetensors"
    fb.save(trained_quantized("w8a8", tie=True), path)  # aliases and an activation scheme
    return path


@pytest.fixture
def dict_file(tmp_path):
    path = tmp_path / "dict.safetensors"
    fb.save({"a": quantize(torch.randn(4, 64), "nf4"), "b": torch.arange(3)}, path)
    return path


def test_reported_crafted_metadata(model_file, dict_file, tmp_path):
    bad = tmp_path / "bad.safetensors"
    deep = "[" * 100_000 + "]" * 100_000
    for key in ("quantized", "aliases"):
        rewrite(model_file, bad, lambda m, key=key: m.update({key: deep}))
        expect_malformed(bad, fresh_model(tie=True), "nested too deeply")
    rewrite(model_file, bad, _edit_json("aliases", lambda a: {k: [v] for k, v in a.items()}))
    expect_malformed(bad, fresh_model(tie=True), "'aliases' entry must be a JSON object of strings")
    rewrite(model_file, bad, _edit_json("quantized", lambda q: {**q, "up": {**q["up"], "module": ["linear"]}}))
    expect_malformed(bad, fresh_model(tie=True), "unknown module kind")
    rewrite(model_file, bad, _edit_json("quantized", lambda q: {**q, "up": {**q["up"], "dtype": ["float32"]}}))
    expect_malformed(bad, fresh_model(tie=True), "bad dtype")
    rewrite(dict_file, bad, _edit_json("entries", lambda e: [e, e]))
    expect_malformed(bad, match="'entries' entry must be a JSON list of distinct strings")
    rewrite(dict_file, bad, lambda m: m.update(entries=deep))
    expect_malformed(bad, match="nested too deeply")
    # activation schemes nested in one another, below and beyond Python's recursion limit (which
    # torch's inductor raises to 2000 once it has compiled anything in this process)
    for depth, match in ((200, "no activations of its own"), (sys.getrecursionlimit() + 500, "nested too deeply")):
        def nest(q, depth=depth):
            act = q["up"]["scheme"]["activations"]
            text = json.dumps(act)
            for _ in range(depth):
                text = json.dumps({**act, "activations": None}).replace('"activations": null', '"activations": ' + text)
            q["up"]["scheme"]["activations"] = "PLACEHOLDER"
            return json.dumps(q).replace('"PLACEHOLDER"', text)
        rewrite(model_file, bad, _edit_json("quantized", nest))
        expect_malformed(bad, fresh_model(tie=True), match)
    rewrite(model_file, bad, _edit_json("quantized", lambda q: {**q, "up": {**q["up"], "scheme": {
        **q["up"]["scheme"], "activations": {**q["up"]["scheme"]["activations"],
                                             "activations": q["up"]["scheme"]["activations"]}}}}))
    expect_malformed(bad, fresh_model(tie=True), "no activations of its own")
    # a lookup format without its values (a bare KeyError before)
    rewrite(dict_file, bad, _edit_json("quantized", lambda q: {"a": {**q["a"], "scheme": {
        **q["a"]["scheme"], "format": {"kind": "lookup", "name": "x"}}}}))
    expect_malformed(bad, match="bad lookup format description")


# values put in place of every field of the metadata, one at a time
ODD_VALUES = [None, True, -1, 2 ** 70, 1.5, float("nan"), "", "linear", [1], ["x"], [[[]]], {}, {"kind": "float"}]


def _leaf_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaf_paths(v, path + (k,))
    elif isinstance(value, list) and len(value) <= 4:
        for i, v in enumerate(value):
            yield from _leaf_paths(v, path + (i,))


def _replaced(value, path, new):
    if not path:
        return new
    value = copy.deepcopy(value)
    target = value
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = new
    return value


@pytest.mark.parametrize("which", ["model", "dict"])
def test_every_field_of_the_wrong_type_is_a_file_format_error(which, model_file, dict_file, tmp_path):
    src = model_file if which == "model" else dict_file
    from safetensors import safe_open
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    bad = tmp_path / "bad.safetensors"
    tried = refused = 0
    for key in [k for k in ("quantized", "aliases", "entries") if k in meta]:
        parsed = json.loads(meta[key])
        for path in _leaf_paths(parsed):
            for new in ODD_VALUES:
                rewrite(src, bad, lambda m, key=key, path=path, new=new:
                        m.update({key: json.dumps(_replaced(parsed, path, new))}))
                model = fresh_model(tie=True) if which == "model" else None
                snap = snapshot(model) if model is not None else None
                tried += 1
                try:
                    fb.load(bad, model=model) if model is not None else fb.load(bad)
                except FileFormatError:
                    refused += 1
                    if model is not None:
                        assert_unchanged(model, snap)
                except Exception as e:  # noqa: BLE001 - the point: nothing else escapes
                    pytest.fail(f"{key} {path} := {new!r}: {type(e).__name__}: {e}")
    assert tried > 200 and refused > tried // 2


def test_the_scheme_schema_covers_every_scheme_field():
    import dataclasses
    assert set(qio._SCHEME_FIELDS) == {f.name for f in dataclasses.fields(QuantScheme)}


# ---------------------------------------------------------------------------------------------
# temporary files: beside the target, one name pattern, removed on failure, stale ones cleaned
# ---------------------------------------------------------------------------------------------
def temps(directory, target="m.safetensors"):
    return sorted(n for n in os.listdir(directory) if n.startswith(atomic.temp_prefix(target)))


def test_the_file_is_written_in_a_temporary_directory_beside_the_target(tmp_path, monkeypatch):
    seen = []
    real = qio._write_safetensors

    def spy(tensors, path, metadata):
        seen.append((path, sorted(os.listdir(tmp_path))))
        real(tensors, path, metadata)

    monkeypatch.setattr(qio, "_write_safetensors", spy)
    fb.save(quantize(torch.randn(4, 8), "int8"), tmp_path / "m.safetensors")
    ((tmp, listing),) = seen
    tmpdir = os.path.dirname(tmp)
    prefix = ".m.safetensors.fewbits-tmp-"
    assert os.path.dirname(tmpdir) == str(tmp_path) and listing == [os.path.basename(tmpdir)]
    assert os.path.basename(tmpdir).startswith(prefix)
    assert atomic.TEMP_RANDOM.fullmatch(os.path.basename(tmpdir)[len(prefix):])
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_keyboard_interrupt_during_save_removes_the_temporary_files(tmp_path, monkeypatch):
    real = qio._write_safetensors

    def interrupted(tensors, path, metadata):
        real(tensors, path, metadata)
        with open(os.path.join(os.path.dirname(path), ".tmpAbC123"), "wb") as f:  # as safetensors' own would
            f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(qio, "_write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fb.save(trained_quantized("int4"), tmp_path / "m.safetensors")
    assert os.listdir(tmp_path) == []


# The child is killed while safetensors writes (safetensors writes a ".tmpXXXXXX" file of its own
# beside the name it is given and renames it at the end: the file left by a kill mid-write), or
# after the write, before the rename.
KILLED_SAVE = """
    import os, signal, torch, fewbits as fb
    import safetensors.torch
    from fewbits.files import safetensors_format as qio
    from fewbits.quant import quantize
    real = safetensors.torch.save_file
    def killed(tensors, path, metadata=None):
        if {midway!r}:
            with open(os.path.join(os.path.dirname(path), ".tmpAbC123"), "wb") as f:
                f.write(b"x" * 100000)
        else:
            real(tensors, path, metadata=metadata)
        os.kill(os.getpid(), signal.SIGKILL)
    safetensors.torch.save_file = killed
    fb.save(quantize(torch.randn(64, 64), "int8"), {target!r})
"""


def test_a_killed_save_leaves_a_temporary_directory_that_the_next_save_removes(tmp_path):
    target = tmp_path / "m.safetensors"
    left = []
    for midway in (True, False, True):  # each killed save removes the one before it: they never pile up
        child = run_child(KILLED_SAVE.format(target=str(target), midway=midway))
        assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
        left.append(temps(tmp_path))
    assert [len(names) for names in left] == [1, 1, 1] and len({names[0] for names in left}) == 3
    assert os.listdir(tmp_path / left[-1][0]) == [".tmpAbC123"] and not target.exists()
    other = tmp_path / "other.safetensors"
    child = run_child(KILLED_SAVE.format(target=str(other), midway=False))
    assert child.returncode == -signal.SIGKILL
    unrelated = [".m.safetensors.fewbits-tmp-toolong123", ".m.safetensors.fewbits-tmp-short", "m.safetensors.tmp",
                 ".m.safetensors.fewbits-tmp-abcdefgh.bak"]
    for name in unrelated:
        (tmp_path / name).mkdir()
    fb.save(quantize(torch.randn(4, 8), "int8"), target)
    assert temps(tmp_path) == sorted(n for n in unrelated if n.startswith(".m."))  # ours gone, look-alikes kept
    assert len(temps(tmp_path, "other.safetensors")) == 1  # another target's: left to its own next save
    fb.load(target)


@pytest.mark.skipif(importlib.util.find_spec("fcntl") is None,
                    reason="no flock on this platform: stale files are not told from live ones")
def test_a_save_in_progress_keeps_its_temporary_directory_and_a_second_save_is_refused(tmp_path):
    # another process writing the same target holds the lock on its temporary directory: the
    # second writer is refused (both reported success before, one replacing the other) and leaves
    # the first one's directory alone
    live = tmp_path / (atomic.temp_prefix("m.safetensors") + "live0000")
    live.mkdir()
    (live / "m.safetensors").write_bytes(b"being written")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({str(live)!r}, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(atomic.ConcurrentWriteError, match="another process is writing"):
            fb.save(quantize(torch.randn(4, 8), "int8"), tmp_path / "m.safetensors")
        assert (live / "m.safetensors").exists() and not (tmp_path / "m.safetensors").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    fb.save(quantize(torch.randn(4, 8), "int8"), tmp_path / "m.safetensors")  # the writer is gone now
    assert not live.exists() and os.listdir(tmp_path) == ["m.safetensors"]


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to give a file away")
def test_another_users_directory_of_the_pattern_is_left_alone(tmp_path):
    foreign = tmp_path / (atomic.temp_prefix("m.safetensors") + "theirs00")
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    fb.save(quantize(torch.randn(4, 8), "int8"), tmp_path / "m.safetensors")
    assert foreign.exists()


@pytest.mark.parametrize("where", ["fb.load", "from_pretrained", "load_state_dict"])
def test_a_nan_scale_in_a_file_is_refused(tmp_path, where):
    """quantize() never stores a NaN or infinite scale; a crafted file's would load, then make
    every output it touches NaN. Each reader refuses it, naming it."""
    import fewbits as fb

    qt = fb.quantize(torch.randn(8, 64), "q4_1")
    bad = fb.QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype,
                                             {**qt.state_dict(), "scales": qt.scales.clone().fill_(float("nan"))})
    if where == "fb.load":
        fb.save({"w": bad}, tmp_path / "x.safetensors")
        with pytest.raises(fb.files.FileFormatError, match="NaN or infinite"):
            fb.load(tmp_path / "x.safetensors")
        return
    layer = torch.nn.Sequential(torch.nn.Linear(64, 8))
    fb.quantize_model(layer, "q4_1")
    state = {"0.qweight.codes": bad.codes, "0.qweight.scales": bad.scales, "0.qweight.minimums": bad.minimums,
             "0.bias": layer[0].bias}
    if where == "load_state_dict":
        before = layer[0].qweight.scales.clone()
        with pytest.raises(RuntimeError, match="NaN or infinite"):
            layer.load_state_dict(state)
        assert torch.equal(layer[0].qweight.scales, before)
        return
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    fb.quantize_model(model, "q4_1")
    fb.save_pretrained(model, tmp_path / "m")
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.qweight.scales"
    tensors[key] = torch.full_like(tensors[key], float("inf"))
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(fb.files.FileFormatError, match="NaN or infinite"):
        fb.from_pretrained(tmp_path / "m")
