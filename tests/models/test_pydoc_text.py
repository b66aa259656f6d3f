"""The pydoc text: whole text, the fixed train/eval split, clean sentences."""
from __future__ import annotations

import re

import pytest
from pydoc_data.topics import topics as raw_topics

from fewbits.models import text as T
from fewbits.models.text import (
    pydoc_sentences, pydoc_split, pydoc_split_topics, pydoc_text, pydoc_topics,
)


def test_topics_and_text_follow_sorted_names():
    topics = pydoc_topics()
    assert list(topics) == sorted(raw_topics)
    assert all(topics[name] == raw_topics[name].strip("\n") for name in raw_topics)
    text = pydoc_text()
    assert text == "\n\n".join(topics[name] for name in sorted(raw_topics))
    assert text == pydoc_text()
    assert len(text) > 300_000
    assert "Assert statements are a convenient way to insert debugging assertions" in text


def test_topics_returns_a_fresh_dict():
    first = pydoc_topics()
    first.clear()
    assert len(pydoc_topics()) == len(raw_topics)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.25, 0.5, 0.9])
def test_split_partitions_whole_topics(fraction):
    train_names, eval_names = pydoc_split_topics(fraction)
    assert train_names == sorted(train_names) and eval_names == sorted(eval_names)
    assert set(train_names).isdisjoint(eval_names)
    assert set(train_names) | set(eval_names) == set(raw_topics)
    assert train_names and eval_names
    size = {name: len(text) for name, text in pydoc_topics().items()}
    total = sum(size.values())
    held = sum(size[name] for name in eval_names)
    # reaches the fraction, overshooting it by less than one topic
    assert held >= fraction * total
    assert held - max(size[name] for name in eval_names) < fraction * total

    split = pydoc_split(fraction)
    topics = pydoc_topics()
    assert split.eval == "\n\n".join(topics[name] for name in eval_names)
    assert split.train == "\n\n".join(topics[name] for name in train_names)
    train, evaluation = split  # unpacks like a tuple
    assert (train, evaluation) == (split.train, split.eval)


def test_split_is_fixed():
    assert pydoc_split_topics(0.1) == pydoc_split_topics(0.1)
    assert pydoc_split(0.1) == pydoc_split()
    # a larger fraction only adds topics (the shuffled order is the same)
    assert set(pydoc_split_topics(0.1)[1]) <= set(pydoc_split_topics(0.3)[1])


@pytest.mark.parametrize("bad", [0, 0.0, 1, 1.0, -0.1, 1.5, float("nan")])
def test_split_rejects_bad_fractions(bad):
    with pytest.raises(ValueError, match="eval_fraction"):
        pydoc_split(bad)


@pytest.mark.parametrize("bad", ["0.1", None, True])
def test_split_rejects_non_numbers(bad):
    with pytest.raises(TypeError, match="eval_fraction"):
        pydoc_split_topics(bad)


def _normalised_text() -> str:
    # the sentences are whitespace-normalised and have Sphinx's emphasis stars removed
    return " ".join(pydoc_text().replace("*", "").split())


def test_sentences_are_real_clean_and_distinct():
    sentences = pydoc_sentences()
    assert len(sentences) >= 500  # 1,343 on Python 3.11
    assert len(set(sentences)) == len(sentences)
    text = _normalised_text()
    for sentence in sentences:
        assert sentence in text, sentence
        assert 6 <= len(sentence.split()) <= 40
        assert sentence[0].isupper() and sentence[-1] in ".!?"
        assert sentence == " ".join(sentence.split())
        for codey in (">>>", "::=", "*", "|", "+--", "\n"):
            assert codey not in sentence, sentence
        assert sentence.count("(") == sentence.count(")")


def test_sentences_sample():
    sample = pydoc_sentences(50, seed=3)
    assert len(sample) == 50 and len(set(sample)) == 50
    assert sample == pydoc_sentences(50, seed=3)
    assert sample != pydoc_sentences(50, seed=4)
    assert set(sample) <= set(pydoc_sentences())
    assert pydoc_sentences(0) == []


def test_sentences_word_limits():
    short = pydoc_sentences(min_words=3, max_words=8)
    assert short and all(3 <= len(s.split()) <= 8 for s in short)
    assert set(pydoc_sentences(min_words=6, max_words=8)) == {
        s for s in short if len(s.split()) >= 6}


def test_sentence_splitting_rules():
    split = T._split_sentences
    assert split("One is here. Two is there.") == ["One is here.", "Two is there."]
    assert split("Use a list, e.g. This one. Then stop.") == [
        "Use a list, e.g. This one.", "Then stop."]
    assert split("It is ‘quoted.’ Next one.") == ["It is ‘quoted.’", "Next one."]
    assert split("Version 3.1 is out. x.y is a name.") == ["Version 3.1 is out. x.y is a name."]
    blocks = list(T._prose_blocks(
        "Title\n*****\n\nSome prose that\ncontinues here.\n\n   code ::= block\n   more\n\n"
        "* A bullet item that\n  continues.\n\n  Indented prose of the item.\n\n"
        "Ragged\n      table"))
    assert blocks == ["Some prose that continues here.", "A bullet item that continues.",
                      "Indented prose of the item."]


def test_sentences_reject_bad_arguments():
    with pytest.raises(ValueError, match="only"):
        pydoc_sentences(10**6)
    with pytest.raises(ValueError, match="n must be"):
        pydoc_sentences(-1)
    with pytest.raises(TypeError, match="n must be"):
        pydoc_sentences(2.0)
    with pytest.raises(ValueError, match="min_words"):
        pydoc_sentences(min_words=10, max_words=5)
    with pytest.raises(TypeError, match="seed"):
        pydoc_sentences(3, seed="x")
    assert not any(re.search(r"\s{2}", s) for s in pydoc_sentences(20))
