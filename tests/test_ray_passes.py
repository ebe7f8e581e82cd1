"""The driver's side of ``index --ray`` (``ray_index.embed_with_ray``) when a pass fails: the shards it received
whole are written as done, a pass that failed because a node left the cluster (or on a Ray system error) runs again
for the others only, and any other failure is raised with the finished shards kept for the next run. Ray is stood
in for (these run without it): each shard's rows come as ``read_shard_rows`` and ``EmbedActor`` give them. The real
node loss is ``tests/test_ray_two_node.py``."""
import types

import numpy as np
import pytest

from clip_mini.retrieval import ray_index
from clip_mini.retrieval.ray_index import ROW_FIELDS, embed_with_ray
from clip_mini.retrieval.wds_source import Parts

DIM = 4


def _rows(shard: str, n: int, node: str) -> dict:
    """A batch of shard ``shard``'s ``n`` rows, embedded on ``node``."""
    rows = [{"shard": shard, "size": 10, "mtime_ns": 1, "key": f"k{i}", "caption": "c", "offset": i, "length": 1,
             "sha256": "0" * 64, "seq": i, "of": n, "mark": False, "reason": "", "read_node": node,
             "embed_node": node} for i in range(n)]
    batch = {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}
    batch["embedding"] = np.stack([np.full(DIM, hash((shard, i)) % 7, np.float32) for i in range(n)])
    return batch


def _half(batch: dict, lo: int, hi: int) -> dict:
    return {k: v[lo:hi] for k, v in batch.items()}


class ActorDiedError(Exception):
    """Stands for ray.exceptions.ActorDiedError."""


class _Ray:
    """Each pass yields the batches planned for it, then raises its error (if any) and drops nodes from the cluster."""

    def __init__(self, passes):
        self.passes, self.alive, self.asked = list(passes), {"n1", "n2", "n3"}, []
        ray = self

        class Dataset:
            def __init__(self, items):
                ray.asked.append([it["shard"] for it in items])

            def flat_map(self, fn):
                return self

            def map_batches(self, *a, **kw):
                return self

            def iter_batches(self, **kw):
                batches, error, lose = ray.passes.pop(0)
                yield from batches
                ray.alive -= lose
                if error is not None:
                    raise error

        self.data = types.SimpleNamespace(
            DataContext=types.SimpleNamespace(get_current=lambda: types.SimpleNamespace()),
            ActorPoolStrategy=lambda **kw: kw, from_items=lambda items, override_num_blocks: Dataset(items))
        self.exceptions = types.SimpleNamespace(ActorDiedError=ActorDiedError)

    def nodes(self):
        return [{"NodeID": n, "Alive": n in self.alive, "NodeManagerAddress": f"10.0.0.{n[1]}"}
                for n in ("n1", "n2", "n3")]

    def cluster_resources(self):
        return {"CPU": 4.0}


def _run(monkeypatch, tmp_path, passes, shards=("a.tar", "b.tar")):
    fake = _Ray(passes)
    monkeypatch.setattr(ray_index, "_ray", lambda: fake)
    monkeypatch.setattr("clip_mini.data.webdataset.shard_identity_of", lambda u: (10, 1))
    parts = Parts(tmp_path, "fp")
    try:
        return fake, parts, embed_with_ray(list(shards), parts, "m", 2, 8, "fp32", False, part_rows=3)
    except Exception as e:   # noqa: BLE001 -- the caller looks at it
        return fake, parts, e


def test_a_pass_that_lost_a_node_runs_again_for_the_unfinished_shards_only(monkeypatch, tmp_path):
    a, b = _rows("a.tar", 4, "n1"), _rows("b.tar", 4, "n2")
    lost = RuntimeError("ObjectLostError: the node holding the block died")
    # pass 1: all of a, half of b, then n2 dies; pass 2 (b only): b again, whole, on n1
    fake, parts, report = _run(monkeypatch, tmp_path, [([a, _half(b, 0, 2)], lost, {"n2"}),
                                                      ([_rows("b.tar", 4, "n1")], None, set())])
    assert fake.asked == [["a.tar", "b.tar"], ["b.tar"]]
    assert report.passes == 2 and report.lost_nodes == ["n2"]
    assert report.received == 10 and report.duplicates == 2   # b's first half came twice: kept once
    assert report.embedded_on == {"n1": 6, "n2": 2} and report.addresses["n2"] == "10.0.0.2"
    kept = Parts(tmp_path, "fp")   # as the next run (or the merge) reads them back from disk
    assert {c[0] for c in kept.complete} == {"a.tar", "b.tar"}
    names = [f"{s}#{k}" for r in kept.rows for s, k in zip(r["shard"], r["key"])]
    assert sorted(names) == sorted({f"{s}#k{i}" for s in ("a.tar", "b.tar") for i in range(4)}) and \
        len(names) == 8
    # b's first half embedded on n2 before it died is the row kept (the first one in), the same embedding
    emb = np.concatenate([np.asarray(x, np.float32) for x in kept.arrays])
    assert np.array_equal(emb[names.index("b.tar#k0")], _rows("b.tar", 4, "n1")["embedding"][0].astype(np.float16))


def test_a_failure_without_a_lost_node_is_raised_and_the_finished_shards_are_kept(monkeypatch, tmp_path):
    a, b = _rows("a.tar", 4, "n1"), _rows("b.tar", 4, "n2")
    fake, parts, err = _run(monkeypatch, tmp_path, [([a, _half(b, 0, 2)], ValueError("a bug in the UDF"), set())])
    assert isinstance(err, ValueError) and fake.asked == [["a.tar", "b.tar"]]
    kept = Parts(tmp_path, "fp")
    assert {c[0] for c in kept.complete} == {"a.tar"}   # b is read again by the next run; its half is in a part
    assert sum(len(r["key"]) for r in kept.rows) == 6


def test_a_ray_system_error_without_a_lost_node_runs_again_too(monkeypatch, tmp_path):
    a = _rows("a.tar", 4, "n1")
    died = ActorDiedError("The actor never ran - it was cancelled before it started running.")
    fake, parts, report = _run(monkeypatch, tmp_path, [([], died, set()), ([a], None, set())], shards=("a.tar",))
    assert fake.asked == [["a.tar"], ["a.tar"]] and report.passes == 2 and not report.lost_nodes


def test_retries_run_out(monkeypatch, tmp_path):
    b = _rows("b.tar", 4, "n3")
    lost = RuntimeError("node died")
    # every pass loses a node: the first and RETRIES more, then the error
    fake, parts, err = _run(monkeypatch, tmp_path, [([_half(b, 0, 1)], lost, {"n3"}), ([], lost, {"n2"}),
                                                    ([], lost, {"n1"})], shards=("b.tar",))
    assert err is lost and len(fake.asked) == 1 + ray_index.RETRIES == 3


def test_a_pass_that_ends_short_of_a_shards_rows_is_an_error(monkeypatch, tmp_path):
    from clip_mini.retrieval.format import EmbeddingIndexError

    b = _rows("b.tar", 4, "n2")
    fake, parts, err = _run(monkeypatch, tmp_path, [([_half(b, 0, 3)], None, set())], shards=("b.tar",))
    assert isinstance(err, EmbeddingIndexError) and "without all rows of 1 shards, e.g. b.tar (3 of 4 rows)" in \
        str(err)
    assert not Parts(tmp_path, "fp").complete


def test_row_fields_are_what_the_index_keeps():
    assert set(ROW_FIELDS) <= set(_rows("a.tar", 1, "n1"))
