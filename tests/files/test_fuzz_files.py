"""benchmarks/fuzz_files.py at its small size: every bit flip and truncation of an fb.save file or
a training checkpoint raises the documented error, with the target unchanged -- no silent load,
no crash, no partial overwrite (issue 12, "Done when"). Its model files (GGUF, a quantized
directory's config.json; issue 29): a smoke run, and the oracle that tells a load that is what
the file says (harmless / honoured) from one that is not (silent)."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fuzz_files.py")


def fuzz(tmp_path, *args, timeout=600):
    out = tmp_path / "fuzz.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, SCRIPT, "--json", str(out), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


FB_KINDS = "fb model,fb qtensor,fb tensor,checkpoint,checkpoint 8b"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    return fuzz(tmp_path_factory.mktemp("fuzz"), "--size", "small", "--kinds", FB_KINDS)


def groups_of(report, prefix):
    return [g for g in report["groups"] if g["kind"].startswith(prefix)]


def assert_all_raised(groups):
    assert groups
    for g in groups:
        assert g["trials"] >= 12, g
        bad = {k: g[k] for k in ("silent", "crashed", "partial", "other") if g[k]}
        assert not bad and g["raised"] == g["trials"], (g["kind"], g["corruption"], bad)


def test_fb_save_files_survive_the_fuzzer(small_run):
    proc, report = small_run
    assert report["errors"]["fb"] == "FileFormatError"
    assert {g["kind"] for g in groups_of(report, "fb ")} == {"fb model", "fb qtensor", "fb tensor"}
    assert_all_raised(groups_of(report, "fb "))


def test_training_checkpoints_survive_the_fuzzer(small_run):
    proc, report = small_run
    assert report["errors"]["checkpoint"] == "CheckpointError"
    assert_all_raised(groups_of(report, "checkpoint"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "file" in proc.stdout and "partial" in proc.stdout  # the table was printed


@pytest.mark.slow  # waits out a hung worker's time limit
def test_the_fuzzer_counts_a_crash_and_a_hang_and_goes_on(tmp_path):
    # the worker is made to die at trial 2 and to stall at trial 4: counted as crashed and hung,
    # and every other trial still runs
    # and to allocate 64 GB at trial 6: the worker's memory limit turns that into a MemoryError
    proc, report = fuzz(tmp_path, "--kinds", "fb qtensor", "--sabotage", "crash:2", "--sabotage", "hang:4",
                        "--sabotage", "memory:6", "--trial-timeout", "2")
    assert proc.returncode == 1
    flips = next(g for g in report["groups"] if g["corruption"] == "flip")
    assert flips["crashed"] == 2 and flips["hung"] == 1 and flips["raised"] == flips["trials"] - 3
    assert sorted(f["detail"].split(" ")[0] for f in report["failures"]) == ["exit", "exit", "hung"]
    assert [f["trial"] for f in report["failures"]] == [2, 4, 6]


# --- model files: GGUF and config.json ------------------------------------------------------------
def _script():
    spec = importlib.util.spec_from_file_location("fuzz_files_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    ff = _script()
    return ff, ff._ModelFiles(str(tmp_path_factory.mktemp("fuzz_gguf")), ("gguf q4_0",))


def _load(ff, files, edit, name="edited.gguf"):
    path = os.path.join(files.workdir, name)
    with open(path, "wb") as f:
        f.write(ff.gguf_mutated(files.layout["gguf q4_0"], edit))
    return path, files.fb.from_pretrained(path)


def test_the_layout_and_the_plan_cover_every_structure(gguf_files):
    from fewbits.files.gguf_header import read_header

    ff, files = gguf_files
    layout = files.layout["gguf q4_0"]
    header = read_header(os.path.join(files.workdir, "q4_0.gguf"))
    assert [t["start"] for t in layout.tensors] == [t.start for t in header.tensors]
    assert [e["key"] for e in layout.kv] == list(header.metadata)
    groups = ff.gguf_mutations(layout, random.Random(0))
    assert all(len(groups[g]) >= 20 for g in ("header", "type", "metadata", "offset", "tensor", "block"))
    text = " ".join(w for g in groups.values() for w, _ in g)
    for needle in ("tensor count", "metadata count", "array count of tokenizer.ggml.tokens", "key length",
                   "llama.block_count = as f32", "swapped", "(shared)",
                   "beyond the file", "fp16 scale", "random bytes", "type of llama.context_length"):
        assert needle in text, needle
    # a metadata edit re-pads the header: the tensors still lie where the table says
    edited = ff.gguf_mutated(layout, {"op": "set", "key": "general.name", "type": "string", "value": "x" * 45})
    path = os.path.join(files.workdir, "renamed.gguf")
    with open(path, "wb") as f:
        f.write(edited)
    h2 = read_header(path)
    assert h2.get("general.name") == "x" * 45 and len(h2.tensors) == len(header.tensors)
    plan = ff.make_plan({"gguf q4_0": len(layout.data)}, "smoke", 0, ("gguf q4_0",),
                        {"gguf q4_0": ff.structures_of("gguf q4_0", layout.data, 0)})
    assert {t["corruption"] for t in plan} == set(ff.GROUPS["gguf"])


def test_the_oracle_tells_harmless_honoured_and_silent_apart(gguf_files):
    ff, files = gguf_files
    torch = files.torch
    # a name: nothing that matters
    path, model = _load(ff, files, {"op": "set", "key": "general.name", "type": "string", "value": "other"})
    assert files.judge("gguf q4_0", path, model) == ("harmless", "")
    # a legitimately different eps: honoured, the config carries it
    eps = files.layout["gguf q4_0"].value("llama.attention.layer_norm_rms_epsilon") * 1.5
    path, model = _load(ff, files, {"op": "set", "key": "llama.attention.layer_norm_rms_epsilon", "type": "f32",
                                    "value": eps})
    assert files.judge("gguf q4_0", path, model) == ("honoured", "")
    # ...and a reader that ignored it would be caught: the intact model judged against that file
    intact = files.fb.from_pretrained(os.path.join(files.workdir, "q4_0.gguf"))
    outcome, detail = files.judge("gguf q4_0", path, intact)
    assert outcome == "silent" and "rms_norm_eps" in detail
    # RoPE scaling ignored: caught by the config check
    path, _ = _load(ff, files, {"op": "set", "key": "llama.rope.scaling.factor", "type": "f32", "value": 4.0})
    outcome, detail = files.judge("gguf q4_0", path, intact)
    assert outcome == "silent" and "rope" in detail
    # new block bytes: honoured when the loaded weights are gguf.quants.dequantize of them ...
    t = next(t for t in files.layout["gguf q4_0"].tensors if t["name"] == "blk.0.attn_v.weight")
    block = struct.pack("<e", 0.01) + bytes(range(16))
    path, model = _load(ff, files, {"op": "bytes", "at": t["start"], "hex": block.hex()})
    assert files.judge("gguf q4_0", path, model) == ("honoured", "")
    # ... and silent when they are not (a weight changed behind the file's back)
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[0] += 1
    outcome, detail = files.judge("gguf q4_0", path, model)
    assert outcome == "silent" and "input_layernorm" in detail


def test_config_mutations_cover_each_group():
    ff = _script()
    config = {"hidden_size": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
              "architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
              "quantization_config": {"quant_method": "fewbits", "format_version": 1, "fewbits_version": "0",
                                      "schemes": {"int4": {"group_size": 128, "format": "int4"}},
                                      "modules": {"m.a": {"scheme": "int4", "shape": [64, 64], "dtype": "float32"}}}}
    groups = ff._config_mutations(config, random.Random(0))
    assert set(groups) == {"value", "delete", "arch", "qconfig"} and all(groups.values())
    text = " ".join(w for g in groups.values() for w, _ in g)
    for needle in ("hidden_size = string", "hidden_size = null", "rms_norm_eps = NaN", "rope_parameters.rope_theta",
                   "tie_word_embeddings deleted", "architectures = ['LlamaForSequenceClassification']",
                   "scheme int4.group_size = 64", "modules.m.a.shape swapped"):
        assert needle in text, needle
    edit = next(e for w, e in groups["qconfig"] if w == "scheme int4 renamed 'other'")
    renamed = json.loads(ff.config_mutated(config, edit))["quantization_config"]
    assert set(renamed["schemes"]) == {"other"} and renamed["modules"]["m.a"]["scheme"] == "other"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return fuzz(tmp_path_factory.mktemp("fuzz_smoke"), "--size", "smoke", "--kinds", "gguf q4_0,hf config")


def test_model_files_smoke_run(smoke_run):
    """Every structured mutation group runs in a worker under the time and memory limits; each
    trial is classified; no hang, no crash; the GGUF's trials all pass."""
    proc, report = smoke_run
    groups = {(g["kind"], g["corruption"]): g for g in report["groups"]}
    assert {c for k, c in groups if k == "gguf q4_0"} == {"flip", "truncate", "header", "type", "metadata", "offset",
                                                         "tensor", "block"}
    assert {c for k, c in groups if k == "hf config"} == {"flip", "truncate", "value", "delete", "arch", "qconfig"}
    for g in groups.values():
        assert g["trials"] >= 2 and g["trials"] == sum(g[o] for o in ("raised", "harmless", "honoured", "silent",
                                                                      "crashed", "hung", "partial", "other")), g
        assert not g["hung"] and not g["crashed"], g
    assert all(t["outcome"] in ("raised", "harmless", "honoured") for t in report["trials"] if t["kind"] == "gguf q4_0")
    assert "honoured" in proc.stdout and "harmless" in proc.stdout


def test_model_files_smoke_run_finds_nothing(smoke_run):
    proc, report = smoke_run
    assert not report["failures"], [(f["what"], f["outcome"]) for f in report["failures"]]
    assert proc.returncode == 0
