"""Real English text that every Python installation carries: the help topics of `pydoc_data`.

`pydoc_data.topics.topics` maps 79 topic names ("assert", "assignment", ...) to the plain-text
chapters of the Python language reference (about 465,000 characters on Python 3.11). It is real
technical prose, ships with the interpreter and needs no network, so it is the built-in text for
perplexity (`pydoc_split`) and for sentence embeddings (`pydoc_sentences`).

The exact text depends on the Python version (the reference is regenerated for each release), so
figures measured on it are comparable between runs on the same Python, not across versions.
"""
from __future__ import annotations

import functools
import random
import re
from typing import NamedTuple

__all__ = [
    "pydoc_topics", "pydoc_text", "pydoc_split", "pydoc_split_topics", "pydoc_sentences",
    "TextSplit",
]

_TOPIC_SEPARATOR = "\n\n"


@functools.lru_cache(maxsize=1)
def _shipped_topics() -> tuple[tuple[str, str], ...]:
    from pydoc_data.topics import topics  # stdlib; imported here so `fewbits.models` stays light

    return tuple((name, topics[name]) for name in sorted(topics))


@functools.lru_cache(maxsize=1)
def _topics() -> tuple[tuple[str, str], ...]:
    # a topic's own trailing newlines would vary the separator between topics
    return tuple((name, text.strip("\n")) for name, text in _shipped_topics())


def pydoc_topics() -> dict[str, str]:
    """The help topics, name -> text, in sorted name order (a fresh dict: callers may edit it)."""
    return dict(_topics())


def pydoc_text(strip: bool = True) -> str:
    """All topics' text joined in sorted topic order, separated by a blank line.

    strip=False joins the topics as shipped, each with its own leading and trailing newlines:
    the corpus of the study's byte-level `lm` training task (fewbits.study.tasks), kept as it
    always was so that the task's losses do not move.
    """
    return _TOPIC_SEPARATOR.join(text for _, text in (_topics() if strip else _shipped_topics()))


class TextSplit(NamedTuple):
    """A train/eval split of the pydoc text: `train, eval = pydoc_split()`."""

    train: str
    eval: str


_SPLIT_SEED = 20240611  # fixed: the split is part of every perplexity figure and must not move


def pydoc_split_topics(eval_fraction: float = 0.1) -> tuple[list[str], list[str]]:
    """Names of the train and of the eval topics (each list in sorted order).

    Whole topics go to one side, so no chapter is cut in two and no eval sentence has its
    paragraph in the training text. The topics are shuffled with a fixed seed and taken into the
    eval side in that order until it holds at least `eval_fraction` of all characters; the eval
    side therefore overshoots the fraction by at most one topic.
    """
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)):
        raise TypeError(f"eval_fraction must be a number, got {type(eval_fraction).__name__}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be strictly between 0 and 1, got {eval_fraction}")
    topics = _topics()
    order = [name for name, _ in topics]
    random.Random(_SPLIT_SEED).shuffle(order)
    size = dict((name, len(text)) for name, text in topics)
    target = eval_fraction * sum(size.values())
    eval_names: set[str] = set()
    held = 0
    for name in order:
        if held >= target:
            break
        eval_names.add(name)
        held += size[name]
    if len(eval_names) == len(order):
        raise ValueError(f"eval_fraction {eval_fraction} leaves no topic for training")
    train = [name for name, _ in topics if name not in eval_names]
    return train, sorted(eval_names)


def pydoc_split(eval_fraction: float = 0.1) -> TextSplit:
    """The pydoc text split by whole topics into a training and an evaluation text.

    The default (10 %) eval text is the shared evaluation text for perplexity: 11 topics, 55,060
    characters, 13,409 SmolLM2 tokens on Python 3.11 (the train text: 409,985 characters). Both
    texts join their topics in sorted name order.
    """
    train_names, eval_names = pydoc_split_topics(eval_fraction)
    topics = dict(_topics())
    return TextSplit(
        train=_TOPIC_SEPARATOR.join(topics[name] for name in train_names),
        eval=_TOPIC_SEPARATOR.join(topics[name] for name in eval_names),
    )


# ---------------------------------------------------------------------------------------------
# sentences
# ---------------------------------------------------------------------------------------------
# The topics are Sphinx's plain-text rendering: paragraphs separated by blank lines, list items
# opened by "* " or "1. " and indented by 2 per level, literal blocks (code, grammar) indented by 3
# more than their paragraph. Prose therefore starts at an even indentation after the list marker.
_LIST_MARKER = re.compile(r"^(\s*)(?:[*\-+]|\d+\.|[a-z]\.)\s+")
# a sentence ends at . ! or ? (and a closing quote or parenthesis after it) before a capital
_SENTENCE_END = re.compile(r"[.!?][’”\"')]?(?=\s+[A-Z_\"“‘(])")
# Sphinx's emphasis, *word* and **word** (not a star inside code such as "*args" or "a * b")
_EMPHASIS = re.compile(r"(?<![\w*\"])\*\*?([^*\s\"](?:[^*\"]*[^*\s\"])?)\*\*?(?![\w*])")
# a split after these is not a sentence end
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "Mr.", "Dr.", "No.", "approx.", "resp.")
_UNDERLINE = re.compile(r"^\s*([*=\-~^\"'`#+])\1{3,}\s*$")
_ALLOWED = re.compile(r"^[A-Za-z0-9 ,.;:!?'\"“”‘’()\[\]{}*\-–—/%&+=<>_]+$")
_CODEY = ("::=", ">>>", "...", "+--", "://")


def _prose_blocks(text: str):
    """Yield each prose paragraph of one topic as a single line (list markers removed)."""
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if any(_UNDERLINE.match(line) for line in lines):
            continue  # a heading
        first = lines[0]
        marker = _LIST_MARKER.match(first)
        content_indent = marker.end() if marker else len(first) - len(first.lstrip(" "))
        # literal blocks sit at an odd indentation (3 more than the even prose indentation)
        if content_indent % 2 == 1 and not marker:
            continue
        if any(line.strip() and len(line) - len(line.lstrip(" ")) != content_indent
               for line in lines[1:]):
            continue  # ragged indentation: code, a table or a grammar rule
        words = [first[marker.end():] if marker else first.strip()]
        words += [line.strip() for line in lines[1:]]
        yield " ".join(w for w in words if w)


def _split_sentences(paragraph: str) -> list[str]:
    pieces, start = [], 0
    for end in _SENTENCE_END.finditer(paragraph):
        pieces.append(paragraph[start:end.end()].strip())
        start = end.end()
    pieces.append(paragraph[start:].strip())
    sentences: list[str] = []
    for piece in pieces:
        if sentences and sentences[-1].endswith(_ABBREVIATIONS):
            sentences[-1] += " " + piece
        else:
            sentences.append(piece)
    return sentences


def _is_clean_sentence(sentence: str, min_words: int, max_words: int) -> bool:
    if not (min_words <= len(sentence.split()) <= max_words):
        return False
    if not (sentence[0].isupper() and sentence[-1] in ".!?") or sentence.endswith(_ABBREVIATIONS):
        return False
    if "*" in sentence:  # a star left after removing emphasis: "*args", a glob or an operator
        return False
    if sentence.endswith(":.") or not _ALLOWED.match(sentence):
        return False
    if any(token in sentence for token in _CODEY):
        return False
    if sentence.count("(") != sentence.count(")") or sentence.count('"') % 2:
        return False
    return True


@functools.lru_cache(maxsize=8)
def _all_sentences(min_words: int, max_words: int) -> tuple[str, ...]:
    seen: set[str] = set()
    found: list[str] = []
    for _, text in _topics():
        for paragraph in _prose_blocks(text):
            for sentence in _split_sentences(paragraph):
                sentence = " ".join(_EMPHASIS.sub(r"\1", sentence).split())
                if sentence.startswith("Note: "):
                    sentence = sentence[len("Note: "):]
                if sentence not in seen and _is_clean_sentence(sentence, min_words, max_words):
                    seen.add(sentence)
                    found.append(sentence)
    return tuple(found)


def pydoc_sentences(n: int | None = None, seed: int = 0, min_words: int = 6,
                    max_words: int = 40) -> list[str]:
    """`n` distinct, clean English sentences from the pydoc topics (all of them if `n` is None).

    Clean means: prose paragraphs only (no headings, code, grammar rules or tables), starting
    with a capital letter and ending with ".", "!" or "?", balanced parentheses and quotes, no
    code listings (">>>", "::=", tables), between `min_words` and `max_words` words.
    1,343 sentences qualify with the defaults on Python 3.11.

    With `n` given, a sample drawn with `random.Random(seed)` from the full list (so the same
    seed gives the same sentences in the same order); with `n` None, every sentence in text order.
    """
    for name, value in (("min_words", min_words), ("max_words", max_words), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if min_words < 1 or max_words < min_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words} and {max_words}")
    sentences = _all_sentences(min_words, max_words)
    if n is None:
        return list(sentences)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int or None, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n > len(sentences):
        raise ValueError(f"asked for {n} sentences, only {len(sentences)} qualify with "
                         f"min_words={min_words}, max_words={max_words}")
    return random.Random(seed).sample(sentences, n)
