"""GGUF files for llama.cpp and transformers (fewbits.files.gguf_file): every check reads the file
with the other tools' readers - gguf.GGUFReader and gguf.quants.dequantize for names, metadata,
shapes, types and values (bit for bit), transformers' GGUF loader for the llama model's logits and
its tokenizer - not with fewbits."""
from __future__ import annotations

import os
import weakref
from collections.abc import Mapping

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits.files import gguf_file
from fewbits.files.gguf_blocks import GGUF_BLOCK_TYPES
from fewbits.files.gguf_file import gguf_recipe, rotary_permutation, write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from transformers import BertConfig, LlamaConfig  # noqa: E402

LEGACY = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
K_QUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def _have_k_quants() -> bool:
    try:
        return all(fb.get_scheme(s) is not None for s in K_QUANTS) and all(
            t in GGUF_BLOCK_TYPES for t in ("Q4_K", "Q5_K", "Q6_K"))
    except ValueError:
        return False


needs_k = pytest.mark.skipif(not _have_k_quants(), reason="the k-quant schemes q4_k/q5_k/q6_k and their GGUF "
                             "blocks (engineer A, fewbits.quant.scheme / files.gguf_blocks) are not in this tree yet")
ALL_SCHEMES = LEGACY + [pytest.param(s, marks=needs_k) for s in K_QUANTS]
# quantizing whole models in the k-quants takes long (their scale search): those runs are slow ones
ALL_SCHEMES_SLOW_K = LEGACY + [pytest.param(s, marks=[needs_k, pytest.mark.slow]) for s in K_QUANTS]

TEXT = ("The quick brown fox jumps over 13 lazy dogs; 2024 was a year. def f(x): return x ** 2  # ok\n"
        "Ünïcödé text, emojis 😀 and numbers 3.14159 and <|im_start|>user\nhello<|im_end|>\n")


# ---------------------------------------------------------------------------------------------
# tiny models and tokenizers
# ---------------------------------------------------------------------------------------------
def llama_config(hidden=64, inter=128, layers=2, vocab=320, tied=True, **kw):
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                       tie_word_embeddings=tied, max_position_embeddings=128, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2, **kw)


def llama_tensors(cfg, scheme="q4_0", seed=0, embed_scheme=None):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("proj.weight") and scheme is not None:
            out[k] = fb.quantize(v, scheme)
        elif k == "model.embed_tokens.weight" and embed_scheme is not None:
            out[k] = fb.quantize(v, embed_scheme)
        else:
            out[k] = v.clone()
    return out


def dequantized(tensors):
    return {k: (v.dequantize(torch.float32) if isinstance(v, fb.QuantizedTensor) else v) for k, v in tensors.items()}


def reference_llama(model_class, cfg, tensors):
    """The fewbits model with dequantized weights: a tied model's lm_head is its embedding (the
    state dict's separate lm_head copy would overwrite the shared matrix when loaded last)."""
    ref = model_class(cfg).eval()
    state = dequantized(tensors)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    assert ref.lm_head.weight is ref.model.embed_tokens.weight or not cfg.tie_word_embeddings
    return ref


def bpe_tokenizer(pre="gpt-2", vocab=320):
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = tokenizers.Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in ("llama-bpe", "qwen2"))
    if pre == "gpt-2":
        tk.pre_tokenizer = byte_level
    elif pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "qwen2"):
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(gguf_file.split_regex(pre)), behavior="isolated"), byte_level])
    elif pre == "whitespace":
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    from fewbits.models.text import pydoc_split
    tk.train_from_iterator([pydoc_split().train[:30000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")


WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "hello", "world", "token", "model"]


def bert_tokenizer(tmp_path):
    """A WordPiece tokenizer as BERT's (lower-casing normalizer, [CLS] A [SEP]); tmp_path unused."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,!?")
    vocab += WORDS + ["##s", "##ed", "##ing", "##er"]
    ids = {t: i for i, t in enumerate(vocab)}
    tk = tokenizers.Tokenizer(models.WordPiece(vocab=ids, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                      special_tokens=[("[CLS]", 3), ("[SEP]", 4)])
    tk.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                  cls_token="[CLS]", mask_token="[MASK]")
    assert tok("hello worlds")["input_ids"] == [3, ids["hello"], ids["world"], ids["##s"], 4]
    return tok, vocab


def bert_config(vocab=64, hidden=64, inter=128, layers=2):
    return BertConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2, pad_token_id=0)


def bert_tensors(cfg, scheme="q8_0", seed=0):
    torch.manual_seed(seed)
    model = transformers.BertModel(cfg).eval()
    out = {}
    for k, v in model.state_dict().items():
        quant = k.endswith(".weight") and v.dim() == 2 and "embeddings" not in k and not k.startswith("pooler")
        out[k] = fb.quantize(v, scheme) if quant and scheme is not None else v.clone()
    return out


# ---------------------------------------------------------------------------------------------
# reading back with gguf
# ---------------------------------------------------------------------------------------------
def fields(path):
    reader = gguf.GGUFReader(str(path))
    return reader, {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def expected_values(tensors, name, gname, cfg, arch):
    """The float32 values the GGUF tensor must hold: fewbits' dequantized tensor, its rows in
    llama.cpp's q/k order for llama (BERT's are not permuted)."""
    v = tensors[name]
    x = v.dequantize(torch.float32) if isinstance(v, fb.QuantizedTensor) else v.to(torch.float32)
    if arch != "llama":
        pass
    elif ".attn_q." in gname:
        x = x[rotary_permutation(x.shape[0], cfg.num_attention_heads)]
    elif ".attn_k." in gname:
        x = x[rotary_permutation(x.shape[0], cfg.num_key_value_heads)]
    return x.numpy()


def check_tensors(path, tensors, cfg, arch):
    reader, _ = fields(path)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    by_gguf = {}
    for name in tensors:
        g = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if g is not None and not name.startswith("pooler.") and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            by_gguf[g] = name
    assert sorted(t.name for t in reader.tensors) == sorted(by_gguf)
    for t in reader.tensors:
        name = by_gguf[t.name]
        v = tensors[name]
        shape = tuple(v.shape)
        assert tuple(int(s) for s in t.shape[::-1]) == shape, t.name
        if isinstance(v, fb.QuantizedTensor):
            assert t.tensor_type.name == fb.files.gguf_blocks.gguf_block_type(v.scheme)
        elif v.dim() == 1 or t.name in ("position_embd.weight", "token_types.weight"):
            assert t.tensor_type.name == "F32", t.name
        else:
            assert t.tensor_type.name == {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[v.dtype]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        want = expected_values(tensors, name, t.name, cfg, arch)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=t.name)
    return reader


# ---------------------------------------------------------------------------------------------
# llama
# ---------------------------------------------------------------------------------------------
def llama_metadata(cfg, file_type):
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return {
        "general.architecture": "llama", "general.type": "model",
        "llama.vocab_size": cfg.vocab_size, "llama.context_length": cfg.max_position_embeddings,
        "llama.embedding_length": cfg.hidden_size, "llama.block_count": cfg.num_hidden_layers,
        "llama.feed_forward_length": cfg.intermediate_size, "llama.attention.head_count": cfg.num_attention_heads,
        "llama.attention.head_count_kv": cfg.num_key_value_heads, "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": head_dim,
        "llama.attention.layer_norm_rms_epsilon": float(np.float32(cfg.rms_norm_eps)),
        "general.file_type": int(file_type),
    }


@pytest.mark.parametrize("scheme", ALL_SCHEMES_SLOW_K)
def test_llama_reader_sees_every_key_tensor_and_value(tmp_path, scheme):
    k = scheme in K_QUANTS
    cfg = llama_config(hidden=256 if k else 64, inter=512 if k else 128)
    tensors = llama_tensors(cfg, scheme)
    path = tmp_path / "m.gguf"
    summary = write_gguf(path, tensors, cfg)
    reader, meta = fields(path)
    ftype = gguf.LlamaFileType[gguf_file._FILE_TYPES[scheme]]
    want = llama_metadata(cfg, ftype)
    want["general.quantization_version"] = 2
    want["tokenizer.ggml.model"] = "none"
    # no vocabulary, but the config's special ids (transformers' GGUF loader builds the config from them)
    want.update({"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 2})
    assert meta == want
    check_tensors(path, tensors, cfg, "llama")
    assert "output.weight" not in [t.name for t in reader.tensors]  # tied
    n_linear = 7 * cfg.num_hidden_layers
    block = fb.files.gguf_blocks.gguf_block_type(scheme)
    assert summary.types == {block: n_linear, "F32": 2 * cfg.num_hidden_layers + 2}
    assert summary.tensors == len(reader.tensors) == n_linear + 2 * cfg.num_hidden_layers + 2
    assert summary.file_bytes == os.path.getsize(path)
    assert summary.tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    params = sum(v.numel if isinstance(v, fb.QuantizedTensor) else v.numel()
                 for n, v in tensors.items() if n != "lm_head.weight")
    assert summary.parameters == params
    assert summary.bits_per_parameter == pytest.approx(summary.tensor_bytes * 8 / params)


@needs_k
@pytest.mark.parametrize("scheme", K_QUANTS)
def test_k_quants_written_bit_exact(tmp_path, scheme):
    """k_proj (permuted rows of 256-value super-blocks) and down_proj in a k-quant, the rest Q8_0."""
    cfg = llama_config(hidden=256, inter=256, layers=1)
    tensors = llama_tensors(cfg, "q8_0")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        tensors[name] = fb.quantize(tensors[name].dequantize(), scheme)
    path = tmp_path / "k.gguf"
    summary = write_gguf(path, tensors, cfg)
    check_tensors(path, tensors, cfg, "llama")
    assert summary.types[scheme.upper()] == 2
    assert fields(path)[1]["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)


def test_llama_untied_writes_output_and_float_dtypes(tmp_path):
    cfg = llama_config(tied=False)
    tensors = llama_tensors(cfg, "q8_0")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.bfloat16)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.float16)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)  # 1-D: written F32
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].dequantize(
        torch.bfloat16)
    path = tmp_path / "u.gguf"
    summary = write_gguf(path, tensors, cfg)
    reader = check_tensors(path, tensors, cfg, "llama")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "BF16" and types["token_embd.weight"] == "F16"
    assert types["output_norm.weight"] == "F32" and types["blk.0.attn_q.weight"] == "BF16"
    assert summary.types["BF16"] == 2


def test_permutation_is_llama_cpps_and_transformers_undoes_it():
    rows, heads = 48, 3
    w = torch.randn(rows, 5)
    ours = w[rotary_permutation(rows, heads)]
    # llama.cpp's converter: reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)
    theirs = w.reshape(heads, 2, rows // heads // 2, 5).swapaxes(1, 2).reshape(rows, 5)
    assert torch.equal(ours, theirs)
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    back = LlamaTensorProcessor()._reverse_permute_weights(ours.numpy(), heads, heads)
    assert np.array_equal(back, w.numpy())


def test_quantized_rows_are_permuted_exactly(tmp_path):
    """The q/k rows of a QuantizedTensor move as whole blocks (codes and scales together): the
    GGUF bytes of attn_q are encode_blocks' rows in llama.cpp's order."""
    cfg = llama_config()
    tensors = llama_tensors(cfg, "q5_1")
    path = tmp_path / "p.gguf"
    write_gguf(path, tensors, cfg)
    reader = gguf.GGUFReader(str(path))
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    blocks = fb.files.gguf_blocks.encode_blocks(q)
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    assert np.array_equal(np.asarray(t.data), blocks[rotary_permutation(q.shape[0], cfg.num_attention_heads).numpy()])


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_row_chunks_encode_like_the_whole(monkeypatch, scheme):
    x = torch.randn(40, 512)
    qt = fb.quantize(x, scheme)
    whole = fb.files.gguf_blocks.encode_blocks(qt)
    monkeypatch.setattr(gguf_file, "_CHUNK_VALUES", 512 * 7)  # 7 rows per slice, a short last slice
    chunks = list(gguf_file._row_chunks(qt))
    assert len(chunks) > 1 or not gguf_file._sliceable(qt)
    assert np.array_equal(gguf_file.gguf_blocks_of(qt), whole)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe"])
def test_transformers_loads_llama_logits_and_tokenizer_equal(tmp_path, pre):
    cfg = llama_config(layers=2)
    tensors = llama_tensors(cfg, "q4_1", embed_scheme="q8_0")
    tok = bpe_tokenizer(pre)
    path = tmp_path / "t.gguf"
    write_gguf(path, tensors, cfg, tok)
    _, meta = fields(path)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == pre
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="t.gguf").eval()
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    ref = reference_llama(transformers.LlamaForCausalLM, cfg, tensors)
    ids = torch.tensor([tok(TEXT)["input_ids"][:40]])
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert torch.equal(a, b)  # transformers dequantizes with gguf to float32 and undoes the permutation
    gtok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in (TEXT, " leading space", "12345 678", "tabs\tand\nnewlines  "):
        assert gtok(text)["input_ids"] == tok(text)["input_ids"], text


@needs_k
def test_transformers_reads_the_low_bit_types_as_fewbits_holds_them(tmp_path):
    """Q2_K (attention), Q3_K (MLP) and IQ4_NL (the tied embedding) read by transformers'
    own GGUF loader (gguf_file=): logits equal the dequantized model's bit for bit."""
    cfg = llama_config(hidden=256, inter=512, layers=2)
    tensors = llama_tensors(cfg, None, embed_scheme="iq4_nl")
    for k in list(tensors):
        if k.endswith("proj.weight"):
            tensors[k] = fb.quantize(tensors[k], "q3_k" if ".mlp." in k else "q2_k")
    write_gguf(tmp_path / "low.gguf", tensors, cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="low.gguf").eval()
    ref = reference_llama(transformers.LlamaForCausalLM, cfg, tensors)
    ids = torch.arange(1, 31).reshape(1, 30)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


def test_attention_biases_permuted_like_their_rows(tmp_path):
    cfg = llama_config(attention_bias=True)
    tensors = llama_tensors(cfg, "q4_0")
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
    path = tmp_path / "b.gguf"
    write_gguf(path, tensors, cfg)
    check_tensors(path, tensors, cfg, "llama")  # attn_q.bias / attn_k.bias in llama.cpp's row order
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="b.gguf").eval()
    ref = reference_llama(transformers.LlamaForCausalLM, cfg, tensors)
    ids = torch.arange(30).reshape(1, 30)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


def test_llama_tokenizer_metadata(tmp_path):
    cfg = llama_config()
    tok = bpe_tokenizer("gpt-2")
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    path = tmp_path / "v.gguf"
    write_gguf(path, llama_tensors(cfg, "q8_0"), cfg, tok)
    reader, meta = fields(path)
    vocab = tok.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg.vocab_size
    assert all(tokens[i] == (by_id[i] if i in by_id else f"[PAD{i}]") for i in range(cfg.vocab_size))
    types = meta["tokenizer.ggml.token_type"]
    assert types[:3] == [3, 3, 3] and set(types[3:len(vocab)]) == {1}
    assert set(types[len(vocab):]) <= {5}
    merges = meta["tokenizer.ggml.merges"]
    assert merges == [" ".join(m) for m in __import__("json").loads(tok.backend_tokenizer.to_str())["model"]["merges"]]
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["tokenizer.ggml.padding_token_id"] == 2 and meta["tokenizer.ggml.unknown_token_id"] == 0
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    assert meta["tokenizer.chat_template"] == tok.chat_template


def test_reads_each_tensor_at_most_twice_and_keeps_none(tmp_path):
    cfg = llama_config()
    data = llama_tensors(cfg, "q4_0")

    class Lazy(Mapping):
        """Hands out a fresh copy per access, and checks that no earlier one is still alive."""
        def __init__(self):
            self.reads, self.alive = {}, []

        def __getitem__(self, key):
            alive = [r for r in self.alive if r() is not None]
            assert not alive, f"{len(alive)} earlier tensors still referenced when reading {key}"
            self.reads[key] = self.reads.get(key, 0) + 1
            v = data[key]
            v = fb.QuantizedTensor.from_state_dict(v.scheme, v.shape, v.dtype, {k: t.clone() for k, t in
                                                   v.state_dict().items()}) if isinstance(v, fb.QuantizedTensor) \
                else v.clone()
            self.alive.append(weakref.ref(v.codes if isinstance(v, fb.QuantizedTensor) else v))
            return v

        def __iter__(self):
            return iter(data)

        def __len__(self):
            return len(data)

    lazy = Lazy()
    write_gguf(tmp_path / "l.gguf", lazy, cfg)
    assert max(lazy.reads.values()) == 2 and "lm_head.weight" not in lazy.reads


def test_progress_callback(tmp_path):
    cfg = llama_config()
    calls = []
    write_gguf(tmp_path / "c.gguf", llama_tensors(cfg), cfg, progress=lambda d, t, n: calls.append((d, t, n)))
    assert [c[0] for c in calls] == list(range(1, calls[0][1] + 1)) and calls[-1][2] == "output_norm.weight"


# ---------------------------------------------------------------------------------------------
# BERT
# ---------------------------------------------------------------------------------------------
def test_bert_reader_names_metadata_and_vocab(tmp_path):
    tok, vocab = bert_tokenizer(tmp_path)
    cfg = bert_config(vocab=len(vocab) + 3)  # 3 ids beyond the tokenizer: [PAD<i>] placeholders
    tensors = bert_tensors(cfg, "q8_0")
    path = tmp_path / "b.gguf"
    summary = write_gguf(path, tensors, cfg, tok)
    reader = check_tensors(path, tensors, cfg, "bert")
    names = {t.name for t in reader.tensors}
    per = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_output_norm", "ffn_up", "ffn_down", "layer_output_norm"]
    assert names == ({"token_embd.weight", "token_types.weight", "position_embd.weight", "token_embd_norm.weight",
                      "token_embd_norm.bias"}
                     | {f"blk.{i}.{p}.{s}" for i in range(2) for p in per for s in ("weight", "bias")})
    _, meta = fields(path)
    tokens = meta.pop("tokenizer.ggml.tokens")
    types = meta.pop("tokenizer.ggml.token_type")
    assert meta == {
        "general.architecture": "bert", "general.type": "model", "bert.vocab_size": cfg.vocab_size,
        "bert.context_length": 64, "bert.embedding_length": 64, "bert.block_count": 2,
        "bert.feed_forward_length": 128, "bert.attention.head_count": 4,
        "bert.attention.layer_norm_epsilon": float(np.float32(1e-12)), "bert.attention.causal": False,
        "bert.pooling_type": int(gguf.PoolingType.MEAN), "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "general.quantization_version": 2, "tokenizer.ggml.model": "bert", "tokenizer.ggml.token_type_count": 2,
        "tokenizer.ggml.bos_token_id": 3, "tokenizer.ggml.eos_token_id": 4, "tokenizer.ggml.unknown_token_id": 2,
        "tokenizer.ggml.seperator_token_id": 4, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.mask_token_id": 5, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True,
        "tokenizer.ggml.add_sep_token": False,
    }
    control = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    want = [t if t in control else (t[2:] if t.startswith("##") else "\u2581" + t) for t in vocab]
    assert tokens == want + [f"[PAD{i}]" for i in range(len(vocab), cfg.vocab_size)]
    assert types == [3 if t in control else 1 for t in vocab] + [5, 5, 5]
    assert summary.types == {"Q8_0": 6 * 2, "F32": 5 + 10 * 2}
    assert "pooler.dense.weight" in tensors  # present in the model, not in the file


def test_bert_float16_embeddings_position_and_types_f32(tmp_path):
    cfg = bert_config()
    tensors = {k: (v.half() if v.dim() == 2 and v.is_floating_point() else v) for k, v in bert_tensors(cfg, None).items()}
    path = tmp_path / "f.gguf"
    write_gguf(path, tensors, cfg)
    reader = check_tensors(path, tensors, cfg, "bert")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "F16" and types["blk.0.attn_q.weight"] == "F16"
    assert types["position_embd.weight"] == types["token_types.weight"] == "F32"
    assert fields(path)[1]["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)


# ---------------------------------------------------------------------------------------------
# gguf_recipe
# ---------------------------------------------------------------------------------------------
def smollm2_like(**kw):
    return llama_config(hidden=576, inter=1536, layers=30, vocab=49152, **kw)


def test_recipe_uniform_legacy_is_pure():
    cfg = llama_config()
    for name in LEGACY:
        recipe = gguf_recipe(name, cfg)
        assert set(recipe.values()) == {name}
        assert "model.embed_tokens" in recipe and "lm_head" not in recipe
        assert len(recipe) == 1 + 7 * cfg.num_hidden_layers
    assert "lm_head" in gguf_recipe("q8_0", llama_config(tied=False))


def test_recipe_rows_that_no_block_holds_stay_float():
    cfg = llama_config(hidden=48, inter=96)  # 48 = 1.5 blocks of 32
    recipe = gguf_recipe("q4_0", cfg)
    assert recipe["model.layers.0.self_attn.q_proj"] is None
    assert recipe["model.layers.0.mlp.down_proj"] == "q4_0"  # rows of 96


def _more_bits(i, n):
    # llama.cpp's use_more_bits, written out for n = 30: the first 3, the last 4, and 5, 8, ..., 23
    return i in {0, 1, 2, 26, 27, 28, 29} or (i >= 3 and (i - 3) % 3 == 2)


@needs_k
def test_recipe_q4_k_m_on_smollm2():
    recipe = gguf_recipe("q4_k_m", smollm2_like())
    assert recipe["model.embed_tokens"] == "q8_0"  # tied, rows of 576: Q6_K would need 256 | 576
    for i in range(30):
        p = f"model.layers.{i}."
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert recipe[p + m] == "q5_0"  # Q4_K's fallback for rows of 576
        assert recipe[p + "self_attn.v_proj"] == ("q8_0" if _more_bits(i, 30) else "q5_0")
        assert recipe[p + "mlp.down_proj"] == ("q6_k" if _more_bits(i, 30) else "q4_k")  # rows of 1536


@needs_k
def test_recipe_k_mixes_with_rows_of_256():
    cfg = llama_config(hidden=256, inter=512, layers=16, vocab=320, tied=False)
    m = gguf_recipe("q4_k_m", cfg)
    assert m["lm_head"] == "q6_k" and m["model.embed_tokens"] == "q4_k"
    assert [m[f"model.layers.{i}.self_attn.v_proj"] for i in range(16)] == \
        ["q6_k" if (i < 2 or i >= 14 or (i - 2) % 3 == 2) else "q4_k" for i in range(16)]
    s = gguf_recipe("q4_k_s", cfg)
    assert [s[f"model.layers.{i}.self_attn.v_proj"] for i in range(6)] == ["q5_k"] * 4 + ["q4_k"] * 2
    assert [s[f"model.layers.{i}.mlp.down_proj"] for i in range(4)] == ["q5_k", "q5_k", "q4_k", "q4_k"]
    assert s["lm_head"] == "q6_k" and s["model.layers.0.self_attn.q_proj"] == "q4_k"
    five = gguf_recipe("q5_k_m", cfg)
    assert five["model.layers.0.mlp.down_proj"] == "q6_k" and five["model.layers.3.mlp.down_proj"] == "q5_k"
    tied = gguf_recipe("q5_k_m", llama_config(hidden=256, inter=512, layers=16, tied=True))
    assert tied["model.embed_tokens"] == "q6_k" and "lm_head" not in tied
    assert set(gguf_recipe("q6_k", cfg).values()) == {"q6_k"}
    assert gguf_recipe("q4_k", smollm2_like())["model.layers.0.self_attn.q_proj"] == "q5_0"
    assert gguf_recipe("q5_k", smollm2_like())["model.layers.0.self_attn.q_proj"] == "q5_1"
    assert gguf_recipe("q6_k", smollm2_like())["model.layers.0.self_attn.q_proj"] == "q8_0"


@needs_k
def test_recipe_low_bit_k_mixes():
    # llama.cpp's llama_tensor_get_type for Q2_K, Q2_K_S and Q3_K_S/M/L (16 layers, 2 query heads per key-value head)
    cfg = llama_config(hidden=256, inter=512, layers=16, vocab=320, tied=False)
    layer = [f"model.layers.{i}." for i in range(16)]

    def column(r, m):
        return [r[p + m] for p in layer]

    two = gguf_recipe("q2_k_m", cfg)
    assert two["lm_head"] == "q6_k" and two["model.embed_tokens"] == "q2_k"
    assert set(column(two, "self_attn.q_proj") + column(two, "mlp.up_proj") + column(two, "mlp.gate_proj")) == {"q2_k"}
    assert set(column(two, "self_attn.v_proj") + column(two, "mlp.down_proj") + column(two, "self_attn.o_proj")) == {"q3_k"}
    two_s = gguf_recipe("q2_k_s", cfg)
    assert column(two_s, "mlp.down_proj") == ["q4_k"] * 2 + ["q2_k"] * 14 and set(column(two_s, "self_attn.v_proj")) == {"q2_k"}
    gqa4 = llama_config(hidden=256, inter=512, layers=16, vocab=320, tied=False)
    gqa4.num_attention_heads, gqa4.num_key_value_heads = 8, 2
    assert set(column(gguf_recipe("q2_k_m", gqa4), "self_attn.v_proj")) == {"q4_k"}
    assert set(column(gguf_recipe("q2_k_s", gqa4), "self_attn.v_proj")) == {"q4_k"}
    small = gguf_recipe("q3_k_s", cfg)
    assert small["lm_head"] == "q6_k" and set(v for k, v in small.items() if k != "lm_head") == {"q3_k"}
    medium = gguf_recipe("q3_k_m", cfg)
    assert column(medium, "self_attn.v_proj") == ["q5_k"] * 2 + ["q4_k"] * 14
    assert column(medium, "mlp.down_proj") == ["q5_k"] + ["q4_k"] * 15  # the first sixteenth
    assert set(column(medium, "self_attn.o_proj")) == {"q4_k"} and set(column(medium, "mlp.up_proj")) == {"q3_k"}
    large = gguf_recipe("q3_k_l", cfg)
    assert set(column(large, "self_attn.v_proj") + column(large, "mlp.down_proj") + column(large, "self_attn.o_proj")) \
        == {"q5_k"}
    # rows of 576 (SmolLM2): Q2_K and Q3_K fall back to Q4_0, as llama.cpp's tensor_type_fallback
    assert gguf_recipe("q3_k", smollm2_like())["model.layers.0.self_attn.q_proj"] == "q4_0"
    assert gguf_recipe("q2_k", smollm2_like())["model.layers.0.mlp.down_proj"] == "q2_k"  # rows of 1536


def test_file_type_inferred_for_the_low_bit_mixes():
    def entries(**types):
        return [gguf_file._Entry(f"t{i}", f"t{i}", (32, 32), t, True, 0, None)
                for t, n in types.items() for i in range(n)]

    ft = gguf.LlamaFileType
    assert gguf_file._file_type(None, entries(Q3_K=5, Q4_K=2, Q5_K=1)) == ft.MOSTLY_Q3_K_M
    assert gguf_file._file_type(None, entries(Q3_K=5, Q5_K=2)) == ft.MOSTLY_Q3_K_L
    assert gguf_file._file_type(None, entries(Q3_K=5, Q6_K=1)) == ft.MOSTLY_Q3_K_S
    assert gguf_file._file_type(None, entries(Q2_K=5, Q3_K=2)) == ft.MOSTLY_Q2_K
    assert gguf_file._file_type(None, entries(Q2_K=5, Q4_K=1)) == ft.MOSTLY_Q2_K_S
    assert gguf_file._file_type(None, entries(IQ4_NL=3)) == ft.MOSTLY_IQ4_NL
    assert gguf_file._file_type("q2_k_m", []) == ft.MOSTLY_Q2_K  # llama-quantize's Q2_K mix


@needs_k
def test_recipe_bert_minilm():
    cfg = bert_config(vocab=30522, hidden=384, inter=1536, layers=6)
    r = gguf_recipe("q4_k_m", cfg)
    assert r["embeddings.word_embeddings"] == "q8_0"  # no output.weight: llama.cpp treats it as tied
    assert r["pooler.dense"] is None
    assert r["encoder.layer.0.attention.self.query"] == "q5_0"
    # use_more_bits on 6 layers: n // 8 = 0, 7 * n // 8 = 5, so layers 2 and 5
    assert [r[f"encoder.layer.{i}.output.dense"] for i in range(6)] == ["q4_k", "q4_k", "q6_k", "q4_k", "q4_k", "q6_k"]
    assert [r[f"encoder.layer.{i}.attention.self.value"] for i in range(6)] == ["q5_0"] * 2 + ["q8_0"] + \
        ["q5_0"] * 2 + ["q8_0"]  # Q6_K falls back to Q8_0 on rows of 384, Q4_K to Q5_0


@pytest.mark.slow
@needs_k
def test_recipe_quantized_and_written(tmp_path):
    """A recipe's schemes, applied with fb.quantize, give a file with exactly the recipe's types."""
    cfg = llama_config(hidden=256, inter=512, layers=3, tied=False)
    recipe = gguf_recipe("q4_k_m", cfg)
    torch.manual_seed(1)
    sd = transformers.LlamaForCausalLM(cfg).state_dict()
    tensors = {k: (fb.quantize(v, recipe[k[:-7]]) if k[:-7] in recipe and recipe[k[:-7]] else v) for k, v in sd.items()}
    path = tmp_path / "r.gguf"
    write_gguf(path, tensors, cfg, file_type="q4_k_m")
    reader = check_tensors(path, tensors, cfg, "llama")
    assert fields(path)[1]["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert {t.name: t.tensor_type.name for t in reader.tensors}["output.weight"] == "Q6_K"


# ---------------------------------------------------------------------------------------------
# bad input: a clear error, nothing written
# ---------------------------------------------------------------------------------------------
def assert_nothing_written(directory, name):
    assert not os.path.exists(directory / name)
    assert [p for p in os.listdir(directory) if name in p] == []


def test_unsupported_architecture(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    supported = ("supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, "
                 "Gemma3ForCausalLM, Phi3ForCausalLM, BertModel")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel|model_type 'gpt2'.*" + supported):
        write_gguf(tmp_path / "x.gguf", {}, cfg)
    with pytest.raises(ValueError, match=supported):
        gguf_recipe("q4_0", {"architectures": ["PhiForCausalLM"]})  # Phi-1/2, not Phi-3
    assert_nothing_written(tmp_path, "x.gguf")


@pytest.mark.parametrize("scheme", ["nf4", "mxfp4", "int4", "int8", "fp8"])
def test_scheme_without_gguf_type(tmp_path, scheme):
    cfg = llama_config()
    tensors = llama_tensors(cfg, "q4_0")
    tensors["model.layers.1.mlp.up_proj.weight"] = fb.quantize(torch.randn(128, 64), scheme)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight: scheme .* has no GGUF type; the GGUF "
                                         r"block schemes are q4_0, q4_1"):
        write_gguf(tmp_path / "s.gguf", tensors, cfg)
    assert_nothing_written(tmp_path, "s.gguf")


def test_row_length_a_block_cannot_hold(tmp_path):
    cfg = llama_config(hidden=48, inter=96)
    tensors = llama_tensors(cfg, None)
    tensors["model.layers.0.self_attn.q_proj.weight"] = fb.quantize(
        tensors["model.layers.0.self_attn.q_proj.weight"], "q4_0")  # 48 columns: padded to 64 in fewbits
    with pytest.raises(ValueError, match="q_proj.weight: GGUF Q4_0 holds rows of a multiple of 32 values, these rows "
                                         "have 48"):
        write_gguf(tmp_path / "r.gguf", tensors, cfg)
    assert_nothing_written(tmp_path, "r.gguf")


@needs_k
def test_k_quant_row_length_names_the_fallback(tmp_path):
    cfg = llama_config()
    tensors = llama_tensors(cfg, "q4_0")
    tensors["model.layers.0.mlp.gate_proj.weight"] = fb.quantize(torch.randn(128, 64), "q4_k")
    with pytest.raises(ValueError, match="GGUF Q4_K holds rows of a multiple of 256 values, these rows have 64; "
                                         "llama.cpp falls back to q5_0"):
        write_gguf(tmp_path / "k.gguf", tensors, cfg)


def test_missing_extra_and_wrong_tensors(tmp_path):
    cfg = llama_config()
    base = llama_tensors(cfg, "q4_0")
    missing = {k: v for k, v in base.items() if "layers.1.mlp.down_proj" not in k}
    with pytest.raises(ValueError, match=r"missing for LlamaForCausalLM with 2 layers: blk.1.ffn_down.weight"):
        write_gguf(tmp_path / "m.gguf", missing, cfg)
    extra = dict(base, **{"model.vision_tower.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="model.vision_tower.weight: not a tensor of LlamaForCausalLM in GGUF"):
        write_gguf(tmp_path / "m.gguf", extra, cfg)
    ints = dict(base, **{"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    with pytest.raises(ValueError, match="model.norm.weight: dtype torch.int32 is not a float dtype"):
        write_gguf(tmp_path / "m.gguf", ints, cfg)
    other = dict(base, **{"model.norm.weight": np.ones(64, np.float32)})
    with pytest.raises(ValueError, match="model.norm.weight: a ndarray, not a torch.Tensor or QuantizedTensor"):
        write_gguf(tmp_path / "m.gguf", other, cfg)
    emb = dict(base, **{"model.embed_tokens.weight": torch.zeros(100, 64)})
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: shape \(100, 64\), the config says \(320, 64\)"):
        write_gguf(tmp_path / "m.gguf", emb, cfg)
    untied = llama_config(tied=False)
    with pytest.raises(ValueError, match="missing .*output.weight"):
        write_gguf(tmp_path / "m.gguf", {k: v for k, v in base.items() if k != "lm_head.weight"}, untied)
    with pytest.raises(TypeError, match="mapping"):
        write_gguf(tmp_path / "m.gguf", [1, 2], cfg)
    assert_nothing_written(tmp_path, "m.gguf")


def test_bad_config_and_options(tmp_path):
    cfg = llama_config()
    tensors = llama_tensors(cfg)
    rope = llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="rope_type 'llama3' is not supported by this GGUF writer; supported: default"):
        write_gguf(tmp_path / "c.gguf", tensors, rope)
    act = llama_config(hidden_act="gelu")
    with pytest.raises(ValueError, match="computes silu; this config has hidden_act 'gelu'"):
        write_gguf(tmp_path / "c.gguf", tensors, act)
    with pytest.raises(ValueError, match="config hidden_size must be a positive int"):
        write_gguf(tmp_path / "c.gguf", tensors, dict(cfg.to_dict(), hidden_size=None))
    with pytest.raises(TypeError, match="PretrainedConfig or a config.json dict"):
        write_gguf(tmp_path / "c.gguf", tensors, 3)
    with pytest.raises(ValueError, match="unknown file_type 'q3_k_xl'"):
        write_gguf(tmp_path / "c.gguf", tensors, cfg, file_type="q3_k_xl")
    with pytest.raises(ValueError, match="unknown GGUF recipe 'iq3_m'; recipes: q8_0"):
        gguf_recipe("iq3_m", cfg)
    assert_nothing_written(tmp_path, "c.gguf")


def test_bad_tokenizers(tmp_path):
    cfg = llama_config()
    tensors = llama_tensors(cfg)
    with pytest.raises(ValueError, match="pre-tokenizer .*Whitespace.* supported: gpt-2"):
        write_gguf(tmp_path / "t.gguf", tensors, cfg, bpe_tokenizer("whitespace"))
    bert_tok, _ = bert_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="byte-level BPE tokenizer .*this tokenizer is WordPiece"):
        write_gguf(tmp_path / "t.gguf", tensors, cfg, bert_tok)
    with pytest.raises(ValueError, match="WordPiece tokenizer; this one is BPE"):
        write_gguf(tmp_path / "t.gguf", bert_tensors(bert_config()), bert_config(), bpe_tokenizer())
    with pytest.raises(ValueError, match="beyond the model's vocab_size 100"):
        small = llama_config(vocab=100)
        write_gguf(tmp_path / "t.gguf", llama_tensors(small), small, bpe_tokenizer())
    with pytest.raises(ValueError, match="is not a directory with tokenizer files"):
        write_gguf(tmp_path / "t.gguf", tensors, cfg, tmp_path / "nowhere")
    with pytest.raises(TypeError, match="fast tokenizer or a directory"):
        write_gguf(tmp_path / "t.gguf", tensors, cfg, object())
    assert_nothing_written(tmp_path, "t.gguf")


def test_existing_path_refused_unless_overwrite(tmp_path):
    cfg = llama_config()
    path = tmp_path / "e.gguf"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_gguf(path, llama_tensors(cfg), cfg)
    assert path.read_bytes() == b"old"
    write_gguf(path, llama_tensors(cfg), cfg, overwrite=True)
    assert fields(path)[1]["general.architecture"] == "llama"
    with pytest.raises(IsADirectoryError):
        write_gguf(tmp_path, llama_tensors(cfg), cfg, overwrite=True)


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch, existing):
    cfg = llama_config()
    path = tmp_path / "i.gguf"
    if existing:
        path.write_bytes(b"old")
    real = gguf.GGUFWriter.write_tensor_data
    calls = []

    def failing(self, tensor, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(self, tensor, *a, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    with pytest.raises(OSError, match="disk full"):
        write_gguf(path, llama_tensors(cfg), cfg, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == (["i.gguf"] if existing else [])
    if existing:
        assert path.read_bytes() == b"old"


# ---------------------------------------------------------------------------------------------
# the real models (slow)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_gguf_loads_in_transformers_with_equal_logits_and_tokens(tmp_path):
    from fewbits.models import load_smollm2
    from fewbits.models.smollm2 import default_cache_dir, smollm2_gguf_path
    from fewbits.models.text import pydoc_split

    model, tok = load_smollm2()
    tensors = {k: (fb.quantize(v, "q8_0") if k.endswith("proj.weight") else v) for k, v in model.state_dict().items()}
    path = tmp_path / "s.gguf"
    summary = write_gguf(path, tensors, model.config, default_cache_dir())
    assert summary.types == {"Q8_0": 210, "F32": 62}
    _, meta = fields(path)
    _, reference = fields(smollm2_gguf_path())  # llama.cpp's own file for this model
    shared = {"general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
              "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
              "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size",
              "llama.rope.dimension_count", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token",
              "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"}
    assert {k: meta[k] for k in shared} == {k: reference[k] for k in shared}
    assert meta["tokenizer.ggml.pre"] == "gpt-2"  # this cached tokenizer has no digit split (module docstring)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="s.gguf").eval()
    ref = reference_llama(type(model), model.config, tensors)
    text = pydoc_split().eval[:4000]
    ids = tok(text, return_tensors="pt")["input_ids"][:, :128]
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, loaded(ids).logits)
    gtok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="s.gguf")
    assert gtok(text)["input_ids"] == tok(text)["input_ids"]


@pytest.mark.slow
def test_minilm_gguf_reader_level(tmp_path):
    from fewbits.models.minilm import minilm_path

    p = minilm_path()
    model = transformers.AutoModel.from_pretrained(p).eval()
    tensors = {k: (fb.quantize(v, "q8_0") if k.endswith("weight") and v.dim() == 2 and "embeddings" not in k
                   and not k.startswith("pooler") else v) for k, v in model.state_dict().items()}
    path = tmp_path / "m.gguf"
    write_gguf(path, tensors, model.config, p)
    check_tensors(path, tensors, model.config, "bert")
    _, meta = fields(path)
    vocab = (p / "vocab.txt").read_text(encoding="utf-8").splitlines()
    control = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    assert meta["tokenizer.ggml.tokens"] == [t if t in control else (t[2:] if t.startswith("##") else "\u2581" + t)
                                              for t in vocab]
    assert meta["tokenizer.ggml.bos_token_id"] == 101 and meta["tokenizer.ggml.seperator_token_id"] == 102
    assert meta["bert.pooling_type"] == 1 and meta["bert.attention.causal"] is False


def test_a_w4a8_model_is_written_as_q4_0(tmp_path):
    """w4a8's weights are Q4_0's; how its activations are quantized is the runtime's choice, which
    GGUF does not store: the file holds Q4_0 tensors whose values are the weights' dequantize()."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    sd = transformers.LlamaForCausalLM(config).state_dict()
    tensors = {k: (fb.quantize(v, "w4a8") if v.dim() == 2 and "embed" not in k and "lm_head" not in k else v)
               for k, v in sd.items()}
    path = tmp_path / "w4a8.gguf"
    write_gguf(path, tensors, config)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_0" and types["token_embd.weight"] == "F32"
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    values = gguf.quants.dequantize(down.data, down.tensor_type).reshape(tensors["model.layers.0.mlp.down_proj.weight"].shape)
    assert np.array_equal(values, tensors["model.layers.0.mlp.down_proj.weight"].dequantize().numpy())
