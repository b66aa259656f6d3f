"""Tied weights are never silently untied by quantize_model (issue 12, item 8).

SmolLM2's lm_head shares its weight with the token embedding; quantizing it untied the pair,
grew the model (134.5 M -> 162.8 M parameters) and made it worse, while the command line kept it
in float. One default now decides for both: resolve_plan keeps tied layers in float."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fewbits.quant.model import model_nbytes, quantize_model, resolve_plan, tied_weights
from fewbits.quant.scheme import get_scheme


class TinyTiedLM(nn.Module):
    """Embedding -> Linear -> head, the head's weight the embedding's (as in tied LMs)."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.relu(self.body(self.embed(ids))))


def _params(model):
    return sum(p.numel() for p in model.parameters())


def test_tied_weights_are_found():
    assert tied_weights(TinyTiedLM()) == {"lm_head": ["embed.weight"]}
    assert tied_weights(TinyTiedLM(), embeddings=True) == {"embed": ["lm_head.weight"],
                                                             "lm_head": ["embed.weight"]}
    assert tied_weights(nn.Sequential(nn.Linear(4, 4))) == {}


@pytest.mark.parametrize("scheme", ["int4", "int8", "nf4"])
def test_quantize_model_keeps_a_tied_head_tied(scheme):
    model = TinyTiedLM()
    before = _params(model)
    ids = torch.randint(0, 64, (2, 8))
    quantize_model(model, scheme)
    assert model.lm_head.weight is model.embed.weight  # still one matrix
    assert isinstance(model.lm_head, nn.Linear) and not hasattr(model.lm_head, "qweight")
    assert hasattr(model.body, "qweight")
    assert model_nbytes(model)["params"] == before  # nothing was duplicated
    assert model(ids).shape == (2, 8, 64)


def test_untie_is_explicit():
    model = TinyTiedLM()
    before = _params(model)
    quantize_model(model, "int4", tied="untie")
    assert hasattr(model.lm_head, "qweight")
    assert model_nbytes(model)["params"] == before + 64 * 32  # the matrix is now held twice


def test_a_rule_naming_a_tied_layer_is_refused_before_anything_changes():
    model = TinyTiedLM()
    body = model.body
    with pytest.raises(ValueError, match="tied to embed.weight.*tied='untie'"):
        quantize_model(model, {"body": "int8", "lm_head": "int4"})
    assert model.body is body  # nothing replaced
    with pytest.raises(ValueError, match="tied must be one of keep, untie"):
        resolve_plan(model, "int4", tied="share")


@pytest.mark.parametrize("rules", [{"*head*": "int8"}, {"*proj*": "int8", "*e*": "nf4"},
                                   {"*_hea?": "int8", "*": "int4"}, {"[l]m_head": "int8", "*": "int4"}])
def test_a_wildcard_rule_matching_a_tied_layer_keeps_it_in_float(rules):
    # only "*" used to be let through: any other wildcard that happened to match lm_head raised
    model = TinyTiedLM()
    model.proj_head = nn.Linear(32, 32)  # an untied layer that "*head*" and "*proj*" also match
    plan = resolve_plan(model, rules)
    assert "lm_head" not in plan and "proj_head" in plan
    quantize_model(model, rules)
    assert model.lm_head.weight is model.embed.weight and not hasattr(model.lm_head, "qweight")
    assert hasattr(model.proj_head, "qweight")


def test_a_wildcard_rule_matching_only_a_tied_layer_says_it_was_kept():
    model = TinyTiedLM()
    assert resolve_plan(model, {"*head*": "int8"}) == {}
    with pytest.raises(ValueError, match="no layer matched.*kept in float because their weights are tied: lm_head"):
        quantize_model(model, {"*head*": "int8"})


def test_an_explicit_name_of_a_tied_layer_is_refused_even_after_a_wildcard_rule():
    model = TinyTiedLM()
    with pytest.raises(ValueError, match="rule 'lm_head' quantizes 'lm_head'.*tied='untie'"):
        resolve_plan(model, {"lm_head": "int8", "*": "int4"})
    # the first matching rule decides: a wildcard before the explicit name keeps the layer in float
    assert "lm_head" not in resolve_plan(model, {"*head": "int8", "lm_head": "int4"})
    plan = resolve_plan(model, {"lm_head": "int8", "*": "int4"}, tied="untie")
    assert plan["lm_head"] == get_scheme("int8")


def test_nothing_but_tied_layers_says_why():
    model = nn.Module()
    model.embed = nn.Embedding(10, 4)
    model.head = nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    with pytest.raises(ValueError, match="tied: head"):
        quantize_model(model, "int8")


def test_transformers_llama_with_tied_embeddings():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = _params(model)
    quantize_model(model, "int4")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model_nbytes(model)["params"] == before
    assert hasattr(model.model.layers[0].mlp.down_proj, "qweight")
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 96, (1, 8))).logits).all()

