"""The deployment path under threads and processes: conversions in threads each write their own
correct output and leave torch as they found it (no nn.Module.register_parameter left patched,
no parameter of another thread on the meta device); two writers of one output file are never
both told they succeeded. No timing is checked here."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from fewbits import model_building  # noqa: E402
from fewbits.files.conversion import convert  # noqa: E402
from fewbits.files.streaming import model_skeleton  # noqa: E402
from fewbits.models import synthetic_llama_config, write_synthetic_llama  # noqa: E402
from together import together  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tiny_tokenizer import save_byte_level_bpe

    path = tmp_path_factory.mktemp("src") / "llama"
    cfg = synthetic_llama_config("135m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=384)
    write_synthetic_llama(path, cfg, shard_bytes=40_000)
    save_byte_level_bpe(path)
    return path


def _tensors(out: str) -> dict:
    from safetensors.torch import load_file

    if out.endswith(".safetensors"):  # a fewbits file: its tensors
        return load_file(out)
    if os.path.isfile(out):  # a GGUF file: its tensors' bytes
        return {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(out).tensors}
    found = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            found.update(load_file(os.path.join(out, name)))
    return found


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt,scheme,suffix", [("hf", "int8", ""), ("gguf", "q8_0", ".gguf"),
                                               ("fewbits", "int8", ".safetensors")])
def test_threaded_conversions_each_write_a_correct_output(llama, tmp_path, fmt, scheme, suffix):
    reference = str(tmp_path / f"serial{suffix}")
    convert(llama, reference, scheme, format=fmt)
    expected = _tensors(reference)
    for round_ in range(3):
        outs = [str(tmp_path / f"out{round_}_{i}{suffix}") for i in range(4)]
        together([lambda o=o: convert(llama, o, scheme, format=fmt) for o in outs])
        for o in outs:
            assert _same(_tensors(o), expected), o
    assert nn.Linear(2, 2).weight.device.type == "cpu"
    assert nn.Module.register_parameter.__qualname__ == "Module.register_parameter"  # not left patched


def test_skeletons_in_threads_leave_torch_as_it_was(llama):
    config = transformers.AutoConfig.from_pretrained(llama)
    models = together([lambda: model_skeleton(config) for _ in range(6)])
    for m in models:
        assert all(p.device.type == "meta" for p in m.parameters())
        assert m.lm_head.weight is m.model.embed_tokens.weight  # tied, as from_pretrained ties it
        assert m.model.rotary_emb.inv_freq.device.type == "cpu"  # buffers computed for real
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_parameters_on_meta_acts_in_its_own_thread_only():
    inside, go_on = threading.Event(), threading.Event()
    made = {}

    def skeleton_thread():
        with model_building.parameters_on_meta():
            made["here"] = nn.Linear(2, 2)
            inside.set()
            go_on.wait(30)
            made["here_later"] = nn.Linear(2, 2)
        made["after"] = nn.Linear(2, 2)

    t = threading.Thread(target=skeleton_thread)
    t.start()
    assert inside.wait(30)
    elsewhere = nn.Linear(2, 2)  # built while the other thread is inside: not on meta
    go_on.set()
    t.join()
    assert elsewhere.weight.device.type == "cpu" and elsewhere.bias.device.type == "cpu"
    assert made["here"].weight.device.type == "meta" and made["here_later"].bias.device.type == "meta"
    assert made["after"].weight.device.type == "cpu"
    p = nn.Parameter(torch.ones(3), requires_grad=False)
    with model_building.parameters_on_meta():
        m = nn.Module()
        m.w = p
    assert m.w.device.type == "meta" and not m.w.requires_grad and type(m.w) is nn.Parameter


def test_the_build_lock_is_one_for_the_process_and_reentrant():
    with model_building.building():
        with model_building.building():  # reentrant in a thread
            other = threading.Thread(target=lambda: got.append(model_building._BUILD_LOCK.acquire(blocking=False)))
            got = []
            other.start()
            other.join()
    assert got == [False]  # another thread waits while one builds


HOLDER = """
import sys
from fewbits import atomic
with atomic.replacing(sys.argv[1]) as tmp:
    open(tmp, "wb").write(b"first")
    print("writing", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.skipif(os.name != "posix", reason="writer locks are flocks")
@pytest.mark.parametrize("name,fmt,scheme", [("m.gguf", "gguf", "q8_0"), ("m.safetensors", "fewbits", "int8")])
def test_a_conversion_to_a_file_another_process_is_writing_is_refused(llama, tmp_path, name, fmt, scheme):
    # was: both writers reported success and the later rename silently replaced the other's file
    from fewbits.atomic import ConcurrentWriteError

    out = tmp_path / name
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        with pytest.raises(ConcurrentWriteError, match=f"another process is writing {out}"):
            convert(llama, out, scheme, format=fmt, overwrite=True)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert out.read_bytes() == b"first" and os.listdir(tmp_path) == [name]
    convert(llama, out, scheme, format=fmt, overwrite=True)  # the writer gone, the next one goes ahead
    assert os.listdir(tmp_path) == [name] and out.stat().st_size > 1000
