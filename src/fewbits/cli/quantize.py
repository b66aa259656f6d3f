"""`fewbits quantize`: write a quantized model for deployment (--scheme S --out OUT), or measure
schemes on a model (--compare, --scheme, --budget), or list them (--list)."""
from __future__ import annotations

import json
import os
import sys

from ..formats.explanation import jsonable
from ..progress import Lines
from .common import check_output_dir, emit_json, model_found, probe_writable, render_table


_QUANT_DEFAULT_COMPARE = "int8,fp8_channel,mxfp8,int4,int4_asym,nf4,nf4_dq,mxfp4,nvfp4,int3"
_DTYPE_WORDS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model: write it for deployment, or measure schemes",
                       description="Quantize a model (MiniLM, SmolLM2, your Hugging Face model directory or a "
                                   "GGUF file). With --scheme S --out OUT: write the quantized model (a Hugging "
                                   "Face directory, a GGUF file or a fewbits file), streamed from disk. With "
                                   "--compare (or --scheme without --out): measure quality, bits per parameter, "
                                   "bytes and throughput against fp32.")
    p.add_argument("model_path", nargs="?", metavar="MODEL",
                   help="minilm, smollm2, a Hugging Face model directory or a GGUF file (default minilm)")
    p.add_argument("--model", metavar="NAME|PATH", help="the same as MODEL")
    p.add_argument("--scheme", metavar="NAME", help="a quantization preset (see `fewbits quantize --list`); with "
                   "--format gguf also a llama.cpp mix: q2_k_s, q2_k_m, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_m")
    p.add_argument("--compare", metavar="A,B,C", nargs="?", const=_QUANT_DEFAULT_COMPARE,
                   help=f"several presets: a comparison table and plot (alone: {_QUANT_DEFAULT_COMPARE})")
    p.add_argument("--method", choices=("rtn", "imatrix", "gptq"), default="rtn",
                   help="rtn: round to nearest (default); imatrix: round to nearest under scales searched on the "
                   "error weighted by each input's importance on calibration text (as llama.cpp's importance "
                   "matrix); gptq: Hessian-aware rounding on calibration text")
    p.add_argument("--budget", type=float, metavar="BITS",
                   help="choose a scheme per layer to fit this many bits per parameter")
    p.add_argument("--out", metavar="OUT", help="with --scheme or --budget: write the quantized model there "
                   "(see --format); with --compare: a directory for results.json and quality_vs_bits.png")
    p.add_argument("--format", choices=("fewbits", "hf", "gguf", "compressed-tensors", "gptq", "bitsandbytes"),
                   help="the written model: hf (a Hugging Face directory), gguf (for llama.cpp), compressed-tensors "
                   "or gptq (directories vLLM, SGLang and transformers load), bitsandbytes (nf4, for transformers "
                   "with bitsandbytes) or fewbits (one safetensors file); default from OUT: *.gguf, *.safetensors, "
                   "else hf")
    p.add_argument("--calibration", metavar="FILE", help="a text file of calibration text for --method imatrix "
                   "or gptq (default: Python's pydoc topics)")
    p.add_argument("--calibration-samples", type=int, metavar="N",
                   help=f"how many windows of the calibration text (default {sq_defaults()[0]})")
    p.add_argument("--calibration-length", type=int, metavar="TOKENS",
                   help=f"tokens per calibration window (default {sq_defaults()[1]})")
    p.add_argument("--embeddings", action="store_true", help="with --out (hf, fewbits): quantize the token "
                   "embedding too (default: it stays in float); on a tied model add --tied untie")
    p.add_argument("--tied", choices=("keep", "untie"), help="with --out (hf, fewbits): keep (default) leaves a "
                   "layer that shares its weight (a tied lm_head) in float; untie quantizes it on its own")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--quick", action="store_true", help="fewer evaluation sentences/tokens")
    p.add_argument("--list", action="store_true", help="list the quantization presets (and the --format choices "
                   "that hold each) and exit")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args, out) -> int:
    from ..quant import get_scheme
    from ..study import quantization as sq

    if args.list:
        return _quant_list(args, out)
    args.model = args.model_path or args.model or "minilm"
    if args.compare is not None and args.scheme:
        raise ValueError("--scheme writes or measures one scheme, --compare measures several: give one of them")
    if args.out and args.compare is None and (args.scheme or args.budget is not None):
        return _quant_convert(args, out, Lines("fewbits", enabled=not args.quiet))
    if args.format or args.overwrite or args.calibration or args.calibration_samples or args.calibration_length:
        raise ValueError("--format, --overwrite and --calibration* go with a conversion: "
                         "--scheme S (or --budget BITS) --out OUT")
    schemes = [s.strip() for s in (args.compare or args.scheme or "").split(",") if s.strip()]
    if not schemes and args.budget is None:
        raise ValueError("give --scheme NAME, --compare A,B,... or --budget BITS")
    for s in schemes:
        get_scheme(s)  # unknown names fail before the model loads
    if args.tied is not None or args.embeddings:
        raise ValueError("--tied and --embeddings go with a conversion: --scheme S --out OUT")
    model_found(args.model, ("minilm", "smollm2"))
    if args.budget is not None and not 1 <= args.budget <= 32:
        raise ValueError(f"--budget is in bits per parameter (1..32), got {args.budget}")
    if args.out:
        check_output_dir(args.out)
    say = Lines("fewbits", enabled=not args.quiet)
    say(f"loading {args.model} ...")
    subject = sq.get_subject(args.model, quick=args.quick)
    rows = sq.compare(subject, schemes, method=args.method, progress=say) if schemes else \
        [sq.measure(subject, subject.model, "fp32", None)]
    allocation = None
    if args.budget is not None:
        candidates = schemes or list(sq.BUDGET_CANDIDATES)
        allocation = sq.allocate_for_budget(subject, candidates, args.budget, progress=say)
        rows.append(allocation.pop("row"))
    result = {"model": subject.name, "quality_metric": subject.quality_metric, "note": subject.note,
              "schemes": rows}
    if allocation is not None:
        result["allocation"] = allocation
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(jsonable(result), f, indent=1)
        if len(rows) > 2:
            sq.plot_quality_vs_bits(rows, subject, os.path.join(args.out, "quality_vs_bits.png"))
    if args.json:
        emit_json(result, out)
    else:
        print(f"{subject.name} — quality = {subject.quality_metric} "
              f"({'higher' if subject.higher_is_better else 'lower'} is better)", file=out)
        print(_quant_rows_table(rows, subject), file=out)
        if subject.note:
            print(f"note: {subject.note}", file=out)
        if args.out:
            print(f"wrote {args.out}/results.json" + (" and quality_vs_bits.png" if len(rows) > 2 else ""), file=out)
    return 0


def _quant_rows_table(rows, subject) -> str:
    headers = ["scheme", "bits/param", "layer bits", "model MB", subject.quality_metric,
               subject.throughput_unit, "method"]
    table = []
    for r in rows:
        lb = r.get("layer_bits_per_param")
        table.append([r.get("scheme_name") or r["scheme"], f"{r['bits_per_param']:.3f}",
                      f"{lb:.3f}" if lb is not None else "32 (fp32)", f"{r['model_bytes'] / 1e6:.1f}",
                      f"{r['quality']:.5f}" if subject.quality_metric == "cosine" else f"{r['quality']:.3f}",
                      f"{r['throughput']:.1f}", r.get("method", "—")])
    return render_table(headers, table, right=(1, 2, 3, 4, 5))


def _quant_list(args, out) -> int:
    from ..files.conversion import formats_for
    from ..quant import get_scheme, list_schemes

    rows = [{"scheme": n, "description": get_scheme(n).describe(),
             "bits_per_value": get_scheme(n).bits_per_value(), "formats": formats_for(n)} for n in list_schemes()]
    if args.json:
        emit_json(rows, out)
    else:  # hf and fewbits hold every scheme: the column names the others
        print(render_table(["scheme", "bits/value", "--format also", "what"],
                           [[r["scheme"], f"{r['bits_per_value']:.3f}",
                             ", ".join(f for f in r["formats"] if f not in ("hf", "fewbits")) or "-",
                             r["description"]] for r in rows],
                           right=(1,)), file=out)
    return 0


def _quant_source(model: str, tmp: str) -> str:
    """The Hugging Face directory to convert: a built-in model's, the given directory, or a GGUF
    file converted (dequantized by transformers) into `tmp`."""
    from ..files.gguf_file import is_gguf_file
    from ..models import minilm_path, smollm2_directory

    if model == "minilm":
        return str(minilm_path())
    if model == "smollm2":
        return str(smollm2_directory())
    if os.path.isdir(model):
        return model
    if is_gguf_file(model):
        from ..files.gguf_reader import gguf_to_float_pretrained
        return gguf_to_float_pretrained(model, tmp)  # checked first; its RoPE scaling kept
    raise ValueError(f"unknown model {model!r}: use minilm, smollm2, a Hugging Face model directory or a GGUF file")


def sq_defaults() -> tuple[int, int]:
    """The default calibration (windows, tokens per window)."""
    from ..study.quantization import CALIBRATION_LENGTH, CALIBRATION_SAMPLES
    return CALIBRATION_SAMPLES, CALIBRATION_LENGTH


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _quant_convert(args, out, say) -> int:
    """`fewbits quantize MODEL --scheme S --out OUT [--format F]`: write a deployable model.
    Everything that can be checked without reading the model is checked first: the format and
    OUT's name, the scheme (resolved to its canonical name, once, here) against the format, the
    options, the model's existence, the output path."""
    from ..files.conversion import convert, float_matrices, output_format, scratch_directory
    from ..files.gguf_file import is_gguf_file
    from ..files.streaming import tokenizer_files
    from ..study import quantization as sq

    fmt = output_format(args.out, args.format)
    scheme = sq.conversion_scheme(args.scheme, fmt) if args.scheme else None
    if args.budget is not None and not 1 <= args.budget <= 32:
        raise ValueError(f"--budget is in bits per parameter (1..32), got {args.budget}")
    calibrating = (args.calibration, args.calibration_samples, args.calibration_length)
    if any(c is not None for c in calibrating) and args.method == "rtn":
        raise ValueError("--calibration, --calibration-samples and --calibration-length choose the text --method "
                         "imatrix or gptq calibrates on: rtn takes none")
    for flag, value in (("--calibration-samples", args.calibration_samples),
                        ("--calibration-length", args.calibration_length)):
        if value is not None and not 1 <= value <= 1_000_000:
            raise ValueError(f"{flag} must be a positive number, got {value}")
    if args.calibration is not None:
        if not os.path.isfile(args.calibration):
            raise ValueError(f"--calibration {args.calibration}: file not found")
    if fmt == "gguf" and (args.tied is not None or args.embeddings):
        raise ValueError("--tied and --embeddings go with --format hf or fewbits: for GGUF the recipe gives the "
                         "token embedding its type (and llama.cpp reads a tied output layer from it)")
    model_found(args.model, ("minilm", "smollm2"))
    if os.path.lexists(args.out) and not args.overwrite:
        raise OSError(f"--out {args.out}: exists; add --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise OSError(f"--out {args.out}: {parent} is not a directory")
    probe_writable(parent, "--out", args.out)
    if scheme is not None and scheme != args.scheme:
        say(f"--scheme {args.scheme} is {scheme}")
    with scratch_directory(args.out) as tmp:  # a GGUF source's float model (a kill leaves it to the next run)
        say(f"reading {args.model} ...")
        source = _quant_source(args.model, os.path.join(tmp, "model"))
        # a GGUF source's own vocabulary, as it is (the tokenizer transformers builds from it is
        # not always one the GGUF writer can spell back: Gemma's SentencePiece)
        vocabulary = args.model if fmt == "gguf" and is_gguf_file(args.model) else None
        if fmt == "gguf" and vocabulary is None and tokenizer_files(source) is None:
            print(f"fewbits quantize: warning: {source} has no tokenizer files: the GGUF gets no vocabulary, so "
                  "llama.cpp can load it but not turn text into tokens", file=sys.stderr)
        plan = sq.conversion_plan(source, scheme, fmt, budget=args.budget, progress=say,
                                  embeddings=args.embeddings, tied=args.tied, vocabulary=vocabulary)
        calibration = None
        if args.method != "rtn":
            samples, length = sq_defaults()
            samples = args.calibration_samples or samples
            length = args.calibration_length or length
            calibration = sq.calibration_for_directory(source, args.calibration, samples, length)
            where = args.calibration or "Python's pydoc topics"
            if "input_ids" in calibration[0] and "attention_mask" not in calibration[0]:
                got = sum(int(b["input_ids"].numel()) for b in calibration)
                say(f"{args.method} calibration: {len(calibration)} windows of {length} tokens ({got} tokens) of {where}"
                    + (f"; the text holds no more (asked for {samples})" if len(calibration) < samples else ""))
            else:
                say(f"{args.method} calibration: {len(calibration)} batches of sentences of {where}")
        say(f"quantizing into {args.out} ({fmt}) ...")
        summary = convert(source, args.out, plan["rules"], format=fmt, method=args.method, calibration=calibration,
                          embeddings=plan["embeddings"], tied=plan["tied"], overwrite=args.overwrite,
                          progress=not args.quiet, vocabulary=vocabulary)
        floats = float_matrices(args.out) if fmt != "gguf" else []
        tied_source = _ties_embeddings(source)
    result = {"model": args.model, "format": fmt, "scheme": plan["scheme"], **summary.to_dict()}
    notes = []
    result.pop("types")
    if summary.types is not None:
        result["types"] = sq.written_types(summary.types, plan["types"])
    if floats:
        result["float_matrices"] = floats
        notes.append(_float_matrices_note(floats, summary.bytes, tied_source, plan, fmt))
    if args.json:
        if notes:
            result["notes"] = notes
        emit_json(result, out)
    else:
        print(render_table(["layers", "bits/param", "size on disk", "time", "peak memory"],
                           [[str(summary.layers), f"{summary.bits_per_param:.3f}", _gb(summary.bytes),
                             f"{summary.seconds:.1f} s", _gb(summary.peak_rss_bytes)]], right=(0, 1, 2, 3, 4)),
              file=out)
        if "types" in result:
            print(f"GGUF types: {sq.written_types_text(result['types'])}", file=out)
        for note in notes:
            print(f"note: {note}", file=out)
        print(f"wrote {args.out}", file=out)
    return 0


def _ties_embeddings(source: str) -> bool:
    try:
        with open(os.path.join(source, "config.json")) as f:
            return bool(json.load(f).get("tie_word_embeddings", False))
    except (OSError, ValueError, AttributeError):
        return False


def _float_matrices_note(floats, total: int, tied: bool, plan, fmt: str = "hf") -> str:
    """One sentence on the matrices a conversion left in float: which, their share of the output,
    and the options that quantize them."""
    size = sum(f["bytes"] for f in floats)
    tied = tied and plan["tied"] == "keep"

    def one(f):
        what = f"{f['name']} ({'×'.join(map(str, f['shape']))}, {_DTYPE_WORDS.get(f['dtype'], f['dtype'])})"
        if tied and "embed" in f["name"]:
            what = f"the tied embedding/lm_head {what}"
        return what

    def amount(n):
        return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
    listed = [one(f) for f in floats[:3]] + ([f"{len(floats) - 3} more"] if len(floats) > 3 else [])
    verb = "stays" if len(floats) == 1 else "stay"
    text = f"{', '.join(listed)} {verb} in float: {amount(size)} of {amount(total)} ({size / total:.0%})"
    if any("embed" in f["name"] for f in floats) and not plan["embeddings"]:
        if fmt not in ("hf", "fewbits"):  # the standard formats quantize Linear layers only
            text += f"; {fmt} keeps embeddings in float" + (
                "; --tied untie quantizes the output layer on its own (a quantized copy of the tied matrix)"
                if tied and fmt != "gptq" else "")
        else:
            text += ("; --embeddings --tied untie quantizes the embedding and the output layer each (two quantized "
                     "copies of a tied matrix)" if tied else "; --embeddings quantizes the embedding")
    return text
