"""Quantization: schemes, quantized tensors, quantized modules, model-level tools (files are in
fewbits.files). This face exports the public names of every module of the package."""
from .scheme import (
    GRANULARITIES, MX_SCALE_MODES, SCALE_FORMATS, SCALE_METHODS, ZERO_POINTS, QuantScheme, get_scheme, list_schemes,
)
from .tensor import QuantizedTensor, quantize
from .modules import KERNELS, KernelQuantizedTensor, QuantEmbedding, QuantLinear, available_kernels
from .model import model_nbytes, quantize_model
from .gptq import (
    GPTQResult, collect_hessians, gptq_quantize_model, gptq_quantize_weight, gptq_solve, hessian_error,
)
from .qat import (
    STE_MODES, FakeQuantLinear, convert_qat, fake_quantize, fake_quantize_reference, fake_quantize_ste,
    is_fake_quantized, is_quantized, prepare_qat,
)
from .sensitivity import (
    FLOAT, METRICS, SIZES, Allocation, AllocationReport, KnapsackSolution, LayerInfo, SensitivityRecord,
    SensitivityTable, allocate_bits, apply_allocation, call_model, knapsack_brute_force, lagrangian_lower_bound,
    layer_sensitivity, output_tensor, solve_knapsack, sqnr_db, uniform_allocation,
)

__all__ = [
    # schemes and tensors
    "QuantScheme", "get_scheme", "list_schemes", "GRANULARITIES", "SCALE_FORMATS", "SCALE_METHODS", "ZERO_POINTS",
    "MX_SCALE_MODES", "QuantizedTensor", "quantize",
    # modules
    "QuantLinear", "QuantEmbedding", "KernelQuantizedTensor", "available_kernels", "KERNELS",
    # models
    "quantize_model", "model_nbytes", "is_quantized", "call_model",
    # GPTQ
    "GPTQResult", "gptq_solve", "gptq_quantize_weight", "hessian_error", "collect_hessians", "gptq_quantize_model",
    # quantization-aware training
    "FakeQuantLinear", "fake_quantize", "fake_quantize_reference", "fake_quantize_ste", "prepare_qat", "convert_qat",
    "is_fake_quantized", "STE_MODES",
    # sensitivity and bit allocation
    "SensitivityRecord", "SensitivityTable", "LayerInfo", "layer_sensitivity", "Allocation", "allocate_bits",
    "uniform_allocation", "apply_allocation", "AllocationReport", "solve_knapsack", "knapsack_brute_force",
    "lagrangian_lower_bound", "KnapsackSolution", "sqnr_db", "output_tensor", "METRICS", "SIZES", "FLOAT",
]
