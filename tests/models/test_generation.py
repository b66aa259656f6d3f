"""fewbits.models.generation: the timed greedy loop and the compiled static-cache path give the
tokens transformers' own greedy generate gives (no timing is checked here)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fewbits.models.generation import CompiledGenerator, GenerationResult, greedy_generate  # noqa: E402

NEW = 12


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)[:, ids.shape[1]:]
    return model, ids, ref


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_eager_loop_equals_generate(tiny, cache):
    model, ids, ref = tiny
    r = greedy_generate(model, ids, NEW, cache=cache)
    assert isinstance(r, GenerationResult)
    assert torch.equal(r.tokens, ref)
    assert r.prompt_tokens == ids.shape[1] and r.decode_steps == NEW - 1
    assert r.prefill_seconds > 0 and r.decode_seconds > 0


def _check_compiled(tiny, compile_prefill):
    model, ids, ref = tiny
    torch._dynamo.reset()
    gen = CompiledGenerator(model, ids.shape[1] + NEW + 4, compile_prefill=compile_prefill)
    first = gen.generate(ids, NEW)
    assert torch.equal(first.tokens, ref)
    assert gen.graph_breaks == {} and gen.graphs == (2 if compile_prefill else 1) and gen.compile_seconds > 0
    again = gen.generate(ids, NEW)
    assert torch.equal(again.tokens, ref)


def test_compiled_static_cache_equals_eager(tiny):
    """Compiled decode into a StaticCache (prefill eager): the same greedy tokens as eager, on a
    second call too (the cache reset, the graph reused), in one graph without breaks."""
    _check_compiled(tiny, compile_prefill=False)


@pytest.mark.slow  # two graphs compiled: ~15 s here
def test_compiled_prefill_too_equals_eager(tiny):
    _check_compiled(tiny, compile_prefill=True)


def test_compiled_quantized_model_equals_its_eager_tokens(tiny):
    """A fewbits int4 model compiled (each QuantLinear one torch.library op): one graph, no
    breaks, and the tokens of the same model run eagerly."""
    import copy

    import fewbits as fb

    model, ids, _ = tiny
    q = fb.quantize_model(copy.deepcopy(model), "int4_g32")
    eager = greedy_generate(q, ids, NEW)
    torch._dynamo.reset()
    gen = CompiledGenerator(q, ids.shape[1] + NEW)
    got = gen.generate(ids, NEW)
    assert torch.equal(got.tokens, eager.tokens)
    assert gen.graph_breaks == {} and got.graph_breaks == {} and gen.graphs == 1


def test_bad_arguments(tiny):
    model, ids, _ = tiny
    with pytest.raises(ValueError, match="batch 1"):
        greedy_generate(model, ids.repeat(2, 1), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(model, ids, 0)
    with pytest.raises(ValueError, match="cache"):
        greedy_generate(model, ids, 3, cache="paged")
    gen = CompiledGenerator(model, ids.shape[1] + 2)
    with pytest.raises(ValueError, match="max_cache_len"):
        gen.generate(ids, 5)
    model.train()
    try:
        with pytest.raises(ValueError, match="training mode"):
            greedy_generate(model, ids, 3)
    finally:
        model.eval()


def test_a_model_changed_after_the_generator_was_built_is_refused(tiny):
    """guards='generate' leaves dynamo's module guards out of each forward, so the generator
    checks the model itself at each generate(): a replaced parameter, a module put in training
    mode or a re-quantized layer is refused, never run through a stale graph."""
    import copy

    import fewbits as fb
    from fewbits.models import generation

    model, ids, ref = tiny
    m = copy.deepcopy(model)
    gen = CompiledGenerator(m, ids.shape[1] + NEW)
    assert gen.guards == ("generate" if generation._module_guards_skippable() else "dynamo")
    if gen.guards != "generate":
        pytest.skip("this torch cannot leave dynamo's module guards out")
    with torch.no_grad():
        m.model.norm.weight.mul_(1.0)  # values change nothing dynamo guards: allowed
    assert torch.equal(CompiledGenerator(m, ids.shape[1] + NEW).generate(ids, NEW).tokens, ref)
    m.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(m.model.layers[0].mlp.down_proj.weight.double())
    with pytest.raises(ValueError, match="model changed"):
        gen.generate(ids, NEW)
    q = fb.quantize_model(copy.deepcopy(model), "int4_g32")
    assert not any(mod.training for mod in q.modules())  # the quantized layers keep the model's mode
    gen = CompiledGenerator(q, ids.shape[1] + NEW)
    q.model.layers[1].self_attn.q_proj.train()
    with pytest.raises(ValueError, match="model changed"):
        gen.generate(ids, NEW)
    q.model.layers[1].self_attn.q_proj.eval()
    for change in (lambda: setattr(q.model.layers[0].mlp, "act_fn", torch.nn.GELU()),  # a module replaced
                   lambda: setattr(q.model.layers[1].self_attn, "scaling", 0.5),        # a plain attribute
                   lambda: setattr(q.config, "rms_norm_eps", 1e-3)):                    # the config
        gen = CompiledGenerator(q, ids.shape[1] + NEW)
        change()
        with pytest.raises(ValueError, match="model changed"):
            gen.generate(ids, NEW)
    gen = CompiledGenerator(q, ids.shape[1] + NEW)
    layer = q.model.layers[0].mlp.up_proj
    layer.load_state_dict(layer.state_dict())  # the quantized weight rebuilt: a new kernel layout
    with pytest.raises(ValueError, match="model changed"):
        gen.generate(ids, NEW)


def test_generators_of_different_models_share_no_graph(tiny):
    """Without the module guards (the model's identity among them) a graph compiled for one model
    must not serve another: each generator compiles its own."""
    import copy

    import fewbits as fb

    model, ids, ref = tiny
    q = fb.quantize_model(copy.deepcopy(model), "int4_g32")
    q_tokens = greedy_generate(q, ids, NEW).tokens
    for m, want in ((q, q_tokens), (model, ref), (q, q_tokens), (copy.deepcopy(model), ref)):
        assert torch.equal(CompiledGenerator(m, ids.shape[1] + NEW).generate(ids, NEW).tokens, want)


def test_dynamos_own_guards_on_request(tiny):
    model, ids, ref = tiny
    torch._dynamo.reset()
    gen = CompiledGenerator(model, ids.shape[1] + NEW, guards="dynamo")
    assert gen.guards == "dynamo"
    assert torch.equal(gen.generate(ids, NEW).tokens, ref)
    with pytest.raises(ValueError, match="guards"):
        CompiledGenerator(model, ids.shape[1] + NEW, guards="none")


def _hook(m):
    m.model.norm.register_forward_hook(lambda mod, args, out: -out)


def _class_swap(m):
    class Negate(torch.nn.Module):
        def forward(self, x):
            return -4.0 * x

    m.model.layers[0].mlp.act_fn.__class__ = Negate


def _attn_impl(m):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def scaled(module, q, k, v, mask, **kw):
        out, w = sdpa_attention_forward(module, q, k, v, mask, **kw)
        return out * 5.0, w

    AttentionInterface.register("fewbits_test_scaled", scaled)
    m.set_attn_implementation("fewbits_test_scaled")  # config._attn_implementation: not in config.to_dict()


@pytest.mark.parametrize("change", [_hook, _class_swap, _attn_impl, "class_forward"],
                         ids=["forward_hook", "class_swap", "attn_implementation", "class_forward"])
def test_a_changed_model_is_refused_or_runs_its_new_graph(tiny, change):
    """Whatever changes the model's eager tokens after the generator was built must either be
    refused (ValueError) or reach the compiled graph: never the old graph's tokens."""
    import copy

    from fewbits.models import generation
    from transformers.models.llama import modeling_llama

    if not generation._module_guards_skippable():
        pytest.skip("this torch cannot leave dynamo's module guards out")
    model, ids, ref = tiny
    m = copy.deepcopy(model)
    gen = CompiledGenerator(m, ids.shape[1] + NEW)
    assert torch.equal(gen.generate(ids, NEW).tokens, ref)
    orig = modeling_llama.LlamaMLP.forward
    try:
        if change == "class_forward":  # a class's forward patched (as kernel libraries do)
            modeling_llama.LlamaMLP.forward = lambda self, x: 3.0 * orig(self, x)
        else:
            change(m)
        want = greedy_generate(m, ids, NEW).tokens
        assert not torch.equal(want, ref)  # the change matters
        assert torch.equal(greedy_generate(m, ids, NEW, cache="static").tokens, want)
        try:
            got = gen.generate(ids, NEW).tokens
        except ValueError as e:
            assert "model changed" in str(e)
        else:
            assert torch.equal(got, want)
    finally:
        modeling_llama.LlamaMLP.forward = orig


def test_next_token_is_argmax_with_ties_and_nans():
    from fewbits.models.generation import _next_token

    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 16, 100, 49152):
        for trial in range(40):
            x = torch.randint(0, 4, (1, 3, n), generator=g).float()  # many ties
            if trial % 4 == 0:
                x[0, -1, torch.randint(0, n, (1,), generator=g)] = float("nan")
            assert torch.equal(_next_token(x), x[:, -1, :].argmax(dim=-1, keepdim=True))


def test_the_garbage_collector_is_off_in_the_loop_and_restored(tiny):
    import gc

    from fewbits.models.generation import _loop

    model, ids, ref = tiny
    seen = []

    def forward(i, p, cache):
        seen.append(gc.isenabled())
        return model(input_ids=i, position_ids=p, cache=cache, use_cache=True, logits_to_keep=1).logits

    from transformers import DynamicCache

    assert gc.isenabled()
    r = _loop(forward, ids, NEW, DynamicCache(config=model.config))
    assert torch.equal(r.tokens, ref) and seen == [False] * NEW and gc.isenabled()
    gc.disable()
    try:
        _loop(forward, ids, 2, DynamicCache(config=model.config))
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()

    def failing(i, p, cache):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _loop(failing, ids, 2, None)
    assert gc.isenabled()
