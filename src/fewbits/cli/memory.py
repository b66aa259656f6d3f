"""`fewbits memory MODEL`: the predicted memory of a model in a precision, per component and at
the peak, or a table of common choices."""
from __future__ import annotations

from .common import emit_json, render_table


_MEMORY_SCHEMES = ("fp32", "bf16", "int8", "int4", "nf4_dq", "mxfp4", "nvfp4")
_MEMORY_POLICIES = ("fp32", "bf16-mixed", "bf16-pure", "fp8-hybrid", "bf16-mixed-8bit-adam")
_MEMORY_LABELS = {"weights": "weights", "master_weights": "master weights", "gradients": "gradients",
                  "optimizer_states": "optimizer states", "activations": "activations",
                  "kv_cache": "kv cache", "workspace": "workspace"}


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="memory of a model in a precision: weights, gradients, optimizer, "
                                      "activations, KV cache",
                       description="Predicted memory of a model (a parameter count such as 7B or 135M, or a "
                                   "Hugging Face config.json) for inference or a training step, per component "
                                   "and at the peak. Without --scheme or --policy: a table of common choices.")
    p.add_argument("model", metavar="MODEL", help="parameter count (7B, 1.5B, 135M, 7000000000) or a config.json "
                                                  "(or its directory) of a llama-like or bert-like model")
    p.add_argument("--mode", choices=("inference", "training"), default="inference")
    p.add_argument("--scheme", metavar="NAME", help="weight storage: a quantization preset as `fewbits quantize` "
                   "stores it, scales included (int8, int4, nf4, nf4_dq, mxfp4, nvfp4, int4_g32, ...; see "
                   "`fewbits quantize --list`), or a float format held plainly (fp32, bf16, fp16, tf32)")
    p.add_argument("--policy", metavar="NAME", help="a training policy preset (fp32, bf16-mixed, bf16-pure, "
                   "fp8-hybrid, ...)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, adamw8bit, lion, sgd, "
                                                        "sgd_momentum, adafactor")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 512, or a bert-like model's "
                                                "positions if fewer)")
    p.add_argument("--runtime", choices=("torch", "fewbits"), default="torch",
                   help="torch: stock PyTorch (autocast for mixed policies); fewbits: fewbits.train.Engine")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="kernels differ (default cpu)")
    p.add_argument("--rest-format", default="bf16", metavar="FMT",
                   help="storage of embeddings and norms under a quantization preset (default bf16)")
    p.add_argument("--logits", choices=("all", "last"), default="all",
                   help="inference: score every position (all, default) or only the last (generation)")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    p.set_defaults(func=run)


def run(args, out) -> int:
    from ..memory import estimate_memory

    common = dict(mode=args.mode, optimizer=args.optimizer, batch=args.batch, seq_len=args.seq_len,
                  runtime=args.runtime, device=args.device, rest_format=args.rest_format, logits=args.logits)
    if args.scheme or args.policy:
        est = estimate_memory(args.model, scheme=args.scheme, policy=args.policy, **common)
        if args.json:
            emit_json(est.as_dict(), out)
        else:
            print(_memory_breakdown_text(est), file=out)
        return 0
    if args.mode == "training":
        ests = [estimate_memory(args.model, policy=p, **common) for p in _MEMORY_POLICIES]
    else:
        ests = [estimate_memory(args.model, scheme=s, **common) for s in _MEMORY_SCHEMES]
    if args.json:
        emit_json([e.as_dict() for e in ests], out)
    else:
        print(_memory_compare_text(ests), file=out)
    return 0


def _memory_heading(est) -> str:
    what = f"{est.model}: {est.parameters:,} parameters"
    if est.architecture:
        what += f"; {est.architecture}"
    run = f"{est.mode}, batch {est.batch} x {est.seq_len} tokens"
    if est.optimizer:
        run += f", optimizer {est.optimizer}"
    return f"{what}\n{run}"


def _memory_breakdown_text(est) -> str:
    from ..memory import format_bytes

    rows = [[_MEMORY_LABELS[k], format_bytes(est.components[k]), format_bytes(est.at_peak[k])]
            for k in _MEMORY_LABELS]
    rows.append(["total (peak)", "", format_bytes(est.total)])
    lines = [_memory_heading(est), f"precision {est.precision}: {est.weight_bits:.3f} bits per parameter "
             "stored, scales included", "", render_table(["component", "size", "at peak"], rows, right={1, 2}),
             "", f"peak: {est.peak_phase}.  phases: " +
             "; ".join(f"{k} {format_bytes(v)}" for k, v in est.phases.items())]
    if any(est.workspace_parts.values()):
        lines.append("workspace: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                               for k, v in est.workspace_parts.items() if v))
    lines += [f"note: {n}" for n in est.notes]
    lines.append("size: each component in full; at peak: what is alive at the peak (they sum to the total). "
                 "GB = 10^9 bytes.")
    return "\n".join(lines)


def _memory_compare_text(ests) -> str:
    from ..memory import format_bytes

    training = ests[0].mode == "training"
    keys = [k for k in _MEMORY_LABELS if any(e.components[k] for e in ests)] or ["weights"]
    headers = ["policy" if training else "scheme", "bits/param"] + [_MEMORY_LABELS[k] for k in keys] + \
        ["total (peak)", "peak during"]
    rows = [[e.precision, f"{e.weight_bits:.3f}"] + [format_bytes(e.components[k]) for k in keys] +
            [format_bytes(e.total), e.peak_phase] for e in ests]
    notes = sorted({n for e in ests for n in e.notes})
    return "\n".join([_memory_heading(ests[0]), "", render_table(headers, rows, right=set(range(1, len(keys) + 3)))] +
                     [f"note: {n}" for n in notes] +
                     ["Components in full; the total is the peak of what is alive at once. GB = 10^9 bytes. "
                      "One of them in detail: --scheme NAME or --policy NAME."])
