"""How a server holds a large index (issue 51, serving a million photos): searched through its read-only memory map,
so processes serving it (``clip-mini serve --workers N``) hold one copy of the rows between them, with answers equal
to the library's; a small one keeps its float32 copy. The timings at 1M rows are
``benchmarks/speed/bench_serve.py --arm 1m``'s."""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

FINGERPRINT = "synthetic-test-model"


def synthetic_index(out: Path, rows: int, dim: int = 64, generation: int = 1, seed: int = 0) -> Path:
    """An index of random unit float16 rows and made-up paths, published as a writer publishes one."""
    from clip_mini.fileio.atomic import atomic_path
    from clip_mini.retrieval.format import commit, writer_lock

    emb = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float16)
    paths = [f"/photos/{i // 100:03d}/img_{i:06d}.jpg" for i in range(rows)]
    items = {"path": paths, "size": [1000] * rows, "mtime_ns": [0] * rows,
             "sha256": [hashlib.sha256(p.encode()).hexdigest() for p in paths], "caption": [""] * rows}
    with writer_lock(out):
        with atomic_path(out / f"embeddings-{generation}.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, emb)
        commit(out, generation, items, {"model_fingerprint": FINGERPRINT, "model_dir": None, "source": "synthetic",
                                        "shard": None}, progress=False)
    return out


def _queries(n: int, dim: int, seed: int = 1) -> np.ndarray:
    q = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


@pytest.mark.parametrize("rows, copied", [(300, True), (3000, False)])
def test_rows_searched_in_place_from_float32_max_rows_on(tmp_path, rows, copied):
    from clip_mini.retrieval.search import exact_search
    from clip_mini.serve.generations import IndexWatcher

    index = synthetic_index(tmp_path / "index", rows)
    gen = IndexWatcher(index, FINGERPRINT, float32_max_rows=1000).current
    assert (gen.rows32 is not None) is copied
    if not copied:   # the rows the search reads are the file's pages, not an array of this process
        assert isinstance(gen.index.embeddings, np.memmap) and gen.index.embeddings.dtype == np.float16
    assert gen.open_s > 0
    stored = np.load(index / "embeddings-1.npy")
    for nq in (1, 3, 8):   # a lone query and batches, as the server's batcher searches them
        q = _queries(nq, 64, seed=nq)
        scores, ids = gen.search(q, 10)
        want_scores, want_ids = exact_search(stored, q, 10, kernel="numpy")
        assert ids.tolist() == want_ids.tolist()
        np.testing.assert_allclose(scores, want_scores, atol=1e-6)


def test_default_keeps_a_float32_copy_only_below_the_in_place_kernels(tmp_path):
    from clip_mini.retrieval import search as S
    from clip_mini.serve.app import ServeConfig
    from clip_mini.serve.generations import FLOAT32_MAX_ROWS, IndexWatcher

    assert FLOAT32_MAX_ROWS == S.FAISS_SCAN_MIN_ROWS and ServeConfig(index="x").float32_max_rows == FLOAT32_MAX_ROWS
    assert IndexWatcher(synthetic_index(tmp_path / "small", 200), FINGERPRINT).current.rows32 is not None


_SERVE_ROWS = """
import sys, numpy as np
from clip_mini.serve.generations import IndexWatcher
gen = IndexWatcher(sys.argv[1], sys.argv[2], float32_max_rows=int(sys.argv[3])).current
q = np.random.default_rng(0).standard_normal((4, gen.index.dim)).astype(np.float32)
gen.search(q / np.linalg.norm(q, axis=1, keepdims=True), 5)   # an exact search reads every row
print("copied" if gen.rows32 is not None else "mapped", flush=True)
sys.stdin.read()   # hold the generation until told to exit
"""
_KB = re.compile(r"^(Rss|Pss):\s+(\d+) kB$")


def _mapping_kb(pid: int, name: str) -> dict:
    """Rss and Pss (kB) of process ``pid``'s mappings of the file called ``name``, from /proc/PID/smaps."""
    out, inside = {"Rss": 0, "Pss": 0}, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split(maxsplit=5)
                inside = len(fields) == 6 and Path(fields[5].strip()).name == name
            elif inside and (m := _KB.match(line.strip())):
                out[m.group(1)] += int(m.group(2))
    return out


def _anon_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return int(re.search(r"^Pss_Anon:\s+(\d+) kB$", f.read(), re.M).group(1))


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads /proc/PID/smaps (Linux)")
def test_two_serving_processes_hold_the_rows_once(tmp_path):
    """What ``--workers 2`` does, two processes each opening and searching the index: both map every page of the
    embeddings file (RSS), each holds half of it (PSS), so the pair counts the rows once; with the float32 copy
    (a small index) each process would instead hold twice the file's size privately."""
    rows, dim = 16384, 64   # a 2 MB file: 512 pages
    index = synthetic_index(tmp_path / "index", rows, dim)
    size_kb = (index / "embeddings-1.npy").stat().st_size / 1024

    def start(max_rows):
        return subprocess.Popen([sys.executable, "-c", _SERVE_ROWS, str(index), FINGERPRINT, str(max_rows)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    procs = [start(1000), start(1000)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["mapped", "mapped"]
        maps = [_mapping_kb(p.pid, "embeddings-1.npy") for p in procs]
        for m in maps:
            assert m["Rss"] >= 0.99 * size_kb                       # every row read through the map ...
            assert abs(m["Pss"] - size_kb / 2) <= 0.03 * size_kb     # ... each page shared by the two
        assert abs(sum(m["Pss"] for m in maps) - size_kb) <= 0.03 * size_kb
        mapped_anon = [_anon_kb(p.pid) for p in procs]
    finally:
        for p in procs:
            p.communicate("", timeout=60)
    # the same processes with the float32 copy (the default below FLOAT32_MAX_ROWS): the copy is private memory,
    # twice the file's size in each, which the in-place processes do not have
    procs = [start(10 ** 9), start(10 ** 9)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["copied", "copied"]
        copied_anon = [_anon_kb(p.pid) for p in procs]
    finally:
        for p in procs:
            p.communicate("", timeout=60)
    for mapped, copied in zip(mapped_anon, copied_anon):
        assert copied - mapped >= 1.5 * size_kb, (mapped_anon, copied_anon, size_kb)


def test_searches_answer_while_a_new_generation_opens(tmp_path, monkeypatch):
    """A reload opens the new generation on the watcher's thread while searches go on answering from the old one;
    the switch is one assignment, after the new generation is completely open."""
    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.serve.batching import SearchBatcher
    from clip_mini.serve.generations import IndexWatcher

    index = synthetic_index(tmp_path / "index", 3000)
    watcher = IndexWatcher(index, FINGERPRINT, float32_max_rows=1000)
    batcher = SearchBatcher(lambda: watcher.current, lambda g, q, k: g.search(q, k))
    synthetic_index(index, 3500, generation=2, seed=2)
    opening, release = threading.Event(), threading.Event()
    load = EmbeddingIndex.load.__func__

    def slow_load(cls, *args, **kwargs):   # the new generation's open takes as long as the test wants
        opening.set()
        assert release.wait(60)
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(EmbeddingIndex, "load", classmethod(slow_load))
    reload = threading.Thread(target=watcher.refresh)
    reload.start()
    try:
        assert opening.wait(60)
        q = _queries(1, 64)
        for _ in range(5):   # answered meanwhile, from the old generation
            gen, scores, ids = batcher.submit(q[0], 10).result(timeout=10)
            assert gen.number == 1 and len(ids) == 10
        assert watcher.current.number == 1 and reload.is_alive()
    finally:
        release.set()
        reload.join(60)
    gen, _, ids = batcher.submit(q[0], 10).result(timeout=10)
    assert gen.number == 2 and len(gen.index) == 3500 and watcher.current is gen and gen.open_s > 0
