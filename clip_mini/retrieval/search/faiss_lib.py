"""faiss, imported only when used: the exact scan imports it for 50k rows and up, an approximate index always."""
from __future__ import annotations


def faiss_module():
    """The faiss module.

    Raises:
        ImportError: faiss is not installed; the message names the package to install.
    """
    try:
        import faiss
    except ImportError:
        raise ImportError("the faiss back end needs faiss: pip install 'clip-mini[faiss]'") from None
    return faiss


def faiss_available() -> bool:
    """Whether faiss is installed (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec("faiss") is not None
