"""LlamaDecoder and the greedy loop under threads and at absurd lengths: concurrent generate()
calls on one decoder each get the tokens of a serial run; a generation whose KV cache cannot
fit in memory is refused with a ValueError before anything is allocated, whatever the model's
configuration allows. No timing is checked here."""
from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("transformers")

import fewbits as fb  # noqa: E402
from fewbits.models import generation  # noqa: E402
from fewbits.models.decoder import LlamaDecoder  # noqa: E402
from fewbits.models.generation import CompiledGenerator, greedy_generate, kv_cache_bytes  # noqa: E402
from together import together  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def _model(**overrides):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, **overrides})
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


def _prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("path,scheme", [("torch", None), ("auto", "int4_g32")])
def test_concurrent_generate_on_one_decoder_gives_each_the_serial_tokens(path, scheme):
    model = _model()
    if scheme:
        fb.quantize_model(model, scheme)
    dec = LlamaDecoder(model, path=path)
    # different prompt lengths and lengths of generation: a shared cache would be overwritten
    # at the positions another call is reading
    prompts = [_prompt(i, 3 + 2 * i) for i in range(8)]
    lengths = [10 + 3 * i for i in range(8)]
    serial = [dec.generate(p, n).tokens for p, n in zip(prompts, lengths)]
    for _ in range(2):
        got = together([lambda i=i: dec.generate(prompts[i], lengths[i]).tokens for i in range(8)])
        assert [torch.equal(a, b) for a, b in zip(got, serial)] == [True] * 8
    steps = together([lambda i=i: dec.step_logits(prompts[i], serial[i]) for i in range(8)])
    for i, logits in enumerate(steps):
        assert torch.equal(torch.cat([x[:, -1].max(-1).indices for x in logits]), serial[i][0])


def test_a_decoder_per_thread_over_one_model_runs_at_the_same_time():
    model = _model()
    fb.quantize_model(model, "int4_g32")
    prompts = [_prompt(i, 4 + i) for i in range(4)]
    serial = [LlamaDecoder(model).generate(p, 16).tokens for p in prompts]
    got = together([lambda i=i: LlamaDecoder(model).generate(prompts[i], 16).tokens for i in range(4)])
    assert [torch.equal(a, b) for a, b in zip(got, serial)] == [True] * 4


def test_a_cache_past_memory_is_refused_before_allocating():
    # a configuration that allows 2^31 positions and a generation of a billion tokens: 2 layers
    # x 2 (k, v) x 2 kv heads x 16 x 1e9 positions x 4 bytes = 512 GB of cache
    model = _model(max_position_embeddings=2 ** 31)
    dec = LlamaDecoder(model)
    with pytest.raises(ValueError, match="memory") as e:
        dec.generate(_prompt(0, 5), 10 ** 9)
    assert "1000000005 positions" in str(e.value) and "max_new_tokens" in str(e.value)
    assert dec._k is None  # nothing allocated
    with pytest.raises(ValueError, match="memory"):
        dec.step_logits(_prompt(0, 5), torch.zeros(1, 1, dtype=torch.long).expand(1, 10 ** 9))
    # the decoder still works, with a cache of what this generation needs
    assert torch.equal(dec.generate(_prompt(0, 5), 7).tokens, greedy_generate(model, _prompt(0, 5), 7).tokens)
    assert dec._k.shape[3] == 12


def test_the_cache_is_compared_with_the_memory_available(monkeypatch):
    model = _model(max_position_embeddings=4096)
    need = kv_cache_bytes(model.config, 1000, torch.float32)
    assert need == 2 * 2 * 2 * 16 * 1000 * 4
    monkeypatch.setattr(generation, "available_memory", lambda: need // 2)
    with pytest.raises(ValueError, match=r"memory.*available"):
        LlamaDecoder(model).generate(_prompt(0, 10), 990)
    with pytest.raises(ValueError, match=r"memory.*available"):
        greedy_generate(model, _prompt(0, 10), 990, cache="static")
    with pytest.raises(ValueError, match=r"memory.*available"):
        CompiledGenerator(model, max_cache_len=1000)
    monkeypatch.setattr(generation, "available_memory", lambda: need * 4)
    ref = greedy_generate(model, _prompt(0, 10), 20)
    assert torch.equal(LlamaDecoder(model).generate(_prompt(0, 10), 20).tokens, ref.tokens)


def test_available_memory_is_a_positive_count_of_bytes():
    avail = generation.available_memory()
    assert avail is None or (isinstance(avail, int) and avail > 0)


def test_the_token_buffer_grows_with_what_is_generated():
    # the loop's buffer of new tokens is not sized by max_new_tokens up front (8 GB here)
    model = _model(max_position_embeddings=2 ** 31)
    seen = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        seen.append(shape)
        return real_empty(*shape, **kw)

    eos = int(greedy_generate(model, _prompt(3, 4), 3).tokens[0, 2])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation.torch, "empty", empty)
        from transformers import DynamicCache

        out = generation._loop(generation._eager_forward(model), _prompt(3, 4), 10 ** 9,
                               DynamicCache(config=model.config), stop=frozenset([eos]))
    assert out.tokens.shape[1] <= 3
    assert all(s[-1] < 10 ** 6 for s in seen if s and isinstance(s[-1], int))


# ---------------------------------------------------------------------------------------------
# threads="auto": the thread count chosen by measuring, the tokens unchanged
# ---------------------------------------------------------------------------------------------
def _feed(chooser, step_seconds: dict, steps: int) -> list[int]:
    """Run `steps` steps through the chooser, each taking step_seconds[threads]; the counts used."""
    used = []
    for _ in range(steps):
        threads = chooser.next()
        used.append(threads)
        chooser.done(threads, step_seconds[threads])
    return used


def test_the_chooser_moves_to_the_count_that_runs_faster_and_back():
    from fewbits.models.decoder import _ThreadChooser

    before = torch.get_num_threads()
    try:
        chooser = _ThreadChooser(2, 2)
        # busy cores: two threads take 0.5 s a step, one 0.02 s
        used = _feed(chooser, {2: 0.5, 1: 0.02}, 400)
        assert chooser.current == 1 and used[-50:] == [1] * 50
        slow = sum(0.5 for t in used if t == 2)
        assert slow <= 0.5 * 6  # the first steps and one probe, not more
        # the load goes: two threads take 0.01 s; a later probe finds it
        used = _feed(chooser, {2: 0.01, 1: 0.02}, 4000)
        assert chooser.current == 2 and used[-50:] == [2] * 50
        # probing costs little: the slower count runs a few percent of the steps at most
        used = _feed(chooser, {2: 0.01, 1: 0.02}, 4000)
        assert used.count(1) < 0.05 * len(used)
        # other work comes: the steps at two threads become slow; fewer threads are tried at once
        _feed(chooser, {2: 0.01, 1: 0.02}, 100)
        used = _feed(chooser, {2: 0.5, 1: 0.02}, 200)
        assert chooser.current == 1 and used.count(2) <= 6
        # slower, but still the faster count: it stays, without probing at every step
        chooser = _ThreadChooser(2, 2)
        _feed(chooser, {2: 0.01, 1: 0.02}, 200)
        used = _feed(chooser, {2: 0.05, 1: 0.1}, 2000)
        assert chooser.current == 2 and used.count(1) < 0.05 * len(used)
        # noise within SWITCH does not move it
        assert set(_feed(_ThreadChooser(2, 2), {2: 0.010, 1: 0.0095}, 2000)) >= {2}
        assert _ThreadChooser(2, 2).current == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("start", [1, 2])
def test_auto_threads_give_the_same_tokens_on_the_native_path(monkeypatch, start):
    from fewbits.models import decoder as decoder_module

    model = _model()
    fb.quantize_model(model, "int4_g32")
    prompt = _prompt(5, 7)
    before = torch.get_num_threads()
    fixed = LlamaDecoder(model, threads=1).generate(prompt, 60).tokens
    monkeypatch.setattr(decoder_module, "threads_for_load", lambda threads=None, window=0.1: min(start, threads))
    monkeypatch.setattr(decoder_module._ThreadChooser, "BUDGET", 0.0)  # probe all the time: counts alternate
    torch.set_num_threads(2)
    try:
        dec = LlamaDecoder(model, threads="auto")
        got = dec.generate(prompt, 60)
        assert torch.get_num_threads() == 2  # torch's count restored
    finally:
        torch.set_num_threads(before)
    if dec.last_path != "native":
        pytest.skip("no native decode step here")
    assert torch.equal(got.tokens, fixed)
    assert sum(dec.last_threads.values()) == 59 and set(dec.last_threads) == {1, 2}


def test_auto_threads_on_the_torch_path_keep_torchs_count(monkeypatch):
    """The torch path's last bits may depend on the thread count, so its tokens would depend on the
    machine's load if "auto" chose a count there (review): it keeps torch's count."""
    from fewbits.models import decoder as decoder_module

    model = _model()
    before = torch.get_num_threads()
    monkeypatch.setattr(decoder_module, "threads_for_load", lambda threads=None, window=0.1: 1)
    dec = LlamaDecoder(model, path="torch", threads="auto")
    got = dec.generate(_prompt(2, 6), 12)
    assert dec.last_threads == {before: 11} and torch.get_num_threads() == before
    assert torch.equal(got.tokens, greedy_generate(model, _prompt(2, 6), 12).tokens)
    assert LlamaDecoder(model, threads=None).threads is None
    for bad in (0, -1, True, "many", 1.5):
        with pytest.raises(ValueError, match="threads"):
            LlamaDecoder(model, threads=bad)


def test_decoders_setting_the_thread_count_in_threads_leave_it_as_it_was():
    """torch's count is the process's, and a new thread starts from the last one set: two decoders
    each setting their own count in threads left the other's behind for good (review). Only the
    main thread sets it."""
    import threading

    model = _model()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        decoders = [LlamaDecoder(model, path="torch", threads=n) for n in (1, 2, 1, 2)]
        runs = [threading.Thread(target=lambda d=d: d.generate(_prompt(2, 6), 40)) for d in decoders]
        for t in runs:
            t.start()
        for t in runs:
            t.join()
        assert [d.last_threads for d in decoders] == [{2: 39}] * 4  # run at the count in force
        decoders[0].generate(_prompt(2, 6), 5)  # from the main thread: its own count, then put back
        assert decoders[0].last_threads == {1: 4}
        seen = []
        probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        probe.start()
        probe.join()
        assert torch.get_num_threads() == 2 and seen == [2]
    finally:
        torch.set_num_threads(before)


def test_the_load_measure_is_a_count_of_cpus():
    from fewbits.models.decoder import busy_elsewhere, threads_for_load

    busy = busy_elsewhere(0.02)
    assert busy is None or busy >= 0.0
    assert 1 <= threads_for_load(2, window=0.02) <= 2
    assert threads_for_load(1, window=0.02) == 1


def test_fewbits_generate_refuses_a_cache_past_memory_and_runs_a_normal_one(tmp_path):
    # was: `fewbits generate` on a model whose config allows 2^31 positions, with
    # --max-new-tokens 1000000000, went to allocate hundreds of gigabytes
    import contextlib
    import io
    import json

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fewbits.cli import main
    from fewbits.models import synthetic_llama_config, write_synthetic_llama

    path = tmp_path / "m"
    write_synthetic_llama(path, synthetic_llama_config("135m", hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, vocab_size=384,
                                                       max_position_embeddings=2 ** 31))
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["generate", str(path), "--prompt", "the", "--quiet", *argv])
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = run("--max-new-tokens", "1000000000")
    assert rc == 2 and "memory" in err and "max_new_tokens=1000000000" in err and "unexpected" not in err
    before = torch.get_num_threads()
    rc, out, err = run("--max-new-tokens", "6", "--no-stop", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["new_tokens"] == 6 and 1 <= info["threads"] <= before
    assert torch.get_num_threads() == before  # threads="auto" leaves torch's count as it was
