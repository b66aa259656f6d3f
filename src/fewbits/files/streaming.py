"""Quantizing a Hugging Face model directory from disk, for models larger than memory.

`quantize_pretrained(source, out, rules, method=...)` never builds the float model. It builds the
architecture on the meta device (no memory), reads the source's safetensors shards tensor by
tensor (memory-mapped), and writes the quantized model as an HF directory whose shards are
written as they fill (fewbits.files.hf_dir.ShardWriter):

- "rtn": each tensor is read, quantized if the plan says so, and handed to the writer; nothing
  else is held. Peak memory: the largest tensor in float32 and its quantized form, plus one
  output shard.
- "imatrix": first the importance of every planned linear layer's input columns is gathered
  (fewbits.quant.importance) from the float model, streamed as GPTQ streams it below (the
  non-block tensors loaded, the first block's calibration inputs captured, then each block loaded,
  run on them with importance hooks and unloaded again); then every tensor is read and quantized
  as "rtn" does, under its layer's importance. The result equals quantize_model(method="imatrix")
  in memory. Peak memory: GPTQ's without its Hessians.
- "gptq": a token embedding tied to the output head first gets its head's input importance
  from one streamed pass as "imatrix" (it is rounded under it, as in memory); the tensors
  outside the repeated blocks (embeddings, final norm, an untied head) are loaded in the
  working dtype; the calibration inputs of the first block are captured; then
  each block is loaded, its layers quantized group by group with the GPTQ of
  fewbits.quant.gptq (the same functions and order as gptq_quantize_model's block-by-block
  path, so the result equals in-memory quantization bit for bit), the block's output computed
  with its quantized weights as the next block's input, its tensors written and the block
  unloaded again. Peak memory: the non-block tensors + one block, both in the working dtype
  (float32), + the calibration activations (two [tokens, hidden] float32 tensors per batch) +
  GPTQ's work on the widest layer (its Hessian [in, in] in float64) + one output shard. Planned
  layers after the blocks (an untied lm_head, BERT's pooler) get their Hessians from a pass in
  which every block replays its recorded output.

The plan (which module gets which scheme) is resolved on the meta-device model with the same
rules as quantize_model (fewbits.quant.plan.resolve_plan).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import resource
import time
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..model_building import building, parameters_on_meta
from ..progress import counter
from ..quant.gptq import DAMP as GPTQ_DAMP
from ..quant.gptq import (
    SHRINK, WEIGHTED_SCALES, _Discovery, _SequentialGPTQ, _find_blocks, _hidden_of, _passes, advance_block,
    capture_block_inputs, check_options,
)
from ..quant.importance import DAMP, ImportanceHooks, importance_sources
from ..quant.plan import calibration_batches, model_device, resolve_plan, run_batch
from ..quant.tensor import QuantizedTensor, quantize
from .hf_dir import model_class
from .safetensors_format import FileFormatError

__all__ = ["ConversionSummary", "model_skeleton", "quantize_pretrained"]

METHODS = ("rtn", "imatrix", "gptq")
STREAM_SHARD_BYTES = 1 << 29  # output shards of 512 MiB: the writer holds one while it fills


@dataclasses.dataclass
class ConversionSummary:
    """What quantize_pretrained did: layers quantized, parameters, bytes written, bits per
    parameter (every stored byte over every parameter), seconds, peak resident memory; for a
    GGUF output (fewbits.files.conversion.convert) the GGML types written with their tensor counts."""
    layers: int
    parameters: int
    bytes: int
    bits_per_param: float
    seconds: float
    peak_rss_bytes: int
    out: str
    types: dict | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _malloc_trim():
    """glibc's malloc_trim, or None where there is none. Freed tensors leave their memory to
    glibc's heap, which hands it back to the system only when trimmed: without it a streamed
    1B model's RTN run held 2.2 GB at the end, with it 1.5 GB."""
    try:
        import ctypes
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Hand memory freed so far back to the system (see _malloc_trim)."""
    if _TRIM is not None:
        _TRIM(0)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def model_skeleton(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of `config` with every parameter on the meta device (no memory) and its buffers
    (rotary frequencies, position ids) computed for real, in eval mode. Safe to call from several
    threads at once (they build one at a time), and nothing outside the calling thread's
    construction lands on meta."""
    cls = model_class(getattr(config, "architectures", None))
    # one construction at a time in the process, parameters on meta in this thread only (see
    # fewbits.model_building: accelerate's init_empty_weights did it for every thread)
    with building():
        try:
            with parameters_on_meta():
                model = cls._from_config(config, dtype=dtype)
        except (RuntimeError, ValueError, TypeError, OverflowError, AttributeError) as e:
            # a config.json of impossible sizes (negative, or beyond memory: the parameters are
            # created, untouched, before they move to the meta device) or of missing fields
            raise ValueError(f"cannot build {cls.__name__} from this configuration: "
                             f"{' '.join(str(e).split())[:300]}") from None
        model.tie_weights()  # as from_pretrained does: a tied head is the embedding's very Parameter
    return model.eval()


def _read_config(source: str):
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(source, "config.json")):
        raise FileFormatError(source, "no config.json: not a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(source)
    except (ValueError, OSError, KeyError) as e:
        raise FileFormatError(os.path.join(source, "config.json"), f"not a usable model configuration: {e}") from None


def _owner_of(name: str, plan: Mapping) -> str | None:
    module = name.rsplit(".", 1)[0] if "." in name else ""
    return module if name.endswith(".weight") and module in plan else None


def _parameters_to_load(model: nn.Module, source: Mapping, plan: Mapping) -> dict[str, str]:
    """{state-dict name in the model: name in the source} for every tensor the model saves.
    A model tensor missing from the source is an error naming it. A tied tensor (lm_head.weight
    of tied embeddings) is read from the tensor it is tied to when the plan quantizes it on its
    own (tied="untie"), and is left out otherwise, as save_pretrained leaves it out."""
    names = {}
    missing = []
    aliases = _tied_aliases(model)
    for name in model.state_dict():
        if name in source:
            names[name] = name
        elif name in aliases:
            if _owner_of(name, plan) is not None and aliases[name] in source:
                names[name] = aliases[name]
        else:
            missing.append(name)
    where = getattr(source, "directory", "source")
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise FileFormatError(where, f"the weights lack {len(missing)} tensor(s) of the model: {shown}")
    if hasattr(source, "info"):
        from .hf_dir import check_fits
        check_fits(model, source, names)
    return names


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """{state-dict name: the earlier name whose very tensor it is} (a tied lm_head.weight ->
    model.embed_tokens.weight)."""
    seen, aliases = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases[name] = seen[id(t)]
        else:
            seen[id(t)] = name
    return aliases


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put `value` in place of the parameter or buffer `name` (on the meta device or not)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(name)


def _load(model: nn.Module, names, source: Mapping, dtype: torch.dtype, plan: Mapping | None = None) -> None:
    plan = plan or {}
    for name in names:
        t = source[name]
        if _owner_of(name, plan) is not None and t.numel() and not bool(torch.isfinite(t).all()):
            where = f" ({source.info(name)[2]})" if hasattr(source, "info") else ""
            raise ValueError(f"{name}{where}: the weight contains NaN or inf, which quantization cannot represent")
        _set_tensor(model, name, t.to(dtype) if dtype is not None and t.is_floating_point() else t)


def _is_plain_embedding(model: nn.Module, name: str, plan: Mapping, shared_ok: bool) -> bool:
    """Whether `name` is the weight of an nn.Embedding the plan keeps in float, whose weight no
    other module computes with (a tied lm_head) unless shared_ok (the head never runs)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf != "weight" or not isinstance(module, nn.Embedding) or module_name in plan:
        return False
    return shared_ok or not any(m is not module and getattr(m, "weight", None) is module.weight
                                for m in model.modules())


def _as_float32(module, args, output):
    return output.to(torch.float32) if output.is_floating_point() else output


def _unload(model: nn.Module, names) -> None:
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if leaf in module._parameters and module._parameters[leaf] is not None:
            p = module._parameters[leaf]
            module._parameters[leaf] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)


class _Replay(nn.Module):
    """Stands in for a block: returns the last block's recorded output for each batch in turn
    (`batch` is shared by all the replays; the first advances it), in the form the block
    returned it (a tensor or a tuple)."""

    def __init__(self, outputs: list, as_tuple: bool, batch: dict, first: bool):
        super().__init__()
        self.outputs, self.as_tuple, self.batch, self.first = outputs, as_tuple, batch, first

    def forward(self, *args, **kwargs):
        if self.first:
            self.batch["index"] += 1
        out = self.outputs[self.batch["index"]]
        return (out,) if self.as_tuple else out


def quantize_pretrained(source, out, scheme_or_rules, *, method: str = "rtn", calibration=None, skip=(),
                        embeddings: bool = False, tied: str = "keep", dtype: torch.dtype | None = None,
                        tokenizer=None, max_shard_bytes: int = STREAM_SHARD_BYTES, overwrite: bool = False,
                        progress: bool | Callable | None = None, check_plan: Callable | None = None,
                        **gptq_options) -> ConversionSummary:
    """Quantize the Hugging Face model directory `source` into the directory `out` (an HF
    directory with a fewbits quantization_config: fb.from_pretrained and transformers load it),
    reading and writing tensor by tensor (see the module docstring for the memory bound).

    scheme_or_rules, skip, embeddings, tied: as fewbits.quantize_model. method: "rtn", "imatrix"
    (option damp) or "gptq" (the last two need calibration: model inputs as for quantize_model,
    e.g. dicts of input_ids). dtype: the dtype
    of the float tensors written and of the quantized tensors' dequantized values (default: the
    source's own, config.dtype); GPTQ computes in float32 either way. tokenizer: a tokenizer or
    directory saved beside the model (default: the source's tokenizer files, if any).
    check_plan: called with the plan {module name: scheme} and the model's skeleton (meta
    parameters: names, types and shapes) before any work, to refuse what an output format cannot
    hold. Returns a ConversionSummary.
    """
    from .hf_dir import ShardWriter, read_tensors

    start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "rtn" and gptq_options:
        raise TypeError(f"unexpected options for rtn: {', '.join(gptq_options)}")
    if method == "imatrix" and set(gptq_options) - {"damp"}:
        raise TypeError(f"unexpected options for imatrix: {', '.join(sorted(set(gptq_options) - {'damp'}))}")
    if method == "gptq":
        gptq_options = _gptq_options(gptq_options)  # checked before any work
    source = os.fspath(source)
    config = _read_config(source)
    tensors = read_tensors(source)
    out_dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(out_dtype, str):
        out_dtype = getattr(torch, out_dtype)
    try:
        model = model_skeleton(copy.deepcopy(config), torch.float32)  # (building a model sets its config's dtype)
    except ValueError as e:
        raise FileFormatError(os.path.join(source, "config.json"), str(e)) from None
    plan = resolve_plan(model, scheme_or_rules, skip, embeddings, tied=tied)
    if not plan:
        raise ValueError("no layer matched: nothing to quantize (check the rules and skip patterns)")
    if check_plan is not None:
        check_plan(plan, model)
    names = _parameters_to_load(model, tensors, plan)
    batches = calibration_batches(calibration) if method != "rtn" else None
    report = counter(progress, len(plan), method)
    writer = ShardWriter(out, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    written = {"params": 0, "bytes": 0}

    def emit(name: str, value) -> None:
        if isinstance(value, QuantizedTensor):
            written["params"] += value.numel
            written["bytes"] += value.nbytes
        else:
            written["params"] += value.numel()
            written["bytes"] += value.numel() * value.element_size()
        writer.add(name, value)

    try:
        if method == "rtn":
            _stream_rtn(tensors, names, plan, out_dtype, emit, report)
        elif method == "imatrix":
            importance = _stream_importance(model, tensors, names, plan, batches, gptq_options.get("damp", DAMP))
            _stream_rtn(tensors, names, plan, out_dtype, emit, report, importance)
        else:
            embedding_importance = {}
            if gptq_options.get("weighted_scales", WEIGHTED_SCALES) and any(
                    e != h for e, h in importance_sources(model, plan).items()):
                # a tied embedding is rounded under its head's input importance, as in memory
                # (gptq.tied_embedding_importance): one streamed pass of the float model first
                measured = _stream_importance(model, tensors, names, plan, batches, DAMP)
                embedding_importance = {n: measured[n] for n in plan
                                        if n in measured and not isinstance(model.get_submodule(n), nn.Linear)}
            _stream_gptq(model, tensors, names, plan, batches, out_dtype, emit, report, gptq_options,
                         embedding_importance)
        writer.finish(_output_config(config, model, names, plan),
                      tokenizer=tokenizer if tokenizer is not None else tokenizer_files(source))
    except BaseException:
        writer.abort()
        raise
    return ConversionSummary(layers=len(plan), parameters=written["params"], bytes=written["bytes"],
                             bits_per_param=written["bytes"] * 8 / max(written["params"], 1),
                             seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss_bytes(),
                             out=os.fspath(out))


def _output_config(config, model: nn.Module, names: Mapping, plan: Mapping):
    """The config written with the output: the source's, untied where the plan quantizes a tied
    weight on its own (tied="untie"), since the output then holds it twice."""
    untied = [n for n in _tied_aliases(model) if n in names and _owner_of(n, plan) is not None]
    if untied and getattr(config, "tie_word_embeddings", False):
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False
    return config


def tokenizer_files(source: str):
    """The source directory itself when it holds tokenizer files, else None."""
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model"):
        if os.path.isfile(os.path.join(source, f)):
            return source
    return None


def _stream_rtn(tensors, names, plan, out_dtype, emit, report, importance=None) -> None:
    """Every tensor read, quantized if planned (under its layer's importance, where given) and
    emitted, one at a time."""
    importance = importance or {}
    done = 0
    for name, key in names.items():
        owner = _owner_of(name, plan)
        t = tensors[key]
        if owner is None:
            emit(name, t.to(out_dtype) if t.is_floating_point() else t)
            continue
        with torch.no_grad():
            qt = _quantize_named(t.to(torch.float32), plan[owner], key, tensors, importance.get(owner))
        emit(name, _with_dtype(qt, out_dtype))
        del qt, t
        release_freed_memory()
        done += 1
        report(done, owner)


def _quantize_named(t: torch.Tensor, scheme, key: str, tensors, importance=None) -> QuantizedTensor:
    """quantize(t, scheme, importance=importance); a weight it cannot quantize (NaN or inf in it, a
    shape the scheme cannot hold) is a ValueError naming the tensor and its file."""
    try:
        return quantize(t, scheme, importance=importance)
    except ValueError as e:
        where = f" ({tensors.info(key)[2]})" if hasattr(tensors, "info") else ""
        raise ValueError(f"{key}{where}: {e}") from None


def _with_dtype(qt: QuantizedTensor, dtype: torch.dtype) -> QuantizedTensor:
    """The same codes and scales, dequantizing to `dtype` by default."""
    return QuantizedTensor.from_state_dict(qt.scheme, qt.shape, dtype, qt.state_dict())


def _stream_importance(model, tensors, names, plan, batches, damp: float) -> dict[str, torch.Tensor]:
    """{layer: importance} of every planned nn.Linear whose scheme takes it, from the float model
    streamed block by block over the calibration batches (see the module docstring); layers after
    the blocks (an untied head) from one pass of the model in which every block replays its
    recorded output. Leaves the model's parameters on the meta device again."""
    sources = importance_sources(model, plan)
    linear = sorted(set(sources.values()))
    if not linear:
        return {}
    # a tied head the plan leaves out (its weight is the embedding's) runs on the embedding's
    # loaded weight in the pass after the blocks
    ties = [(model.get_submodule(n), model.get_submodule(e)) for e, n in sources.items() if e != n]
    blocks, block_of, in_block, outside = _split_by_block(model, linear, names, "imatrix")
    post = [n for n in linear if block_of(n) is None]
    lookups = {n for n in outside if _is_plain_embedding(model, n, plan, shared_ok=not post)}
    _load(model, [n for n in outside if n not in lookups], tensors, torch.float32, plan)
    _load(model, lookups, tensors, None, plan)
    hooks = [model.get_submodule(n.rpartition(".")[0]).register_forward_hook(_as_float32) for n in lookups]
    collected = ImportanceHooks({n: model.get_submodule(n) for n in linear})
    originals = list(blocks)
    for head_module, embedding in ties:
        head_module._parameters["weight"] = embedding._parameters["weight"]
    try:
        cached = capture_block_inputs(model, blocks[0], batches)
        as_tuple = False
        with collected:
            for i, block in enumerate(blocks):
                _load(model, in_block[i], tensors, torch.float32, plan)
                if i == len(blocks) - 1 and post:
                    collected.active = False  # a probe of the block's output form, not a pass
                    with torch.no_grad():
                        as_tuple = not isinstance(block(cached[0][0], *cached[0][1], **cached[0][2]), torch.Tensor)
                    collected.active = True
                advance_block(block, cached)
                _unload(model, in_block[i])
                release_freed_memory()
            if post:
                outputs = [entry[0] for entry in cached]
                batch = {"index": -1}
                for j in range(len(blocks)):
                    blocks[j] = _Replay(outputs, as_tuple, batch, first=(j == 0))
                with torch.no_grad():
                    for b in batches:
                        run_batch(model, b, model_device(model))
        measured = collected.importance(damp)
        return {name: measured[source] for name, source in sources.items()}
    finally:
        for j, block in enumerate(originals):
            blocks[j] = block
        for h in hooks:
            h.remove()
        _unload(model, outside)
        for head_module, embedding in ties:  # tied again to the unloaded weight
            head_module._parameters["weight"] = embedding._parameters["weight"]


def _split_by_block(model, linear, names, method: str):
    """(the model's repeated blocks, block_of(name) -> block index or None, the tensor names of
    each block, the tensor names outside the blocks); a ValueError when the model has no stack
    of repeated blocks holding the `linear` layers."""
    found = _find_blocks(model, linear)
    if found is None:
        raise ValueError(f"streamed {method} needs a model made of repeated blocks (an nn.ModuleList of "
                         "decoder or encoder layers); quantize this one in memory with fewbits.quantize_model")
    prefix, blocks = found
    head = prefix + "."

    def block_of(name):
        return int(name[len(head):].split(".", 1)[0]) if name.startswith(head) else None

    in_block = [[] for _ in blocks]
    outside = []
    for name in names:
        b = block_of(name)
        (outside if b is None else in_block[b]).append(name)
    return blocks, block_of, in_block, outside


_GPTQ_OPTIONS = ("block_size", "damp", "act_order", "static_groups", "weighted_scales", "shrink")


def _gptq_options(options: Mapping) -> dict:
    """Every GPTQ option with its default filled in, checked (a TypeError for an unknown one, as
    gptq_quantize_model's, a ValueError for a bad value)."""
    unknown = sorted(set(options) - set(_GPTQ_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected options for gptq: {', '.join(unknown)}; options: {', '.join(_GPTQ_OPTIONS)}")
    full = {"block_size": 128, "damp": GPTQ_DAMP, "act_order": False, "static_groups": None,
            "weighted_scales": WEIGHTED_SCALES, "shrink": SHRINK, **options}
    check_options(full["block_size"], full["damp"], full["shrink"])
    if not isinstance(full["act_order"], bool) or not (full["static_groups"] is None or isinstance(full["static_groups"], bool)):
        raise TypeError("act_order must be a bool and static_groups a bool or None")
    return full


def _stream_gptq(model, tensors, names, plan, batches, out_dtype, emit, report, options,
                 embedding_importance=None) -> None:
    linear = [n for n in plan if isinstance(model.get_submodule(n), nn.Linear)]
    blocks, block_of, in_block, outside = _split_by_block(model, linear, names, "GPTQ")
    # an embedding that stays in float is looked up in the source's dtype and its rows cast to
    # float32 (the same values as a float32 table's rows, at half the memory for bf16 weights)
    after = any(block_of(n) is None for n in linear)  # a pass of the whole model will run (a tied head too)
    lookups = {n for n in outside if _is_plain_embedding(model, n, plan, shared_ok=not after)}
    _load(model, [n for n in outside if n not in lookups], tensors, torch.float32, plan)
    _load(model, lookups, tensors, None, plan)
    hooks = [model.get_submodule(n.rpartition(".")[0]).register_forward_hook(_as_float32) for n in lookups]
    modules = {n: model.get_submodule(n) for n in linear}
    run = _SequentialGPTQ(model, plan, batches, modules, _gptq_options(options), report)
    done_names = set()
    # planned layers outside the blocks, before them, cannot be streamed (nothing in the usual
    # layouts: an embedding is rounded to nearest, as in memory, a tied one under its head's importance)
    for name in plan:
        if name not in modules:
            with torch.no_grad():
                run.results[name] = quantize(run.weight_of(name), plan[name],
                                             importance=(embedding_importance or {}).get(name))
            run.swap_in(name)
            run.done += 1
            report(run.done, name)
    cached = capture_block_inputs(model, blocks[0], batches)
    as_tuple = False
    for i, block in enumerate(blocks):
        _load(model, in_block[i], tensors, torch.float32, plan)
        block_linear = {n: modules[n] for n in linear if block_of(n) == i}
        if block_linear:
            wrapper = _OneBlock(block)
            discovery = _Discovery(wrapper, tuple(cached[0]), block_linear, None)
            run.one_block(block, discovery.groups, discovery.calls, cached)
        if i == len(blocks) - 1:
            with torch.no_grad():
                as_tuple = not isinstance(block(cached[0][0], *cached[0][1], **cached[0][2]), torch.Tensor)
        advance_block(block, cached)
        for name in in_block[i]:
            owner = _owner_of(name, plan)
            if owner is not None:
                emit(name, _with_dtype(run.results.pop(owner), out_dtype))
                done_names.add(owner)
            else:
                t = model.get_parameter(name) if _is_parameter(model, name) else model.get_buffer(name)
                emit(name, t.detach().to(out_dtype) if t.is_floating_point() else t.detach())
        for p in block.parameters():
            run.originals.pop(id(p), None)
        _unload(model, in_block[i])
        release_freed_memory()
    post = [n for n in linear if block_of(n) is None]
    if post:
        outputs = [entry[0] for entry in cached]
        batch = {"index": -1}
        for j in range(len(blocks)):
            blocks[j] = _Replay(outputs, as_tuple, batch, first=(j == 0))
        groups = _Discovery(model, batches[0], {n: modules[n] for n in post}, None).groups
        for group in groups:
            batch["index"] = -1
            hessians = _passes(model, batches, {n: modules[n] for n in group}, stop_early=False)
            for name in group:
                run.finish(name, hessians.pop(name), swap=True)
    for name in outside:
        owner = _owner_of(name, plan)
        if owner is not None:
            emit(name, _with_dtype(run.results.pop(owner), out_dtype))
        else:
            t = run.originals.get(id(_tensor(model, name)), (None, _tensor(model, name)))[1]
            emit(name, t.detach().to(out_dtype) if t.is_floating_point() else t.detach())
    for h in hooks:
        h.remove()
    run.restore()


def _tensor(model, name):
    return model.get_parameter(name) if _is_parameter(model, name) else model.get_buffer(name)


def _is_parameter(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf in module._parameters


class _OneBlock(nn.Module):
    """Runs one block on a cached input [hidden, other args, kwargs] (for discovering the order
    and grouping of its layers, as _Discovery does on a whole model)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden, rest, kwargs):
        return _hidden_of(self.block(hidden, *rest, **kwargs))
