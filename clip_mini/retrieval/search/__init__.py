"""Search back ends over stored float16 (or bfloat16) embeddings: exact (four kernels) and faiss (HNSW, IVF, IVF-PQ).

Exact search has four kernels with the same result, the float32 top-K of the rows as stored with ties by row id;
``auto_kernel`` picks one:

* faiss scan (``exact_faiss``): one or a few queries, with or without torch, when faiss >= 1.11 is installed;
  faiss streams the stored rows in place, one read of the matrix a query.
* onnxruntime (``exact_ort``): many queries without torch (onnxruntime is loaded anyway for the query towers).
* numpy (``exact_numpy``): always available; small or float32 matrices.
* torch (``exact_torch``): when torch is already imported (a server, a notebook) on a CPU with native bf16, or asked
  for.

Each kernel scores approximately in float32 (or bf16), keeps the rows within a proven error bound (``bounds``) of
the approximate K-th best, and re-scores them exactly (``shortlist``), so ties and near-ties come out the same from
every kernel. An index stored as bfloat16 (``clip-mini index --dtype bfloat16``, ``clip_mini.retrieval.rows``)
skips every conversion; re-scoring uses the stored values either way, so results are exact for the rows as stored.

faiss's approximate indexes (``approximate``) are worth it for large indexes: their stored graph or inverted lists
avoid touching every row. faiss is imported only when used (the exact scan imports it for 50k rows and up); where it
is missing or older than 1.11, ``auto`` leaves the scan out.

Modules, each importing only those above it::

    bounds       the error bound the short lists rest on
    shortlist    query checks, the running top-K, the floor, exact re-scoring
    faiss_lib    importing faiss when used
    exact_numpy, exact_ort, exact_faiss, exact_torch    the four exact kernels
    approximate  faiss HNSW / IVF / IVF-PQ: build, search (re-ranked), save, load, sizes
    dispatch     exact_search and auto_kernel
"""
from clip_mini.retrieval.search.approximate import (FAISS_THRESHOLD, HNSW_M, IVFPQ_MIN_ROWS, IVFPQ_THRESHOLD,
                                                    RERANK, FaissKind, build_faiss, faiss_memory, faiss_search,
                                                    ivf_lists, ivfpq_lists, load_faiss, save_faiss)
from clip_mini.retrieval.search.dispatch import (FAISS_SCAN_MAX_QUERIES, FAISS_SCAN_MAX_QUERIES_NO_TORCH,
                                                 FAISS_SCAN_MIN_ROWS, KERNELS, ORT_MIN_ROWS, TORCH_MIN_ROWS,
                                                 auto_kernel, exact_search)
from clip_mini.retrieval.search.exact_faiss import faiss_scan_available
from clip_mini.retrieval.search.faiss_lib import faiss_available
from clip_mini.retrieval.search.faiss_lib import faiss_module as _faiss   # the name retrieval/dupes.py imports

__all__ = ["FAISS_SCAN_MAX_QUERIES", "FAISS_SCAN_MAX_QUERIES_NO_TORCH", "FAISS_SCAN_MIN_ROWS", "FAISS_THRESHOLD",
           "HNSW_M", "IVFPQ_MIN_ROWS", "IVFPQ_THRESHOLD", "KERNELS", "ORT_MIN_ROWS", "RERANK", "TORCH_MIN_ROWS",
           "FaissKind", "auto_kernel", "build_faiss", "exact_search", "faiss_available", "faiss_memory",
           "faiss_scan_available", "faiss_search", "ivf_lists", "ivfpq_lists", "load_faiss", "save_faiss"]
