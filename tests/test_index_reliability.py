"""Reliability of index builds under SIGKILL and of readers racing a writer (separate processes)."""
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import clip_mini
from clip_mini.retrieval.index import EmbeddingIndex
from clip_mini.retrieval.files import scan_images

ROOT = Path(__file__).resolve().parents[1]
# SIGKILL trials per crash test: a few in CI, many with scripts/crash_trials.sh
KILL_TRIALS = int(os.environ.get("CLIP_MINI_KILL_TRIALS", "2"))

SLOW_BUILD = """
import sys, time
import clip_mini
from clip_mini.retrieval.index import EmbeddingIndex
from clip_mini.retrieval.files import scan_images
model_dir, folder, out = sys.argv[1:4]
embedder = clip_mini.load(model_dir)
encode = embedder.model.project_image
def slow(pixels, *a, **k):
    time.sleep(0.4)   # leaves time to be killed between chunks
    return encode(pixels, *a, **k)
embedder.model.project_image = slow   # every indexing path ends in the image head
EmbeddingIndex.build(out, embedder, scan_images(folder), batch_size=2, flush_every=2, progress=False)
"""

READER = """
import sys, time
import numpy as np
from clip_mini.retrieval.index import EmbeddingIndex
path, reference, stop = sys.argv[1:4]
ref = EmbeddingIndex.load(reference)
row = {p: i for i, p in enumerate(ref.items["path"])}
ref_emb = np.asarray(ref.embeddings, np.float32)
loads, generations = 0, set()
while True:
    done = __import__("os").path.exists(stop)
    index = EmbeddingIndex.load(path, verify=True)
    emb = np.asarray(index.embeddings, np.float32)
    assert len(index.items["path"]) == emb.shape[0] == len(index)
    expected = ref_emb[[row[p] for p in index.items["path"]]]
    assert np.abs(emb - expected).max() < 3e-3, "rows of one generation paired with another's items"
    loads += 1
    generations.add(index.manifest["generation"])
    if done:
        break
print(loads, len(generations))
"""


@pytest.mark.slow
def test_sigkill_mid_build_then_resume_equals_one_pass(tmp_path, model_dir, image_folder):
    embedder = clip_mini.load(model_dir)
    files = scan_images(image_folder)
    one = EmbeddingIndex.build(tmp_path / "one", embedder, files, progress=False)
    rng = random.Random(os.getpid())
    for trial in range(KILL_TRIALS):
        out = tmp_path / f"idx{trial}"
        EmbeddingIndex.build(out, embedder, files[:4], progress=False)   # generation 1: the first 4 images
        proc = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(model_dir), str(image_folder), str(out)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # Kill at a random point: once the build has started or its first chunk is on disk, then 0 to 0.3 s on
        # (mid-embedding or mid-write of a chunk; each batch of 2 takes over 0.4 s, so the build is still running).
        chunks, deadline = rng.randint(0, 1), time.time() + 120
        marker = out / ".work" / f"chunk-{chunks - 1:06d}.json" if chunks else out / ".work"
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.time() < deadline, "the build never wrote its chunks"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, "the build ended before the kill"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # Readers still see generation 1, intact.
        before = EmbeddingIndex.load(out, verify=True)
        assert before.manifest["generation"] == 1 and len(before) == 4
        resumed = EmbeddingIndex.build(out, embedder, files, progress=False)
        assert resumed.items["path"] == one.items["path"] == sorted(files)   # nothing missing, no duplicates
        assert resumed.items["sha256"] == one.items["sha256"]
        np.testing.assert_allclose(np.asarray(resumed.embeddings, np.float32),
                                   np.asarray(one.embeddings, np.float32), atol=2e-3)
        assert not list(out.glob(".*.tmp*")) and not (out / ".work").exists()


@pytest.mark.slow
def test_readers_never_see_a_mix_of_generations(tmp_path, model_dir, image_folder):
    embedder = clip_mini.load(model_dir)
    files = scan_images(image_folder)
    EmbeddingIndex.build(tmp_path / "reference", embedder, files, progress=False)
    sets = [files[:6], files[6:]]   # same size: a mix could only be caught by the row check
    out, stop = tmp_path / "idx", tmp_path / "stop"
    EmbeddingIndex.build(out, embedder, sets[0], progress=False)
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(out), str(tmp_path / "reference"), str(stop)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    time.sleep(3)   # let the readers start
    for i in range(16):
        EmbeddingIndex.build(out, embedder, sets[(i + 1) % 2], progress=False)
    stop.touch()
    for r in readers:
        stdout, stderr = r.communicate(timeout=120)
        assert r.returncode == 0, stderr[-3000:]
        loads, generations = map(int, stdout.split())
        assert loads >= 5 and generations >= 2
    kept = {p.name for p in out.iterdir() if p.name.startswith(("embeddings-", "items-"))}
    assert kept == {"embeddings-16.npy", "embeddings-17.npy", "items-16.cols", "items-17.cols"}   # old ones removed
