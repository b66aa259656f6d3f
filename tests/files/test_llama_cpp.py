"""fewbits' GGUF files read by llama.cpp itself (llama-cpp-python), and the flag choice of
benchmarks/setup_llama_cpp.sh.

The llama.cpp tests are marked slow and skip when llama_cpp is not importable (it is built from
source by benchmarks/setup_llama_cpp.sh, not a dependency). The setup script's tests run it with
--dry-run on made-up /proc/cpuinfo files: nothing is built.
"""
from __future__ import annotations

import copy
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "benchmarks" / "setup_llama_cpp.sh"

XEON_AMX = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512cd avx512bw "
            "avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8")
EPYC_ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2"
EPYC_ZEN4 = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512cd avx512bw "
             "avx512vl avx512vbmi avx512_vnni avx512_bf16")


def _dry_run(tmp_path, flags: str | None, model="Test CPU", extra=()):
    if shutil.which("bash") is None:
        pytest.skip("bash is not available")
    info = tmp_path / "cpuinfo"
    lines = ["processor\t: 0", f"model name\t: {model}"]
    if flags is not None:
        lines.append(f"flags\t\t: {flags}")
    else:
        lines.append("Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32")
    info.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, CPUINFO=str(info), PYTHON="false")
    return subprocess.run(["bash", str(SETUP), "--dry-run", *extra], capture_output=True, text=True, env=env,
                          timeout=60)


def _cmake_args(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("CMAKE_ARGS="))
    args = line.split("=", 1)[1].strip('"').split()
    return dict(a[2:].split("=", 1) for a in args)


def test_setup_xeon_with_amx_gets_avx512_and_never_amx(tmp_path):
    r = _dry_run(tmp_path, XEON_AMX, "Intel(R) Xeon(R) Platinum 8480+")
    assert r.returncode == 0, r.stderr
    args = _cmake_args(r.stdout)
    assert args["GGML_NATIVE"] == "OFF"
    for key in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512", "GGML_AVX512_VNNI",
                "GGML_AVX512_BF16", "GGML_AVX512_VBMI"):
        assert args[key] == "ON", key
    for key in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "GGML_AVX_VNNI"):
        assert args[key] == "OFF", key
    assert args["LLAVA_BUILD"] == "OFF"
    assert "AMX: present" in r.stdout and "Xeon(R) Platinum 8480+" in r.stdout
    assert "pip install --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36" in r.stdout


def test_setup_epyc_without_avx512(tmp_path):
    r = _dry_run(tmp_path, EPYC_ZEN3, "AMD EPYC 7B13 64-Core Processor")
    assert r.returncode == 0, r.stderr
    args = _cmake_args(r.stdout)
    assert args["GGML_NATIVE"] == "OFF"
    assert args["GGML_AVX2"] == "ON" and args["GGML_FMA"] == "ON" and args["GGML_F16C"] == "ON"
    for key in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI", "GGML_AMX_INT8"):
        assert args[key] == "OFF", key
    assert "AMX: not on this CPU" in r.stdout


def test_setup_epyc_zen4_avx512_without_amx(tmp_path):
    args = _cmake_args(_dry_run(tmp_path, EPYC_ZEN4, "AMD EPYC 9654").stdout)
    assert args["GGML_AVX512"] == "ON" and args["GGML_AVX512_BF16"] == "ON"
    assert args["GGML_AMX_INT8"] == "OFF" and args["GGML_AMX_TILE"] == "OFF"


def test_setup_partial_avx512_is_off(tmp_path):
    # ggml's GGML_AVX512 compiles for F, CD, VL, DQ and BW together: without BW it must stay off,
    # and so must the AVX-512 extensions on top of it
    flags = EPYC_ZEN4.replace(" avx512bw", "")
    args = _cmake_args(_dry_run(tmp_path, flags).stdout)
    assert args["GGML_AVX512"] == "OFF"
    assert args["GGML_AVX512_VNNI"] == "OFF" and args["GGML_AVX512_BF16"] == "OFF"
    assert args["GGML_AVX2"] == "ON"


def test_setup_old_x86_without_avx(tmp_path):
    args = _cmake_args(_dry_run(tmp_path, "fpu sse sse2 ssse3").stdout)
    for key in ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX512"):
        assert args[key] == "OFF", key


def test_setup_not_x86_keeps_ggml_defaults(tmp_path):
    r = _dry_run(tmp_path, None, "")
    assert r.returncode == 0, r.stderr
    args = _cmake_args(r.stdout)
    assert not any(k.startswith("GGML_") for k in args)
    assert "not an x86-64 CPU" in r.stdout


def test_setup_bad_option_and_unreadable_cpuinfo(tmp_path):
    r = _dry_run(tmp_path, EPYC_ZEN3, extra=("--bogus",))
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr
    env = dict(os.environ, CPUINFO=str(tmp_path / "missing"))
    r = subprocess.run(["bash", str(SETUP), "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "cannot read" in r.stderr


# ---------------------------------------------------------------------------------------------
# llama.cpp reading fewbits' files
# ---------------------------------------------------------------------------------------------
def _llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                                   "(benchmarks/setup_llama_cpp.sh builds it)")


def _mapping(model):
    from fewbits.quant.plan import is_quantized

    quantized = [n for n, m in model.named_modules() if is_quantized(m)]
    out = {f"{n}.weight": model.get_submodule(n).qweight for n in quantized}
    held = tuple(f"{n}.qweight." for n in quantized)
    out.update({k: v for k, v in model.state_dict().items() if not k.startswith(held)})
    return out


def _dequantized(original, quantized):
    from fewbits.quant.plan import is_quantized

    m = copy.deepcopy(original)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if is_quantized(module):
                m.get_submodule(name).weight.copy_(module.qweight.dequantize(torch.float32))
    return m


def _llama_logits(llama_cpp, path, ids):
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=1, verbose=False)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)]))
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["q4_0", "q4_k_m", "q3_k_m", "q2_k_m"])
def test_llama_cpp_computes_the_dequantized_model(tmp_path, recipe):
    """llama.cpp's logits from a fewbits GGUF are fewbits' dequantized model's (up to llama.cpp's
    f16 KV cache and 8-bit activations), far closer than the float model's."""
    llama_cpp = _llama_cpp()
    import fewbits as fb
    from fewbits.files.gguf_file import gguf_recipe, write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = list(range(1, 49))
    with torch.no_grad():
        float_logits = model(torch.tensor([ids])).logits[0]
    write_gguf(tmp_path / "f32.gguf", model.state_dict(), cfg)
    f32 = _llama_logits(llama_cpp, tmp_path / "f32.gguf", ids)
    assert (f32 - float_logits).abs().max() < 5e-3 * float_logits.abs().max()

    q = fb.quantize_model(copy.deepcopy(model), gguf_recipe(recipe, cfg), embeddings=True, tied="untie")
    write_gguf(tmp_path / "q.gguf", _mapping(q), cfg)
    with torch.no_grad():
        deq_logits = _dequantized(model, q)(torch.tensor([ids])).logits[0]
    got = _llama_logits(llama_cpp, tmp_path / "q.gguf", ids)
    to_deq = (got - deq_logits).abs().max()
    to_float = (deq_logits - float_logits).abs().max()
    assert to_float > 0
    assert to_deq < 0.2 * to_float, (to_deq, to_float)


def _llama_quantize(llama_cpp, src, dst, ftype, pure=True):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = pure
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


@pytest.mark.slow
def test_minilm_in_llama_cpp_and_q4_0_bytes_equal_llama_cpps_quantizer(tmp_path):
    """all-MiniLM-L6-v2 as a fewbits F32 GGUF: llama.cpp's embeddings equal the torch model's
    (cosine > 0.99999); fewbits' RTN q4_0 file holds the same bytes as llama.cpp's own quantizer
    makes from that F32 file (llama-quantize --pure Q4_0), and gguf_recipe's q4_k_m gives every
    tensor the type llama.cpp's Q4_K_M gives it."""
    llama_cpp = _llama_cpp()
    import gguf

    import fewbits as fb
    from fewbits.files.gguf_file import gguf_recipe, write_gguf
    from fewbits.models.minilm import embed, embedding_quality, load_minilm
    from fewbits.models.text import pydoc_sentences

    model, tokenizer = load_minilm()
    sentences = pydoc_sentences(32, seed=1)
    f32 = tmp_path / "f32.gguf"
    write_gguf(f32, model.state_dict(), model.config, tokenizer)
    llm = llama_cpp.Llama(str(f32), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1,
                          verbose=False)
    try:
        got = torch.nn.functional.normalize(torch.tensor(np.asarray(llm.embed(sentences), dtype=np.float32)), dim=1)
    finally:
        llm.close()
    assert embedding_quality(embed(model, tokenizer, sentences), got).min_cosine > 0.99999

    q = fb.quantize_model(copy.deepcopy(model), gguf_recipe("q4_0", model.config), embeddings=True, tied="untie")
    ours = tmp_path / "fewbits-q4_0.gguf"
    write_gguf(ours, _mapping(q), model.config, tokenizer)
    theirs = tmp_path / "llama-q4_0.gguf"
    _llama_quantize(llama_cpp, f32, theirs, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)
    a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    assert a.keys() == b.keys()
    quantized = [n for n, t in b.items() if t.tensor_type == gguf.GGMLQuantizationType.Q4_0]
    assert len(quantized) == 37  # 36 Linears and the token embedding
    for name in quantized:
        assert a[name].tensor_type == b[name].tensor_type
        assert np.array_equal(np.asarray(a[name].data).view(np.uint8), np.asarray(b[name].data).view(np.uint8)), name

    mixed = tmp_path / "llama-q4_k_m.gguf"
    _llama_quantize(llama_cpp, f32, mixed, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, pure=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(mixed).tensors}
    recipe = gguf_recipe("q4_k_m", model.config)
    q = fb.quantize_model(copy.deepcopy(model), recipe, embeddings=True, tied="untie")
    ours = tmp_path / "fewbits-q4_k_m.gguf"
    write_gguf(ours, _mapping(q), model.config, tokenizer)
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(ours).tensors} == types


@pytest.mark.slow
def test_smollm2_fewbits_gguf_generates_in_llama_cpp(tmp_path):
    llama_cpp = _llama_cpp()
    import fewbits as fb
    from fewbits.files.gguf_file import gguf_recipe, write_gguf
    from fewbits.models import load_smollm2

    model, tokenizer = load_smollm2()
    fb.quantize_model(model, gguf_recipe("q8_0", model.config), embeddings=True, tied="untie")
    path = tmp_path / "smollm2-q8_0.gguf"
    write_gguf(path, _mapping(model), model.config, tokenizer)
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False)
    try:
        text = llm("The capital of France is", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    assert "Paris" in text, text
