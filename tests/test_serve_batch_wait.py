"""``SearchBatcher`` waits a moment for queries announced as being embedded (``expect``), so that clients under
steady load share one search pass instead of taking turns; a lone query, or one nobody announced, is never delayed,
and an announced query that never comes holds a batch up for ``MAX_WAIT_S`` at most."""
import threading
import time

import numpy as np

from clip_mini.serve import batching
from clip_mini.serve.batching import SearchBatcher


def _batcher(calls: list, delay: float = 0.0) -> SearchBatcher:
    def search(gen, queries, k):
        calls.append(len(queries))
        time.sleep(delay)
        return queries[:, :k].copy(), np.tile(np.arange(k), (len(queries), 1))

    return SearchBatcher(lambda: "gen", search)


def test_an_announced_query_joins_the_batch_that_waits_for_it():
    calls: list = []
    b = _batcher(calls)
    b._last_search_s = 1.0   # a slow last pass: the wait may be MAX_WAIT_S
    b.expect()                # a query is being embedded ...
    first = b.submit(np.ones(4), 2)

    def late():
        time.sleep(0.005)
        b.submit(np.full(4, 2.0), 2, expected=True)   # ... and arrives while the batch waits

    t = threading.Thread(target=late)
    t.start()
    gen, scores, ids = first.result(timeout=10)
    t.join()
    assert calls == [2] and b.batches == 1 and b.queries == 2
    assert 0 < b.waited_s < batching.MAX_WAIT_S + 0.01
    assert scores.tolist() == [1.0, 1.0] and b._expected == 0


def test_a_lone_query_is_not_delayed():
    calls: list = []
    b = _batcher(calls)
    b._last_search_s = 1.0
    for _ in range(3):
        b.search(np.ones(4), 2)
    assert calls == [1, 1, 1] and b.waited_s == 0


def test_an_announced_query_that_never_comes_holds_a_batch_up_briefly():
    calls: list = []
    b = _batcher(calls)
    b._last_search_s = 10.0
    b.expect()
    start = time.perf_counter()
    b.search(np.ones(4), 2)
    took = time.perf_counter() - start
    assert calls == [1] and took < batching.MAX_WAIT_S + 0.2
    b.expect(-1)   # withdrawn (the service does this when embedding fails)
    b.search(np.ones(4), 2)
    assert calls == [1, 1] and b.waited_s < batching.MAX_WAIT_S + 0.01


def test_the_wait_is_a_share_of_the_last_pass():
    calls: list = []
    b = _batcher(calls)
    b._last_search_s = 0.002   # a fast pass: waiting long for a straggler would cost more than a second pass
    b.expect()
    b.search(np.ones(4), 2)
    assert b.waited_s <= batching.WAIT_SHARE * 0.002 + 0.005
    b.expect(-1)
