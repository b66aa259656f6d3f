"""The package's faces: `fewbits` and each room's `__init__` keep every public name they had
(the lists below were taken from the package as it stood before issue 13 item 6), every name a
face lists is there, and the top level presents names its rooms' faces export."""
from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import fewbits as fb

SRC = pathlib.Path(fb.__file__).resolve().parent

TOP_ALL = [
    "Format", "FloatFormat", "IntFormat", "LookupFormat", "MODES", "OVERFLOW_POLICIES", "get_format",
    "list_formats", "explain", "round", "encode", "decode", "pack", "unpack", "use_backend", "QuantScheme",
    "QuantizedTensor", "get_scheme", "list_schemes", "quantize", "quantize_model", "model_nbytes", "save",
    "load", "from_pretrained", "save_pretrained", "QuantLinear", "QuantEmbedding", "prepare_qat", "convert_qat",
    "layer_sensitivity",
    "allocate_bits", "apply_allocation", "Policy", "Engine", "LossScaler", "estimate_memory",
]
# besides __all__ (numpy, which the root imports first for torch's sake, is not a fewbits name)
TOP_OTHER = ["__version__", "atomic", "files", "formats", "kernels", "memory", "quant", "train"]

ROOM_ALL = {
    "formats": [
        "Format", "FloatFormat", "IntFormat", "LookupFormat", "NF4_VALUES", "SPECIALS", "MODES", "MODE_PRESETS",
        "OVERFLOW_POLICIES", "OVERFLOW_PRESETS", "get_format", "list_formats", "register", "torch_dtype",
        "normalize_name", "FLOAT_DTYPES", "describe", "aliases_of", "round_value", "encode_value",
        "decode_value", "check_mode",
    ],
    "kernels": ["round", "encode", "decode", "pack", "unpack", "code_dtype", "use_backend"],
    "quant": ["QuantScheme", "QuantizedTensor", "get_scheme", "list_schemes", "quantize"],
    "train": [
        "Policy", "PRESETS", "Engine", "LossScaler", "Telemetry", "cast", "round_to", "ScaledCast", "mx_round",
        "pow2_scale", "scaled_round", "PackedState", "StateStore", "pack_state", "save_checkpoint",
        "load_checkpoint", "read_checkpoint", "CheckpointError",
    ],
    "files": ["save", "load", "FileFormatError", "from_pretrained", "save_pretrained"],
    "memory": [
        "estimate_memory", "MemoryEstimate", "describe_model", "ModelSpec", "Tensors", "Architecture",
        "architecture_from_config", "load_config", "parse_parameter_count", "resolve_precision", "Precision",
        "measure_peak_memory", "measure_training_step", "measure_inference", "MeasuredMemory", "tensor_bytes",
        "format_bytes", "COMPONENTS", "MODES", "RUNTIMES", "DEVICES", "DEFAULT_SEQ_LEN", "OPTIMIZERS",
        "LLAMA_LIKE", "BERT_LIKE",
    ],
    "models": [
        "pydoc_text", "pydoc_topics", "pydoc_split", "pydoc_split_topics", "pydoc_sentences", "TextSplit",
        "load_minilm", "minilm_path", "embed", "embedding_quality", "EmbeddingQuality", "load_smollm2",
        "smollm2_gguf_path", "default_cache_dir", "perplexity", "PerplexityResult", "Q4_1_CAVEAT", "tiny_task",
        "TinyTask", "tiny_charlm_model", "train_classifier", "accuracy",
    ],
}


def test_the_top_level_keeps_its_names():
    assert fb.__all__ == TOP_ALL
    assert set(TOP_ALL + TOP_OTHER) <= set(dir(fb))


@pytest.mark.parametrize("room", sorted(ROOM_ALL))
def test_each_face_keeps_its_names_and_has_what_it_lists(room):
    face = importlib.import_module(f"fewbits.{room}")
    assert set(ROOM_ALL[room]) <= set(face.__all__)
    assert len(face.__all__) == len(set(face.__all__)), "a name listed twice"
    assert [n for n in face.__all__ if not hasattr(face, n)] == []


def test_the_top_level_presents_its_rooms_faces():
    """Each name of fb.__all__ is a name some room's face exports, the same object; and the root
    imports from faces only (`from .quant import ...`, never `from .quant.model import ...`)."""
    faces = [importlib.import_module(f"fewbits.{room}") for room in ROOM_ALL]
    for name in fb.__all__:
        assert any(name in face.__all__ and getattr(face, name) is getattr(fb, name) for face in faces), name
    deep = []
    for node in ast.parse((SRC / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and "." in node.module:
            deep.append(node.module)
    assert deep == []


def test_face_names_do_not_hide_submodules():
    """A face exporting a name that is also one of its modules (`formats.explain` the function and
    `formats/explain.py`) would make `import fewbits.formats.explain as m` return the function."""
    clashes = []
    for room in ROOM_ALL:
        face = importlib.import_module(f"fewbits.{room}")
        modules = {p.stem for p in (SRC / room).glob("*.py")} | {p.name for p in (SRC / room).iterdir() if p.is_dir()}
        clashes += [f"fewbits.{room}.{n}" for n in face.__all__ if n in modules]
    assert clashes == []


@pytest.mark.parametrize("room", sorted(ROOM_ALL))
def test_a_face_exports_what_its_modules_declare(room):
    """A module's __all__ is public API: its room's face exports each of those names."""
    face = importlib.import_module(f"fewbits.{room}")
    missing = []
    for path in sorted((SRC / room).glob("*.py")):
        if path.name != "__init__.py":
            module = importlib.import_module(f"fewbits.{room}.{path.stem}")
            missing += [f"{path.stem}.{n}" for n in getattr(module, "__all__", ()) if n not in face.__all__]
    assert missing == []
