"""fewbits.files.hf_dir: ShardWriter (atomic, sharded), read_tensors (lazy, validated), the
quantization_config schema, save_pretrained / from_pretrained, and every bad directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import fewbits as fb
from fewbits import atomic
from fewbits.files.hf_dir import (
    CONFIG_NAME, INDEX_NAME, SINGLE_NAME, ShardWriter, model_tensors, parse_quantization_config, read_tensors,
    save_pretrained,
)
from fewbits.files.safetensors_format import FileFormatError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def tiny_llama(seed=0, tied=False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).eval()


def _leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if atomic.TEMP_MARK in n)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 128, generator=g)
    return {"a.weight": fb.quantize(w, "int4"), "a.bias": torch.randn(64, generator=g),
            "b.weight": torch.randn(32, 32, generator=g), "c.weight": fb.quantize(w[:32], "nf4")}


# ---------------------------------------------------------------------------------------------
# ShardWriter and read_tensors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_shard_bytes", [1, 6000, 2 ** 30])
def test_writer_and_reader_round_trip(tmp_path, max_shard_bytes):
    out = tmp_path / "m"
    tensors = _tensors()
    with ShardWriter(out, max_shard_bytes=max_shard_bytes) as w:
        for k, v in tensors.items():
            w.add(k, v)
        w.finish({"architectures": ["Nothing"], "model_type": "none"})
    names = sorted(os.listdir(out))
    if max_shard_bytes == 2 ** 30:
        assert names == [CONFIG_NAME, SINGLE_NAME]
    else:
        assert INDEX_NAME in names and SINGLE_NAME not in names
        index = json.loads((out / INDEX_NAME).read_text())
        assert set(index["weight_map"]) == {"a.qweight.codes", "a.qweight.scales", "a.bias", "b.weight",
                                            "c.qweight.codes", "c.qweight.scales",
                                            "a.weight", "c.weight"}  # the guards (hf_dir.GUARD_DTYPE)
        if max_shard_bytes == 1:  # every entry in a shard of its own, a quantized weight's parts together
            assert len(set(index["weight_map"].values())) == 4
    config = json.loads((out / CONFIG_NAME).read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fewbits" and qc["format_version"] == 1
    assert qc["modules"] == {"a": {"scheme": "int4", "shape": [64, 128], "dtype": "float32"},
                             "c": {"scheme": "nf4", "shape": [32, 128], "dtype": "float32"}}
    got = read_tensors(out)
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        if isinstance(v, fb.QuantizedTensor):
            assert got[k].scheme == v.scheme
            assert all(torch.equal(a, b) for a, b in zip(got[k].state_dict().values(), v.state_dict().values()))
        else:
            assert torch.equal(got[k], v)
    assert _leftovers(tmp_path) == []


def test_files_are_plain_safetensors_that_safetensors_reads(tmp_path):
    tensors = _tensors()
    with ShardWriter(tmp_path / "m") as w:
        for k, v in tensors.items():
            w.add(k, v)
        w.finish({})
    plain = safetensors_torch.load_file(str(tmp_path / "m" / SINGLE_NAME))
    assert torch.equal(plain["a.qweight.codes"], tensors["a.weight"].codes)
    assert torch.equal(plain["b.weight"], tensors["b.weight"])


def test_an_existing_output_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ShardWriter(out)
    with ShardWriter(out, overwrite=True) as w:
        w.add("x", torch.zeros(3))
        w.finish({})
    assert sorted(os.listdir(out)) == [CONFIG_NAME, SINGLE_NAME]
    assert _leftovers(tmp_path) == []


def test_an_exception_leaves_nothing(tmp_path):
    out = tmp_path / "m"
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(out, max_shard_bytes=10) as w:
            w.add("x", torch.zeros(30))
            w.add("y", torch.zeros(30))  # the first shard is on disk by now
            raise RuntimeError("boom")
    assert not out.exists() and _leftovers(tmp_path) == []


def test_a_killed_writer_leaves_nothing_finished_and_the_next_write_cleans_up(tmp_path):
    """A process killed outright (SIGKILL while shards are on disk) leaves only a temporary
    directory, which the next write of the same target removes."""
    out = tmp_path / "m"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from fewbits.files.hf_dir import ShardWriter
        w = ShardWriter({str(out)!r}, max_shard_bytes=10)
        w.add("x", torch.zeros(30)); w.add("y", torch.zeros(30))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    rc = subprocess.run([sys.executable, "-c", script], timeout=120).returncode
    assert rc == -signal.SIGKILL
    assert not out.exists()
    left = _leftovers(tmp_path)
    assert len(left) == 1 and os.listdir(tmp_path / left[0])  # its shard
    with ShardWriter(out) as w:
        w.add("x", torch.ones(2))
        w.finish({})
    assert _leftovers(tmp_path) == [] and read_tensors(out)["x"].tolist() == [1.0, 1.0]


def test_writer_refuses_bad_additions(tmp_path):
    with ShardWriter(tmp_path / "m") as w:
        w.add("a.weight", fb.quantize(torch.randn(8, 32), "int8"))
        with pytest.raises(ValueError, match="added already"):
            w.add("a.weight", torch.zeros(1))
        with pytest.raises(ValueError, match="'<module>.weight'"):
            w.add("a.codes", fb.quantize(torch.randn(8, 32), "int8"))
        with pytest.raises(ValueError, match="already uses"):
            w.add("a.qweight.codes", torch.zeros(1))
        with pytest.raises(ValueError, match="meta"):
            w.add("m", torch.empty(3, device="meta"))
        with pytest.raises(TypeError):
            w.add("l", [1, 2])
    with ShardWriter(tmp_path / "e") as w, pytest.raises(ValueError, match="no tensors"):
        w.finish({})
    assert not (tmp_path / "e").exists()


def test_the_mapping_reads_a_sharded_model_back(tmp_path):
    model = fb.quantize_model(tiny_llama(), "q4_0")
    save_pretrained(model, tmp_path / "m", max_shard_bytes=30000)
    t = read_tensors(tmp_path / "m")
    assert len(t.files) > 1
    want = model_tensors(model)
    assert sorted(t) == sorted(want) and len(t) == len(want)
    for k, v in want.items():
        got = t[k]
        if isinstance(v, fb.QuantizedTensor):
            assert torch.equal(got.dequantize(), v.dequantize()), k
        else:
            assert torch.equal(got, v), k
    with pytest.raises(KeyError):
        t["model.layers.0.self_attn.q_proj.qweight.codes"]


# ---------------------------------------------------------------------------------------------
# save_pretrained and the model's tensor mapping
# ---------------------------------------------------------------------------------------------
def test_model_tensors_leaves_declared_tied_weights_out():
    model = fb.quantize_model(tiny_llama(tied=True), "int8")
    t = model_tensors(model)
    assert "lm_head.weight" not in t and "model.embed_tokens.weight" in t
    assert isinstance(t["model.layers.0.mlp.down_proj.weight"], fb.QuantizedTensor)
    assert not any(".qweight." in k for k in t)


def test_save_pretrained_writes_what_transformers_reads_as_plain_safetensors(tmp_path):
    model = fb.quantize_model(tiny_llama(), "int4")
    save_pretrained(model, tmp_path / "m")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert cfg.quantization_config["quant_method"] == "fewbits"
    state = model.state_dict()
    plain = safetensors_torch.load_file(str(tmp_path / "m" / SINGLE_NAME))
    guards = {f"{name}.weight" for name in cfg.quantization_config["modules"]}
    assert set(plain) == set(state) | guards and not guards & set(state)
    assert all(torch.equal(plain[k], state[k]) for k in state)
    assert all(plain[k].dtype == torch.uint8 and plain[k].shape == (0,) for k in guards)
    with pytest.raises(FileExistsError):
        save_pretrained(model, tmp_path / "m")
    with pytest.raises(TypeError, match="transformers model"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "x")


# ---------------------------------------------------------------------------------------------
# bad directories: each a FileFormatError naming the file and the problem
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def sharded(tmp_path):
    out = tmp_path / "m"
    with ShardWriter(out, max_shard_bytes=1) as w:
        for k, v in _tensors().items():
            w.add(k, v)
        w.finish({"model_type": "none"})
    return out


def _index(d):
    return json.loads((d / INDEX_NAME).read_text())


def _write_index(d, index):
    (d / INDEX_NAME).write_text(json.dumps(index))


def test_a_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileFormatError, match=r"no model weights.*pytorch_model\.bin"):
        read_tensors(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_tensors(tmp_path / "nothing")
    with pytest.raises(FileFormatError, match="not a directory"):
        read_tensors(tmp_path / "config.json")


def test_an_index_naming_missing_shards(sharded):
    victim = sorted(set(_index(sharded)["weight_map"].values()))[1]
    os.remove(sharded / victim)
    with pytest.raises(FileFormatError, match=f"not there: '{victim}'") as e:
        read_tensors(sharded)
    assert e.value.path.endswith(INDEX_NAME)


def test_a_tensor_listed_but_absent_from_its_shard(sharded):
    index = _index(sharded)
    shard = index["weight_map"]["b.weight"]
    index["weight_map"]["ghost.weight"] = shard
    _write_index(sharded, index)
    with pytest.raises(FileFormatError, match="'ghost.weight' is listed in the index for this shard") as e:
        read_tensors(sharded)
    assert e.value.path.endswith(shard)


def test_duplicate_names_across_shards(sharded):
    index = _index(sharded)
    shard = index["weight_map"]["a.bias"]
    extra = sharded / "model-00099-of-00099.safetensors"
    safetensors_torch.save_file({"b.weight": torch.zeros(1)}, str(extra))
    index["weight_map"]["zz"] = extra.name  # listed, so not "not in the index"
    _write_index(sharded, index)
    with pytest.raises(FileFormatError, match="duplicate names across shards"):
        read_tensors(sharded)
    del shard


def test_a_shard_not_in_the_index(sharded):
    safetensors_torch.save_file({"z": torch.zeros(1)}, str(sharded / "model-00077-of-00077.safetensors"))
    with pytest.raises(FileFormatError, match="shards not in the index: 'model-00077-of-00077.safetensors'"):
        read_tensors(sharded)


def test_tensors_in_a_shard_but_not_in_the_index(sharded):
    index = _index(sharded)
    del index["weight_map"]["a.qweight.scales"]  # its shard holds the codes too, which stay listed
    _write_index(sharded, index)
    with pytest.raises(FileFormatError, match="not listed in the index: 'a.qweight.scales'"):
        read_tensors(sharded)


@pytest.mark.parametrize("bad", ["not json", "[]", '{"weight_map": {"a": 1}}', '{"weight_map": {}}',
                                 '{"weight_map": {"a.bias": "../x.safetensors"}}'])
def test_a_malformed_index(sharded, bad):
    (sharded / INDEX_NAME).write_text(bad)
    with pytest.raises(FileFormatError, match="index"):
        read_tensors(sharded)


def test_both_a_single_file_and_an_index(sharded):
    safetensors_torch.save_file({"z": torch.zeros(1)}, str(sharded / SINGLE_NAME))
    with pytest.raises(FileFormatError, match="ambiguous"):
        read_tensors(sharded)


def test_a_truncated_shard(sharded):
    shard = sharded / _index(sharded)["weight_map"]["b.weight"]
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(FileFormatError, match="not a readable safetensors file"):
        read_tensors(sharded)


def _edit_config(d, fn):
    cfg = json.loads((d / CONFIG_NAME).read_text())
    fn(cfg)
    (d / CONFIG_NAME).write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, message", [
    (lambda qc: qc.update(quant_method="bitsandbytes"), "is not 'fewbits'"),
    (lambda qc: qc.update(format_version=2), "newer than this fewbits reads"),
    (lambda qc: qc.update(format_version="1"), "bad format_version"),
    (lambda qc: qc.update(extra=1), "unknown fields 'extra'"),
    (lambda qc: qc.pop("schemes"), "missing fields 'schemes'"),
    (lambda qc: qc["schemes"]["int4"].update(granularity=7), "field 'granularity' has a value of the wrong type"),
    (lambda qc: qc["schemes"]["int4"].update(granularity="diagonal"), "granularity must be one of"),
    (lambda qc: qc["schemes"]["int4"].update(format={"kind": "float", "exp_bits": 99, "man_bits": 1}),
     "wrong type or range"),
    (lambda qc: qc["modules"]["a"].update(scheme="nope"), "scheme 'nope' is not one of"),
    (lambda qc: qc["modules"]["a"].update(shape=[64]), "shape must be"),
    (lambda qc: qc["modules"]["a"].update(dtype="int8"), "dtype 'int8'"),
    (lambda qc: qc["modules"]["a"].update(kind="linear"), "exactly dtype, scheme, shape"),
    (lambda qc: qc["modules"].update({"x..y": qc["modules"]["a"]}), "not a module name"),
    (lambda qc: qc["modules"]["a"].update(shape=[32, 128]), r"a.qweight.codes: U8 \[4096\] stored"),
    (lambda qc: qc["modules"]["a"].update(scheme="nf4"), "nf4"),
    (lambda qc: qc["modules"].pop("c"), "module 'c', which the quantization_config does not list"),
    (lambda qc: qc["modules"].update(d=qc["modules"]["a"]), r"'d' \(int4\): missing d.qweight.codes"),
])
def test_a_bad_quantization_config(sharded, edit, message):
    _edit_config(sharded, lambda cfg: edit(cfg["quantization_config"]))
    with pytest.raises(FileFormatError, match=message) as e:
        read_tensors(sharded)
    assert os.path.basename(e.value.path) in (CONFIG_NAME,) + tuple(os.listdir(sharded))


def test_quantized_entries_without_a_quantization_config(sharded):
    _edit_config(sharded, lambda cfg: cfg.pop("quantization_config"))
    with pytest.raises(FileFormatError, match="no fewbits quantization_config"):
        read_tensors(sharded)


def test_a_missing_or_extra_quantized_entry(tmp_path):
    qt = fb.quantize(torch.randn(8, 32), "int4_asym")
    for drop, message in (("scales", "missing a.qweight.scales"), (None, "unexpected dq_codes")):
        out = tmp_path / f"m{drop}"
        state = {f"a.qweight.{k}": v for k, v in qt.state_dict().items() if k != drop}
        if drop is None:
            state["a.qweight.dq_codes"] = torch.zeros(2, dtype=torch.int8)
        out.mkdir()
        safetensors_torch.save_file(state, str(out / SINGLE_NAME))
        from fewbits.files.hf_dir import quantization_config
        (out / CONFIG_NAME).write_text(json.dumps({"quantization_config": quantization_config({"a": qt})}))
        with pytest.raises(FileFormatError, match=message):
            read_tensors(out)


def test_codes_outside_their_format_are_refused_when_read(tmp_path):
    fmt = fb.LookupFormat("three", values=[-1.0, 0.0, 1.0])
    qt = fb.quantize(torch.randn(4, 8), fb.QuantScheme(fmt))
    with ShardWriter(tmp_path / "m") as w:
        w.add("a.weight", qt)
        w.finish({})
    path = tmp_path / "m" / SINGLE_NAME
    state = safetensors_torch.load_file(str(path))
    state["a.qweight.codes"] = torch.full_like(state["a.qweight.codes"], 0xFF)
    safetensors_torch.save_file(state, str(path))
    t = read_tensors(tmp_path / "m")
    with pytest.raises(FileFormatError, match="outside the codebook") as e:
        t["a.weight"]
    assert e.value.path.endswith(SINGLE_NAME)


def test_parse_quantization_config_accepts_what_is_written():
    qc = fb.files.hf_dir.quantization_config({"m": fb.quantize(torch.randn(4, 64), "q4_1")})
    parsed = parse_quantization_config("x", json.loads(json.dumps(qc)))
    assert parsed["m"][0] == fb.get_scheme("q4_1") and parsed["m"][1:] == ((4, 64), torch.float32)


def test_shards_written_from_the_tensors_memory_read_back_with_safetensors(tmp_path):
    """hf_dir.write_safetensors writes the format itself (save_file copies every tensor first);
    safetensors' own reader gives back every dtype, shape and byte, and the metadata."""
    from safetensors import safe_open

    from fewbits.files.hf_dir import write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
               "f16": torch.randn(2, 2, 2, generator=g).half(), "u8": torch.arange(13, dtype=torch.uint8),
               "i8": torch.tensor([-128, 5, 127], dtype=torch.int8), "b": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "i64": torch.tensor([2 ** 40])}
    write_safetensors(str(tmp_path / "x.safetensors"), tensors, metadata={"format": "pt"})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for k, t in tensors.items():
            back = f.get_tensor(k)
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), k
