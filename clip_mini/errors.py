"""Every error clip_mini raises for bad input, in a leaf module every other module can import.

``except clip_mini.ClipMiniError`` catches them all; ``from clip_mini.errors import ConfigError`` (or any class
below) catches one kind. Each subclass also derives from the built-in exception it refines (``ValueError`` for bad
values, ``OSError`` for files), so code that caught those keeps working. The modules that raise them import them
from here, so ``clip_mini.config.ConfigError is clip_mini.errors.ConfigError``.
"""


class ClipMiniError(Exception):
    """Bad input to clip_mini (a file, row, config key, model or index directory): the message names it."""


class InputError(ClipMiniError, ValueError):
    """An input to ``encode_text`` / ``encode_image`` (or a command's argument) is unusable; the message names it."""


# -- configuration and devices ---------------------------------------------------------------------------------
class ConfigError(ClipMiniError, ValueError):
    """A config file, key or value is wrong; the message names the key."""


class DeviceError(ClipMiniError, ValueError):
    """A device that does not exist here (e.g. ``cuda`` on a machine without a GPU) or is misspelled."""


class QueryError(InputError):
    """A search query that cannot be parsed or combined; the message names the term and shows a usage example."""


class PrecisionError(ClipMiniError, ValueError):
    """A compute precision that is misspelled, or that the device cannot run (bf16 on a GPU without bf16 units)."""


# -- files -----------------------------------------------------------------------------------------------------
class OutputError(ClipMiniError, OSError):
    """Writing an output failed; the earlier file at that path (if any) is intact."""


class UnreadableFileError(ClipMiniError, OSError):
    """A file that must not or could not be read: not a regular file, too large, or too slow.

    An ``OSError`` (``strerror`` is the reason), so callers that already treat unreadable files as ``OSError``
    keep working; ``path`` names the file and ``reason`` says why.
    """

    def __init__(self, path: str, reason: str):
        super().__init__(reason)
        self.path, self.reason, self.strerror, self.filename = str(path), reason, reason, str(path)

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


# -- data ------------------------------------------------------------------------------------------------------
class DataError(ClipMiniError, ValueError):
    """A captions file, row or field is unusable; the message names the file and the row or field."""


class ImageError(ClipMiniError, ValueError):
    """An image cannot be used; ``path`` names it (or the in-memory item) and ``reason`` says why."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


# -- models ----------------------------------------------------------------------------------------------------
class ModelDirError(ClipMiniError, ValueError):
    """A model directory is missing, incomplete or corrupt; the message names the file."""


class OnnxError(ModelDirError):
    """The ONNX copy of a model is missing, damaged or from another model; the message names the file."""


class QueryEncoderError(ModelDirError):
    """A model directory cannot serve queries, or a query is unusable; the message names the file or item."""


class TokenizerError(ClipMiniError, ValueError):
    """A tokenizer directory is missing or unreadable."""


class WeightsError(ClipMiniError, ValueError):
    """A pretrained weights file is missing, unreadable or does not fit the model."""


# -- indexes ---------------------------------------------------------------------------------------------------
class EmbeddingIndexError(ClipMiniError, ValueError):
    """An index directory is missing, corrupt, busy or built with another model, or a request on it is unusable."""


class FilterError(EmbeddingIndexError):
    """A search filter (``--under``, ``--glob``, ``--after``, ``--before``) is unusable: a folder outside the index's
    folder, a date in no accepted format, a bad pattern; the message names the filter and what it accepts."""


class DatesNotIndexedError(FilterError):
    """A date filter on an index that records no dates (built before dates were recorded, or from WebDataset
    shards); the message says to re-index."""


class ItemsFormatError(ClipMiniError, ValueError):
    """The items file is damaged or not an items file (the reader names the file)."""


# -- evaluation ------------------------------------------------------------------------------------------------
class EvalError(ClipMiniError, ValueError):
    """An evaluation request cannot be served (empty split, unknown labels, no images); the message says why."""


class LedgerError(ClipMiniError, ValueError):
    """The test-split ledger has a line that is not a test scoring (the message names the file and line)."""


# -- training ---------------------------------------------------------------------------------------------------
class BudgetError(ClipMiniError, RuntimeError):
    """The budget cannot be met (one-time work alone exceeds it); the message gives the estimate and what to change."""


class TrainError(ClipMiniError, RuntimeError):
    """Training cannot start or cannot go on (the message says why and what to change)."""


class CheckpointError(ClipMiniError, ValueError):
    """A checkpoint is missing, truncated, corrupt or not a clip_mini checkpoint; the message names the file."""
