"""A real two-node Ray cluster on this box: ``ray start --head`` and ``ray start --address HEAD`` as separate nodes
(own IPs, the machine's and 127.0.0.2, own ports, object stores and working folders), and ``clip-mini index --shards
PATTERN --ray HEAD`` run as a driver that joins them:

- tasks run on both nodes (the report names each node and the rows it read and embedded) and the index equals the
  single-process index of the same shards, row for row (embeddings within 1e-6, as ``test_ray_index``), while a
  shard that no Ray worker can read is that shard's skip (``skipped.csv`` and the report);
- an address where nothing answers is an error naming it within 30 s, not a hang;
- SIGKILL of every process of the worker node mid-run (its raylet, actor and tasks: the node is lost) loses nothing.

The cluster is ``benchmarks/lib/ray_cluster.LocalCluster``: teardown kills exactly the processes its nodes started
(found by an environment marker), never through ``ray stop``, which would stop any Ray on the machine.
Skipped when Ray is not installed (``pip install 'clip-mini[ray]'``).
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'clip-mini[ray]'")

import clip_mini  # noqa: E402
from clip_mini.cli.main import main  # noqa: E402
from clip_mini.retrieval.reader import IndexReader  # noqa: E402
from clip_mini.retrieval.wds_source import index_shards  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lib.ray_cluster import RAY_ENV, LocalCluster, free_port  # noqa: E402

pytestmark = pytest.mark.slow

N_SHARDS, PER_SHARD = 6, 20


@pytest.fixture(scope="module")
def cluster():
    # 2 embedding actors (Ray Data spreads them, one a node) and a CPU for the read tasks, on the head alone too
    # once the worker is gone: a cluster that cannot fit the actors and one read task waits for CPUs forever
    c = LocalCluster(cpus_per_node=2, head_cpus=3)
    try:
        yield c.start(workers=1)
    finally:
        c.stop()
        assert not c.pids(), "processes of the test's Ray nodes are still running"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[list[str], str]:
    from clip_mini.data import generate
    from clip_mini.data.convert import convert_to_webdataset
    from clip_mini.data.readers import read_captions
    from clip_mini.data.webdataset import expand_shards

    root = tmp_path_factory.mktemp("ray2shards")
    df, _ = read_captions(generate(root / "shapes", n=N_SHARDS * PER_SHARD, seed=5, size=32) / "captions.csv")
    pattern = convert_to_webdataset(df, root / "wds", shard_size=PER_SHARD, progress=False)["pattern"]
    return expand_shards(pattern), pattern


@pytest.fixture(scope="module")
def reference(shards, model_dir, tmp_path_factory) -> IndexReader:
    out = tmp_path_factory.mktemp("ray2ref") / "ix"
    return IndexReader.load(index_shards(out, clip_mini.load(model_dir), shards[0], precision="fp32",
                                         progress=False).path)


def _same(a: IndexReader, b: IndexReader) -> None:
    assert a.items == b.items   # same rows (path, shard, key, offset, caption, sha256, ...) in the same order
    assert np.abs(a.embeddings[:].astype(np.float32) - b.embeddings[:].astype(np.float32)).max() <= 1e-6


ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    """A driver's environment: the cluster's auth mode (off). Unset, with ~/.ray/auth_token present (a local
    ray.init writes it: tests/test_ray_index.py), Ray 2.60 turns token auth on for the driver alone, and its first
    pass fails with ActorDiedError (a pool actor "cancelled before it started running")."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **RAY_ENV}


def _driver(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A driver in a process of its own, as a user runs it (``clip-mini index``)."""
    env = _env()
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _index(cluster, model_dir, pattern, out, cwd) -> tuple[int, str, str]:
    done = _driver(["-m", "clip_mini", "index", "--model", str(model_dir), "--shards", pattern, "--out", str(out),
                    "--ray", cluster.address, "--ray-workers", "2", "--batch-size", "8", "--precision", "fp32"], cwd)
    return done.returncode, done.stdout, done.stderr


def _node_rows(out: str, ip: str, node_id: str) -> tuple[int, int]:
    """Rows the report says the node embedded and read (``ray:   node IP ID8: N embedded, M read``)."""
    for line in out.splitlines():
        if line.startswith(f"ray:   node {ip} {node_id[:8]}:"):
            embedded, read = line.split(":")[-1].split(",")
            return int(embedded.split()[0]), int(read.split()[0])
    raise AssertionError(f"no report line for node {ip} {node_id[:8]} in:\n{out}")


def test_both_nodes_embed_a_shard_no_worker_reads_is_skipped_and_the_index_is_the_single_process_one(
        cluster, shards, model_dir, reference, tmp_path):
    # One run, two checks (each Ray run costs its actors' start-up). The extra shard is a link through
    # /proc/self/cwd: it exists for the driver (its working folder holds the tar) and for no Ray worker (each works
    # in its node's folder), as a shard missing from the workers' mounts.
    (tmp_path / "here").mkdir()
    shutil.copy(shards[0][0], tmp_path / "here" / "only-here.tar")
    link = tmp_path / "unreadable.tar"
    link.symlink_to("/proc/self/cwd/here/only-here.tar")
    code, out, err = _index(cluster, model_dir, f"{shards[1]}::{link}", tmp_path / "ix", cwd=tmp_path)
    assert code == 0, err[-3000:]
    # Read tasks ran on both nodes (Ray Data spreads them); the rows were embedded by the actors that were up,
    # which on 120 tiny images may be the first one alone: every row is embedded once, on a node of the cluster
    head = _node_rows(out, cluster.ips["head"], cluster.node_ids["head"])
    worker = _node_rows(out, cluster.ips["worker1"], cluster.node_ids["worker1"])
    assert head[1] > 0 and worker[1] > 0 and head[1] + worker[1] == N_SHARDS * PER_SHARD + 1, out   # +1: the skip
    assert head[0] + worker[0] == N_SHARDS * PER_SHARD, out
    with open(tmp_path / "ix" / "skipped.csv", newline="") as f:
        skipped = {row["path"]: row["reason"] for row in csv.DictReader(f)}
    assert list(skipped) == [f"{link}#"]
    why = skipped[f"{link}#"]
    assert why.startswith("cannot open shard: No such file") and " (on Ray node " in why, why
    assert f"ray: shard skipped: {link}: cannot open shard" in out
    _same(IndexReader.load(tmp_path / "ix"), reference)   # every row of the readable shards, as one process gives


def test_an_address_where_nothing_answers_is_an_error_naming_it_within_30_s(model_dir, shards, tmp_path, capsys):
    address = f"127.0.0.1:{free_port()}"   # nothing listens there
    t0 = time.monotonic()
    code = main(["index", "--model", str(model_dir), "--shards", shards[1], "--out", str(tmp_path / "ix"),
                 "--ray", address, "--quiet"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2 and took < 30, (code, took, err)
    assert f"--ray {address}: no Ray head answers" in err
    assert not (tmp_path / "ix" / "manifest.json").exists()


KILL_DRIVER = """
import json, sys
import clip_mini
from clip_mini.retrieval.ray_index import ray_embedder
from clip_mini.retrieval.wds_source import index_shards
model, address, out, shards = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# small batches and parts (the pipeline --ray ADDRESS builds, finer grained): the kill lands mid-run
embed = ray_embedder(model, address, workers=2, batch_size=4, precision="fp32", progress=False, part_rows=10)
index_shards(out, clip_mini.load(model), shards, precision="fp32", progress=False, embed=embed)
r = embed.report
print(json.dumps({"lines": r.lines(), "lost": r.lost_nodes, "received": r.received}))
"""


def test_killing_the_worker_node_mid_run_loses_nothing(cluster, shards, model_dir, reference, tmp_path):
    """Last in this module: the worker node does not come back."""
    out, killed = tmp_path / "ix", []
    env = _env()
    driver = subprocess.Popen([sys.executable, "-c", KILL_DRIVER, str(model_dir), cluster.address, str(out),
                               *shards[0]], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)

    def worker_actor_up() -> bool:
        for pid in cluster.pids("worker1"):
            try:
                if b"EmbedActor" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    try:
        deadline = time.time() + 180
        while not killed and time.time() < deadline and driver.poll() is None:
            parts = len(list((out / ".work").glob("part-*.json")))
            if parts >= 1 and worker_actor_up():
                killed.append((cluster.kill("worker1"), parts))
            time.sleep(0.02)
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    total_parts = N_SHARDS * PER_SHARD // 10
    assert killed and killed[0][0] and killed[0][1] < total_parts, "the run ended before the worker could be killed"
    report = json.loads(stdout.strip().splitlines()[-1])
    print("\n".join(report["lines"]))
    assert report["received"] >= N_SHARDS * PER_SHARD, report["lines"]
    _same(IndexReader.load(out), reference)
    # the worker node is gone for Ray too (the report names it when the GCS saw it go before the pass ended)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        deadline = time.time() + 20
        while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == cluster.node_ids["worker1"]):
            assert time.time() < deadline, "the killed worker node is still alive for Ray"
            time.sleep(0.5)
    finally:
        ray.shutdown()
