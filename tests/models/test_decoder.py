"""fewbits.models.decoder: LlamaDecoder's written-out forward gives transformers' logits bit for
bit at every step and greedy_generate's tokens, on tiny random Llama / Mistral / Qwen2 / Qwen3 /
Gemma 3 models,
fewbits-quantized ones and SmolLM2; unsupported models and lengths are refused before any work.
No timing is checked here."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fewbits as fb  # noqa: E402
from fewbits.models.decoder import LlamaDecoder  # noqa: E402
from fewbits.models.generation import greedy_generate  # noqa: E402

NEW = 12
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def _model(kind: str = "llama", dtype=torch.float32, **overrides):
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "phi3": ("Phi3Config", "Phi3ForCausalLM")}[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**SMALL, **overrides})
    config._attn_implementation = "sdpa"
    return getattr(transformers, model_cls)(config).to(dtype).eval()


def _ids(n: int = 10, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(1))


def _stepwise_logits(model, ids: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' last-position logits of the prompt and of each token fed after it."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    with torch.inference_mode():
        n = ids.shape[1]
        out.append(model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits)
        for i in range(tokens.shape[1] - 1):
            out.append(model(input_ids=tokens[:, i:i + 1], position_ids=torch.tensor([[n + i]]), cache=cache,
                             use_cache=True, logits_to_keep=1).logits)
    return out


def _check_exact(model, ids, new=NEW):
    """LlamaDecoder's tokens are greedy_generate's and its logits at each step are transformers'."""
    ref = greedy_generate(model, ids, new)
    dec = LlamaDecoder(model, path="torch")
    got = dec.generate(ids, new)
    assert dec.last_path == "torch"
    assert torch.equal(got.tokens, ref.tokens)
    assert got.prompt_tokens == ids.shape[1] and got.decode_steps == new - 1
    assert got.prefill_seconds > 0 and got.decode_seconds > 0
    want = _stepwise_logits(model, ids, ref.tokens)
    have = dec.step_logits(ids, ref.tokens)
    assert len(have) == len(want)
    for i, (a, b) in enumerate(zip(have, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"step {i}: max difference {(a - b).abs().max().item()}"
    return dec, ref


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),                                   # grouped-query attention (4 heads, 2 kv)
    ("llama", {"num_key_value_heads": 4}),           # multi-head
    ("llama", {"num_key_value_heads": 1, "head_dim": 32}),  # head_dim apart from hidden / heads
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {}),
    ("qwen2", {}),                                   # q/k/v biases
    ("qwen3", {"head_dim": 16}),                     # q/k norms per head
    ("phi3", {"pad_token_id": 0}),                   # fused q/k/v and gate/up
])
def test_float_models_bit_for_bit(kind, overrides):
    _check_exact(_model(kind, **overrides), _ids())


def test_bfloat16_model_bit_for_bit():
    _check_exact(_model("llama", torch.bfloat16), _ids())


@pytest.mark.parametrize("scheme", ["int4_g32", "nf4", "mxfp4", "int8", "w8a8", "w4a8"])
def test_quantized_model_bit_for_bit(scheme):
    model = _model("llama")
    fb.quantize_model(model, scheme, tied="untie")
    _check_exact(model, _ids())


def test_one_token_prompt_and_one_new_token():
    model = _model()
    _check_exact(model, _ids(1), new=1)
    _check_exact(model, _ids(1), new=5)


def test_cache_grows_and_is_reused():
    model = _model()
    dec = LlamaDecoder(model)
    short = dec.generate(_ids(), 4)
    cache = dec._k
    again = dec.generate(_ids(), 4)
    assert dec._k is cache and torch.equal(short.tokens, again.tokens)
    longer = dec.generate(_ids(20), 30)
    assert dec._k.shape[3] >= 50
    assert torch.equal(longer.tokens, greedy_generate(model, _ids(20), 30).tokens)


def test_a_model_changed_in_place_runs_as_it_is_now():
    model = _model()
    dec = LlamaDecoder(model)
    dec.generate(_ids(), NEW)
    fb.quantize_model(model, "int4_g32")
    assert torch.equal(dec.generate(_ids(), NEW).tokens, greedy_generate(model, _ids(), NEW).tokens)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.bias = None
        model.model.norm.weight.mul_(-1)
    assert torch.equal(dec.generate(_ids(), NEW).tokens, greedy_generate(model, _ids(), NEW).tokens)


@pytest.fixture(scope="module")
def smollm2_int4():
    from fewbits.models import load_smollm2

    try:
        model, _ = load_smollm2()
    except ImportError as e:
        pytest.skip(str(e))
    model.config._attn_implementation = "sdpa"
    fb.quantize_model(model, "int4", tied="untie")
    return model


def _gemma(config_cls: str, model_cls: str, attention: str, **fields):
    """A tiny Gemma of transformers' classes (3 layers, heads of 16, a window of 6) with the
    attention implementation given, its norms away from 0 (so that a lost 1 + weight shows)."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**SMALL, "head_dim": 16, "query_pre_attn_scalar": 16,
                                                  "sliding_window": 6, "num_hidden_layers": 3, **fields})
    config._attn_implementation = attention
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _gemma3(**overrides):
    """A tiny Gemma 3: layers 0 and 1 sliding (a window of 6), layer 2 full."""
    return _gemma("Gemma3TextConfig", "Gemma3ForCausalLM", "sdpa", **{"sliding_window_pattern": 3, **overrides})


@pytest.mark.parametrize("prompt", [4, 5, 6, 10])  # the window of 6 filled during decode, at its end, in the prompt
@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 4}, {"final_logit_softcapping": 3.0},
                                       {"tie_word_embeddings": False}])
def test_gemma3_bit_for_bit(prompt, overrides):
    """Gemma 3's blocks -- (1 + weight) norms before and after attention and MLP, q/k norms, GELU,
    scaled embeddings, a RoPE base per kind of layer, sliding-window layers (masked as
    transformers' sdpa attention masks them), final soft-capping -- give transformers' logits bit
    for bit, before, at and past the window."""
    model = _gemma3(**overrides)
    assert model.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    _check_exact(model, _ids(prompt), new=12)


@pytest.mark.parametrize("scheme", ["int4_g32", "q8_0", "w8a8"])
def test_phi3_quantized_bit_for_bit_and_natively(scheme):
    """Phi-3's fused q/k/v and gate/up: the torch path splits them as transformers does (bit for
    bit); the native step runs each as one kernel writing q, k, v (gate, up) one after the other."""
    model = _model("phi3", pad_token_id=0)
    fb.quantize_model(model, scheme)
    _check_exact(model, _ids(), new=10)
    _check_native(model, _ids(), new=10)


@pytest.mark.parametrize("scheme", ["int4_g32", "q8_0"])
@pytest.mark.parametrize("prompt", [4, 10])  # the window of 6 filled during the native decode steps, in the prompt
def test_gemma3_quantized_bit_for_bit_and_natively(scheme, prompt):
    """Gemma 3 quantized (its scaled embedding too) on the torch path, bit for bit; natively: the
    (1 + weight) norms, post norms, GELU (tanh), sliding window, RoPE base per kind of layer and
    soft-capping in decode.c, within float32 roundings of the torch path."""
    model = _gemma3(tie_word_embeddings=False, final_logit_softcapping=3.0)
    fb.quantize_model(model, scheme, embeddings=True)
    _check_exact(model, _ids(prompt), new=10)
    _check_native(model, _ids(prompt), new=10)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LlamaDecoder(_gemma3(attn_logit_softcapping=50.0))
    windowless = _gemma3()
    windowless.config.sliding_window = None
    with pytest.raises(ValueError, match="sliding_window of at least 1"):
        LlamaDecoder(windowless)
    partial = _model("phi3", pad_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor is 0.5"):
        LlamaDecoder(partial)


def _gemma2(**overrides):
    """A tiny Gemma 2 (transformers' eager attention, as Gemma 2 needs for its capped scores):
    layers 0 and 2 sliding (a window of 6), attention and logits capped low enough to matter."""
    return _gemma("Gemma2Config", "Gemma2ForCausalLM", "eager",
                  **{"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, **overrides})


@pytest.mark.parametrize("prompt", [4, 6, 10])
@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 4}])
def test_gemma2_bit_for_bit(prompt, overrides):
    """Gemma 2's capped attention (transformers' eager attention, its masks) and the rest of its
    blocks give transformers' logits bit for bit, before, at and past the window."""
    _check_exact(_gemma2(**overrides), _ids(prompt), new=12)


@pytest.mark.parametrize("scheme", ["int4_g32", "q8_0"])
def test_gemma2_quantized_natively(scheme):
    model = _gemma2()
    fb.quantize_model(model, scheme, embeddings=True, tied="untie")
    _check_exact(model, _ids(10), new=10)
    _check_native(model, _ids(10), new=10)


def test_smollm2_int4_bit_for_bit(smollm2_int4):
    _check_exact(smollm2_int4, _ids(24, 49152), new=8)


def test_unsupported_models_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).eval()
    with pytest.raises(ValueError, match="model_type is 'gpt2'"):
        LlamaDecoder(gpt2)
    with pytest.raises(ValueError, match="model_type"):
        LlamaDecoder(torch.nn.Linear(2, 2))
    dynamic = _model(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic'"):
        LlamaDecoder(dynamic)
    broken = _model()
    del broken.model.layers[0].mlp.up_proj
    with pytest.raises(ValueError, match="up_proj"):
        LlamaDecoder(broken)


def test_bad_arguments_and_lengths_are_refused():
    model = _model()
    dec = LlamaDecoder(model)
    with pytest.raises(ValueError, match="batch 1"):
        dec.generate(torch.zeros(2, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="positive int"):
        dec.generate(_ids(), 0)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        dec.generate(_ids(100), 29)
    windowed = _model("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding window"):
        LlamaDecoder(windowed).generate(_ids(10), 7)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        dec.generate(_ids(), 2)


# --- the native decode step (kernels/csrc/decode.c) ------------------------------------------
# its reductions (RMSNorm, attention) and exp have their own order and precision, so its logits
# are the torch path's within a few float32 roundings, relative to the largest logit (measured:
# 1-3e-7 on the tiny models, up to 8e-7 on SmolLM2 int4), and the tokens are the same. Schemes
# that quantize activations (w8a8, w4a8) are held to it here because these seeded models put no
# activation near an int8 rounding boundary; on SmolLM2 a last-bit difference does move codes,
# and w8a8's logits then differ by as much as transformers' sdpa and eager attention do (README).
NATIVE_RTOL = 64 * 2.0 ** -24


def _skip_without_row_kernels(model):
    """Which kernel a scheme gets depends on the CPU (w8a8's panels need VNNI, w4a8's kernel its
    vectorized build): where a projection has no one-row kernel here, the native path cannot be
    tested here."""
    reason = LlamaDecoder(model).native_reason()
    if reason is not None and ("no one-row C kernel" in reason or "native library is not loaded" in reason):
        pytest.skip(f"on this CPU: {reason}")


def _check_native(model, ids, new=NEW, rtol=NATIVE_RTOL):
    _skip_without_row_kernels(model)
    ref = LlamaDecoder(model, path="torch")
    want = ref.generate(ids, new)
    dec = LlamaDecoder(model, path="native")
    got = dec.generate(ids, new)
    assert dec.last_path == "native" and dec.native_reason() is None
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.tokens, greedy_generate(model, ids, new).tokens)
    have, logits = dec.step_logits(ids, want.tokens), ref.step_logits(ids, want.tokens)
    assert torch.equal(have[0], logits[0])  # the prompt runs the torch path
    for i, (a, b) in enumerate(zip(have, logits)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= rtol, f"step {i}: relative difference {err:.2e}"
    return dec


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("llama", {"num_key_value_heads": 4}),
                                            ("qwen2", {}), ("qwen3", {"head_dim": 16}), ("llama", {"head_dim": 32})])
@pytest.mark.parametrize("scheme", ["int4_g32", "nf4", "nvfp4", "q4_0", "int8", "w8a8", "w4a8"])
def test_native_step_matches_the_torch_path(kind, overrides, scheme):
    model = _model(kind, **overrides)
    fb.quantize_model(model, scheme, tied="untie")
    _check_native(model, _ids(20), new=20)


@pytest.mark.parametrize("scheme", ["q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_native_step_runs_every_gguf_integer_block(scheme):
    """GGUF's blocks other than Q4_0 / Q4_1 (introw.c's one-row kernel, parameters read as
    stored): the decode step runs natively and matches the torch path."""
    model = _model()
    fb.quantize_model(model, scheme, tied="untie")
    _check_native(model, _ids(20), new=20)


def test_native_step_at_two_threads_and_across_calls():
    model = _model()
    fb.quantize_model(model, "int4_g32")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        dec = _check_native(model, _ids(), new=NEW)
    finally:
        torch.set_num_threads(threads)
    first = dec.generate(_ids(), NEW)
    longer = dec.generate(_ids(30), 40)  # a larger cache: a new step over it
    assert torch.equal(first.tokens, dec.generate(_ids(), NEW).tokens)
    assert torch.equal(longer.tokens, LlamaDecoder(model, path="torch").generate(_ids(30), 40).tokens)


def test_auto_falls_back_to_torch_and_native_says_why():
    model = _model()  # float layers: no one-row C kernel
    dec = LlamaDecoder(model)
    assert "no one-row C kernel" in dec.native_reason()
    dec.generate(_ids(), 3)
    assert dec.last_path == "torch"
    with pytest.raises(ValueError, match="path='native' cannot run this model: layer 0's q projection"):
        LlamaDecoder(model, path="native").generate(_ids(), 3)
    fb.quantize_model(model, "int4_g32")
    dec.generate(_ids(), 3)
    assert dec.last_path == "native"
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert dec.native_reason() == "layer 1's activation is GELU, not SiLU or GELU (tanh)"
    bf16 = _model(dtype=torch.bfloat16)
    assert "float32 models" in LlamaDecoder(bf16).native_reason()
    assert LlamaDecoder(model, path="torch").native_reason() == "path='torch'"
    with pytest.raises(ValueError, match="path must be one of"):
        LlamaDecoder(model, path="fast")


def test_native_step_without_the_library():
    from fewbits.kernels import native

    model = _model()
    fb.quantize_model(model, "int4_g32")
    with native.turned_off():
        dec = LlamaDecoder(model)
        assert "native library is not loaded" in dec.native_reason()
        r = dec.generate(_ids(), NEW)
        assert dec.last_path == "torch"
    assert torch.equal(r.tokens, greedy_generate(model, _ids(), NEW).tokens)


def test_smollm2_int4_native_step(smollm2_int4):
    _check_native(smollm2_int4, _ids(24, 49152), new=16)


def test_stop_tokens_end_the_generation():
    model = _model()
    dec = LlamaDecoder(model, path="torch")
    full = dec.generate(_ids(), 20)
    tokens = full.tokens[0].tolist()
    k = 5
    stop = tokens[k]
    first = tokens.index(stop)  # the first occurrence ends it
    got = dec.generate(_ids(), 20, stop=[stop, 10_000])
    assert got.tokens[0].tolist() == tokens[:first + 1] and got.decode_steps == first
    assert dec.generate(_ids(), 20, stop=tokens[0]).tokens[0].tolist() == tokens[:1]
    assert torch.equal(dec.generate(_ids(), 20, stop=()).tokens, full.tokens)


def test_norm_weights_of_another_dtype_than_the_stream():
    """float16 norm weights over a float32 stream (as a GGUF's F16 norms load): transformers'
    product promotes them, so does the torch path, and the native step takes them as float32."""
    model = _model()
    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.weight.data = m.weight.data.half()
    _check_exact(model, _ids())
    fb.quantize_model(model, "int4_g32")
    _check_native(model, _ids())


def test_a_head_dim_past_the_native_steps_limit_runs_the_torch_path():
    model = _model(num_attention_heads=1, num_key_value_heads=1, head_dim=576)
    fb.quantize_model(model, "int4_g32", tied="untie")
    dec = LlamaDecoder(model)
    assert "head_dim 576" in dec.native_reason()
    r = dec.generate(_ids(5), 3)
    assert dec.last_path == "torch"
    assert torch.equal(r.tokens, LlamaDecoder(model, path="torch").generate(_ids(5), 3).tokens)
    with pytest.raises(ValueError, match="head_dim 576"):
        LlamaDecoder(model, path="native").generate(_ids(5), 3)


def test_stop_takes_the_forms_token_ids_come_in():
    import numpy as np

    model = _model()
    dec = LlamaDecoder(model, path="torch")
    tokens = dec.generate(_ids(), 12).tokens[0].tolist()
    first = tokens[3]
    want = tokens[:tokens.index(first) + 1]
    for stop in (first, np.int64(first), torch.tensor(first), torch.tensor([first, 9999]), [first, None],
                 [[first, 9999]], (first,)):
        assert dec.generate(_ids(), 12, stop=stop).tokens[0].tolist() == want, stop
    for stop in (None, [], [None]):
        assert dec.generate(_ids(), 12, stop=stop).tokens[0].tolist() == tokens
    for stop in ("2", True, 1.5):
        with pytest.raises(TypeError, match="stop takes token ids"):
            dec.generate(_ids(), 12, stop=stop)


def test_last_path_says_torch_when_no_native_step_ran():
    model = _model()
    fb.quantize_model(model, "int4_g32", tied="untie")
    dec = LlamaDecoder(model)
    dec.generate(_ids(5), 1)  # the prompt only: torch ops
    assert dec.last_path == "torch"
    dec.generate(_ids(5), 2)
    assert dec.last_path == "native"
