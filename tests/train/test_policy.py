"""Policies: presets with the attributes other modules read, canonical names, clear errors."""
import pytest

import fewbits as fb
from fewbits.train import PRESETS, Policy

REQUIRED = ["fp32", "tf32", "bf16-mixed", "fp16-mixed", "fp8-hybrid", "mxfp8", "bf16-pure", "bf16-pure-sr",
            "bf16-pure-kahan"]


def test_required_presets_and_plain_attributes():
    for name in REQUIRED:
        p = fb.Policy.preset(name)
        assert p.name == name
        for attr in ("forward", "backward", "weights", "optimizer_states", "grad_accum", "comm"):
            v = getattr(p, attr)
            assert isinstance(v, str) and (v == "int8_blockwise" or fb.get_format(v).name == v)
        assert p.master is None or fb.get_format(p.master).name == p.master
    assert Policy.preset("bf16-mixed").master == "fp32" and Policy.preset("bf16-pure").master is None
    fp8 = Policy.preset("fp8-hybrid")
    assert (fp8.forward, fp8.backward, fp8.fp8_recipe) == ("fp8_e4m3", "fp8_e5m2", "delayed")
    assert Policy.preset("mxfp8").fp8_recipe == "mx"
    assert Policy.preset("bf16-pure-sr").update_rounding == "stochastic"
    assert Policy.preset("bf16-pure-kahan").update_rounding == "kahan"
    assert Policy.preset("fp16-mixed").loss_scaling == "dynamic"
    assert Policy.preset("BF16_Mixed") is PRESETS["bf16-mixed"]
    assert set(REQUIRED) <= set(Policy.presets())


def test_custom_policies_normalise_names():
    p = Policy(forward="e4m3", backward="float8_e5m2", activations="bfloat16", weights="bf16", master="fp32",
               optimizer_states="int8_blockwise", fp8_recipe="current")
    assert (p.forward, p.backward, p.activations) == ("fp8_e4m3", "fp8_e5m2", "bf16")
    q = Policy.preset("bf16-mixed").replace(optimizer_states="bf16")
    assert q.name == "bf16-mixed+custom" and q.optimizer_states == "bf16"
    assert Policy.preset("fp16-mixed").to_dict()["loss_scaling"] == "dynamic"


def test_keep_fp32_patterns():
    p = Policy.preset("bf16-mixed")
    assert p.keeps_fp32("blocks.0.ln1", "LayerNorm") and p.keeps_fp32("model.norm", "LlamaRMSNorm")
    assert p.keeps_fp32("bn", "BatchNorm2d") and p.keeps_fp32("crit", "CrossEntropyLoss")
    assert not p.keeps_fp32("blocks.0.qkv", "Linear") and not p.keeps_fp32("", "TinyNormNet")
    assert Policy(keep_fp32="head*").keeps_fp32("head.proj", "Linear")


@pytest.mark.parametrize("kw, match", [
    ({"forward": "fp9"}, "forward"), ({"forward": 3}, "format name"), ({"loss_scaling": "auto"}, "loss_scaling"),
    ({"fp8_recipe": "lazy"}, "fp8_recipe"), ({"update_rounding": "up"}, "update_rounding"),
    ({"forward_rounding": "sideways"}, "forward_rounding"), ({"growth_factor": 0.5}, "growth_factor"),
    ({"amax_history_len": 0}, "amax_history_len"), ({"update_rounding": "kahan"}, "low-precision weights"),
])
def test_bad_policies(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Policy(**kw)
    with pytest.raises(ValueError, match="unknown policy preset"):
        Policy.preset("bf16-mixd")


def test_preset_names_follow_the_format_spelling_rule():
    for spelling in ("bf16-mixed", "BF16_Mixed", "bf16 mixed", "bf16.mixed", " bf16mixed "):
        assert Policy.preset(spelling).name == "bf16-mixed"
    with pytest.raises(ValueError, match="unknown policy preset"):
        Policy.preset("bf16-mixd")
