"""Search back ends over stored float16 (or bfloat16) embeddings: exact (five kernels) and faiss (HNSW, IVF, IVF-PQ).

Exact search has five kernels with the same result, the float32 top-K of the rows as stored with ties by row id;
``auto_kernel`` picks one:

* int8 (``exact_int8``): where the rows' int8 codes are at hand (``codes``: a memory-mapped sidecar that
  ``clip-mini index`` writes beside the rows of each generation of 65,536 rows or more, or that an earlier int8
  search made), on a CPU without AMX, for the query counts where it is measured faster (5 or more with VNNI, 1 to 8
  without: ``dispatch.INT8_MIN_QUERIES``). An 8-bit integer product over one byte a value, its error bound computed
  from the codes' stored residuals and the query's own quantization.

* faiss scan (``exact_faiss``): one or a few queries, with or without torch, when faiss >= 1.11 is installed;
  faiss streams the stored rows in place, one read of the matrix a query.
* onnxruntime (``exact_ort``): many queries without torch (onnxruntime is loaded anyway for the query towers), and
  with torch on a CPU without AMX (``clip_mini.runtime.isa``), where its float32 pass is measured faster than
  torch's products (bf16 with AVX512-BF16 alone, float32 without bf16).
* numpy (``exact_numpy``): always available; small or float32 matrices.
* torch (``exact_torch``): many queries when torch is already imported (a server, a notebook) on a CPU with AMX,
  or asked for.

Each kernel scores approximately in float32 (or bf16, or int8 codes), keeps the rows within a proven error bound
(``bounds``) of the approximate K-th best, and re-scores them exactly (``shortlist``), so ties and near-ties come
out the same from every kernel. Over a large matrix the numpy and onnxruntime kernels keep only the maxima of
groups of 16 rows of their float32 products, one worker thread per core (``groups``), as the torch kernel does for
many queries (and the int8 kernel of its integer products). An
index stored as bfloat16 (``clip-mini index --dtype bfloat16``, ``clip_mini.retrieval.rows``) skips every
conversion; re-scoring uses the stored values either way, so results are exact for the rows as stored.

faiss's approximate indexes (``approximate``) are worth it for large indexes: their stored graph or inverted lists
avoid touching every row. faiss is imported only when used (the exact scan imports it for 50k rows and up); where it
is missing or older than 1.11, ``auto`` leaves the scan out.

Modules, each importing only those above it::

    bounds       the error bound the short lists rest on
    shortlist    query checks, the running top-K, the floor, exact re-scoring
    groups       the group-maxima pass over chunked float32 products, shared out between the cores
    faiss_lib    importing faiss when used
    codes        per-row int8 codes of the rows, and their sidecar files
    exact_numpy, exact_ort, exact_faiss, exact_torch, exact_int8    the five exact kernels
    approximate  faiss HNSW / IVF / IVF-PQ: build, search (re-ranked), save, load, sizes
    dispatch     exact_search, auto_kernel, prepare (what auto will use, readied), searches (per kernel)
"""
from clip_mini.retrieval.search.approximate import (FAISS_THRESHOLD, HNSW_M, IVFPQ_MIN_ROWS, IVFPQ_THRESHOLD,
                                                    RERANK, FaissKind, build_faiss, faiss_memory, faiss_search,
                                                    ivf_lists, ivfpq_lists, load_faiss, save_faiss)
from clip_mini.retrieval.search.dispatch import (FAISS_SCAN_MAX_QUERIES, FAISS_SCAN_MAX_QUERIES_NO_BF16,
                                                 FAISS_SCAN_MAX_QUERIES_NO_TORCH, FAISS_SCAN_MIN_ROWS,
                                                 INT8_MAX_QUERIES_U8, INT8_MIN_QUERIES, INT8_MIN_QUERIES_U8,
                                                 INT8_MIN_ROWS, KERNELS, ORT_MIN_ROWS, TORCH_MIN_ROWS, auto_kernel,
                                                 exact_search, prepare, searches)
from clip_mini.retrieval.search.exact_faiss import faiss_scan_available
from clip_mini.retrieval.search.faiss_lib import faiss_available
from clip_mini.retrieval.search.faiss_lib import faiss_module as _faiss   # the name retrieval/dupes.py imports

__all__ = ["FAISS_SCAN_MAX_QUERIES", "FAISS_SCAN_MAX_QUERIES_NO_BF16", "FAISS_SCAN_MAX_QUERIES_NO_TORCH",
           "FAISS_SCAN_MIN_ROWS", "FAISS_THRESHOLD", "HNSW_M", "INT8_MAX_QUERIES_U8", "INT8_MIN_QUERIES",
           "INT8_MIN_QUERIES_U8", "INT8_MIN_ROWS", "IVFPQ_MIN_ROWS", "IVFPQ_THRESHOLD", "KERNELS", "ORT_MIN_ROWS",
           "RERANK", "TORCH_MIN_ROWS",
           "FaissKind", "auto_kernel", "build_faiss", "exact_search", "faiss_available", "faiss_memory", "prepare",
           "searches",
           "faiss_scan_available", "faiss_search", "ivf_lists", "ivfpq_lists", "load_faiss", "save_faiss"]
