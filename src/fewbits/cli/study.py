"""`fewbits study`: the study run on the built-in real models, its report written."""
from __future__ import annotations

import os

from .common import check_output_dir, emit_json, render_table


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="measure every precision on real models and write a report",
                       description="Run the study offline on the built-in real models: number formats, memory "
                                   "per format and training policy (estimated and measured), speed on this "
                                   "machine, quantization of MiniLM and SmolLM2, training under precision "
                                   "policies. Writes report.html with PNG figures and results.json. Exit code 1 "
                                   "when a part failed (the report says why; the others still ran).")
    p.add_argument("--quick", action="store_true", help="a short run for first contact and CI (minutes)")
    p.add_argument("--only", metavar="PARTS", help="comma-separated parts: formats,memory,speed,quant,train")
    p.add_argument("--out", default="fewbits-report", metavar="DIR", help="report directory (default fewbits-report)")
    p.add_argument("--model", metavar="PATH", help="your Hugging Face model directory for the memory and "
                                                   "quantization parts (instead of MiniLM and SmolLM2)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    p.set_defaults(func=run)


def run(args, out) -> int:
    from ..study.run import Progress, check_model_path, parse_parts, run_study

    parts = parse_parts(args.only)  # ValueError (exit 2) for an unknown part, before anything runs
    model = check_model_path(args.model) if args.model else None
    check_output_dir(args.out)
    study = run_study(out=args.out, quick=args.quick, parts=parts, model=model,
                      progress=Progress(enabled=not args.quiet))
    failed = [p for p in study["parts"] if p["status"] != "ok"]
    if args.json:
        emit_json({"report": study["report"], "results": os.path.join(args.out, "results.json"),
                   "seconds": study["seconds"],
                   "parts": [{"name": p["name"], "status": p["status"], "seconds": p["seconds"],
                              "error": p.get("error"), "figures": [f["file"] for f in p["figures"]]}
                             for p in study["parts"]]}, out)
    else:
        rows = [[p["name"], p["status"], f"{p['seconds']:.1f}", len(p["figures"]), len(p["tables"]),
                 p.get("error") or ""] for p in study["parts"]]
        print(render_table(["part", "status", "seconds", "figures", "tables", "error"], rows, right={2, 3, 4}),
              file=out)
        print(f"report: {study['report']} ({study['seconds']:.0f} s); every number in "
              f"{os.path.join(args.out, 'results.json')}", file=out)
    return 1 if failed else 0
