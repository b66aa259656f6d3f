"""The tiny next-character task: real data, a trained model well above chance, deterministic,
returned as independent copies."""
from __future__ import annotations

import pytest
import torch

from fewbits.models import tiny as T
from fewbits.models.text import pydoc_split
from fewbits.models.tiny import accuracy, tiny_charlm_model, tiny_task, train_classifier


@pytest.fixture(scope="module")
def task():
    return tiny_task()


def test_shapes_and_types(task):
    model, (x_train, y_train), (x_eval, y_eval), evaluate = task
    assert x_train.shape == (40_000, T.TINY_CONTEXT) and y_train.shape == (40_000,)
    assert x_eval.shape == (8_000, T.TINY_CONTEXT) and y_eval.shape == (8_000,)
    for t in (x_train, y_train, x_eval, y_eval):
        assert t.dtype == torch.long and 0 <= int(t.min()) and int(t.max()) < T.TINY_CLASSES
    logits = model(x_eval[:5])
    assert logits.shape == (5, T.TINY_CLASSES)
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 3
    assert not model.training


def test_windows_are_real_text(task):
    _, (x_train, y_train), (x_eval, y_eval), _ = task
    train_ids, eval_ids = T._char_ids()
    split = pydoc_split()
    assert len(train_ids) == len(split.train) and len(eval_ids) == len(split.eval)
    # each row is 9 consecutive characters of its side of the split
    for inputs, targets, ids in ((x_train, y_train, train_ids), (x_eval, y_eval, eval_ids)):
        text = "".join(map(chr, ids.tolist()))  # ids as characters: substring search
        for row in range(0, len(inputs), 97):
            window = inputs[row].tolist() + [int(targets[row])]
            assert "".join(map(chr, window)) in text


def test_model_learned_the_task(task):
    model, (x_train, y_train), (x_eval, y_eval), evaluate = task
    eval_accuracy = evaluate(model)
    assert eval_accuracy == accuracy(model, x_eval, y_eval)
    most_frequent = int(torch.bincount(y_train).argmax())
    chance = float((y_eval == most_frequent).double().mean())
    assert chance < 0.2
    assert eval_accuracy > 0.45 > chance + 0.25  # 0.512 measured
    assert accuracy(model, x_train, y_train) > eval_accuracy  # 0.574 measured


def test_copies_are_independent_and_deterministic():
    model, (x_train, _), _, evaluate = tiny_task()  # not the fixture's: this test spoils it
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    x_train.zero_()
    fresh = tiny_task()
    assert evaluate(fresh.model) > 0.45
    assert int(fresh.train[0].abs().sum()) > 0
    again = tiny_task()
    for (name, a), (_, b) in zip(fresh.model.state_dict().items(),
                                 again.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(fresh.eval[0], again.eval[0])


def test_building_leaves_global_state_alone():
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    tiny_charlm_model(seed=5)
    train_classifier(tiny_charlm_model(seed=5), torch.zeros(10, T.TINY_CONTEXT, dtype=torch.long),
                     torch.zeros(10, dtype=torch.long), steps=3)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads


def test_train_classifier_retrains_and_is_reproducible(task):
    _, (x_train, y_train), (x_eval, y_eval), evaluate = task
    a = train_classifier(tiny_charlm_model(seed=1), x_train, y_train, steps=150, seed=2)
    b = train_classifier(tiny_charlm_model(seed=1), x_train, y_train, steps=150, seed=2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    untrained = evaluate(tiny_charlm_model(seed=1))
    assert evaluate(a) > untrained + 0.2


def test_bad_arguments():
    with pytest.raises(ValueError, match="differ in length"):
        train_classifier(tiny_charlm_model(), torch.zeros(3, 8, dtype=torch.long),
                         torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="steps"):
        train_classifier(tiny_charlm_model(), torch.zeros(3, 8, dtype=torch.long),
                         torch.zeros(3, dtype=torch.long), steps=-1)
    with pytest.raises(TypeError, match="seed"):
        tiny_task(seed=1.5)
