"""`fewbits train`: a built-in task trained under one precision policy, or several compared."""
from __future__ import annotations

import sys

from ..progress import Every
from .common import check_plot, emit_json, render_table


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a built-in task under precision policies",
                       description="Train a small GPT-style LM on Python's pydoc_data text (--task lm) or an "
                                   "MLP on scikit-learn's digits (--task mlp) under a precision policy, or "
                                   "compare several: final loss, step time, memory, skipped steps, underflow "
                                   "and lost updates, with a loss-curve plot.")
    p.add_argument("--policy", metavar="NAME", help="a policy preset (default bf16-mixed): "
                   "fp32, tf32, bf16-mixed, fp16-mixed, fp8-hybrid, fp8-rowwise, mxfp8, int8-mixed, "
                   "int8-mixed-gw8, bf16-pure, bf16-pure-sr, bf16-pure-kahan, ...")
    p.add_argument("--compare", metavar="P1,P2,...", help="several policies: a table and a loss-curve PNG")
    p.add_argument("--task", choices=("lm", "mlp"), default="mlp", help="lm or mlp (default mlp)")
    p.add_argument("--steps", type=int, help="training steps (default: lm 20, mlp 300)")
    p.add_argument("--batch-size", type=int, help="default: lm 16, mlp 128")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, help="lm width (default 512)")
    p.add_argument("--layers", type=int, help="lm layers (default 4)")
    p.add_argument("--heads", type=int, help="lm attention heads (default 8)")
    p.add_argument("--seq", type=int, help="lm sequence length (default 256)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--telemetry-every", type=int, default=10, metavar="N", help="sample numerics every N steps")
    p.add_argument("--plot", metavar="FILE.png", help="loss-curve plot (default with --compare and without "
                                                      "--json: train_compare_TASK.png)")
    p.add_argument("--histogram", metavar="FILE.png", help="exponent histograms of one policy's tensors")
    p.add_argument("--layers-detail", action="store_true", help="per-layer telemetry in the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args, out) -> int:
    from ..train import Policy, Telemetry
    from ..study.charts import save_histogram_figure, save_loss_figure
    from ..study.tasks import TaskConfig, run_task

    names = [n.strip() for n in (args.compare or args.policy or "bf16-mixed").split(",") if n.strip()]
    policies = [Policy.preset(n) for n in names]  # ValueError (exit 2) for an unknown name
    cfg = TaskConfig(args.task, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                     **{k: v for k, v in (("d_model", args.d_model), ("n_layers", args.layers),
                                          ("n_heads", args.heads), ("seq", args.seq)) if v is not None})
    if args.compare and not args.plot and not args.json:  # with --json, a picture only when --plot asks
        args.plot = f"train_compare_{cfg.task}.png"
    check_plot(args)
    if len(policies) == 1:
        check_plot(args, "histogram", "--histogram")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    results = []
    for pol in policies:
        if not args.json and not args.quiet:
            print(f"training {cfg.task} under {pol.name} for {cfg.steps} steps", file=sys.stderr, flush=True)
        tel = Telemetry(every=args.telemetry_every)
        r = run_task(pol, cfg, telemetry=tel, progress=_train_progress(args.quiet or args.json))
        r.pop("_engine")
        if args.histogram and len(policies) == 1:
            save_histogram_figure(tel, args.histogram, title=f"{cfg.task} under {pol.name}")
        r["layers"] = tel.layers() if args.layers_detail else None
        results.append(r)
    plot = args.plot
    if plot:
        save_loss_figure(results, plot, title=f"fewbits train --task {cfg.task}: loss by policy")
    if args.json:
        emit_json(results if args.compare else results[0], out)
    else:
        print(_train_table(results), file=out)
        print("step ms: median step time; peak MB: growth of the process's peak resident memory during the run; "
              "state MB: weights, masters, gradients and optimizer states held; underflow: non-zero gradients "
              "entering the backward matmuls that the format flushed to zero; lost updates: optimizer updates "
              "that did not change the stored weights (sampled every "
              f"{args.telemetry_every} steps).", file=out)
    for path in [p for p in (plot, args.histogram if len(policies) == 1 else None) if p]:
        print(f"wrote {path}", file=sys.stderr if args.json else out)
    return 0


def _train_progress(quiet: bool):
    """A progress callback printing to stderr about every 2 s (only runs longer than that show it)."""
    every = Every(2.0, last=True)

    def progress(step, total, loss):
        if not quiet and every.due(step, total):
            print(f"  step {step}/{total}  loss {loss:.4f}  ({every.elapsed:.0f}s)", file=sys.stderr, flush=True)
    return progress


def _train_table(results) -> str:
    def mb(v):
        return "—" if v is None else f"{v / 1e6:.1f}"
    rows = [[r["policy"], f"{r['final_loss']:.4f}", f"{r['step_time_s'] * 1e3:.1f}", mb(r["peak_memory_bytes"]),
             mb(r["state_bytes"]), r["skipped_steps"], f"{r['underflow_fraction']:.2%}",
             f"{r['lost_update_fraction']:.2%}", r.get("gemm_path", "")] for r in results]
    return render_table(["policy", "final loss", "step ms", "peak MB", "state MB", "skipped", "underflow",
                         "lost updates", "matmuls ran as"], rows, right=range(1, 8))
