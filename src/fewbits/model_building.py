"""Building transformers models in a process with threads.

transformers' model construction changes process-wide state while it runs: torch's default
dtype (`_from_config`, `from_pretrained`), `PreTrainedModel.tie_weights` and the torch init
functions replaced by no-ops (`from_pretrained`), class patches; accelerate's
`init_empty_weights` replaces `nn.Module.register_parameter` for every thread. Two threads
building models at once see each other's changes (a skeleton whose head is not tied, parameters
of another thread's module on the meta device) and can restore each other's replacements in the
wrong order, leaving one in place for the rest of the process (every later nn.Linear on meta,
tie_weights a no-op). So:

- `building()`: the one process-wide lock every fewbits construction of a transformers model
  holds while it builds (model skeletons; from_pretrained calls should hold it too), so such
  constructions run one at a time;
- `parameters_on_meta()`: accelerate's init_empty_weights(include_buffers=False) for the calling
  thread only: parameters registered inside it land on the meta device through torch's
  parameter-registration hook and a thread-local flag; other threads' parameters never do.

A leaf module: it imports nothing of fewbits, so every layer may use it.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["building", "parameters_on_meta"]

_BUILD_LOCK = threading.RLock()
_state = threading.local()


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Hold the process-wide model-construction lock for the block (reentrant in a thread)."""
    with _BUILD_LOCK:
        yield


def _parameter_to_meta(module, name, param):
    """torch's global parameter-registration hook: in a thread inside parameters_on_meta(), the
    parameter moved to the meta device (its class, requires_grad and attributes kept); in any
    other thread, None (untouched)."""
    if not getattr(_state, "meta", False) or param is None or param.device.type == "meta":
        return None
    attributes = dict(param.__dict__)
    hf_initialized = attributes.pop("_is_hf_initialized", None)
    meta = type(param)(param.to("meta"), requires_grad=param.requires_grad, **attributes)
    if hf_initialized is not None:
        meta._is_hf_initialized = hf_initialized
    return meta


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """In the calling thread, parameters registered inside the block land on the meta device
    (created where their module makes them, then moved); buffers stay where they are made."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    handle = register_module_parameter_registration_hook(_parameter_to_meta)
    before = getattr(_state, "meta", False)
    _state.meta = True
    try:
        yield
    finally:
        _state.meta = before
        handle.remove()
