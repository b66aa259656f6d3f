"""A tiny byte-level BPE tokenizer (256 byte tokens, "th", "the", an end-of-text token) saved
beside a synthetic Llama directory: the tokenizer the GGUF writer takes (llama.cpp's gpt2 vocabulary
with the gpt-2 pre-tokenizer), for the deployment tests."""
from __future__ import annotations


def save_byte_level_bpe(path) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"th": 256, "the": 257, "<|endoftext|>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("t", "h"), ("th", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
