"""Memory of a model in a given precision: predicted before running, measured while running.

    est = fb.estimate_memory("7B", mode="training", policy="bf16-mixed")
    est = fb.estimate_memory(model, mode="inference", scheme="nf4_dq", batch=4, seq_len=1024)
    est = fb.estimate_memory("path/to/config.json", mode="training", policy="bf16-pure")
    est.total, est.peak_phase, est.components, est.at_peak

What is predicted (bytes; decimal units in the tables, GB = 10^9 bytes):
  weights           the stored weights in their format, scales and zero points included
  master_weights    a separate higher-precision copy the optimizer updates (when the policy has one)
  gradients         one gradient per parameter
  optimizer_states  the optimizer's per-parameter state (AdamW: two), step counters included
  activations       training: the tensors autograd saves for the backward pass;
                    inference: the live intermediate tensors at the forward's busiest point
  kv_cache          keys and values cached by a causal LM's forward (inference)
  workspace         short-lived buffers alive at the peak: the loss gradients over the vocabulary,
                    optimizer temporaries, low-precision copies of the weights made by autocast,
                    dequantized weights of a quantized layer
and `total`, the peak: the largest sum of what is alive at once, over the phases of the step
(forward, loss gradient, lm-head backward, optimizer step). `at_peak` gives each component's
share of that peak and `peak_phase` names the phase.

Where the numbers come from: parameter counts and shapes from the module itself, from a
Hugging Face config.json (llama-like and bert-like models), or from a bare count ("7B"). The
activation terms are per-token byte counts of what the Hugging Face implementations of these two
families save for backward (sdpa attention, a causal-LM loss over the vocabulary), in the three
ways PyTorch runs a precision policy: all in one dtype (fp32, or bf16 "pure"), or fp32 parameters
under torch.autocast ("mixed"). They were derived op by op and are checked against measurement:
`measure_peak_memory` reads the CPU allocator's own running total through torch's profiler
(every allocation and free made by torch's CPU allocator, not an estimate) or CUDA's peak-memory
counter; tests/test_memory.py and benchmarks/bench_memory.py compare the two.

Runtimes: runtime="torch" (the default) predicts stock PyTorch: a policy whose working weights
are narrower than its fp32 master runs as fp32 parameters under autocast (the master is the
parameter, the working copy is autocast's weight cache); a policy without master stores the
parameters in its weight format, and torch.optim keeps optimizer states in the parameter dtype.
runtime="fewbits" predicts fewbits.train.Engine, which keeps low-precision working weights beside
fp32 masters, fp32 gradient buffers that persist between steps, norms in fp32, outputs returned in
fp32, and states in the policy's format (its int8_blockwise packing temporaries are not modelled).

Validated on a CPU (tests and benchmarks/bench_memory.py): llama-like and bert-like models,
inference in fp32, bf16 and under autocast, training steps under fp32, bf16-mixed and bf16-pure
(both runtimes). device="cuda" changes the attention kernels and the optimizer's temporaries
(foreach) by derivation, not by measurement.

Parts: architecture.py (parameter tensors and the transformer shapes, from a module, a config or a
count), precision.py (how each tensor role is stored under a scheme or a policy), estimate.py (the
components and the peak), measure.py (the allocator's record of a real call), storage.py (bytes held).
"""
from .architecture import (
    BERT_LIKE, LLAMA_LIKE, Architecture, ModelSpec, Tensors, architecture_from_config, describe_model, load_config,
    parse_parameter_count,
)
from .estimate import (
    COMPONENTS, DEFAULT_SEQ_LEN, DEVICES, MODES, OPTIMIZERS, RUNTIMES, MemoryEstimate, estimate_memory, format_bytes,
)
from .measure import measure_inference, measure_training_step
from .peak import MeasuredMemory, measure_peak_memory
from .precision import Precision, resolve_precision
from .storage import tensor_bytes

__all__ = [
    "estimate_memory", "MemoryEstimate", "describe_model", "ModelSpec", "Tensors", "Architecture",
    "architecture_from_config", "load_config", "parse_parameter_count", "resolve_precision", "Precision",
    "measure_peak_memory", "measure_training_step", "measure_inference", "MeasuredMemory", "tensor_bytes",
    "format_bytes", "COMPONENTS", "MODES", "RUNTIMES", "DEVICES", "DEFAULT_SEQ_LEN", "OPTIMIZERS",
    "LLAMA_LIKE", "BERT_LIKE",
]
