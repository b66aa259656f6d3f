"""The estimate: bytes per component and the peak over the phases of a forward or a training step
(see the package docstring for what is predicted and where the numbers come from)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..formats import get_format
from ..train.optim import packed_kind
from .architecture import Architecture, ModelSpec, Tensors, describe_model
from .precision import Precision, _format_bytes, _state_bytes, resolve_precision


def _bf16_matmul_float32_buffer() -> bool:
    """peak.bf16_matmul_float32_buffer: whether this CPU's bf16 matmuls allocate a float32
    output buffer (probed once, when an estimate first needs it)."""
    from .peak import bf16_matmul_float32_buffer
    return bf16_matmul_float32_buffer()

COMPONENTS = ("weights", "master_weights", "gradients", "optimizer_states", "activations", "kv_cache",
              "workspace")
MODES = ("inference", "training")
RUNTIMES = ("torch", "fewbits")
DEVICES = ("cpu", "cuda")
DEFAULT_SEQ_LEN = 512


def format_bytes(n: float) -> str:
    """Decimal units, three significant digits: 1.00 GB, 750 MB, 12.3 kB; 0 for nothing."""
    if n is None:
        return "—"
    n = float(n)
    if n == 0:
        return "0"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:#.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------
OPTIMIZERS = {"adamw": 2, "adam": 2, "adamw8bit": 2, "lion": 1, "sgd": 0, "sgd_momentum": 1, "adafactor": 0}


@dataclass
class MemoryEstimate:
    """Bytes per component (full size), bytes of each component alive at the peak, the peak
    (`total`) and the phase it occurs in."""
    model: str
    mode: str
    precision: str
    parameters: int
    components: dict[str, int]
    at_peak: dict[str, int]
    total: int
    peak_phase: str
    phases: dict[str, int]
    batch: int
    seq_len: int
    optimizer: str | None
    weight_bits: float
    architecture: str | None
    notes: list[str] = field(default_factory=list)
    workspace_parts: dict[str, int] = field(default_factory=dict)

    def __getattr__(self, name):  # est.weights, est.gradients, ... read the components
        comps = self.__dict__.get("components")
        if comps is not None and name in comps:
            return comps[name]
        raise AttributeError(name)

    def as_dict(self) -> dict:
        d = {k: int(self.components[k]) for k in COMPONENTS}
        d["total"] = int(self.total)
        d.update({
            "peak_phase": self.peak_phase, "at_peak": {k: int(v) for k, v in self.at_peak.items()},
            "phases": {k: int(v) for k, v in self.phases.items()},
            "workspace_parts": {k: int(v) for k, v in self.workspace_parts.items()},
            "model": self.model, "mode": self.mode, "precision": self.precision, "parameters": self.parameters,
            "weight_bits": self.weight_bits, "batch": self.batch, "seq_len": self.seq_len,
            "optimizer": self.optimizer, "architecture": self.architecture, "notes": list(self.notes),
        })
        return d


def estimate_memory(model, mode: str = "inference", *, scheme=None, policy=None, optimizer: str = "adamw",
                    batch: int = 1, seq_len: int | None = None, runtime: str = "torch", device: str = "cpu",
                    rest_format: str = "bf16", kv_cache: bool | None = None, logits: str = "all") -> MemoryEstimate:
    """Predicted memory of `model` (an nn.Module, a parameter count such as 7_000_000_000 or "7B",
    a path to a Hugging Face config.json, or a config dict).

    mode: "inference" (a forward pass under no_grad over batch x seq_len tokens, with the KV cache
    of a causal LM) or "training" (one steady-state step: forward, loss, backward, optimizer step).
    scheme: a quantization preset, as fewbits.quant.get_scheme names them (int8, int4, nf4, nf4_dq,
    mxfp4, nvfp4, int4_g32, ...: the linear layers quantized with their scale overhead, exactly as
    `quantize` stores them, the other parameters in `rest_format`), or a float format held plainly
    (fp32, bf16, fp16, tf32: every parameter in it, no scales). policy: a fewbits.train Policy or its
    preset name (fp32, bf16-mixed, bf16-pure, ...). optimizer: adamw | adam | adamw8bit | lion | sgd |
    sgd_momentum | adafactor. runtime: "torch" or "fewbits" (see the module docstring). device:
    "cpu" or "cuda" (attention kernels and optimizer implementation differ). kv_cache: keep a KV
    cache in inference (default: yes for causal LMs). logits: "all" (a forward that scores every
    position, as model(input_ids) does) or "last" (generation: the LM head on the last position).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    opt = str(optimizer).lower().replace("-", "_")
    if opt not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for label, v in (("batch", batch), ("seq_len", seq_len)):
        if (v is not None or label == "batch") and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"{label} must be a positive integer, got {v!r}")
    spec = describe_model(model)
    arch = spec.architecture
    S = seq_len if seq_len is not None else DEFAULT_SEQ_LEN
    if arch is not None and arch.family == "bert" and arch.max_positions and seq_len is None:
        S = min(S, arch.max_positions)
    if arch is not None and arch.family == "bert" and arch.max_positions and S > arch.max_positions:
        raise ValueError(f"seq_len {S} exceeds the model's {arch.max_positions} learned positions")
    if mode == "training" and scheme is None and policy is None and not spec.dtypes:
        policy = "fp32"
    prec = resolve_precision(scheme=scheme, policy=policy, mode=mode, runtime=runtime, spec=spec,
                             rest_format=rest_format, device=device)
    if opt == "adamw8bit":
        prec = dataclasses.replace(prec, state_format="int8_blockwise")
    ctx = _Context(spec, prec, mode, opt, batch, S, runtime, device,
                   kv_cache if kv_cache is not None else (arch is not None and arch.causal), logits)
    return ctx.estimate()


@dataclass
class _Context:
    spec: ModelSpec
    prec: Precision
    mode: str
    optimizer: str
    batch: int
    seq_len: int
    runtime: str
    device: str
    kv_cache: bool
    logits: str = "all"

    # --- parameters ------------------------------------------------------------------------
    def _fp32_kept(self, t: Tensors) -> bool:
        """fewbits' Engine keeps norm parameters (and their modules) in fp32."""
        return self.runtime == "fewbits" and t.role == "other" and "norm" in t.name.lower()

    def weight_bytes(self) -> int:
        p = self.prec
        if p.kind == "loaded":
            return int(self.spec.stored_bytes)
        total = 0.0
        for t in self.spec.tensors:
            if p.kind == "scheme":
                if t.role in ("linear", "head", "all"):
                    total += self._scheme_bytes(t)
                else:
                    total += t.numel * _format_bytes(p.rest_format)
            else:
                fmt = "fp32" if self._fp32_kept(t) else p.weight_format
                total += t.numel * _format_bytes(fmt)
        return int(round(total))

    def _scheme_bytes(self, t: Tensors) -> float:
        qs = self.prec.scheme
        if t.role == "all" or not hasattr(qs, "nbytes"):
            return t.numel * qs.bits_per_value() / 8
        return qs.nbytes(t.shape) * t.count

    def linear_numel(self) -> int:
        return sum(t.numel for t in self.spec.tensors if t.role in ("linear", "head"))

    def autocast_copies(self) -> int:
        """autocast caches a low-precision copy of every matmul weight for the whole forward and
        backward; a tied LM head casts the shared embedding matrix too."""
        p, a = self.prec, self.spec.architecture
        if not p.autocast:
            return 0
        n = self.linear_numel()
        if a is not None and a.family == "llama" and a.tied_embeddings:
            n += a.vocab * a.hidden
        return int(n * p.copy_bytes)

    def master_bytes(self) -> int:
        p = self.prec
        if self.mode != "training" or self.runtime != "fewbits" or p.master_format is None:
            return 0
        return int(sum(t.numel for t in self.spec.tensors if not self._fp32_kept(t)) * _format_bytes(p.master_format))

    def gradient_bytes(self) -> int:
        if self.mode != "training":
            return 0
        if self.runtime == "fewbits" and self._engine_wraps():
            # fp32 gradient buffers for the wrapped parameters, plain fp32 grads for norms
            return int(self.spec.parameters * 4)
        return int(sum(t.numel * (4 if self._fp32_kept(t) else self.prec.grad_bytes) for t in self.spec.tensors))

    def _engine_wraps(self) -> bool:
        p = self.prec
        return p.master_format is not None or p.weight_format != "fp32"

    def state_bytes(self) -> int:
        if self.mode != "training":
            return 0
        n_states = OPTIMIZERS[self.optimizer]
        p = self.prec
        per_value = _state_bytes(p.state_format)
        if self.runtime == "fewbits" and p.state_format != "int8_blockwise":
            # train.optim.pack_state: torch dtypes as themselves, formats of 8 bits or fewer as one
            # code per byte, other emulated formats as fp32 values
            kind = packed_kind(p.state_format)
            per_value = get_format(p.state_format).bits / 8 if kind == "dtype" else (1 if kind == "codes" else 4)
        if self.optimizer == "adafactor":
            total = 0.0
            for t in self.spec.tensors:
                if len(t.shape) >= 2:
                    total += (t.shape[0] + math.prod(t.shape[1:])) * t.count * 4
                else:
                    total += t.numel * 4
            states = total
        else:
            states = self.spec.parameters * n_states * per_value
        steps = 4 * self.spec.tensor_count if self.optimizer in ("adamw", "adam", "adamw8bit") else 0
        return int(round(states + steps + self.spec.parameters * p.compensation_bytes))

    def optimizer_temporaries(self) -> int:
        if self.optimizer in ("sgd", "sgd_momentum"):
            return 0
        p = self.prec
        param_bytes = 4 if (self.runtime == "fewbits" or p.autocast) else _format_bytes(p.weight_format)
        if self.device == "cuda":  # foreach: one temporary per parameter at once
            return int(self.spec.parameters * param_bytes)
        # single-tensor AdamW on CPU: sqrt(v) and its quotient, one parameter at a time
        largest = self.spec.largest or 0
        return int((2 if self.optimizer in ("adamw", "adam", "adamw8bit") else 1) * largest * param_bytes)

    def wrapped_parameters(self) -> int:
        """Parameters fewbits' Engine gives a working copy (all but the fp32-kept norms)."""
        if self.runtime != "fewbits" or not self._engine_wraps():
            return 0
        return sum(t.numel for t in self.spec.tensors if not self._fp32_kept(t))

    # --- the estimate ----------------------------------------------------------------------
    def estimate(self) -> MemoryEstimate:
        spec, p = self.spec, self.prec
        weights = self.weight_bytes()
        notes = list(p.notes)
        arch = spec.architecture
        T = self.batch * self.seq_len
        if p.kind == "scheme":
            notes.append(f"linear layers in {p.name}, embeddings, norms and biases in {p.rest_format}"
                         if spec.structured else f"every parameter in {p.name} (a bare count has no layers to "
                                                 "tell apart)")
        if arch is None:
            notes.append("no architecture known (a bare parameter count or a module without a Hugging Face "
                         "config): activations and KV cache are not estimated")
        if self.mode == "inference":
            acts, kv, parts, phase_name = self._inference_terms(T) if arch is not None else (0, 0, {}, "forward")
            if p.kind == "scheme" and spec.structured:
                lin = [t for t in spec.tensors if t.role in ("linear", "head")]
                if lin:
                    parts["dequantized_weight"] = max(math.prod(t.shape) for t in lin) * p.activation_bytes
            ws = sum(parts.values())
            components = dict.fromkeys(COMPONENTS, 0)
            components.update(weights=weights, activations=acts, kv_cache=kv, workspace=ws)
            phases = {phase_name: {"weights": weights, "activations": acts, "kv_cache": kv, "workspace": ws}}
            workspace_parts = parts
        else:
            components, phases, workspace_parts = self._training_phases(T, weights)
            if self.runtime == "fewbits" and p.state_format == "int8_blockwise":
                notes.append("fewbits runtime with int8_blockwise states: the Engine unpacks every state to "
                             "fp32 for the step, and its packing temporaries are not modelled (under-predicts)")
        totals = {k: sum(v.values()) for k, v in phases.items()}
        peak_phase = max(totals, key=totals.get)
        at_peak = {k: int(phases[peak_phase].get(k, 0)) for k in COMPONENTS}
        n = spec.parameters
        return MemoryEstimate(
            model=spec.name, mode=self.mode, precision=p.name, parameters=n,
            components={k: int(v) for k, v in components.items()}, at_peak=at_peak, total=int(totals[peak_phase]),
            peak_phase=peak_phase, phases={k: int(v) for k, v in totals.items()}, batch=self.batch,
            seq_len=self.seq_len, optimizer=self.optimizer if self.mode == "training" else None,
            weight_bits=weights * 8 / n, architecture=_arch_text(arch), notes=notes,
            workspace_parts={k: int(v) for k, v in workspace_parts.items() if v})

    def _training_phases(self, T: int, weights: int):
        """Components, the candidate peaks (what is alive in each phase of a steady-state step) and
        the workspace's parts. Steady state: the optimizer states exist; torch's gradients were
        freed by zero_grad(set_to_none=True), fewbits' fp32 gradient buffers persist."""
        p, arch = self.prec, self.spec.architecture
        master, grads, states = self.master_bytes(), self.gradient_bytes(), self.state_bytes()
        fewbits = self.runtime == "fewbits"
        wrapped = self.wrapped_parameters()
        kept_grads = wrapped * 4                     # the Engine's fp32 gradient buffers
        base = {"weights": weights, "master_weights": master, "optimizer_states": states, "gradients": kept_grads}
        opt_tmp = self.optimizer_temporaries()
        step_extra = 0
        if fewbits and wrapped:
            if p.master_format is None:  # the optimizer steps a float32 view of every stored weight
                step_extra += wrapped * 4
            if p.state_format == "int8_blockwise" or get_format(p.state_format).name != "fp32":
                step_extra += self.spec.parameters * OPTIMIZERS[self.optimizer] * 4  # states unpacked to fp32
        components = {"weights": weights, "master_weights": master, "gradients": grads, "optimizer_states": states,
                      "activations": 0, "kv_cache": 0, "workspace": opt_tmp + step_extra}
        if arch is None:
            phases = {"optimizer step": {**base, "gradients": grads, "workspace": opt_tmp + step_extra}}
            return components, phases, {"optimizer_temporaries": opt_tmp + step_extra}
        t = self._training_terms(T)
        working_grads = int(wrapped * _format_bytes(p.weight_format)) if fewbits else 0
        phases = {"backward: loss gradient": {**base, "activations": t["saved"],
                                              "workspace": t["copies"] + t["loss"]}}
        if t.get("lm_head") is not None:
            extra_act, lm_grad, lm_ws = t["lm_head"]
            phases["backward: lm head"] = {**base, "activations": t["saved"] + extra_act,
                                           "gradients": kept_grads + lm_grad, "workspace": t["copies"] + lm_ws}
        phases["backward: end"] = {**base, "gradients": grads + working_grads, "workspace": t["logits"]}
        phases["optimizer step"] = {**base, "gradients": grads, "workspace": t["logits"] + opt_tmp + step_extra}
        if fewbits and wrapped and p.master_format is None:
            # landing the fp32 result in the stored weights, one tensor at a time (train.optim.land_update):
            # nearest/stochastic round a copy (fp32) and cast it; kahan also holds the old value, the update,
            # the rounded sum and the lost part in fp32
            per_value = 18 if p.update_rounding == "kahan" else 4 + _format_bytes(p.weight_format)
            landing = int(per_value * self.spec.largest)
            phases["weight update"] = {**base, "gradients": grads, "workspace": t["logits"] + step_extra + landing}
        components["activations"] = t["saved"]
        components["workspace"] = max(ph.get("workspace", 0) for ph in phases.values())
        parts = {"autocast_weight_copies": t["copies"], "loss_buffers": t["loss"], "logits": t["logits"],
                 "optimizer_temporaries": opt_tmp + step_extra}
        return components, phases, parts

    # --- activations ---------------------------------------------------------------------------
    def _inference_terms(self, T: int):
        """(activations, kv cache, workspace parts, phase) of a no_grad forward over T tokens."""
        a, p = self.spec.architecture, self.prec
        c = p.activation_bytes
        f = 4 if p.autocast else c           # the residual stream's dtype
        parts = {}
        if p.autocast:
            parts["autocast_weight_copies"] = self.autocast_copies()
        kv = 0
        if a.family == "llama":
            if self.kv_cache:
                k_bytes = 4 if p.autocast else c  # rotary embedding in fp32 under autocast
                kv = a.layers * T * a.kv_dim * (k_bytes + c)
            mlp = T * (4 * a.hidden * f + 3 * a.intermediate * c)
            scored = T if self.logits == "all" else self.batch
            head = T * 3 * a.hidden * f + scored * a.vocab * c
            matmul = p.compute_format if p.autocast else p.weight_format
            if self.device == "cpu" and matmul == "bf16" and _bf16_matmul_float32_buffer():
                # the busiest matmul's float32 output buffer (several rows), beside its bf16 output
                rows, out = (scored, a.vocab) if head > mlp else (T, a.intermediate)
                if rows > 1:
                    parts["bf16_matmul_float32_output"] = rows * out * 4
            if head > mlp:
                return head, kv, parts, "forward: lm head"
            return mlp, kv, parts, "forward: last MLP"
        # the busiest point of an encoder layer: the MLP's GELU (its input and output beside the
        # residual stream), or the LayerNorm after it when the MLP is narrow
        per_token = max(3 * a.hidden * f + 2 * a.intermediate * c, 5 * a.hidden * f + a.intermediate * c) + 8
        return T * per_token, kv, parts, "forward: last MLP"

    def _training_terms(self, T: int) -> dict:
        """Bytes over T tokens: "saved" (what autograd keeps for backward), "copies" (autocast's
        weight cache), "loss" (buffers of the loss gradient over the vocabulary, beyond the saved
        log-softmax), "logits" (the model's output, alive until the step ends), "lm_head" (the
        phase after the loss gradient: activations freed/added, gradients, workspace) or None.

        Per token and layer, as the Hugging Face implementations save them (c: activation bytes,
        w: parameter bytes; autocast keeps the residual stream and norms in fp32 and casts every
        matmul input to c separately)."""
        a, p, S = self.spec.architecture, self.prec, self.seq_len
        c = p.activation_bytes
        auto = p.autocast
        fewbits = self.runtime == "fewbits"
        w = 4 if auto else _format_bytes(p.weight_format)
        H, I, Q, KV, V, nh = a.hidden, a.intermediate, a.q_dim, a.kv_dim, a.vocab, a.heads
        cpu = self.device == "cpu"
        copies = self.autocast_copies()
        if a.family == "llama":
            if auto:  # x and x*rsqrt in fp32, then one c-copy per consuming matmul (q, k, v | gate, up | head)
                norm_attn, norm_mlp, norm_final = H * (8 + 3 * c), H * (8 + 2 * c), H * (8 + c)
            elif fewbits and c < 4:  # an fp32 module: its fp32 input, x*rsqrt, and the output cast to c
                norm_attn = norm_mlp = norm_final = H * (8 + c)
            else:  # x in fp32 (a copy unless already fp32), normalised x, and weight * normalised x
                norm_attn = norm_mlp = norm_final = H * (4 + 2 * w)
            if a.attention_dropout > 0 and cpu:  # the math kernel: q, k, v in fp32, scores, mask, probs
                attn = (Q + 2 * KV) * 4 + Q * c + 3 * nh * S * 4
            else:  # the fused kernel saves q, k, v, its output and the log-sum-exp
                attn = (2 * Q + 2 * KV) * c + 4 * nh
            layer = norm_attn + norm_mlp + 2 * 4 + attn + 4 * I * c   # + two rsqrt; gate, silu, up, product
            per_token = a.layers * layer + norm_final + 4 + 16 + V * 4  # ids, labels, log-softmax output
            saved = T * per_token + 2 * S * a.head_dim * (4 if auto else w)  # rotary cos, sin
            logits_bytes = 4 if fewbits else c   # the Engine hands outputs back in fp32
            logits = T * V * logits_bytes
            loss = T * V * (logits_bytes + 8)    # logits, d(log-softmax), d(logits) in fp32
            g = 4 if auto else (_format_bytes(p.weight_format) if not fewbits else c)
            lm_head = (T * V * (c - 4), V * H * g, T * V * c + (V * H * c if auto else 0))
            return {"saved": int(saved), "copies": copies, "loss": int(loss), "logits": int(logits),
                    "lm_head": tuple(int(x) for x in lm_head)}
        f = 4 if (auto or (fewbits and c < 4)) else w  # LayerNorm inputs: fp32 under autocast and the Engine
        lin3 = 3 * c if auto else c
        drop = c if a.hidden_dropout > 0 else 0
        if a.attention_dropout > 0 and cpu:
            # a CPU runs attention dropout in the math kernel: q, k, v (in fp32), softmax output,
            # dropout mask and dropped probabilities, and the re-laid-out context
            up = 4 if c < 4 else c
            attn = 3 * Q * up + 3 * nh * S * up + Q * c
        else:  # the fused kernels (CUDA's take dropout too): q, k, v, output, log-sum-exp
            attn = 4 * Q * c + 4 * nh
        layer = H * lin3 + attn + H * drop + H * f + 2 * f + H * c + 2 * I * c + H * drop + H * f + 2 * f
        per_token = a.layers * layer + H * (f + drop) + 2 * f + 24
        return {"saved": int(T * per_token), "copies": copies, "loss": int(T * H * 8), "logits": int(T * H * f),
                "lm_head": None}


def _arch_text(a: Architecture | None) -> str | None:
    if a is None:
        return None
    s = (f"{a.model_type} ({a.family}-like): {a.layers} layers, hidden {a.hidden}, {a.heads} heads"
         f"{f' ({a.kv_heads} kv)' if a.kv_heads != a.heads else ''}, head dim {a.head_dim}, "
         f"intermediate {a.intermediate}, vocab {a.vocab}")
    if a.tied_embeddings:
        s += ", tied embeddings"
    return s

