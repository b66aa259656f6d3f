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
