"""LlamaDecoder's decode speed on a quiet machine and beside a CPU hog, at fixed thread counts and
with threads="auto" (what `fewbits generate` uses unless --threads is given).

A parallel region waits for every thread of its team; where another process keeps a core busy,
the thread that lands there waits for its turn of the scheduler (milliseconds) and so does the
whole region. The native decode step of SmolLM2-135M runs ~200 regions a token, so on a busy
2-core machine 2 threads decoded at 0.4-3.7 tokens/s against 32-88 at 1 thread (issue 29).

The hog: one busy-loop process per CPU this process may use (`--hog-procs` to change), each
ending by itself after --hog-seconds at most, started before a measurement and killed after it.
Conditions (quiet, hog) and modes (--modes: thread counts and "auto") are interleaved: each round
runs every mode in every condition, one generation each, and the table shows the median decode
tokens/s over --rounds rounds, with the thread counts that "auto" ran its steps at. "quiet" means
no hog of ours: on a machine shared with other work the table says what else was running only
through the load average printed with it.

    python benchmarks/bench_decode_under_load.py                      # SmolLM2 int4, 1 / 2 / auto
    python benchmarks/bench_decode_under_load.py --model synthetic    # a tiny random Llama (seconds)
    python benchmarks/bench_decode_under_load.py --rounds 3 --new-tokens 64 --modes 1,2,auto
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import fewbits as fb
from fewbits.hardware import machine_info
from fewbits.models.decoder import LlamaDecoder

HOG = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def _model(kind: str, scheme: str):
    if kind == "smollm2":
        from fewbits.models import load_smollm2

        model, tok = load_smollm2()
        ids = tok("The history of the printing press begins with", return_tensors="pt").input_ids
    else:
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                                          num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                                          max_position_embeddings=1024)
        model = transformers.LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(1))
    model.config._attn_implementation = "sdpa"
    fb.quantize_model(model, scheme, tied="untie")
    return model.eval(), ids


class Hog:
    """`procs` busy-loop processes, each ending by itself after `seconds` at most."""

    def __init__(self, procs: int, seconds: float):
        self.procs, self.seconds = procs, seconds
        self.children: list[subprocess.Popen] = []

    def __enter__(self):
        self.children = [subprocess.Popen([sys.executable, "-c", HOG, str(self.seconds)]) for _ in range(self.procs)]
        time.sleep(0.3)  # let them start spinning
        return self

    def __exit__(self, *exc):
        for c in self.children:
            c.kill()
        for c in self.children:
            c.wait()
        return False


def _mode(text: str):
    return "auto" if text == "auto" else int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "synthetic"), default="smollm2")
    ap.add_argument("--scheme", default="int4")
    ap.add_argument("--modes", default="1,2,auto", help="thread counts and/or 'auto', comma-separated")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hog-procs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--hog-seconds", type=float, default=120.0, help="the most a hog process lives")
    ap.add_argument("--conditions", default="quiet,hog")
    args = ap.parse_args(argv)
    modes = [_mode(m) for m in args.modes.split(",")]
    conditions = args.conditions.split(",")

    torch.set_num_threads(max(m for m in modes if m != "auto") if any(m != "auto" for m in modes)
                          else torch.get_num_threads())
    info = machine_info()
    print(f"CPU: {info['name']} ({len(os.sched_getaffinity(0))} CPUs usable), torch {info['torch']}, "
          f"torch threads {torch.get_num_threads()} ('auto' chooses among these and fewer), "
          f"native kernels {info['native_kernels']}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model, ids = _model(args.model, args.scheme)
    decoders = {m: LlamaDecoder(model, threads=m) for m in modes}
    for d in decoders.values():  # warm up (the native library, the caches)
        d.generate(ids, 4)
    speeds = {(c, m): [] for c in conditions for m in modes}
    used = {(c, m): {} for c in conditions for m in modes}
    path = None
    for r in range(args.rounds):
        for c in conditions:
            hog = Hog(args.hog_procs, args.hog_seconds) if c == "hog" else None
            if hog:
                hog.__enter__()
            try:
                for m in (modes if r % 2 == 0 else modes[::-1]):
                    d = decoders[m]
                    res = d.generate(ids, args.new_tokens)
                    speeds[(c, m)].append(res.decode_tokens_per_s)
                    for t, n in (d.last_threads or {}).items():
                        used[(c, m)][t] = used[(c, m)].get(t, 0) + n
                    path = d.last_path
                    print(f"  round {r + 1} {c:5s} threads={m}: {res.decode_tokens_per_s:6.1f} tok/s "
                          f"(steps at {d.last_threads})", flush=True)
            finally:
                if hog:
                    hog.__exit__(None, None, None)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\n{args.model} {args.scheme}, {path} decode path, {ids.shape[1]}-token prompt, {args.new_tokens} new "
          f"tokens, median of {args.rounds} rounds; hog = {args.hog_procs} busy-loop processes\n")
    head = "| threads | " + " | ".join(f"{c} tok/s" for c in conditions) + " | auto's steps (threads: steps) |"
    print(head)
    print("|" + "---|" * (len(conditions) + 2))
    for m in modes:
        cells = [f"{statistics.median(speeds[(c, m)]):.1f}" for c in conditions]
        steps = "; ".join(f"{c}: " + ", ".join(f"{t}: {n}" for t, n in sorted(used[(c, m)].items()))
                          for c in conditions) if m == "auto" else ""
        print(f"| {m} | " + " | ".join(cells) + f" | {steps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
