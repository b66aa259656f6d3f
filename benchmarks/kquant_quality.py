"""Round-to-nearest quality of the GGUF k-quant presets (q4_k, q5_k, q6_k) on real weights: the
mean squared error of fewbits' scale search against a plain range choice (scale_method "absmax")
and, where the tests' port of llama.cpp's reference quantizer is importable (run from the
repository root), against llama.cpp's own algorithm.

    python benchmarks/kquant_quality.py            # all-MiniLM-L6-v2's six FFN down projections

Errors: plain MSE, weighted by |x| and by x^2 (sum w (q - x)^2 / sum w), over all six matrices.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import fewbits as fb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
try:
    import llama_kquant_reference as ref
except ImportError:  # not run from a checkout
    ref = None


def weights() -> list[torch.Tensor]:
    from fewbits.models.minilm import load_minilm

    model, _ = load_minilm()
    return [m.weight.detach().clone() for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.in_features == 1536]


def errors(ws, qs) -> tuple[float, float, float]:
    num = [0.0, 0.0, 0.0]
    den = [0.0, 0.0, 0.0]
    for w, q in zip(ws, qs):
        e = (q.double() - w.double()) ** 2
        for i, wt in enumerate((torch.ones_like(w), w.abs(), w * w)):
            num[i] += float((wt.double() * e).sum())
            den[i] += float(wt.double().sum())
    return tuple(n / d for n, d in zip(num, den))


def main() -> int:
    ws = weights()
    print(f"{len(ws)} matrices {tuple(ws[0].shape)} (all-MiniLM-L6-v2 FFN down projections)\n")
    print("| type | choice | MSE | MSE weighted by abs(x) | MSE weighted by x^2 |")
    print("|---|---|---|---|---|")
    for name in ("q4_k", "q5_k", "q6_k"):
        scheme = fb.get_scheme(name)
        rows = [("plain range (absmax)", [fb.quantize(w, scheme.with_(scale_method="absmax")).dequantize() for w in ws]),
                ("fewbits search (preset)", [fb.quantize(w, scheme).dequantize() for w in ws])]
        if ref is not None:
            port = ref.q6_k_reference if name == "q6_k" else (lambda a, b=scheme.format.bits: ref.q45_k_reference(a, b))
            rows.append(("llama.cpp reference (port)", [torch.from_numpy(port(w.numpy())) for w in ws]))
        for label, qs in rows:
            mse, wabs, wsq = errors(ws, qs)
            print(f"| {name.upper()} | {label} | {mse:.4e} | {wabs:.4e} | {wsq:.4e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
