"""Converting a Hugging Face model directory into a deployable quantized model, in one of these
formats, streamed from disk (fewbits.files.streaming):

- "hf": a Hugging Face directory with a fewbits quantization_config (fb.from_pretrained, and
  transformers' from_pretrained once fewbits is imported, load it);
- "gguf": one GGUF file for llama.cpp (and transformers' gguf_file=): every planned scheme must
  be a GGUF block type (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_k ... q6_k), checked before any work;
- "compressed-tensors": a Hugging Face directory in compressed-tensors' format, which vLLM,
  SGLang and transformers (with the compressed-tensors package) load; every planned scheme must
  have an exact compressed-tensors form (fewbits.files.compressed_tensors), checked before any
  work;
- "gptq": a Hugging Face directory in the GPTQ checkpoint format (v1, symmetric), which vLLM,
  SGLang, TGI, ExLlama and GPTQModel load: one scheme with an exact GPTQ form for every Linear
  layer of the decoder blocks, the others in float (a scheme given alone is applied so;
  fewbits.files.gptq_format), checked before any work;
- "bitsandbytes": a Hugging Face directory in bitsandbytes' 4-bit layout, which transformers loads
  with bitsandbytes installed (nf4; fewbits.files.bnb_format);
- "fewbits": one fewbits safetensors file (fb.save; fb.load into a float skeleton reads it).

The model is quantized into a temporary HF directory beside the output first when the format is
not "hf"; the output itself appears only once complete (an interrupted run leaves nothing that
looks finished), and an existing output is refused unless overwrite=True.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping

from ..atomic import DirectoryReplacement
from ..quant.scheme import get_scheme
from .gguf_blocks import gguf_block_type
from .standard_formats import STANDARD_FORMATS
from .streaming import ConversionSummary, _read_config, quantize_pretrained, tokenizer_files

__all__ = ["FORMATS", "convert", "float_matrices", "formats_for"]

FORMATS = ("hf", "gguf", "fewbits", *STANDARD_FORMATS)
_DIRECTORIES = ("hf", *STANDARD_FORMATS)


_NAMED_FORMATS = {".gguf": ("gguf", "a GGUF file"), ".safetensors": ("fewbits", "a fewbits safetensors file")}
_FORMAT_WHAT = {"hf": "a Hugging Face directory", "gguf": "a GGUF file", "fewbits": "a fewbits safetensors file",
                **{name: f"a {name} directory" for name in STANDARD_FORMATS}}


def output_format(out, format: str | None = None) -> str:
    """The format asked for, or the one the output's name implies: *.gguf -> gguf,
    *.safetensors -> fewbits, anything else -> hf (a directory). A name that implies another
    format than the one asked for (format "hf" for "x.gguf": a directory called x.gguf) is a
    ValueError."""
    name = os.fspath(out)
    implied = next(((f, what, ext) for ext, (f, what) in _NAMED_FORMATS.items() if name.lower().endswith(ext)),
                   None)
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        if implied is not None and implied[0] != format:
            f, what, ext = implied
            raise ValueError(f"{name}: the name ends in {ext}, {what}, but the format asked for is {format} "
                             f"({_FORMAT_WHAT[format]}); name the output without {ext}, or ask for {f} "
                             f"(--format {f}, or no --format)")
        return format
    return implied[0] if implied is not None else "hf"


def formats_for(scheme) -> list[str]:
    """The output formats (FORMATS) that hold `scheme` exactly: hf and fewbits hold every scheme,
    gguf those with a GGUF block type, the standard formats those they have an exact form of."""
    found = ["hf", "fewbits"]
    checks = {"gguf": gguf_block_type, **{name: f.scheme_args for name, f in STANDARD_FORMATS.items()}}
    for fmt, check in checks.items():
        try:
            check(scheme)
        except ValueError:
            continue
        found.append(fmt)
    return found


def check_format_options(fmt: str, embeddings: bool = False, tied: str | None = None) -> None:
    """What a standard format refuses of convert's options, before any work: quantized embeddings
    (they quantize Linear layers), and --tied untie where the output layer stays in float."""
    standard = STANDARD_FORMATS.get(fmt)
    if standard is None:
        return
    if embeddings:
        raise ValueError(f"--format {fmt} quantizes Linear layers and keeps the embeddings in float: no --embeddings")
    if standard.keeps_head_in_float and tied == "untie":
        raise ValueError(f"--tied untie quantizes the output layer, which --format {fmt} keeps in float")


def check_gguf_source(source, vocabulary=None) -> None:
    """What the GGUF writer would refuse of the HF directory `source` (its architecture, config
    or tokenizer; `vocabulary`, a GGUF file whose vocabulary is written instead), checked before
    the work of quantizing it: a ValueError."""
    from .gguf_file import check_model

    source = os.fspath(source)
    check_model(_read_config(source), vocabulary if vocabulary is not None else tokenizer_files(source))


def check_gguf_plan(plan, model=None) -> None:
    """Every planned scheme has a GGUF block type; otherwise a ValueError naming the layers and
    the GGUF schemes (`model`, the skeleton quantize_pretrained passes, is not needed)."""
    bad = {}
    for name, scheme in plan.items():
        try:
            gguf_block_type(scheme)
        except ValueError as e:
            bad.setdefault(get_scheme(scheme).label, (name, str(e)))
    if bad:
        label, (name, why) = next(iter(bad.items()))
        raise ValueError(f"--format gguf: {why} (layer {name!r})")


@contextlib.contextmanager
def scratch_directory(out) -> Iterator[str]:
    """A private working directory beside `out`, removed when the block ends. It is a
    fewbits.atomic.DirectoryReplacement of `out` that is never committed: named and locked as
    the temporary directories of writes of `out` are, so a run killed outright leaves it to the
    next write of `out` to remove (a staged model of many gigabytes included)."""
    work = DirectoryReplacement(out, overwrite=True)
    try:
        yield work.tmp
    finally:
        work.abort()


def _size_on_disk(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def convert(source, out, scheme_or_rules, *, format: str | None = None, method: str = "rtn", calibration=None,
            skip=(), embeddings: bool = False, tied: str = "keep", overwrite: bool = False,
            progress: bool | Callable | None = None, vocabulary=None, **options) -> ConversionSummary:
    """Quantize the HF model directory `source` with `scheme_or_rules` (as fb.quantize_model)
    and write it to `out` in `format` (see the module docstring; default from out's name).
    vocabulary: for GGUF, a GGUF file whose vocabulary (its tokenizer.* keys, as they are) is
    written instead of the source's tokenizer files -- a model read from a GGUF keeps its own.
    Returns the ConversionSummary, whose `bytes` is the size of the output on disk and, for GGUF,
    `types` the GGML types written with their tensor counts (llama.cpp's fallbacks show there)."""
    from .hf_dir import read_tensors

    fmt = output_format(out, format)
    out = os.fspath(out)
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    if fmt not in _DIRECTORIES:
        if os.path.isdir(out):
            raise IsADirectoryError(f"{out} is a directory; a {fmt} model is one file: give its path")
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{out}: the directory {parent} does not exist")
    if vocabulary is not None and fmt != "gguf":
        raise ValueError(f"vocabulary (a GGUF file's) goes with format gguf, not {fmt}")
    if fmt == "gguf":
        check_gguf_source(source, vocabulary)
    check_format_options(fmt, embeddings, tied)
    if fmt in STANDARD_FORMATS and not isinstance(scheme_or_rules, Mapping):
        from transformers import AutoConfig

        scheme_or_rules = STANDARD_FORMATS[fmt].default_rules(scheme_or_rules, AutoConfig.from_pretrained(source))
    check = check_gguf_plan if fmt == "gguf" else STANDARD_FORMATS[fmt].check_plan if fmt in STANDARD_FORMATS \
        else None
    if fmt == "hf":
        summary = quantize_pretrained(source, out, scheme_or_rules, method=method, calibration=calibration,
                                      skip=skip, embeddings=embeddings, tied=tied, overwrite=overwrite,
                                      progress=progress, check_plan=check, **options)
        summary.bytes = _size_on_disk(out)
        return summary
    with scratch_directory(out) as work:
        staged = os.path.join(work, "model")
        try:
            summary = quantize_pretrained(source, staged, scheme_or_rules, method=method, calibration=calibration,
                                          skip=skip, embeddings=embeddings, tied=tied, progress=progress,
                                          check_plan=check, **options)
        except OSError as e:
            if work not in str(e):
                raise
            # a full disk while staging: name the output asked for, not the temporary directory
            raise OSError(f"cannot write {out}: staging the quantized model beside it failed: "
                          + str(e).replace(f"cannot write {staged}: ", "")) from None
        if fmt == "gguf":
            from transformers import AutoConfig

            from .gguf_file import write_gguf
            # the source's tokenizer files (the staged copies are the same): errors name the source
            written = write_gguf(out, read_tensors(staged), AutoConfig.from_pretrained(staged),
                                 tokenizer=vocabulary if vocabulary is not None else tokenizer_files(os.fspath(source)),
                                 overwrite=overwrite)
            summary.types = dict(written.types)
        elif fmt in STANDARD_FORMATS:
            STANDARD_FORMATS[fmt].write(out, read_tensors(staged), tokenizer=tokenizer_files(os.fspath(source)),
                                        overwrite=overwrite)
        else:
            from safetensors import SafetensorError

            from .hf_quantizer import from_pretrained
            from .safetensors_format import save
            try:
                save(from_pretrained(staged), out)
            except SafetensorError as e:  # safetensors reports its I/O errors (a full disk) as its own
                raise OSError(f"cannot write {out}: {e}") from None
    summary.bytes = _size_on_disk(out)
    summary.out = out
    return summary


def float_matrices(out) -> list[dict]:
    """The matrices a written hf directory or fewbits file `out` holds in float (2-d `*.weight`
    tensors of a float dtype; quantized ones are stored as codes and scales), read from the
    safetensors headers, largest first: [{"name", "shape", "dtype", "bytes"}]."""
    from safetensors import safe_open

    out = os.fspath(out)
    paths = ([os.path.join(out, n) for n in sorted(os.listdir(out)) if n.endswith(".safetensors")]
             if os.path.isdir(out) else [out])
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
    found = []
    for path in paths:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                shape, dtype = part.get_shape(), part.get_dtype()
                if name.endswith(".weight") and len(shape) == 2 and dtype in sizes:
                    found.append({"name": name, "shape": list(shape), "dtype": dtype,
                                  "bytes": shape[0] * shape[1] * sizes[dtype]})
    return sorted(found, key=lambda f: -f["bytes"])
