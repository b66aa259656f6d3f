"""`fewbits bench`: this machine's memory bandwidth and matmul speed per precision, rooflines,
known accelerators, and quantized layer speed beside the installed peers."""
from __future__ import annotations

from ..progress import Lines
from .common import check_plot, emit_json, render_table, wrote


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="this machine's memory bandwidth and matmul speed per precision, rooflines, "
                                     "quantized layer speed beside bitsandbytes and torchao",
                       description="Measure memory bandwidth and matmul throughput per dtype (fp32, tf32, bf16, "
                                   "fp16, fp8, int8) as ratios to fp32, place matmul shapes on the roofline, "
                                   "list known accelerator peaks, and time a 4096 x 4096 Linear in fewbits' "
                                   "schemes beside the installed peers (one interleaved run, ratios to fp32). "
                                   "About a minute by default.")
    p.add_argument("--shape", action="append", metavar="MxNxK",
                   help="matmul shape(s) to place on the roofline, repeatable (default 1x4096x4096 and "
                        "512x4096x4096)")
    p.add_argument("--dtypes", metavar="A,B", help="only these (fp32,tf32,bf16,fp16,fp8,int8)")
    p.add_argument("--budget", type=float, default=1.5, metavar="SECONDS", help="time per probe (default 1.5)")
    p.add_argument("--buffer-mb", type=int, default=256, metavar="MIB",
                   help="bandwidth probe buffer (default 256; keep it above the caches)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--layer-dim", type=int, default=4096, metavar="N",
                   help="layer speed: a Linear(N, N) in fp32, bf16 and fewbits' schemes beside the installed "
                        "peers (bitsandbytes, torchao, quantize_dynamic) (default 4096)")
    p.add_argument("--layer-batches", default="1,64", metavar="B,B", help="layer speed batch sizes (default 1,64)")
    p.add_argument("--layer-peers", metavar="A,B", help="layer speed peers by label, comma-separated, or none "
                                                         "(default: fewbits.study.layer_speed.BENCH_PEERS)")
    p.add_argument("--no-layers", action="store_true", help="skip the layer speed section")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the rooflines")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args, out) -> int:
    from ..hardware import MATMUL_DTYPES, MatmulShape, check_device, run_bench

    shapes = [MatmulShape.parse(s) for s in (args.shape or ["1x4096x4096", "512x4096x4096"])]
    dtypes = [d.strip() for d in (args.dtypes or ",".join(MATMUL_DTYPES)).split(",") if d.strip()]
    if args.budget <= 0 or args.buffer_mb <= 0:
        raise ValueError(f"--budget and --buffer-mb must be positive, got {args.budget} and {args.buffer_mb}")
    check_device(args.device)
    check_plot(args)
    layer_batches = _layer_batches(args)
    peers = _layer_peers(args)
    say = Lines("fewbits bench", enabled=not args.json)
    res = run_bench(shapes, dtypes, budget_s=args.budget, device=args.device, buffer_mb=args.buffer_mb,
                    progress=say)
    layers = None
    if layer_batches and _device_type(args.device) == "cpu":
        from ..study.layer_speed import BENCH_FEWBITS, layer_speed, linear_stack

        layers = layer_speed(linear_stack(args.layer_dim, layers=1), layer_batches, BENCH_FEWBITS, peers,
                             budget_s=args.budget, progress=say)
    if args.json:
        emit_json(dict(res.as_dict(), layer_speed=layers), out)
    else:
        text = _bench_text(res)
        if layers is not None:
            from ..study.layer_speed import layer_speed_text

            text += "\n\n" + layer_speed_text(layers, render_table) + \
                f"\nrel err: ||y - y_fp32|| / ||y_fp32|| at batch {layer_batches[0]}. Measured in {layers['seconds']:.0f} s."
        elif layer_batches:
            text += "\n\nlayer speed: measured on the CPU only (--device cpu)"
        print(text, file=out)
    if args.plot:
        from ..study.hardware_figures import save_roofline_figure

        save_roofline_figure(res, args.plot)
        wrote(args, out)
    return 0


def _bench_text(res) -> str:
    from ..hardware import KNOWN_ACCELERATORS

    m, bw = res.machine, res.bandwidth
    flags = ", ".join(m.get("matmul_flags", [])) or "—"
    lines = [f"this machine: {m['name']}; {m['threads']} threads; torch {m['torch']}"
             + (f"; {m['cpu_capability']} ({flags})" if "cpu_capability" in m else "")
             + (f"; fused C kernels: {m['native_kernels']}" if "native_kernels" in m else ""),
             f"memory bandwidth: {bw.copy_gbs:.3g} GB/s copy (read + write of a {bw.buffer_bytes / 2 ** 20:.0f} MiB "
             f"buffer), {bw.read_gbs:.3g} GB/s read (sum)", ""]
    rows = [[d, s.kernel or "—", s.n or "—", f"{s.gflops:.3g}" if s.available else "—",
             f"{s.ratio:.2f}" if s.ratio is not None else "—", s.note] for d, s in res.matmuls.items()]
    lines += ["matmul throughput, n x n x n, best call:",
              render_table(["dtype", "kernel", "n", "GFLOP/s", "x fp32", "note"], rows, right={2, 3, 4}), ""]
    rows = []
    for r in res.shapes:
        acc = r["accelerators"]
        n_bw = sum(v == "bandwidth" for v in acc.values())
        on_acc = "—" if not acc else ("bandwidth on all" if n_bw == len(acc) else
                                      "compute on all" if n_bw == 0 else f"bandwidth on {n_bw} of {len(acc)}")
        rows.append([r["shape"], r["dtype"], f"{r['intensity']:.3g}", f"{r['ridge']:.3g}", r["bound"],
                     f"{r['attainable_gflops']:.3g}",
                     "—" if r["measured_gflops"] is None else f"{r['measured_gflops']:.3g}", on_acc])
    lines += [f"roofline (shape MxNxK: M tokens through a K x N weight; bandwidth {bw.copy_gbs:.3g} GB/s):",
              render_table(["shape", "dtype", "op/byte", "ridge", "bound here", "roofline GFLOP/s",
                            "measured", "known accelerators"], rows, right={2, 3, 5, 6}), ""]
    rows = [[a.name, f"{a.memory_gb:g}", f"{a.bandwidth_gbs:g}"] +
            ["—" if a.peak(d) is None else f"{a.peak(d):g}" for d in ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")]
            + [f"{a.ridge('bf16'):.0f}" if a.bf16 else "—", a.note] for a in KNOWN_ACCELERATORS]
    lines += ["known accelerators: dense peaks in TFLOP/s (int8: TOP/s), memory in GB, bandwidth in GB/s:",
              render_table(["accelerator", "memory", "GB/s", "fp32", "tf32", "fp16", "bf16", "fp8", "int8",
                            "bf16 ridge", "note"], rows, right=set(range(1, 10))),
              "", f"int8 counts integer operations (GOP/s, TOP/s). x fp32: throughput relative to fp32 here. ridge: "
                  f"operations per byte above which a matmul is compute-bound. Measured in {res.seconds:.0f} s."]
    return "\n".join(lines)


def _device_type(device: str) -> str:
    import torch

    return torch.device(device).type


def _layer_batches(args) -> list[int]:
    if args.no_layers:
        return []
    try:
        batches = [int(b) for b in args.layer_batches.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) <= 0:
        raise ValueError(f"--layer-batches takes positive integers such as 1,64, got {args.layer_batches!r}")
    if args.layer_dim <= 0:
        raise ValueError(f"--layer-dim must be positive, got {args.layer_dim}")
    return batches


def _layer_peers(args) -> list[str]:
    from ..study.layer_speed import BENCH_PEERS, PEERS_BY_LABEL

    if args.layer_peers is None:
        return list(BENCH_PEERS)
    if args.layer_peers.strip().lower() == "none":
        return []
    peers = [p.strip() for p in args.layer_peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS_BY_LABEL]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(map(repr, unknown))} for --layer-peers; choose from "
                         f"{', '.join(PEERS_BY_LABEL)}")
    return peers
