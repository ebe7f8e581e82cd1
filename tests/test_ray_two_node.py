"""A real two-node Ray cluster on this box: ``ray start --head`` and ``ray start --address HEAD`` as separate nodes
(own IPs, the machine's and 127.0.0.2, own ports, object stores and working folders), and ``clip-mini index --shards
PATTERN --ray HEAD`` run as a driver that joins them:

- rows are embedded on both nodes (the report names each node and its rows) and the index equals the
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
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'clip-mini[ray]'")

import clip_mini  # noqa: E402
from clip_mini.cli.main import main  # noqa: E402
from clip_mini.retrieval.ray_index import ray_embedder  # noqa: E402
from clip_mini.retrieval.reader import IndexReader  # noqa: E402
from clip_mini.retrieval.wds_source import index_shards  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lib.ray_cluster import LocalCluster, free_port  # noqa: E402

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


def _index(cluster, model_dir, pattern, out, capsys) -> tuple[int, str, str]:
    code = main(["index", "--model", str(model_dir), "--shards", pattern, "--out", str(out), "--ray",
                 cluster.address, "--ray-workers", "2", "--batch-size", "8", "--precision", "fp32"])
    got = capsys.readouterr()
    return code, got.out, got.err


def _node_rows(out: str, ip: str, node_id: str) -> int:
    """Rows the report says the node embedded (``ray:   node IP ID8: N embedded, M read``)."""
    for line in out.splitlines():
        if line.startswith(f"ray:   node {ip} {node_id[:8]}:"):
            return int(line.split(":")[-1].split()[0])
    raise AssertionError(f"no report line for node {ip} {node_id[:8]} in:\n{out}")


def test_both_nodes_embed_a_shard_no_worker_reads_is_skipped_and_the_index_is_the_single_process_one(
        cluster, shards, model_dir, reference, tmp_path, capsys, monkeypatch):
    # One run, two checks (each Ray run costs its actors' start-up). The extra shard is a link through
    # /proc/self/cwd: it exists for the driver (its working folder holds the tar) and for no Ray worker (each works
    # in its node's folder), as a shard missing from the workers' mounts.
    (tmp_path / "here").mkdir()
    shutil.copy(shards[0][0], tmp_path / "here" / "only-here.tar")
    link = tmp_path / "unreadable.tar"
    link.symlink_to("/proc/self/cwd/here/only-here.tar")
    monkeypatch.chdir(tmp_path)
    code, out, err = _index(cluster, model_dir, f"{shards[1]}::{link}", tmp_path / "ix", capsys)
    assert code == 0, err
    head = _node_rows(out, cluster.ips["head"], cluster.node_ids["head"])
    worker = _node_rows(out, cluster.ips["worker1"], cluster.node_ids["worker1"])
    assert head > 0 and worker > 0 and head + worker == N_SHARDS * PER_SHARD, out
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


def test_killing_the_worker_node_mid_run_loses_nothing(cluster, shards, model_dir, reference, tmp_path):
    """Last in this module: the worker node does not come back."""
    out, killed = tmp_path / "ix", []
    # small batches and parts (the CLI's pipeline, as ``--ray ADDRESS`` builds it): the kill lands mid-run
    embed = ray_embedder(str(model_dir), cluster.address, workers=2, batch_size=4, precision="fp32", progress=False,
                         part_rows=10)
    result = {}

    def build():
        try:
            result["index"] = index_shards(out, clip_mini.load(model_dir), shards[0], precision="fp32",
                                           progress=False, embed=embed)
        except BaseException as e:   # noqa: BLE001 -- re-raised below
            result["error"] = e

    def worker_actor_up() -> bool:
        for pid in cluster.pids("worker1"):
            try:
                if b"EmbedActor" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    run = threading.Thread(target=build)
    run.start()
    deadline = time.time() + 180
    while not killed and time.time() < deadline and run.is_alive():
        parts = len(list((out / ".work").glob("part-*.json")))
        if parts >= 1 and worker_actor_up():
            killed.append((cluster.kill("worker1"), parts))
        time.sleep(0.02)
    run.join(300)
    assert not run.is_alive(), "the index run did not finish after the worker node was killed"
    if "error" in result:
        raise result["error"]
    total_parts = N_SHARDS * PER_SHARD // 10
    assert killed and killed[0][0] and killed[0][1] < total_parts, "the run ended before the worker could be killed"
    report = embed.report
    print("\n".join(report.lines()))
    assert cluster.node_ids["worker1"] in report.lost_nodes, report.lines()
    assert report.received >= N_SHARDS * PER_SHARD, report.lines()
    _same(result["index"], reference)
