"""Synthetic Llama directories: what transformers reads back is the model the config describes."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from fewbits.models import LLAMA_SHAPES, synthetic_llama_config, write_synthetic_llama  # noqa: E402


def test_a_synthetic_model_is_a_loadable_directory_of_small_shards(tmp_path):
    import transformers

    config = synthetic_llama_config("135m", num_hidden_layers=2)
    info = write_synthetic_llama(tmp_path / "m", config, shard_bytes=8 << 20)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert info["shards"] == len(files) > 1
    assert index["metadata"]["total_size"] == info["bytes"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.dtype == torch.bfloat16 and model.config.hidden_size == LLAMA_SHAPES["135m"][0]
    assert sum(p.numel() for p in model.parameters()) == info["parameters"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    w = model.model.layers[1].mlp.down_proj.weight.float()
    assert 0.015 < float(w.std()) < 0.025
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))


def test_the_same_seed_writes_the_same_weights_and_an_existing_directory_is_refused(tmp_path):
    from safetensors.torch import load_file

    config = synthetic_llama_config("135m", num_hidden_layers=1, vocab_size=512)
    write_synthetic_llama(tmp_path / "a", config, seed=3)
    write_synthetic_llama(tmp_path / "b", config, seed=3)
    a = {k: v for f in sorted((tmp_path / "a").glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted((tmp_path / "b").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_synthetic_llama(tmp_path / "a", config)
    with pytest.raises(ValueError, match="sizes: 135m, 1b, 3b, 8b"):
        synthetic_llama_config("7b")
    assert not list(tmp_path.glob(".*building*"))
