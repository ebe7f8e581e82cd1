"""Search back ends, re-exported from ``clip_mini.retrieval.search`` (where they live) for existing imports."""
from clip_mini.retrieval.search import (FAISS_THRESHOLD, build_faiss, exact_search, faiss_available,  # noqa: F401
                                        faiss_search, load_faiss, save_faiss)

__all__ = ["exact_search", "build_faiss", "faiss_search", "faiss_available", "save_faiss", "load_faiss",
           "FAISS_THRESHOLD"]
