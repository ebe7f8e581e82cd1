"""Query arithmetic: weighted text and image terms, parsed in rclip's grammar and combined into one query row.

The one implementation behind ``clip-mini search``, ``EmbeddingIndex.search`` / ``hits``, ``Embedder.encode_query``
and ``clip-mini serve``::

    clip-mini search --index DIR "a dog" + "beach" - "grass"     terms are arguments joined by + and -
    clip-mini search --index DIR "2:golden retriever"             a number and a colon weight a term
    clip-mini search --index DIR ./cat.jpg + "at night"           a term written as a path is an image

The query is the weighted sum of the terms' unit embeddings (a ``-`` term's weight counts negative), scaled back
to unit length. In the Python API a term is ``(value, weight)``: a ``str`` value is a caption, anything else (a
``pathlib.Path``, a PIL image, an (H, W, 3) array) an image, and a negative weight means "without".
"""
from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from clip_mini.errors import QueryError

USAGE = ('for example: "a dog" + "beach" - "grass", "2:golden retriever" (weight 2), ./cat.jpg + "at night" '
         '(an image and words)')
API_USAGE = 'for example [("a dog", 1.0), ("grass", -1.0), (Path("cat.jpg"), 0.5)]'
OPERATORS = {"+": 1.0, "-": -1.0}
# A term written as a path is an image; any other argument is a caption.
PATH_PREFIXES = ("./", "../", "/", "~/", ".\\", "..\\")
# "WEIGHT:rest", the weight one word without spaces: "a dog: running" is a caption.
_WEIGHTED = re.compile(r"([^\s:]*):(.*)", re.S)
_CANCEL = 1e-6   # a combined query shorter than this has no direction left ("a dog" - "a dog")


@dataclass(frozen=True)
class Term:
    """One term of a query: a caption (``is_image`` False) or an image, and its weight (negative: "without")."""

    value: Any
    weight: float = 1.0
    is_image: bool = False

    def __str__(self) -> str:
        text = os.fspath(self.value) if isinstance(self.value, (str, os.PathLike)) else f"<{type(self.value).__name__}>"
        weight = abs(self.weight)
        return text if weight == 1 else f"{weight:g}:{text}"


def parse_term(text: str, sign: float = 1.0, paths: bool = True) -> Term:
    """One argument as a term: ``[WEIGHT:]caption`` or, with ``paths``, ``[WEIGHT:]./image.jpg``.

    Args:
        text: the argument as the user typed it (one shell word, or one box of the search page).
        sign: +1.0 or -1.0, from the operator before it.
        paths: whether a path-like argument is an image file (False on the server: no client names a path there).

    Raises:
        QueryError: an empty term, a weight that is not a positive number, or a weight with nothing after it.
    """
    if not isinstance(text, str) or not text.strip():
        raise QueryError(f"a query term is empty ({text!r}); {USAGE}")
    weight, body = 1.0, text.strip()
    m = None if paths and body.startswith(PATH_PREFIXES) else _WEIGHTED.fullmatch(body)
    # "2:dog", "2: dog" and "x:dog" (a typo'd weight) are weighted; "note: dog" is a caption, as prose writes it
    if m and (_is_number(m.group(1)) or not m.group(2)[:1].isspace()):
        weight, body = _weight(m.group(1), text), m.group(2).strip()
        if not body:
            raise QueryError(f"the term {text!r} has a weight but nothing to weight; {USAGE}")
    if paths and body.startswith(PATH_PREFIXES):
        return Term(_image_file(body, " (a term written as a path is an image file)"), sign * weight, True)
    return Term(body, sign * weight, False)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _weight(prefix: str, text: str) -> float:
    weight = float(prefix) if _is_number(prefix) else math.nan
    if not math.isfinite(weight) or weight <= 0:
        hint = " (weights are positive: put a term after - to search without it)" if weight <= 0 else ""
        raise QueryError(f"malformed weight {prefix!r} in the term {text!r}: a weight is a positive number before "
                         f"a colon{hint}; {USAGE}. To search for the words as they are, weight them: "
                         f"\"1:{text.strip()}\"")
    return weight


def _image_file(path: str, hint: str = "") -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory, not an image file" if p.is_dir() else "not found"
        raise QueryError(f"query image {what}: {path}{hint}")
    return str(p)


def parse_args(args: Sequence[str], images: Sequence[str] = (), paths: bool = True) -> list[Term]:
    """The terms of a command line: arguments joined by ``+`` and ``-`` (rclip's grammar), and ``--image`` files.

    Words between two operators are one caption (``a dog + beach`` is "a dog" and "beach"), so an argument is an
    operator only when it is exactly ``+`` or ``-``: the one argument "red - blue" is one caption. A path stands
    alone between operators.

    Raises:
        QueryError: no term at all, two operators in a row, an operator at the end, a path run together with
            other words, only negative terms, or any error of ``parse_term``.
    """
    if args and not images and not any(a.strip() for a in args):
        raise QueryError(f"the text query is empty: type some words describing the image; {USAGE}")
    terms: list[Term] = [Term(_image_file(p), 1.0, True) for p in images]
    sign, words, last_op = 1.0, [], None
    for arg in args:
        if arg not in OPERATORS:
            words.append(arg)
            continue
        if words:
            terms.append(_join(words, sign, paths))
        elif last_op is not None:
            raise QueryError(f"two operators in a row ({last_op} {arg}): a term goes between them; {USAGE}")
        sign, words, last_op = OPERATORS[arg], [], arg
    if words:
        terms.append(_join(words, sign, paths))
    elif last_op is not None:
        raise QueryError(f"the query ends with {last_op}: a term goes after it; {USAGE}")
    return check_terms(terms)


def _join(words: list[str], sign: float, paths: bool) -> Term:
    if len(words) > 1 and paths and any(w.strip().startswith(PATH_PREFIXES) for w in words):
        raise QueryError(f"an image path stands alone between + and -: {' '.join(words)!r}; {USAGE}")
    return parse_term(" ".join(words), sign, paths)


def check_terms(terms: Sequence[Term], usage: str = USAGE) -> list[Term]:
    """``terms`` as a list, refusing none at all and only negative ones (a "without" needs something to be
    without)."""
    terms = list(terms)
    if not terms:
        raise QueryError(f"the query is empty: give at least one caption or image; {usage}")
    if not any(t.weight > 0 for t in terms):
        raise QueryError(f"the query has only negative terms ({describe(terms)}): give at least one term to search "
                         f"for before the - terms; {usage}")
    return terms


def as_terms(query: Any) -> list[Term]:
    """The Python API's terms: one caption (a ``str``), or a list of ``(value, weight)`` pairs, ``Term``s or bare
    values (weight 1). A ``str`` value is a caption, taken as written (no weight prefix, no path); any other value
    (a ``pathlib.Path``, PIL image, (H, W, 3) array or encoded bytes) is an image.

    Raises:
        QueryError: an empty list, a weight that is not a finite non-zero number, an empty caption, only negative
            weights.
    """
    if isinstance(query, (str, Term, os.PathLike)):
        query = [query]
    if not isinstance(query, (list, tuple)):
        raise QueryError(f"query terms must be a caption or a list of (caption or image, weight) pairs, got "
                         f"{type(query).__name__}; {API_USAGE}")
    terms = []
    for i, item in enumerate(query):
        if isinstance(item, Term):
            terms.append(item)
            continue
        value, weight = item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) \
                or weight == 0:
            raise QueryError(f"term {i} has weight {weight!r}: a weight is a finite non-zero number (negative: "
                             f"without); {API_USAGE}")
        if isinstance(value, str) and not value.strip():
            raise QueryError(f"term {i} is an empty caption; {API_USAGE}")
        terms.append(Term(value, float(weight), not isinstance(value, str)))
    return check_terms(terms, API_USAGE)


def looks_like_terms(query: Any) -> bool:
    """Whether ``query`` is meant as terms (a caption, a path, or a list holding one, or a ``(value, weight)``
    pair) rather than query feature rows."""
    def term_like(x) -> bool:
        return isinstance(x, (str, os.PathLike, Term)) or (
            isinstance(x, tuple) and len(x) == 2 and not isinstance(x[0], numbers.Real))

    return term_like(query) or (isinstance(query, (list, tuple)) and any(term_like(x) for x in query))


def combine(terms: Sequence[Term], encode_text: Callable[[list], np.ndarray],
            encode_image: Callable[[list], np.ndarray]) -> np.ndarray:
    """One query row: the weighted sum of the terms' unit embeddings, scaled to unit length.

    Args:
        terms: checked terms (``parse_args``, ``as_terms``).
        encode_text, encode_image: a list of captions / images -> (n, d) rows (each encoder is called at most once).

    Returns:
        (d,) float32, unit L2 norm.

    Raises:
        QueryError: the weighted terms cancel out (``"a dog" - "a dog"``).
    """
    terms = check_terms(terms)
    rows: list = [None] * len(terms)
    for is_image, encode in ((False, encode_text), (True, encode_image)):
        at = [i for i, t in enumerate(terms) if t.is_image == is_image]
        if at:
            for i, row in zip(at, np.asarray(encode([terms[i].value for i in at]), dtype=np.float64)):
                rows[i] = row / max(np.linalg.norm(row), 1e-12)
    query = sum(t.weight * row for t, row in zip(terms, rows))   # (d,) float64: no cancellation error to speak of
    norm = float(np.linalg.norm(query))
    if norm < _CANCEL:
        raise QueryError(f"the terms of {describe(terms)} cancel out: their weighted sum has no direction to search "
                         "for")
    return (query / norm).astype(np.float32)


def single_caption(terms: Sequence[Term]) -> str | None:
    """The caption of a query that is one text term of weight 1, else None: the queries a match map explains
    (``clip-mini search --explain``, ``clip-mini serve``'s ``/api/explain``), since a map shows where one caption
    matches, not a weighted sum of terms or an image."""
    terms = list(terms)
    if len(terms) == 1 and not terms[0].is_image and terms[0].weight == 1:
        return str(terms[0].value)
    return None


def describe(terms: Sequence[Term]) -> str:
    """The terms in the command line's grammar (one plain caption stays as it is): for titles and JSON."""
    terms = list(terms)
    if len(terms) == 1 and terms[0].weight == 1:
        return str(terms[0])
    out = []
    for t in terms:
        if out or t.weight < 0:
            out.append("-" if t.weight < 0 else "+")
        out.append(str(t) if t.is_image else f'"{t}"')
    return " ".join(out)
