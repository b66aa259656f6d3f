"""Quantization: schemes, quantized tensors, quantized modules, model-level tools (files are in
fewbits.files). This face exports the public names of every module of the package."""
from .scheme import (
    GRANULARITIES, MX_SCALE_MODES, SCALE_FORMATS, SCALE_METHODS, ZERO_POINTS, QuantScheme, get_scheme, list_schemes,
)
from .tensor import QuantizedTensor, quantize
from .modules import KERNELS, KernelQuantizedTensor, QuantEmbedding, QuantLinear, available_kernels
from .plan import (
    TIED, calibration_batches, call_model, is_quantized, quantizable_modules, quantized_module, resolve_plan,
    set_submodule, tied_weights,
)
from .model import METHODS, model_nbytes, quantize_model
from .gptq import (
    GPTQResult, collect_hessians, gptq_quantize_model, gptq_quantize_weight, gptq_solve, hessian_error,
)
from .qat import (
    STE_MODES, FakeQuantLinear, convert_qat, fake_quantize, fake_quantize_reference, fake_quantize_ste,
    is_fake_quantized, prepare_qat,
)
from .sensitivity import (
    FLOAT, METRICS, SIZES, Allocation, AllocationReport, KnapsackSolution, LayerInfo, SensitivityRecord,
    SensitivityTable, allocate_bits, apply_allocation, knapsack_brute_force, lagrangian_lower_bound,
    layer_sensitivity, output_tensor, solve_knapsack, sqnr_db, uniform_allocation,
)

__all__ = [
    # schemes and tensors
    "QuantScheme", "get_scheme", "list_schemes", "GRANULARITIES", "SCALE_FORMATS", "SCALE_METHODS", "ZERO_POINTS",
    "MX_SCALE_MODES", "QuantizedTensor", "quantize",
    # modules
    "QuantLinear", "QuantEmbedding", "KernelQuantizedTensor", "available_kernels", "KERNELS",
    # the plan (which layer gets which scheme) and models
    "resolve_plan", "TIED", "tied_weights", "quantizable_modules", "is_quantized", "quantized_module", "set_submodule",
    "calibration_batches", "call_model", "quantize_model", "METHODS", "model_nbytes",
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
