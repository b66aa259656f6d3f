"""Fast vectorized kernels: rounding in every mode and overflow policy, encode/decode, packing."""
from .compile import use_backend
from .packing import ORDERS, pack, pack_reference, packed_nbytes, unpack, unpack_reference
from .rounding import code_dtype, decode, encode, round

__all__ = ["round", "encode", "decode", "pack", "unpack", "code_dtype", "use_backend",
           "packed_nbytes", "pack_reference", "unpack_reference", "ORDERS"]
