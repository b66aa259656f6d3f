"""fb.from_pretrained of a llama GGUF file: its block tensors come back as the very
QuantizedTensors fewbits wrote (the q/k rows put back in transformers' order), so the model
computes exactly what the model that wrote it computes."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import fewbits as fb  # noqa: E402
from fewbits.files import FileFormatError, write_gguf  # noqa: E402
from fewbits.files.gguf_reader import read_gguf  # noqa: E402
from fewbits.files.hf_dir import model_tensors  # noqa: E402


def _model(hidden=64, inter=128, tied=True):
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return a.scheme == b.scheme and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("scheme,hidden,tied", [("q8_0", 64, True), ("q4_1", 64, False), ("q4_k", 256, True)])
def test_a_fewbits_gguf_reads_back_as_the_same_quantized_model(tmp_path, scheme, hidden, tied):
    model = _model(hidden, 2 * hidden, tied)
    fb.quantize_model(model, scheme, embeddings=True, tied="untie")
    path = tmp_path / "m.gguf"
    write_gguf(path, model_tensors(model), model.config)
    cfg, tensors = read_gguf(path)
    written = model_tensors(model)
    for name, value in tensors.items():
        if isinstance(value, fb.QuantizedTensor):
            assert _same(value, written[name if name in written else "model.embed_tokens.weight"]), name
        else:
            assert torch.equal(value, written[name]), name
    loaded = fb.from_pretrained(path)
    ids = torch.arange(24).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_files_it_cannot_read_are_named(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(FileFormatError, match="x.gguf"):
        fb.from_pretrained(bad)
