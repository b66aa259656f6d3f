"""`fewbits generate MODEL --prompt TEXT`: greedy generation through LlamaDecoder, quantized
first with --scheme, with the prefill and decode speed."""
from __future__ import annotations

import json
import os

from ..models.decoder import PATHS as DECODE_PATHS
from ..progress import Lines
from .common import emit_json, model_found


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model, quantized or not, with the fast decode path",
                       description="Greedy generation from a Llama-architecture causal LM (SmolLM2, a Hugging Face "
                                   "directory -- fewbits-quantized ones as stored -- or a GGUF file), optionally "
                                   "quantized first with --scheme, through fewbits.models.LlamaDecoder: the "
                                   "prompt in torch ops, each new token in one C call where every projection has "
                                   "a one-row kernel. Prints the text and the prefill and decode speed.")
    p.add_argument("model", metavar="MODEL", help="smollm2, a Hugging Face model directory or a GGUF file")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument("--scheme", metavar="NAME", help="quantize to this preset first (e.g. int4, w4a8, nf4, int8; "
                   "the tied output layer too); default: the model as stored")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="at most N new tokens (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--path", choices=DECODE_PATHS, default="auto",
                   help="decode path: native (one C call per token; an error if it cannot run), torch "
                        "(transformers' logits bit for bit), auto (native where it can run; default)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's count, or fewer while other "
                                               "processes keep the cores busy, measured as it decodes)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def run(args, out) -> int:
    import torch

    from ..models.decoder import LlamaDecoder
    from ..quant import get_scheme, quantize_model

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    _check_prompt(args.prompt)
    scheme = get_scheme(args.scheme).name or args.scheme if args.scheme else None  # unknown: fails before loading
    model_found(args.model, ("smollm2",))
    if scheme is not None:
        _refuse_requantizing(args.model, scheme)
    say = Lines("fewbits", enabled=not args.quiet)
    say(f"loading {args.model} ...")
    model, tokenizer, what = _causal_lm(args.model)
    if scheme is not None:
        _refuse_requantizing(what, scheme, model)
        say(f"quantizing to {scheme} ...")
        quantize_model(model, scheme, tied="untie")
    # without --threads, the count that runs fastest now (a busy machine's cores make 2 threads slower than 1)
    decoder = LlamaDecoder(model, path=args.path, threads=None if args.threads is not None else "auto")
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    else:
        ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    _check_token_ids(ids, model, tokenizer, what)
    stop = [] if args.no_stop or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    result = decoder.generate(ids, args.max_new_tokens, stop=stop)
    # the continuation decoded after the prompt, not alone: a tokenizer may drop a leading space
    # of the first new token when it is decoded on its own (Llama 2's and Mistral's do)
    before = tokenizer.decode(ids[0], skip_special_tokens=True)
    whole = tokenizer.decode(torch.cat([ids[0], result.tokens[0]]), skip_special_tokens=True)
    text = whole[len(before):] if whole.startswith(before) else tokenizer.decode(result.tokens[0],
                                                                                 skip_special_tokens=True)
    used = decoder.last_threads or {torch.get_num_threads(): 0}  # {threads: decode steps run at it}
    info = {"model": what, "scheme": scheme, "path": decoder.last_path, "threads": max(used, key=used.get),
            "prompt": args.prompt, "text": text, "prompt_tokens": result.prompt_tokens,
            "new_tokens": int(result.tokens.shape[1]), "prefill_tokens_per_s": result.prefill_tokens_per_s,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "stopped_at_eos": bool(stop) and int(result.tokens[0, -1]) in stop}
    reason = decoder.native_reason() if decoder.last_path != "native" else None
    if reason is not None:  # None too where no step was left to decode (one new token)
        info["native_reason"] = reason
    if args.json:
        emit_json(info, out)
        return 0
    print(text if args.chat else args.prompt + text, file=out)
    decode = (f"decode {info['new_tokens'] - 1} tokens at {info['decode_tokens_per_s']:.1f} tok/s"
              if info["new_tokens"] > 1 else "no decode step")
    print(f"\n[{what}, {scheme or 'as stored'}, {info['threads']} thread(s), {decoder.last_path} decode path: "
          f"prefill {info['prompt_tokens']} tokens at {info['prefill_tokens_per_s']:.0f} tok/s, {decode}"
          f"{', stopped at end of sequence' if info['stopped_at_eos'] else ''}]", file=out)
    if "native_reason" in info and args.path == "auto":
        print(f"[the native decode step did not run: {info['native_reason']}]", file=out)
    return 0


def _causal_lm(spec: str):
    """(model in eval mode, tokenizer, what was loaded): smollm2, a GGUF file or a Hugging Face
    directory -- fewbits-quantized, compressed-tensors and GPTQ ones through fb.from_pretrained
    (quantized weights as stored), others through transformers in float32."""
    from ..files.hf_quantizer import from_pretrained
    from ..study.quantization import _load_part

    if spec == "smollm2":
        from ..models import load_smollm2

        model, tokenizer = load_smollm2()
        return model, tokenizer, "SmolLM2-135M-Instruct (packaged)"
    path = os.path.expanduser(spec)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ImportError("generation needs transformers: pip install transformers") from None
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        model = from_pretrained(path)  # checks the file before the tokenizer's reader sees it
        tokenizer = _load_part(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name))
        return model, tokenizer, f"{path} (GGUF)"
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"unknown model {spec!r}: use smollm2, a GGUF file or a Hugging Face model directory")
    try:
        with open(config) as f:
            quant = (json.load(f).get("quantization_config") or {}).get("quant_method")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{config}: unreadable config ({e})") from None
    from ..files.standard_formats import STANDARD_FORMATS
    from ..files.hf_dir import read_tensors
    # config.json's values, the shards, the index and the layer count checked before transformers
    # reads any of it (the tokenizer builds the config too)
    standard = STANDARD_FORMATS.get(quant) if isinstance(quant, str) else None
    readable = standard is not None and standard.reads
    read_tensors(path, foreign=standard is not None).close()
    tokenizer = _load_part(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(path, local_files_only=True))
    if quant == "fewbits":
        return from_pretrained(path), tokenizer, f"{path} (fewbits-quantized)"
    if readable:  # its codes and scales as they are, in fewbits' kernels
        return from_pretrained(path), tokenizer, f"{path} ({quant}, read by fewbits)"
    model, info = _load_part(path, "model", lambda: AutoModelForCausalLM.from_pretrained(
        path, dtype="float32", local_files_only=True, output_loading_info=True))
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers filled them at random
        raise ValueError(f"{config}: the model it describes has weights the directory does not hold: "
                         f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    return model.eval(), tokenizer, path


def _check_prompt(prompt: str) -> None:
    """A prompt that is not text: bytes that are not UTF-8 reach Python's sys.argv as lone
    surrogates ('\\udcff'), which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start:e.end]
        shown = ", ".join(f"0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"U+{ord(c):04X}" for c in bad)
        raise ValueError(f"--prompt is not valid UTF-8 text: the byte{'s' if len(bad) > 1 else ''} {shown} at "
                         f"character {e.start} (give the prompt in UTF-8)") from None


def _refuse_requantizing(model: str, scheme: str, loaded=None) -> None:
    """--scheme on a model that is quantized already: quantize_model would convert only its float
    layers, and the run would be reported as `scheme` while it runs the stored one. Checked from
    config.json before loading (a fewbits directory) and on the loaded model (a quantized GGUF)."""
    kinds = None
    if loaded is None:
        config = os.path.join(os.path.expanduser(model), "config.json")
        try:
            with open(config) as f:
                qc = json.load(f).get("quantization_config") or {}
        except (OSError, ValueError, AttributeError):
            return
        if isinstance(qc, dict) and qc.get("quant_method"):
            schemes = sorted({m.get("scheme") for m in (qc.get("modules") or {}).values()
                              if isinstance(m, dict) and isinstance(m.get("scheme"), str)})
            kinds = f"{qc['quant_method']}" + (f" {', '.join(schemes)}" if schemes else "")
    else:
        from ..quant.plan import is_quantized

        schemes = sorted({m.qweight.scheme.label for m in loaded.modules() if is_quantized(m)})
        kinds = ", ".join(schemes) if schemes else None
    if kinds:
        raise ValueError(f"{model} is quantized already ({kinds}): --scheme {scheme} would quantize only its float "
                         "layers and run the rest as stored; drop --scheme to run it as stored, or give the float "
                         "model")


def _check_token_ids(ids, model, tokenizer, what: str) -> None:
    """Token ids the model's embedding has no row for: a tokenizer larger than the model's
    vocabulary (an index error deep in the forward otherwise)."""
    embedding = model.get_input_embeddings()
    rows = int(getattr(embedding, "num_embeddings", 0) or 0)
    top = int(ids.max())
    if rows and top >= rows:
        raise ValueError(f"{what}: the tokenizer gives token id {top} (it has {len(tokenizer)} tokens) but the "
                         f"model's embedding has {rows} rows: the tokenizer does not belong to this model")
