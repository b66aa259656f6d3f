"""GGUF export of the decoders besides Llama: Mistral (written as llama.cpp's "llama", rows
permuted), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorms) and Phi-3 (fused q/k/v and gate/up), as
"qwen2"/"qwen3"/"phi3" (rotary halves, as transformers: no permutation); Gemma 3 in
test_gguf_gemma3.py. Each file is read by the other tools' readers -- gguf.GGUFReader
for tensors and metadata (bit for bit), transformers' GGUF loader for the model (its logits equal
to the model with fewbits' dequantized weights, bit for bit) and its tokenizer -- and by fewbits'
own reader (fb.from_pretrained), whose model gives transformers' logits. llama.cpp runs them in
benchmarks/bench_gguf_architectures.py (its tools are not in CI)."""
from __future__ import annotations

import pytest
import torch

import fewbits as fb
from fewbits.files.gguf_file import gguf_recipe, write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from test_gguf_file import TEXT, bpe_tokenizer, check_tensors, dequantized, fields  # noqa: E402

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
# transformers' GGUF reader builds Qwen3 with its default head_dim (128; it does not read
# attention.key_length for qwen3): the tiny model keeps hidden / heads = 128
KINDS = {"mistral": ("MistralConfig", "MistralForCausalLM", "llama", {"sliding_window": None}),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {}),
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {"head_dim": 128}),
         # Phi-3: q/k/v and gate/up fused (attn_qkv, ffn_up of 2 x ffn rows); its pad id default 32000
         "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", {"pad_token_id": 0, "sliding_window": None})}


def _model(kind: str, tied: bool = False, **overrides):
    config_cls, model_cls, _, extra = KINDS[kind]
    cfg = getattr(transformers, config_cls)(**{**SMALL, **extra, "tie_word_embeddings": tied, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms and biases away from their initial 1 / 0, so that a lost one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _tensors(model, scheme):
    out = {}
    for k, v in model.state_dict().items():
        out[k] = fb.quantize(v, scheme) if k.endswith("proj.weight") and scheme is not None else v.clone()
    return out


def _reference(model, tensors):
    ref = type(model)(model.config).eval()
    state = dequantized(tensors)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    ref.load_state_dict(state, strict=False)
    return ref


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("scheme,tied", [("q4_0", False), ("q5_k", True), (None, False)])
def test_transformers_reads_the_model_and_its_logits_are_fewbits(tmp_path, kind, scheme, tied):
    model = _model(kind, tied=tied)
    tensors = _tensors(model, scheme)
    path = tmp_path / "m.gguf"
    summary = write_gguf(path, tensors, model.config)
    arch = KINDS[kind][2]
    assert summary.architecture == arch
    _, meta = fields(path)
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.attention.head_count_kv"] == 1 and meta[f"{arch}.block_count"] == 2
    check_tensors(path, tensors, model.config, arch)  # qwen2/qwen3: rows as transformers holds them
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    if kind == "qwen2":
        assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.1.attn_v.bias"} <= names
    if kind == "qwen3":
        assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    if kind == "phi3":
        assert {"blk.0.attn_qkv.weight", "blk.1.ffn_up.weight"} <= names and "blk.0.ffn_gate.weight" not in names
    assert ("output.weight" in names) == (not tied)
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _reference(model, tensors)(ids).logits
        assert torch.equal(read(ids).logits, want)
        mine = fb.from_pretrained(str(path))  # fewbits' reader: the blocks kept, its kernels' sums
        got = mine(ids).logits
    assert type(mine).__name__ == ("LlamaForCausalLM" if kind == "mistral" else type(model).__name__)
    # fewbits runs some of these types with 8-bit activations (llama.cpp's arithmetic), transformers
    # in float32: 0.4-1.1% of the largest logit on these random-weight models
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


def test_qwen_tokenizer_is_written_with_its_split_and_read_back_equal(tmp_path):
    model = _model("qwen2")
    tok = bpe_tokenizer("qwen2")
    write_gguf(tmp_path / "q.gguf", _tensors(model, "q8_0"), model.config, tok)
    _, meta = fields(tmp_path / "q.gguf")
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    gtok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf")
    for text in (TEXT, "12345 678", " x  y\n\nz"):
        assert gtok(text)["input_ids"] == tok(text)["input_ids"], text


def test_recipes_cover_the_new_decoders():
    for kind in KINDS:
        cfg = _model(kind).config
        r = gguf_recipe("q4_k_m", cfg)
        if kind == "phi3":  # llama.cpp's q4_k_m gives a fused attn_qkv Q5_K
            assert r["model.layers.0.self_attn.qkv_proj"] == "q5_k" and r["model.layers.0.mlp.gate_up_proj"] == "q4_k"
        else:
            assert r["model.layers.0.self_attn.q_proj"] == "q4_k"
        assert r["model.layers.1.mlp.down_proj"] == "q6_k"


def test_configs_llama_cpp_would_compute_otherwise_are_refused_or_warned(tmp_path):
    for kind in ("qwen2", "qwen3"):
        model = _model(kind, use_sliding_window=True, sliding_window=64, max_window_layers=0)
        with pytest.raises(ValueError, match="use_sliding_window"):
            write_gguf(tmp_path / "w.gguf", _tensors(model, None), model.config)
    model = _model("qwen3", attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        write_gguf(tmp_path / "b.gguf", _tensors(model, None), model.config)
    for kind in ("mistral", "phi3"):
        model = _model(kind, sliding_window=64)
        with pytest.warns(UserWarning, match="sliding_window 64"):
            write_gguf(tmp_path / f"{kind}.gguf", _tensors(model, None), model.config, overwrite=True)
    # llama.cpp's Phi-3 fix-ups look up Phi-3's own tokens when the name says phi3: a vocabulary
    # without them would not load there, so the name is left out
    model = _model("phi3")
    model.config._name_or_path = "/models/tiny-phi3-instruct"
    with pytest.warns(UserWarning, match="general.name 'tiny-phi3-instruct' left out"):
        write_gguf(tmp_path / "n.gguf", _tensors(model, None), model.config, bpe_tokenizer())
    assert "general.name" not in fields(tmp_path / "n.gguf")[1]
    model = _model("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        write_gguf(tmp_path / "p.gguf", _tensors(model, None), model.config)
    model = _model("qwen2", hidden_act="gelu")
    with pytest.raises(ValueError, match="silu"):
        write_gguf(tmp_path / "g.gguf", _tensors(model, None), model.config)


@pytest.mark.parametrize("kind,method", [(k, "rtn") for k in KINDS] + [("qwen3", "gptq")])
def test_fewbits_quantize_streams_a_directory_of_each_architecture_into_gguf(tmp_path, kind, method):
    """`fewbits quantize DIR --scheme q4_k_m --format gguf` (the streamed path, RTN or GPTQ, a
    byte-level BPE tokenizer beside the weights): llama.cpp's mix of types, and the file reads back
    in transformers and fewbits with the same logits, the GGUF's tokenizer the directory's."""
    import contextlib
    import io

    from fewbits.cli import main
    from tiny_tokenizer import save_byte_level_bpe

    model = _model(kind)
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
    assert types["blk.0.attn_qkv.weight" if kind == "phi3" else "blk.0.attn_q.weight"] == \
        ("Q5_K" if kind == "phi3" else "Q4_K")
    assert types["blk.1.ffn_down.weight"] == "Q6_K"
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = read(ids).logits, fb.from_pretrained(str(out))(ids).logits
    # fewbits runs some of these types with 8-bit activations (llama.cpp's arithmetic), transformers
    # in float32: 0.4-1.1% of the largest logit on these random-weight models
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())
    tok = transformers.AutoTokenizer.from_pretrained(src)
    gtok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert gtok("hello world 123")["input_ids"] == tok("hello world 123")["input_ids"]


def test_crafted_qwen_files_are_refused_before_any_model_is_built(tmp_path):
    """fewbits' reader of the new architectures (the file is untrusted): an architecture it does not
    run, keys under another architecture's prefix, a qwen3 file without its q/k norms (a qwen2 file
    relabelled), a qwen3 key_length the tensors do not hold: each a FileFormatError naming the file
    and the problem."""
    from gguf_craft import rewrite

    from fewbits.files import FileFormatError

    model = _model("qwen2")
    src = tmp_path / "q.gguf"
    write_gguf(src, _tensors(model, "q8_0"), model.config)
    _, meta = fields(src)
    keys = {k: v for k, v in meta.items() if k.startswith("qwen2.")}

    def crafted(name, **edits):
        out = tmp_path / name
        rewrite(src, out, **edits)
        return str(out)

    def typed(v):
        return ("f32", float(v)) if isinstance(v, float) else ("u32", int(v))

    cases = {
        "starcoder2 architecture": (crafted("g.gguf", set={"general.architecture": ("string", "starcoder2")}),
                                    "architectures gemma2, gemma3, llama, phi3, qwen2, qwen3; this one is 'starcoder2'"),
        "keys under llama.": (crafted("k.gguf", drop=tuple(keys), set={k.replace("qwen2.", "llama.", 1): typed(v)
                                                                       for k, v in keys.items()}),
                              "qwen2.block_count is missing"),
        "qwen2 relabelled qwen3": (crafted("r.gguf", drop=tuple(keys),
                                           set={"general.architecture": ("string", "qwen3"),
                                                **{k.replace("qwen2.", "qwen3.", 1): typed(v) for k, v in keys.items()}}),
                                   "not a tensor of a qwen3 model"),
        "key_length": (crafted("h.gguf", set={"qwen2.attention.key_length": ("u32", 64),
                                              "qwen2.attention.value_length": ("u32", 64),
                                              "qwen2.rope.dimension_count": ("u32", 64)}),
                       "attn_q.weight has 256 rows"),
    }
    for what, (path, message) in cases.items():
        with pytest.raises(FileFormatError, match=message) as e:
            fb.from_pretrained(path)
        assert path in str(e.value), what
