"""The base class of every error clip_mini raises for bad input, in a leaf module every other module can import.

``except clip_mini.ClipMiniError`` catches them all; each subclass also derives from the built-in exception it
refines (``ValueError`` for bad values, ``OSError`` for files), so code that caught those keeps working.
"""


class ClipMiniError(Exception):
    """Bad input to clip_mini (a file, row, config key, model or index directory): the message names it."""


class InputError(ClipMiniError, ValueError):
    """An input to ``encode_text`` / ``encode_image`` (or a command's argument) is unusable; the message names it."""
