"""Memory of a model in a given precision: predicted before running, measured while running."""
from .estimate import (
    BERT_LIKE, COMPONENTS, DEFAULT_SEQ_LEN, DEVICES, LLAMA_LIKE, MODES, OPTIMIZERS, RUNTIMES, Architecture,
    MeasuredMemory, MemoryEstimate, ModelSpec, Precision, Tensors, architecture_from_config, describe_model,
    estimate_memory, format_bytes, load_config, measure_inference, measure_peak_memory, measure_training_step,
    parse_parameter_count, resolve_precision, tensor_bytes,
)
