"""``index --shards ... --ray``: a 2-actor local Ray Data pipeline gives the single-process index, also when an
embedding actor is killed mid-run (same rows, embeddings within 1e-6). Skipped when Ray is not installed
(``pip install 'clip-mini[ray]'``: ~410 MB, so it is not in the test extra)."""
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'clip-mini[ray]'")

import clip_mini  # noqa: E402
from clip_mini.data.convert import convert_to_webdataset  # noqa: E402
from clip_mini.data.readers import read_captions  # noqa: E402
from clip_mini.data.webdataset import expand_shards  # noqa: E402
from clip_mini.retrieval.ray_index import embed_with_ray, ray_embedder  # noqa: E402
from clip_mini.retrieval.reader import IndexReader  # noqa: E402
from clip_mini.retrieval.wds_source import index_shards  # noqa: E402

pytestmark = pytest.mark.slow   # starting Ray takes ~10 s


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=3, object_store_memory=256 << 20, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from clip_mini.data import generate

    root = tmp_path_factory.mktemp("rayshards")
    shapes = generate(root / "shapes", n=400, seed=3, size=32)
    df, _ = read_captions(shapes / "captions.csv")
    return expand_shards(convert_to_webdataset(df, root / "wds", shard_size=20, progress=False)["pattern"])


@pytest.fixture(scope="module")
def reference(shards, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ix"
    return IndexReader.load(index_shards(out, clip_mini.load(model_dir), shards, progress=False).path)


def _same(a: IndexReader, b: IndexReader) -> None:
    assert a.items == b.items   # same rows (path, shard, key, offset, caption, ...) in the same order
    assert np.abs(a.embeddings[:].astype(np.float32) - b.embeddings[:].astype(np.float32)).max() <= 1e-6


def test_two_ray_workers_give_the_single_process_index(local_ray, shards, model_dir, reference, tmp_path):
    embed = ray_embedder(str(model_dir), None, workers=2, batch_size=8, precision="fp32", progress=False)
    index = index_shards(tmp_path / "ix", clip_mini.load(model_dir), shards, progress=False, embed=embed)
    assert len(index) == 400
    _same(index, reference)


def _actor_pids() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"MapBatches(EmbedActor)" in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_a_killed_worker_loses_and_duplicates_nothing(local_ray, shards, model_dir, reference, tmp_path):
    out, killed, received = tmp_path / "ix", [], []

    def embed(pending, parts):   # small batches and parts: the kill lands while rows are flowing
        received.append(embed_with_ray(pending, parts, str(model_dir), 2, 4, "fp32", False, part_rows=20).received)

    result = {}
    run = threading.Thread(target=lambda: result.update(
        index=index_shards(out, clip_mini.load(model_dir), shards, progress=False, embed=embed)))
    run.start()
    deadline = time.time() + 120
    while not killed and time.time() < deadline and run.is_alive():
        if len(list((out / ".work").glob("part-*.json"))) >= 1 and _actor_pids():
            pid = _actor_pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append((pid, len(list((out / ".work").glob("part-*.json")))))
        time.sleep(0.02)
    run.join(300)
    assert killed and killed[0][1] < 400 // 20, "the run finished before a worker could be killed mid-run"
    assert received[0] >= 400
    _same(result["index"], reference)
