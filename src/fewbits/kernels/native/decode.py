"""Bindings of decode.c: one decode step of a Llama-architecture model in one C call
(`DecodeStep`), its linear layers handed over as `RowKernel`s (a function address and its
arguments)."""
from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable

import torch


def declare_decode(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.fb_decode_step.argtypes = [p, p, i64]
    lib.fb_decode_step.restype = ctypes.c_int32
    lib.fb_decode_rms_norm.argtypes = [p, p, f32, i64, p]
    lib.fb_decode_rms_norm.restype = None
    lib.fb_decode_rope.argtypes = [p, i64, i64, p, p]
    lib.fb_decode_rope.restype = None
    lib.fb_decode_attend.argtypes = [p, p, p, i64, i64, i64, i64, i64, f32, f32, p, p]
    lib.fb_decode_attend.restype = None
    lib.fb_decode_silu_mul.argtypes = [p, p, i64]
    lib.fb_decode_silu_mul.restype = None
    lib.fb_decode_gelu_tanh_mul.argtypes = [p, p, i64]
    lib.fb_decode_gelu_tanh_mul.restype = None
    lib.fb_decode_exp.argtypes = [p, i64, p]
    lib.fb_decode_exp.restype = None


def function_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of one of the library's functions, for C code that calls it (RowKernel)."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


@dataclasses.dataclass(frozen=True)
class RowKernel:
    """A layer's one-row C call, y [out] = f(args, x [in]) (+ bias): the address of a function
    of this library taking (const void *args, const float *x, float *y) and returning an int32
    code, its argument address, the code's check (raises for non-zero), a float32 bias or None,
    and what keeps the arguments alive (the prepared weight)."""

    function: int
    args: int
    check: Callable[[int], None]
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    keep: object


class _DecLin(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("out", ctypes.c_int64)]


DECODE_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
DECODE_MAX_HEAD_DIM = 512  # decode.c's rotary buffer


def decode_heads_ok(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether fb_decode_step takes these attention shapes."""
    return 2 <= head_dim <= DECODE_MAX_HEAD_DIM and head_dim % 2 == 0 and kv_heads >= 1 and heads % kv_heads == 0


class _DecLayer(ctypes.Structure):
    _fields_ = [(n, _DecLin) for n in DECODE_LINEARS] + [
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("eps_q", ctypes.c_float), ("eps_k", ctypes.c_float),
        ("post1", ctypes.c_void_p), ("post2", ctypes.c_void_p), ("eps_p1", ctypes.c_float), ("eps_p2", ctypes.c_float),
        ("act", ctypes.c_int32), ("window", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("softcap", ctypes.c_float)]
ACTIVATIONS = ("silu", "gelu_tanh")  # decode.c's act codes 0, 1


class _DecModel(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("layers", "d", "heads", "kv_heads", "head_dim", "inter", "capacity")]
                + [("layer", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                   ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("scaling", ctypes.c_float),
                   ("norm_f", ctypes.c_void_p), ("eps_f", ctypes.c_float)]
                + [(n, ctypes.c_void_p) for n in ("x", "q", "k", "v", "att", "g", "u", "o", "scores")]
                + [("failed_layer", ctypes.c_int64), ("failed_linear", ctypes.c_int64)])


def _f32_vector(t, n: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu" or t.numel() != n:
        raise ValueError(f"{what} must be a CPU float32 tensor of {n} values")
    return t.detach().reshape(-1).contiguous()


class DecodeStep:
    """decode.c's fb_decode_step over one model: every layer of a Llama-architecture decoder for
    one token in one C call (see decode.c), the linear layers through their RowKernels.

    layers: per layer a dict of RowKernels q, k, v, o, gate, up, down and the float32 RMSNorm
    weights norm1, norm2 with their eps1, eps2 (and, for Qwen3, q_norm, k_norm [head_dim] with eps_q,
    eps_k: each head of q and k RMS-normalized before the rotation). k_cache, v_cache: float32 contiguous [layers, 1,
    kv_heads, capacity, head_dim], written at each step's position. cos, sin: float32
    [capacity, head_dim], the rotary embedding of each position. Shapes are checked here, once;
    the tensors are held for the object's life.

    Optional per layer: post1, post2 with eps_p1, eps_p2 (Gemma 3's norms of the attention's and
    the MLP's outputs), act ("silu", the default, or "gelu_tanh"), window (attend over the last
    `window` positions; 0 or absent: all), cos / sin (this layer's rotary embedding), softcap
    (Gemma 2: attention scores as softcap * tanh(score / softcap); 0 or absent: none). Fused
    projections (Phi-3): k and v None with q a kernel of q, k and v's rows, up None with gate one
    of gate's and up's -- in every layer or in none.
    """

    def __init__(self, lib: ctypes.CDLL, layers: list[dict], norm_f: torch.Tensor, eps_f: float,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 heads: int, kv_heads: int, head_dim: int, scaling: float):
        if not layers:
            raise ValueError("a decode step needs at least one layer")
        if not decode_heads_ok(heads, kv_heads, head_dim):
            raise ValueError(f"unsupported heads {heads}, kv heads {kv_heads}, head_dim {head_dim}")
        first = layers[0]
        if not all(isinstance(first.get(n), RowKernel) for n in ("q", "gate")):
            raise ValueError("layer 0 q and gate must be RowKernels")
        fused_qkv, fused_mlp = first.get("k") is None, first.get("up") is None
        for i, spec in enumerate(layers):
            if (spec.get("k") is None, spec.get("v") is None) != (fused_qkv, fused_qkv) \
                    or (spec.get("up") is None) != fused_mlp:
                raise ValueError(f"layer {i}: fused projections (k, v or up None) in every layer or in none")
        d = first["q"].in_features
        inter = first["gate"].out_features // (2 if fused_mlp else 1)
        qkv = (heads + 2 * kv_heads) * head_dim if fused_qkv else heads * head_dim
        want = {"q": (d, qkv), "k": (d, kv_heads * head_dim), "v": (d, kv_heads * head_dim),
                "o": (heads * head_dim, d), "gate": (d, inter * (2 if fused_mlp else 1)), "up": (d, inter),
                "down": (inter, d)}
        shape = (len(layers), 1, kv_heads, k_cache.shape[3] if k_cache.dim() == 5 else -1, head_dim)
        capacity = shape[3]
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (c.dtype != torch.float32 or c.device.type != "cpu" or tuple(c.shape) != shape or capacity < 1
                    or not c.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous CPU float32 tensor [layers, 1, kv_heads, capacity, "
                                 f"head_dim] = {shape}, got {c.dtype} {tuple(c.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != torch.float32 or tuple(t.shape) != (capacity, head_dim) or t.device.type != "cpu":
                raise ValueError(f"{name} must be CPU float32 [{capacity}, {head_dim}], got {t.dtype} {tuple(t.shape)}")
        self._keep: list = [k_cache, v_cache]
        self._layers = (_DecLayer * len(layers))()
        self.kernels: list[dict] = []
        for i, spec in enumerate(layers):
            entry = self._layers[i]
            for name in DECODE_LINEARS:
                rk = spec[name]
                if rk is None and ((name in ("k", "v") and fused_qkv) or (name == "up" and fused_mlp)):
                    continue  # in q's / gate's output
                if not isinstance(rk, RowKernel) or (rk.in_features, rk.out_features) != want[name]:
                    got = (rk.in_features, rk.out_features) if isinstance(rk, RowKernel) else type(rk).__name__
                    raise ValueError(f"layer {i} {name}: a RowKernel of (in, out) = {want[name]} expected, got {got}")
                bias = None if rk.bias is None else _f32_vector(rk.bias, rk.out_features, f"layer {i} {name}'s bias")
                self._keep += [rk.keep, bias]
                setattr(entry, name, _DecLin(rk.function, rk.args, bias.data_ptr() if bias is not None else None,
                                             rk.out_features))
            for k in ("norm1", "norm2"):
                w = _f32_vector(spec[k], d, f"layer {i} {k}")
                self._keep.append(w)
                setattr(entry, k, w.data_ptr())
            entry.eps1, entry.eps2 = float(spec["eps1"]), float(spec["eps2"])
            for k, eps, n in (("q_norm", "eps_q", head_dim), ("k_norm", "eps_k", head_dim),  # optional
                              ("post1", "eps_p1", d), ("post2", "eps_p2", d)):
                if spec.get(k) is not None:
                    w = _f32_vector(spec[k], n, f"layer {i} {k}")
                    self._keep.append(w)
                    setattr(entry, k, w.data_ptr())
                    setattr(entry, eps, float(spec[eps]))
            act = spec.get("act", "silu")
            if act not in ACTIVATIONS:
                raise ValueError(f"layer {i}: act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
            entry.act = ACTIVATIONS.index(act)
            window = spec.get("window") or 0
            if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < 2 ** 62:
                raise ValueError(f"layer {i}: window must be a non-negative int, got {window!r}")
            entry.window = window
            softcap = spec.get("softcap") or 0.0
            if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < float("inf"):
                raise ValueError(f"layer {i}: softcap must be a finite number >= 0, got {softcap!r}")
            entry.softcap = float(softcap)
            for k in ("cos", "sin"):
                t = spec.get(k)
                if t is not None:
                    if t.dtype != torch.float32 or tuple(t.shape) != (capacity, head_dim) or t.device.type != "cpu":
                        raise ValueError(f"layer {i} {k} must be CPU float32 [{capacity}, {head_dim}]")
                    t = t.contiguous()
                    self._keep.append(t)
                    setattr(entry, k, t.data_ptr())
            self.kernels.append({name: spec.get(name) for name in DECODE_LINEARS})
        norm_f = _f32_vector(norm_f, d, "the final norm's weight")
        cos, sin = cos.contiguous(), sin.contiguous()
        sizes = {"x": d, "q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim,
                 "att": heads * head_dim, "g": inter, "u": inter, "o": d, "scores": heads * capacity}
        self._scratch = {n: torch.empty(v, dtype=torch.float32) for n, v in sizes.items()}
        if fused_qkv:  # q's kernel writes q, k, v one after the other
            qkv_buf = torch.empty(qkv, dtype=torch.float32)
            self._scratch["q"], self._scratch["k"], self._scratch["v"] = qkv_buf.split(
                [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        if fused_mlp:  # gate's kernel writes gate, then up
            self._scratch["g"], self._scratch["u"] = torch.empty(2 * inter, dtype=torch.float32).split([inter, inter])
        self._keep += [norm_f, cos, sin]
        self._model = _DecModel(len(layers), d, heads, kv_heads, head_dim, inter, capacity,
                                ctypes.addressof(self._layers), k_cache.data_ptr(), v_cache.data_ptr(),
                                cos.data_ptr(), sin.data_ptr(), float(scaling), norm_f.data_ptr(), float(eps_f),
                                *(self._scratch[n].data_ptr() for n in sizes), -1, -1)
        self._address = ctypes.addressof(self._model)
        self._lib = lib
        self.d, self.capacity = d, capacity
        self.out = self._scratch["x"]  # the final norm of the last step's hidden state

    def __call__(self, h: torch.Tensor, pos: int) -> torch.Tensor:
        """h [d] float32 contiguous (the token's embedding, overwritten with the last layer's
        output) at position pos -> the final RMSNorm of it, [d] (self.out: the next call
        overwrites it)."""
        if h.dtype != torch.float32 or h.numel() != self.d or not h.is_contiguous() or h.device.type != "cpu":
            raise ValueError(f"h must be a contiguous CPU float32 tensor of {self.d} values")
        if not 0 <= pos < self.capacity:
            raise ValueError(f"position {pos} is outside the cache's {self.capacity} positions")
        rc = self._lib.fb_decode_step(self._address, h.data_ptr(), pos)
        if rc:
            m = self._model
            if m.failed_layer >= 0:
                self.kernels[m.failed_layer][DECODE_LINEARS[m.failed_linear]].check(rc)
            raise RuntimeError(f"the decode step refused its arguments (code {rc})")
        return self.out
