"""Quality of fewbits' GGUF files against llama.cpp at its best, on text neither was calibrated on,
judged by llama.cpp's own `llama-perplexity` with KL divergence to the float model.

    python benchmarks/bench_quality.py                        # 8 types x 5 makers, ~45 min here
    python benchmarks/bench_quality.py --types q4_0,q4_k_m --methods imatrix --json q.json --plot q.png

Needs llama.cpp's C++ tools (benchmarks/setup_llama_tools.sh builds them once, ~5 min) and the
Debian package `fortunes` (downloaded once with `apt-get download`, unpacked into
~/.cache/fewbits/texts; nothing is installed). On SmolLM2-135M:

- Calibration text: Python's pydoc topics (the training split, fewbits' default calibration
  text), the first --calib-samples windows of --calib-length tokens. Both sides get the same
  amount of the same text: llama.cpp's `llama-imatrix -c LENGTH --chunks SAMPLES` on the same
  file, fewbits' `--calibration FILE --calibration-samples SAMPLES --calibration-length LENGTH`.
- Evaluation text: another domain, never calibrated on: the English prose sections of Debian's
  `fortunes` (people, politics, science, wisdom, ...; the computer sections left out), the
  first --eval-chunks windows of 512 tokens. llama-perplexity writes the F32 model's logits once
  (--kl-divergence-base) and scores every file against them: perplexity, mean and 99th
  percentile KL divergence, and how often the top token is the float model's.
- Files, per GGUF type, all of the same tensor types (checked tensor by tensor) and so the same
  size: llama.cpp's `llama-quantize` without and with its importance matrix (`--imatrix`; the
  uniform types with `--pure`, as fewbits' uniform schemes are; the mixes with llama.cpp's own
  rules, which fewbits' q4_k_m / q5_k_m recipes reproduce), and `fewbits quantize smollm2
  --format gguf --method M` for each --methods M (rtn, imatrix, gptq).
- CAVEAT: SmolLM2's packaged weights are GGUF Q4_1 dequantized (fewbits.models.Q4_1_CAVEAT):
  types with a per-group minimum (Q4_1, Q5_1, the K mixes) can re-find that grid and come out
  near-lossless for whoever finds it; Q4_0, Q5_0, Q8_0 cannot. --finetune STEPS first moves the
  weights off that grid: STEPS steps of fp32 AdamW (--finetune-lr, 4 windows of 256 tokens a step) on a
  third text, the GPL and other licenses of /usr/share/common-licenses, and the whole
  benchmark runs on that genuinely float model (printed: how far off the grid it is, as the
  relative error of re-quantizing its matrices to Q4_1, against a fresh Gaussian's).

Prints the CPU, a table (type, maker, tensor types, bits/param, PPL, KLD mean / 99%, same top
%, KLD against llama.cpp + imatrix) and, with --plot, KLD against bits per parameter.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_gguf_decode import tools_dir  # noqa: E402

# type -> (llama-quantize type, --pure, fewbits --scheme)
TYPES = {
    "q4_0": ("Q4_0", True, "q4_0"), "q4_1": ("Q4_1", True, "q4_1"), "q5_0": ("Q5_0", True, "q5_0"),
    "q5_1": ("Q5_1", True, "q5_1"), "q8_0": ("Q8_0", True, "q8_0"), "q6_k": ("Q6_K", True, "q6_k"),
    "q4_k_m": ("Q4_K_M", False, "q4_k_m"), "q5_k_m": ("Q5_K_M", False, "q5_k_m"),
    # below 4 bits: llama-quantize's Q2_K is a mix (fewbits' q2_k_m; fewbits' q2_k is every tensor in Q2_K)
    "q2_k_m": ("Q2_K", False, "q2_k_m"), "q3_k_s": ("Q3_K_S", False, "q3_k_s"), "q3_k_m": ("Q3_K_M", False, "q3_k_m"),
    "q3_k_l": ("Q3_K_L", False, "q3_k_l"), "q2_k": ("Q2_K", True, "q2_k"), "q3_k": ("Q3_K", True, "q3_k"),
    "iq4_nl": ("IQ4_NL", True, "iq4_nl"),
}
METHODS = ("rtn", "imatrix", "gptq")
# the prose sections of Debian's fortunes (the computer, Linux, Debian and ASCII-art ones left out)
FORTUNE_SECTIONS = ("art", "education", "food", "humorists", "kids", "law", "love", "medicine",
                    "people", "pets", "platitudes", "politics", "science", "songs-poems", "sports", "wisdom", "work")
TEXTS = os.path.expanduser("~/.cache/fewbits/texts")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def fortunes_dir() -> str:
    """The unpacked `fortunes` package's text files, downloaded once (apt-get download + dpkg-deb -x)."""
    target = os.path.join(TEXTS, "fortunes")
    found = os.path.join(target, "usr", "share", "games", "fortunes")
    if os.path.isfile(os.path.join(found, "people")):
        return found
    os.makedirs(target, exist_ok=True)
    r = subprocess.run(["apt-get", "download", "fortunes"], cwd=target, capture_output=True, text=True)
    debs = glob.glob(os.path.join(target, "fortunes_*.deb"))
    if not debs:
        raise SystemExit("cannot download the Debian package fortunes (apt-get download fortunes):\n" + r.stderr[-1500:])
    subprocess.run(["dpkg-deb", "-x", debs[0], target], check=True)
    return found


def write_texts(work: str) -> tuple[str, str]:
    from fewbits.models.text import pydoc_split

    calib = os.path.join(work, "calibration-pydoc.txt")
    with open(calib, "w", encoding="utf-8") as f:
        f.write(pydoc_split().train)
    src = fortunes_dir()
    parts = []
    for name in FORTUNE_SECTIONS:
        with open(os.path.join(src, name), encoding="utf-8", errors="replace") as f:
            parts.append(f.read().replace("\n%\n", "\n\n"))
    evaluation = os.path.join(work, "evaluation-fortunes.txt")
    with open(evaluation, "w", encoding="utf-8") as f:
        f.write("\n\n".join(parts))
    return calib, evaluation


def model_directory(work: str, finetune: int, lr: float = 1e-3) -> str:
    """SmolLM2's HF directory: the packaged one, or a copy fine-tuned `finetune` steps at learning
    rate `lr` (cached)."""
    from fewbits.models import smollm2_directory

    src = str(smollm2_directory())
    if not finetune:
        return src
    out = os.path.join(work, f"smollm2-finetuned-{finetune}-lr{lr:g}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    text = "\n\n".join(open(p, encoding="utf-8", errors="replace").read()
                        for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p))
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    windows = ids[: ids.numel() // 256 * 256].reshape(-1, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(finetune):
        batch = windows[(step * 4) % len(windows):][:4]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        log(f"fine-tune step {step + 1}/{finetune}: loss {loss.item():.3f}")
    model.eval()
    part = out + ".part"
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part)
    tok.save_pretrained(part)
    os.replace(part, out)
    return out


def off_grid(directory: str) -> float:
    """Mean over the 2-d matrices of ||W - Q4_1(W)|| / ||W - Q4_1(G)||-normalized: the relative
    error of re-quantizing W to Q4_1, over that of a Gaussian matrix of the same shape (0: on
    Q4_1's grid, 1: as far off it as random floats)."""
    import torch

    from fewbits.files.hf_dir import read_tensors
    from fewbits.quant import quantize

    tensors = read_tensors(directory)
    ratios = []
    g = torch.Generator().manual_seed(0)
    for name in sorted(tensors):
        w = tensors[name]
        if w.dim() != 2 or "layers.3." not in name:  # one block's matrices: enough to tell
            continue
        w = w.to(torch.float32)
        rel = float((quantize(w, "q4_1").dequantize() - w).norm() / w.norm())
        r = torch.randn(w.shape, generator=g)
        ref = float((quantize(r, "q4_1").dequantize() - r).norm() / r.norm())
        ratios.append(rel / ref)
    return sum(ratios) / max(len(ratios), 1)


def f32_gguf(work: str, directory: str, tag: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_gguf import tensor_mapping
    from fewbits.files.gguf_file import write_gguf

    path = os.path.join(work, f"{tag}-f32.gguf")
    if not os.path.exists(path):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        write_gguf(path + ".part", tensor_mapping(model), model.config, AutoTokenizer.from_pretrained(directory),
                   overwrite=True, file_type="f32")
        os.replace(path + ".part", path)
    return path


def run(cmd, what: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{what} failed ({' '.join(cmd[:3])} ...):\n{(r.stderr or r.stdout)[-2500:]}")
    return r.stdout + r.stderr


def kl_scores(bins: str, path: str, base: str, threads: int) -> dict:
    out = run([os.path.join(bins, "llama-perplexity"), "-m", path, "--kl-divergence-base", base, "--kl-divergence",
               "-t", str(threads)], f"llama-perplexity on {os.path.basename(path)}")

    def number(pattern):
        m = re.search(pattern, out, re.M)
        if not m:
            raise SystemExit(f"llama-perplexity printed no {pattern!r} for {path}:\n{out[-1500:]}")
        return float(m.group(1))
    return {"ppl": number(r"^Mean PPL\(Q\)\s*:\s*([\d.]+)"), "kld": number(r"^Mean\s+KLD:\s*([\d.]+)"),
            "kld99": number(r"^99\.0%\s+KLD:\s*([\d.]+)"), "same_top": number(r"^Same top p:\s*([\d.]+)")}


def file_stats(path: str) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    params = sum(int(t.n_elements) for t in r.tensors)
    data = sum(int(t.n_bytes) for t in r.tensors)
    from collections import Counter
    c = Counter(v for k, v in types.items() if v != "F32")
    return {"types": types, "bits_per_param": data * 8 / params,
            "summary": " ".join(f"{k}x{n}" for k, n in sorted(c.items()))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-length", type=int, default=256)
    p.add_argument("--eval-chunks", type=int, default=32, help="windows of 512 tokens of the evaluation text")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tools", help="llama.cpp's bin directory (default: setup_llama_tools.sh's)")
    p.add_argument("--work", default=os.path.expanduser("~/.cache/fewbits/bench-quality"))
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write KLD against bits per parameter here (PNG)")
    p.add_argument("--finetune", type=int, default=0, metavar="STEPS",
                   help="first move SmolLM2 off its Q4_1 grid with STEPS steps of fp32 fine-tuning (see above)")
    p.add_argument("--finetune-lr", type=float, default=1e-3, help="the fine-tune's learning rate (default 1e-3)")
    p.add_argument("--table", metavar="JSON", help="only print the table of a saved --json result (a run stopped early)")
    p.add_argument("--no-llama", action="store_true", help="only fewbits' files (no llama-quantize files: the "
                   "ratio column is empty and the tensor types are checked among fewbits' files only; llama.cpp's "
                   "rows of the same types come from a run without it)")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print_table(json.load(f))
        return 0
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for t in types:
        if t not in TYPES:
            raise SystemExit(f"--types: unknown {t!r}; known: {', '.join(TYPES)}")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: unknown {m!r}; known: {', '.join(METHODS)}")
    os.makedirs(args.work, exist_ok=True)
    bins = tools_dir(args.tools)
    log(f"CPU: {cpu_name()}; llama.cpp tools: {bins}")
    calib, evaluation = write_texts(args.work)
    tag = f"smollm2-ft{args.finetune}-lr{args.finetune_lr:g}" if args.finetune else "smollm2"
    directory = model_directory(args.work, args.finetune, args.finetune_lr)
    grid = off_grid(directory)
    log(f"model: {tag} ({directory}); off Q4_1's grid: {grid:.3f} (0 on it, 1 as a Gaussian)")
    f32 = f32_gguf(args.work, directory, tag)
    base = os.path.join(args.work, f"{tag}-base-{args.eval_chunks}.kld")
    if not os.path.exists(base):
        log("llama-perplexity: the F32 model's logits on the evaluation text ...")
        run([os.path.join(bins, "llama-perplexity"), "-m", f32, "-f", evaluation, "-c", "512", "--chunks",
             str(args.eval_chunks), "-t", str(args.threads), "--kl-divergence-base", base + ".part"], "the base logits")
        os.replace(base + ".part", base)
    f32_scores = kl_scores(bins, f32, base, args.threads)
    log(f"F32: perplexity {f32_scores['ppl']:.3f} on {args.eval_chunks} x 512 tokens of fortunes")
    imatrix = os.path.join(args.work, f"{tag}-imatrix-{args.calib_samples}x{args.calib_length}.gguf")
    t0 = time.perf_counter()
    run([os.path.join(bins, "llama-imatrix"), "-m", f32, "-f", calib, "-c", str(args.calib_length), "--chunks",
         str(args.calib_samples), "-t", str(args.threads), "-o", imatrix], "llama-imatrix")
    imatrix_seconds = time.perf_counter() - t0
    rows = []
    result = {"cpu": cpu_name(), "model": tag, "off_grid": grid, "f32": f32_scores,
              "finetune": [args.finetune, args.finetune_lr] if args.finetune else None,
              "calibration": [args.calib_samples, args.calib_length], "eval_chunks": args.eval_chunks, "rows": rows}

    def save():  # after every row: a long run stopped early keeps what it measured
        if args.json:
            with open(args.json + ".part", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(args.json + ".part", args.json)

    for t in types:
        ltype, pure, scheme = TYPES[t]
        makers = [] if args.no_llama else [("llama.cpp", None), ("llama.cpp + imatrix", imatrix)]
        makers += [(f"fewbits {m}", m) for m in methods]
        ref_types = None
        for maker, how in makers:
            path = os.path.join(args.work, f"{tag}-{t}-{maker.replace(' ', '_').replace('+', 'plus')}.gguf")
            t0 = time.perf_counter()
            if maker.startswith("llama.cpp"):
                cmd = [os.path.join(bins, "llama-quantize")] + (["--pure"] if pure else [])
                cmd += (["--imatrix", how] if how else []) + [f32, path, ltype, str(args.threads)]
                run(cmd, f"llama-quantize {ltype}")
            else:
                cmd = [sys.executable, "-m", "fewbits.cli", "quantize", directory, "--scheme", scheme, "--format", "gguf",
                       "--method", how, "--out", path, "--overwrite", "--quiet"]
                if how != "rtn":
                    cmd += ["--calibration", calib, "--calibration-samples", str(args.calib_samples),
                            "--calibration-length", str(args.calib_length)]
                run(cmd, f"fewbits quantize {scheme} --method {how}")
            seconds = time.perf_counter() - t0 + (imatrix_seconds if how == imatrix else 0.0)
            stats = file_stats(path)
            if ref_types is None:
                ref_types = stats["types"]
            mismatched = sorted(n for n in set(ref_types) | set(stats["types"])
                                if ref_types.get(n) != stats["types"].get(n))
            row = {"type": t, "maker": maker, "tensor_types": stats["summary"], "bits_per_param": stats["bits_per_param"],
                   "types_match": not mismatched, "mismatched": mismatched[:5], "seconds": seconds,
                   **kl_scores(bins, path, base, args.threads)}
            rows.append(row)
            save()
            log(f"{t:7s} {maker:20s} {stats['summary']:28s} KLD {row['kld']:.4f}  PPL {row['ppl']:.3f}"
                + ("" if row["types_match"] else f"  TYPES DIFFER: {mismatched[:3]}"))
    save()
    print_table(result)
    if args.plot:
        plot(rows, args.plot, tag)
    return 0


def print_table(result: dict) -> None:
    """The markdown table of a run's result (as --json writes it)."""
    rows = result["rows"]
    best = {r["type"]: r["kld"] for r in rows if r["maker"] == "llama.cpp + imatrix"}
    ft = result.get("finetune")
    what = (f"fine-tuned {ft[0]} steps at lr {ft[1]:g}, {result['off_grid']:.2f} of the way off Q4_1's grid" if ft
            else "Q4_1-dequantized weights: see the caveat")
    samples, length = result["calibration"]
    print(f"# CPU: {result['cpu']}. SmolLM2-135M ({what}); calibration {samples} x {length} tokens of pydoc (both "
          f"sides); evaluation {result['eval_chunks']} x 512 tokens of Debian's fortunes; F32 perplexity "
          f"{result['f32']['ppl']:.3f}; scored by llama-perplexity")
    print("| type | maker | tensor types | bits/param | PPL | KLD | KLD 99% | same top % | KLD vs llama.cpp + imatrix |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["kld"] / best[r["type"]] if best.get(r["type"]) else float("nan")  # nan: no llama.cpp row
        print(f"| {r['type']} | {r['maker']} | {r['tensor_types']}{'' if r['types_match'] else ' (DIFFER)'} | "
              f"{r['bits_per_param']:.3f} | {r['ppl']:.3f} | {r['kld']:.4f} | {r['kld99']:.3f} | {r['same_top']:.2f} | "
              f"{ratio:.2f}x |")


def kld_plot(rows, x: str, path: str, xlabel: str, ylabel: str, title: str, xlog2: bool = False) -> None:
    """One line per maker of rows[...]["kld"] (log scale) against rows[...][x], saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for maker in dict.fromkeys(r["maker"] for r in rows):
        pts = sorted((r[x], r["kld"]) for r in rows if r["maker"] == maker)
        ax.plot([p for p, _ in pts], [k for _, k in pts], marker="o", label=maker)
    if xlog2:
        ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(rows, path: str, tag: str) -> None:
    kld_plot(rows, "bits_per_param", path, "bits per parameter (tensor data)", "mean KL divergence to F32 (log)",
             f"{tag} on held-out text (fortunes), calibrated on pydoc")


if __name__ == "__main__":
    sys.exit(main())
