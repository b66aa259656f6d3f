"""Optimizer-side precision: how optimizer states are stored between steps, and how an update
lands in low-precision weights when there is no master copy.

State storage (any torch.optim optimizer): after each step, every floating state tensor shaped
like its parameter is packed into the policy's `optimizer_states` format; before the next step it
is unpacked into float32 for the optimizer's own arithmetic. Packed forms:
  bf16 / fp16          the torch dtype (2 bytes a value)
  formats of <= 8 bits fewbits codes, one uint8 each (fb.encode / fb.decode)
  int8_blockwise       blocks of 256 values with one float32 scale each (bitsandbytes' layout);
                       signed states: int8 = round(v / (absmax / 127)); non-negative states
                       (second moments) use an unsigned 8-bit float with 4 exponent bits, so small
                       values keep a relative precision instead of rounding to zero, which would
                       blow up Adam's v-denominator
  anything else        float32 holding the rounded values (emulation: no memory saved)

Updates without a master copy: the optimizer steps a float32 copy of the stored weights that
lives only for the step; the result lands by `update_rounding`:
  nearest     the stored weights are the nearest values (updates under half a spacing vanish)
  stochastic  unbiased stochastic rounding (vanishes only on average as often as it should)
  kahan       compensated summation: what rounding lost is kept in a buffer of the weights'
              format and added to the next update
"""
from __future__ import annotations

import torch

from ..formats import FloatFormat, get_format
from ..kernels import decode, encode
from .casts import native_dtype, round_to

BLOCK = 256
UNSIGNED_8BIT = FloatFormat(exp_bits=4, man_bits=4, signed=False, specials="none")


class PackedState:
    """One optimizer state tensor stored in a narrow format between steps."""

    def __init__(self, kind: str, shape, data: torch.Tensor, scales: torch.Tensor | None = None,
                 fmt: str | None = None, unsigned: bool = False):
        self.kind, self.shape, self.data, self.scales = kind, tuple(shape), data, scales
        self.fmt, self.unsigned = fmt, unsigned

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (self.scales.numel() * self.scales.element_size() if self.scales is not None else 0)

    def unpack(self) -> torch.Tensor:
        if self.kind == "dtype" or self.kind == "values":
            return self.data.float().reshape(self.shape)
        if self.kind == "codes":
            return decode(self.data, self.fmt, dtype=torch.float32).reshape(self.shape)
        # blockwise
        if self.unsigned:
            vals = decode(self.data, UNSIGNED_8BIT, dtype=torch.float32)
        else:
            vals = self.data.float()
        vals = vals.reshape(-1, BLOCK) * self.scales[:, None]
        n = 1
        for s in self.shape:
            n *= s
        return vals.reshape(-1)[:n].reshape(self.shape)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "shape": list(self.shape), "data": self.data, "scales": self.scales,
                "fmt": self.fmt, "unsigned": self.unsigned}

    @classmethod
    def from_dict(cls, d: dict) -> PackedState:
        return cls(d["kind"], d["shape"], d["data"], d["scales"], d["fmt"], d["unsigned"])


def packed_kind(fmt_name: str) -> str:
    """How states in the storage `fmt_name` are packed: blockwise, dtype, codes or values."""
    if fmt_name == "int8_blockwise":
        return "blockwise"
    fmt = get_format(fmt_name)
    if native_dtype(fmt.name) is not None:
        return "dtype"
    return "codes" if fmt.bits <= 8 else "values"


def pack_state(v: torch.Tensor, fmt_name: str, mode: str = "nearest_even",
               generator: torch.Generator | None = None) -> PackedState:
    """v (float32) in the storage `fmt_name` ('int8_blockwise' or a fewbits format name)."""
    kind = packed_kind(fmt_name)
    if kind == "blockwise":
        return _pack_blockwise(v, mode, generator)
    fmt = get_format(fmt_name)
    if kind == "dtype":
        return PackedState("dtype", v.shape, round_to(v, fmt, mode, generator=generator).to(native_dtype(fmt.name)))
    if kind == "codes":
        return PackedState("codes", v.shape, encode(v, fmt, mode=mode, generator=generator), fmt=fmt.name)
    return PackedState("values", v.shape, round_to(v, fmt, mode, generator=generator), fmt=fmt.name)


def check_packed_dict(d, fmt_name: str, shape: tuple) -> str | None:
    """What is wrong with `d` as PackedState.to_dict() of a state of `shape` stored in `fmt_name`
    (None: nothing). A checkpoint's packed states are checked with it before any is loaded."""
    if not isinstance(d, dict) or set(d) != {"kind", "shape", "data", "scales", "fmt", "unsigned"}:
        return "not a packed state (keys kind, shape, data, scales, fmt, unsigned)"
    kind = packed_kind(fmt_name)
    if d["kind"] != kind:
        return f"packed as {d['kind']!r}, states in {fmt_name} are packed as {kind!r}"
    if not (isinstance(d["shape"], (list, tuple)) and all(type(s) is int for s in d["shape"])
            and tuple(d["shape"]) == tuple(shape)):
        return f"shape {d['shape']!r}, the parameter's is {list(shape)}"
    data, scales, unsigned = d["data"], d["scales"], d["unsigned"]
    if not isinstance(data, torch.Tensor):
        return "its data is not a tensor"
    if not isinstance(unsigned, bool):
        return f"unsigned={unsigned!r} is not a bool"
    n = 1
    for s in shape:
        n *= s
    if kind == "blockwise":
        blocks = -(-n // BLOCK)
        want = torch.uint8 if unsigned else torch.int8
        if data.dtype != want or tuple(data.shape) != (blocks * BLOCK,):
            return f"data {data.dtype} of {data.numel()} values, expected {want} of {blocks * BLOCK}"
        if not (isinstance(scales, torch.Tensor) and scales.dtype == torch.float32 and scales.dim() == 1
                and scales.numel() == blocks):
            return f"scales must be {blocks} float32 values"
        if d["fmt"] is not None:
            return f"fmt={d['fmt']!r}, blockwise states have none"
        return None
    fmt = get_format(fmt_name)
    want = {"dtype": native_dtype(fmt.name), "codes": torch.uint8, "values": torch.float32}[kind]
    if data.dtype != want or tuple(data.shape) != tuple(shape):
        return f"data {data.dtype} {tuple(data.shape)}, expected {want} {tuple(shape)}"
    if scales is not None or unsigned:
        return "scales or unsigned given for a state without blocks"
    if d["fmt"] != (None if kind == "dtype" else fmt.name):
        return f"fmt={d['fmt']!r}, expected {None if kind == 'dtype' else fmt.name!r}"
    return None


def _pack_blockwise(v: torch.Tensor, mode: str, generator) -> PackedState:
    flat = v.detach().float().reshape(-1)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    unsigned = bool((flat >= 0).all())
    top = UNSIGNED_8BIT.max if unsigned else 127.0
    scales = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax))
    scaled = blocks / scales[:, None]
    if unsigned:
        codes = encode(scaled, UNSIGNED_8BIT, mode=mode, overflow="saturate", generator=generator)
    else:
        int8 = get_format("int8")
        codes = round_to(scaled, int8, mode, "saturate", generator).to(torch.int8)
    return PackedState("blockwise", v.shape, codes.reshape(-1), scales, unsigned=unsigned)


class StateStore:
    """Packs and unpacks the states of one torch optimizer in a given format."""

    def __init__(self, optimizer: torch.optim.Optimizer, fmt_name: str, mode: str = "nearest_even",
                 generator: torch.Generator | None = None):
        self.optimizer, self.fmt_name, self.mode, self.generator = optimizer, fmt_name, mode, generator
        self.active = fmt_name != "fp32"

    def _states(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if st:
                    yield p, st

    def unpack(self) -> None:
        if not self.active:
            return
        for _, st in self._states():
            for k, v in st.items():
                if isinstance(v, PackedState):
                    st[k] = v.unpack()

    def pack(self) -> None:
        if not self.active:
            return
        for p, st in self._states():
            for k, v in st.items():
                if (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1
                        and v.numel() == _numel(p, v)):
                    st[k] = pack_state(v, self.fmt_name, self.mode, self.generator)

    def nbytes(self) -> int:
        total = 0
        for _, st in self._states():
            for v in st.values():
                if isinstance(v, PackedState):
                    total += v.nbytes
                elif isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total


def _numel(p: torch.Tensor, v: torch.Tensor) -> int:
    # a shadow parameter may be empty between steps; states keep the full shape
    return v.numel() if p.numel() == 0 else p.numel()


def land_update(stored: torch.Tensor, new_value: torch.Tensor, fmt, rule: str,
                compensation: torch.Tensor | None = None, generator: torch.Generator | None = None) -> None:
    """Write the optimizer's float32 result `new_value` into the low-precision `stored` tensor.

    rule: nearest | stochastic | kahan (kahan needs `compensation`, a tensor like `stored`)."""
    if rule == "nearest":
        stored.copy_(round_to(new_value, fmt).to(stored.dtype))
    elif rule == "stochastic":
        stored.copy_(round_to(new_value, fmt, "stochastic", generator=generator).to(stored.dtype))
    elif rule == "kahan":
        if compensation is None:
            raise ValueError("kahan updates need a compensation buffer")
        old = stored.float()
        y = (new_value - old).add_(compensation.float())   # this step's update plus what was lost before
        landed = round_to(old + y, fmt).to(stored.dtype)
        lost = y.sub_(landed.float() - old)                  # the part of y the rounding dropped
        compensation.copy_(round_to(lost, fmt).to(compensation.dtype))
        stored.copy_(landed)
    else:
        raise ValueError(f"update rule {rule!r}: choose nearest, stochastic or kahan")
