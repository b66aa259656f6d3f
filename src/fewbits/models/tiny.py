"""A tiny real task and model for fast tests: next-character prediction on the pydoc text.

`tiny_task()` returns (model, train, eval, evaluate):

- the data is real English/technical text (Python's own pydoc topics, `fewbits.models.text`), so
  the model has real structure to lose when its weights are coarsened; the train and eval
  windows come from the fixed train and eval split of the topics;
- inputs: the previous 8 characters as ids (LongTensor, shape (n, 8)); target: the next
  character's id; 64 classes = the 63 most frequent characters of the train text (99.4 % of
  it) + one class for every other character;
- model: Embedding(64, 16) -> Flatten -> Linear(128, 128) -> ReLU -> Linear(128, 128) -> ReLU
  -> Linear(128, 64), outputting logits (loss: cross-entropy); 42,304 parameters;
- train: 40,000 windows; eval: 8,000 windows; `evaluate(model)` is the eval accuracy.

Measured here (seed 0, 600 Adam steps of 256): eval accuracy 0.512 (train 0.574; always
predicting the most frequent character, the space, scores 0.171). Rounding the three Linear
weights to symmetric per-tensor integers (round to nearest, scale absmax / (2^(b-1) - 1)) gives
eval accuracy 0.512 at 8 bits, 0.480 at 4 bits and 0.316 at 3 bits; 300 more steps of
quantization-aware training (the same 4-bit rounding in the forward pass, straight-through
gradient) bring 4 bits back to 0.512.

Building takes 1-2 s (training included; the first call also reads the text), more when
other processes load the machine. Training runs
on one thread: these matrices are too small to gain from more, threads competing for 2 busy
cores made it 15x slower, and one thread makes the result independent of the thread count.
The trained weights and data are cached per seed; each call returns a fresh copy of the model and
of the data, so callers may modify them.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .text import pydoc_split

__all__ = [
    "TinyTask", "tiny_task", "tiny_charlm_model", "train_classifier", "accuracy",
    "TINY_CONTEXT", "TINY_CLASSES",
]

TINY_CONTEXT = 8
TINY_CLASSES = 64
_EMBED_DIM = 16
_HIDDEN = 128
_TRAIN_WINDOWS = 40_000
_EVAL_WINDOWS = 8_000
_STEPS = 600
_BATCH = 256
_LR = 3e-3


class TinyTask(NamedTuple):
    """model: trained nn.Module mapping inputs to logits; train, eval: (inputs, targets);
    evaluate(model) -> accuracy on the eval data (a float in [0, 1])."""

    model: nn.Module
    train: tuple[torch.Tensor, torch.Tensor]
    eval: tuple[torch.Tensor, torch.Tensor]
    evaluate: Callable[[nn.Module], float]


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_charlm_model(seed: int = 0) -> nn.Module:
    """The untrained tiny model, its initial weights drawn from `seed` (the global torch random
    state is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Embedding(TINY_CLASSES, _EMBED_DIM),
            nn.Flatten(),
            nn.Linear(TINY_CONTEXT * _EMBED_DIM, _HIDDEN), nn.ReLU(),
            nn.Linear(_HIDDEN, _HIDDEN), nn.ReLU(),
            nn.Linear(_HIDDEN, TINY_CLASSES),
        )


def accuracy(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of rows whose highest logit is the target (eval mode, no gradients; the model's
    mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _one_thread():
            return float((model(inputs).argmax(dim=1) == targets).double().mean())
    finally:
        model.train(was_training)


def train_classifier(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     steps: int = _STEPS, lr: float = _LR, batch_size: int = _BATCH,
                     seed: int = 0) -> nn.Module:
    """Train `model` in place with Adam on cross-entropy, mini-batches drawn with `seed`.

    The recipe that trained the tiny model, for callers who retrain it (e.g. quantization-aware
    training). Runs on one thread; returns the model (left in train mode).
    """
    if len(inputs) != len(targets):
        raise ValueError(f"inputs and targets differ in length: {len(inputs)} vs {len(targets)}")
    if steps < 0 or batch_size < 1:
        raise ValueError(f"need steps >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    with _one_thread():
        for _ in range(steps):
            batch = torch.randint(0, len(inputs), (batch_size,), generator=generator)
            loss = nn.functional.cross_entropy(model(inputs[batch]), targets[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model


@functools.lru_cache(maxsize=1)
def _char_ids() -> tuple[torch.Tensor, torch.Tensor]:
    split = pydoc_split()
    frequent = [c for c, _ in collections.Counter(split.train).most_common(TINY_CLASSES - 1)]
    index = {c: i for i, c in enumerate(frequent)}
    other = TINY_CLASSES - 1

    def encode(text: str) -> torch.Tensor:
        return torch.tensor([index.get(c, other) for c in text], dtype=torch.long)

    return encode(split.train), encode(split.eval)


def _windows(ids: torch.Tensor, count: int, generator: torch.Generator):
    ends = torch.randint(TINY_CONTEXT, len(ids), (count,), generator=generator)
    rows = ids.unfold(0, TINY_CONTEXT + 1, 1)[ends - TINY_CONTEXT]  # ids[end-8 .. end]
    return rows[:, :TINY_CONTEXT].contiguous(), rows[:, TINY_CONTEXT].contiguous()


@functools.lru_cache(maxsize=4)
def _trained(seed: int):
    train_ids, eval_ids = _char_ids()
    generator = torch.Generator().manual_seed(seed)
    train = _windows(train_ids, _TRAIN_WINDOWS, generator)
    evaluation = _windows(eval_ids, _EVAL_WINDOWS, generator)
    model = train_classifier(tiny_charlm_model(seed), *train, seed=seed).eval()
    return model.state_dict(), train, evaluation


def tiny_task(seed: int = 0) -> TinyTask:
    """The trained tiny character model and its data (see the module docstring)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    state, train, evaluation = _trained(seed)
    model = tiny_charlm_model(seed)
    model.load_state_dict(copy.deepcopy(state))
    model.eval()
    eval_inputs, eval_targets = evaluation

    def evaluate(candidate: nn.Module) -> float:
        return accuracy(candidate, eval_inputs, eval_targets)

    return TinyTask(model=model, train=(train[0].clone(), train[1].clone()),
                    eval=(eval_inputs.clone(), eval_targets.clone()), evaluate=evaluate)
