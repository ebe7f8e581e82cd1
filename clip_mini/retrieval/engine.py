"""QueryEngine: turns search queries (text or images) into embeddings with a saved model, loaded once.

``clip-mini search``, ``EmbeddingIndex.search_text`` / ``search_image`` and ``clip-mini serve`` all embed their
queries here, so they agree on what a query means. Both towers run in onnxruntime (``query``): no torch import,
whether the query is text or an image. Each tower is loaded on first use and kept: a text search never loads the
image graph, and a server pays for each tower once. The ONNX files are exported on first use if the model
directory has none (that one time imports torch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from clip_mini.features.unit import unit_rows
from clip_mini.fileio.manifest import read_manifest
from clip_mini.retrieval.query import QUERY_FILES, ImageQueryEncoder, TextQueryEncoder
from clip_mini.features.terms import as_terms, combine


class QueryEngine:
    """Query embeddings from one model directory: ``encode_text(list[str])``, ``encode_image(list)``, and
    ``encode_query(terms)`` for query arithmetic (``terms``).

    Both return (n, dim) float32 rows with unit L2 norm, comparable with the rows of an index built by the same
    model (``fingerprint`` says which model that is). ``flip_average``: image queries average each image with its
    mirror, as the rows of an index built with ``--flip-average`` do (``IndexReader.flip_average``).
    """

    def __init__(self, model_dir: str | Path, fingerprint: str, device: str = "cpu", flip_average: bool = False):
        self.model_dir, self.fingerprint, self.device = Path(model_dir), fingerprint, device
        self.flip_average = bool(flip_average)
        self._text = None
        self._image = None

    def __repr__(self) -> str:
        return f"QueryEngine({str(self.model_dir)!r}, model={self.fingerprint})"

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", flip_average: bool = False) -> "QueryEngine":
        """Check that ``model_dir`` is a model directory (the full checksum check happens when a tower loads)."""
        manifest = read_manifest(model_dir, verify=False, required=QUERY_FILES)
        return cls(model_dir, manifest["fingerprint"], device, flip_average)

    def encode_text(self, texts: Sequence[str]) -> np.ndarray:
        if self._text is None:
            self._text = TextQueryEncoder.load(self.model_dir)
        return unit_rows(self._text.encode_text(list(texts)))

    def encode_image(self, images: Sequence[Any]) -> np.ndarray:
        """Images as paths, encoded bytes, PIL images or arrays (decoded and preprocessed like the eval transform)."""
        return unit_rows(self._image_encoder().encode_image(list(images), flip_average=self.flip_average))

    def encode_query(self, terms: Any) -> np.ndarray:
        """One (d,) unit row for weighted text and image terms (``terms.as_terms``: a caption, or a list of
        ``(caption or image, weight)``), combined by ``terms.combine``."""
        return combine(as_terms(terms), self.encode_text, self.encode_image)

    def image_input_size(self) -> int:
        """The side of the square the image tower takes (loads the image tower)."""
        return int(self._image_encoder().preprocess["image_size"])

    def runtime(self) -> dict:
        """What runs the queries: onnxruntime's version and, per loaded tower, its execution providers."""
        import onnxruntime

        towers = {name: enc.session.get_providers() for name, enc in (("text", self._text), ("image", self._image))
                  if enc is not None}
        return {"runtime": "onnxruntime", "version": onnxruntime.__version__, "towers": towers}

    def _image_encoder(self) -> ImageQueryEncoder:
        if self._image is None:
            self._image = ImageQueryEncoder.load(self.model_dir)
        return self._image

    def check_index(self, index, name: Optional[str] = None) -> None:
        """Refuse an index built by another model, or with image rows made otherwise than this engine's."""
        index.check_model(self.fingerprint, name or f"model {self.model_dir}")
        index.check_flip_average(self.flip_average, "this engine's image queries")


