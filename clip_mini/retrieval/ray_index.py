"""``clip-mini index --shards PATTERN --ray [ADDRESS]``: the embedding pass of ``wds_source`` as a Ray Data pipeline.

    shards -> read (tasks: one shard each, samples with their offsets) -> decode + embed (an actor pool, one model
    per actor) -> the driver writes index parts -> ``wds_source.index_shards`` merges them into one generation

Without an address a local Ray instance is started (and stopped after); with one, the driver joins that cluster
(``connect``: an address that does not answer is an error naming it, within ``CONNECT_TIMEOUT_S``) and the workers
must see the shard paths and the model directory at the same paths (``docs/distributed.md``).

Every row carries the Ray node that read it and the node that embedded it; ``RayReport`` counts them per node.
A shard that a worker cannot open is a skip (``skipped.csv``, path ``<shard>#``, the reason names the node), and the
index is built from the other shards.

Faults: Ray Data re-runs the blocks of a task or actor that died (actors are restarted), and the driver keeps the
first row of each (shard, key), so a re-run block can neither duplicate nor lose a row. The driver marks a shard done
in a part only once it has every row the read task announced for it (``of``), so a pass that fails still leaves its
finished shards behind: a pass that fails because a node left the cluster is run again, on the nodes left, for the
unfinished shards (``retries``), and a run that fails anyway resumes after its finished shards. The driver's own
death loses only the rows not yet written to a part. Needs ``pip install 'clip-mini[ray]'``.
"""
from __future__ import annotations

import hashlib
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from clip_mini.retrieval.format import EmbeddingIndexError
from clip_mini.retrieval.wds_source import ROW_FIELDS, Parts, embed_images, empty_rows

_PART_ROWS = 4096         # rows per index part written by the driver
CONNECT_TIMEOUT_S = 25.0  # joining a cluster: the port check and ray.init together
_PORT_CHECK_S = 5.0       # the TCP check of the head's port
RETRIES = 2               # passes run again after a node was lost
# columns the driver reads besides ROW_FIELDS: the row's number in its shard's read and how many the read gave,
# a marker row (an empty shard's only row: no sample, no skip), why the sample was skipped, the nodes
_EXTRA = ("seq", "of", "mark", "reason", "read_node")


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise EmbeddingIndexError("--ray needs Ray: pip install 'clip-mini[ray]' (Ray Data and pyarrow, ~410 MB)") \
            from None
    return ray


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def read_shard_rows(item: dict) -> list[dict]:
    """Ray read stage: one shard -> one row per sample (image bytes, offset, caption) or per skipped sample.

    Each row has its number ``seq`` among the ``of`` rows of this read, so the driver knows when it has the whole
    shard; a shard without samples gives one marker row. A shard-level skip (key "": it cannot be opened, or is
    damaged before its first sample) names the node, which may be the only one that cannot read it."""
    from clip_mini.data.webdataset import SkipLog, iter_shard, shard_identity_of

    url = item["shard"]
    size, mtime = shard_identity_of(url)
    log = SkipLog(show=0)
    node = _node()
    rows = [{"shard": url, "size": size, "mtime_ns": mtime, "key": s.key, "caption": s.caption,
             "offset": s.offset, "length": len(s.image), "sha256": hashlib.sha256(s.image).hexdigest(),
             "image": s.image, "reason": "", "mark": False} for s in iter_shard(url, log)]
    where = ""
    if any(not key for _, key, _ in log.rows):
        import ray

        where = f" (on Ray node {ray.util.get_node_ip_address()} {node[:8]})"
    rows += [{"shard": sh, "size": size, "mtime_ns": mtime, "key": key, "caption": "", "offset": -1, "length": 0,
              "sha256": "", "image": b"", "reason": why + ("" if key else where), "mark": False}
             for sh, key, why in log.rows]
    if not rows:
        rows = [{"shard": url, "size": size, "mtime_ns": mtime, "key": "", "caption": "", "offset": -1, "length": 0,
                 "sha256": "", "image": b"", "reason": "", "mark": True}]
    for i, r in enumerate(rows):
        r.update(seq=i, of=len(rows), read_node=node)
    return rows


class EmbedActor:
    """Ray actor: loads the model once, then decodes and embeds batches (rows with a reason pass through)."""

    def __init__(self, model_dir: str, precision: str, device: str = "auto", flip_average: bool = False):
        import torch

        from clip_mini.embed import load
        from clip_mini.model.clip import ImageForward
        from clip_mini.runtime.devices import resolve_precision

        torch.set_num_threads(1)   # one core per actor: the pool, not threads, spreads the work
        self.embedder = load(model_dir, device=actor_device(device))
        # "auto" resolved here, for this actor's device: the driver may have no GPU, or another kind
        self.precision = resolve_precision(precision, self.embedder.device)
        self.forward = ImageForward(self.embedder.model, self.precision, self.embedder.device, flip_average)
        self.node = None   # this actor's Ray node, asked on the first batch (not needed outside Ray)

    def __call__(self, batch: dict) -> dict:
        if self.node is None:
            self.node = _node()
        n = len(batch["key"])
        todo = [i for i in range(n) if not batch["reason"][i] and not batch["mark"][i]]
        feats, bad = embed_images(self.embedder, [batch["image"][i] for i in todo],
                                  [f"{batch['shard'][i]}:{batch['key'][i]}" for i in todo], self.forward)
        out = np.zeros((n, self.embedder.dim), np.float32)
        reason = [str(r) for r in batch["reason"]]
        ok = [i for j, i in enumerate(todo) if j not in bad]
        out[ok] = feats
        for j, why in bad.items():
            reason[todo[j]] = why
        keep = {f: batch[f] for f in ROW_FIELDS + _EXTRA}
        return {**keep, "reason": np.array(reason, dtype=object), "embedding": out,
                "embed_node": np.array([self.node] * n, dtype=object)}


def actor_device(device: str) -> str:
    """An actor's device for the user's ``--device``: Ray gives a GPU actor its own GPU as ``cuda:0`` of its visible
    devices (``CUDA_VISIBLE_DEVICES``), so ``cuda:N`` names the kind, not the index."""
    return "cuda" if str(device).startswith("cuda") else str(device)


def actor_gpus(ray, device: str) -> int:
    """GPUs each embedding actor asks Ray for: 1 for ``--device cuda[:N]``, and for ``auto`` when the cluster has
    GPUs; else 0. Without a request Ray hides every GPU from the actor (or, with the variable unset, every actor
    lands on GPU 0)."""
    device = str(device)
    if device.startswith("cuda"):
        if not ray.cluster_resources().get("GPU", 0):
            raise EmbeddingIndexError(f"--device {device}: the Ray cluster has no GPU")
        return 1
    if device == "auto":
        return 1 if ray.cluster_resources().get("GPU", 0) else 0
    return 0


@dataclass
class RayReport:
    """What a Ray pass did: rows received (re-run copies included) and kept, per node, and the passes it took."""
    received: int = 0
    duplicates: int = 0                                      # re-run copies the driver dropped
    embedded_on: dict[str, int] = field(default_factory=dict)   # node id -> rows embedded (kept rows)
    read_on: dict[str, int] = field(default_factory=dict)       # node id -> rows read (kept rows and skips)
    addresses: dict[str, str] = field(default_factory=dict)     # node id -> its IP address
    shard_skips: dict[str, str] = field(default_factory=dict)   # shard -> why no worker read it
    passes: int = 0
    lost_nodes: list[str] = field(default_factory=list)         # nodes that left the cluster during the run

    def lines(self) -> list[str]:
        """The report as printed by ``clip-mini index --ray``: one line for the pass, one per node."""
        kept = sum(self.embedded_on.values())
        nodes = sorted(set(self.embedded_on) | set(self.read_on))
        out = [f"ray: {kept} rows embedded on {len(self.embedded_on)} of {len(nodes)} nodes, {self.received} received"
               f" ({self.duplicates} re-run copies dropped), {self.passes} pass{'es' if self.passes != 1 else ''}"
               + (f"; nodes lost: {', '.join(self._name(n) for n in self.lost_nodes)}" if self.lost_nodes else "")]
        out += [f"ray:   node {self._name(n)}: {self.embedded_on.get(n, 0)} embedded, {self.read_on.get(n, 0)} read"
                for n in nodes]
        out += [f"ray: shard skipped: {s}: {why}" for s, why in sorted(self.shard_skips.items())]
        return out

    def _name(self, node: str) -> str:
        return f"{self.addresses.get(node, '?')} {node[:8]}"


class _Pass:
    """The driver's side: rows kept once each, buffered into parts; a shard is complete once all its rows came."""

    def __init__(self, parts: Parts, part_rows: int, report: RayReport):
        self.parts, self.part_rows, self.report = parts, part_rows, report
        self.rows, self.feats, self.skipped = empty_rows(), [], {}
        self.seen: set[str] = set()                  # "shard#key" kept (or skipped) already
        self.got: dict[str, set[int]] = {}           # shard -> the seq numbers received
        self.of: dict[str, int] = {}                 # shard -> rows its read gave
        self.done: set[str] = set()                  # shards with every row received
        self.unwritten: list[str] = []               # of those, the ones no part marks complete yet

    def take(self, batch: dict) -> None:
        rep = self.report
        for i in range(len(batch["key"])):
            rep.received += 1
            shard = str(batch["shard"][i])
            self.got.setdefault(shard, set()).add(int(batch["seq"][i]))
            self.of.setdefault(shard, int(batch["of"][i]))
            if shard not in self.done and len(self.got[shard]) >= self.of[shard]:
                self.done.add(shard)
                self.unwritten.append(shard)
            if batch["mark"][i]:
                continue
            name = f"{shard}#{batch['key'][i]}"
            if name in self.seen:
                rep.duplicates += 1
                continue   # a re-run block's copy
            self.seen.add(name)
            rn = str(batch["read_node"][i])
            rep.read_on[rn] = rep.read_on.get(rn, 0) + 1
            if batch["reason"][i]:
                self.skipped[name] = str(batch["reason"][i])
                if not batch["key"][i]:
                    rep.shard_skips[shard] = self.skipped[name]
                continue
            en = str(batch["embed_node"][i])
            rep.embedded_on[en] = rep.embedded_on.get(en, 0) + 1
            for f in ROW_FIELDS:
                v = batch[f][i]
                self.rows[f].append(v.item() if hasattr(v, "item") else str(v))
            self.feats.append(batch["embedding"][i])
        if len(self.rows["key"]) >= self.part_rows:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as a part that marks complete the shards whose rows are all written now."""
        if not self.rows["key"] and not self.skipped and not self.unwritten:
            return
        from clip_mini.data.webdataset import shard_identity_of

        dim = self.parts.arrays[0].shape[1] if self.parts.arrays else 0
        emb = np.stack(self.feats) if self.feats else np.zeros((0, dim), np.float32)
        self.parts.write(self.rows, emb, [(u, *shard_identity_of(u)) for u in self.unwritten], self.skipped)
        self.rows, self.feats, self.skipped, self.unwritten = empty_rows(), [], {}, []


def embed_with_ray(pending: Sequence[str], parts: Parts, model_dir: str, workers: int, batch_size: int,
                   precision: str, progress: bool, part_rows: int = _PART_ROWS, device: str = "auto",
                   retries: int = RETRIES, report: Optional[RayReport] = None, flip_average: bool = False
                   ) -> RayReport:
    """Run the pipeline over ``pending`` shards, writing a part per ``part_rows`` rows; returns the report.

    ``precision`` may be "auto" and ``device`` any ``--device``: each actor resolves both where it runs. The actors
    embed with ``flip_average`` as ``wds_source.embed_local`` does (``model.clip.ImageForward``). A pass that
    fails after a node left the cluster, or on a Ray system error (``_system_error``), runs again for the shards not
    complete, at most ``retries`` times.

    Raises:
        EmbeddingIndexError: a pass that ended without every row of its shards (nothing is marked done then).
    """
    ray = _ray()
    report = report if report is not None else RayReport()
    run = _Pass(parts, part_rows, report)
    for attempt in range(retries + 1):
        todo = [u for u in pending if u not in run.done]
        if not todo:
            break
        before = _alive_nodes(ray)
        report.passes += 1
        try:
            for batch in _dataset(ray, todo, model_dir, workers, batch_size, precision, progress, device,
                                  flip_average).iter_batches(batch_size=None, batch_format="numpy"):
                run.take(batch)
            run.flush()
        except Exception as e:   # noqa: BLE001 -- Ray's errors have no one base class (Ray Data wraps them)
            run.flush()   # what came is kept: the next pass, or the next run, starts after it
            lost = _note_lost(ray, before, report)
            if not (lost or _system_error(ray, e)) or attempt == retries or isinstance(e, EmbeddingIndexError):
                raise
            why = f"{len(lost)} node(s) left the cluster" if lost else "a Ray actor or object was lost"
            print(f"ray: {why} during the pass ({type(e).__name__}: {str(e).splitlines()[0][:200]}); running the "
                  f"{len(set(todo) - run.done)} unfinished shards again", file=sys.stderr)
        else:
            _note_lost(ray, before, report)   # Ray Data may have recovered by itself
            break
    report.addresses.update(_addresses(ray))
    missing = [u for u in pending if u not in run.done]
    if missing:
        raise EmbeddingIndexError(f"the Ray pass ended without all rows of {len(missing)} shards, e.g. {missing[0]} "
                                  f"({len(run.got.get(missing[0], ()))} of {run.of.get(missing[0], '?')} rows): "
                                  "run the index command again to finish them")
    return report


def _dataset(ray, shards: Sequence[str], model_dir: str, workers: int, batch_size: int, precision: str,
             progress: bool, device: str, flip_average: bool = False):
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    ds = ray.data.from_items([{"shard": u} for u in shards], override_num_blocks=len(shards))
    ds = ds.flat_map(read_shard_rows)
    # Ray Data's actor pools restart a dead actor and retry its tasks by default (max_restarts=-1)
    return ds.map_batches(EmbedActor, fn_constructor_kwargs={"model_dir": str(model_dir), "precision": precision,
                                                             "device": str(device), "flip_average": flip_average},
                          compute=ray.data.ActorPoolStrategy(size=workers), batch_size=batch_size, num_cpus=1,
                          num_gpus=actor_gpus(ray, device), batch_format="numpy")


def _system_error(ray, e: BaseException) -> bool:
    """A Ray system failure (an actor or worker that died, say killed for memory; a lost object), which a new pass
    may not meet again. A constructor that raises (no model directory on a node) is an ActorDiedError too, and
    fails every pass: ``retries`` bounds that."""
    names = ("RayActorError", "ActorDiedError", "ObjectLostError", "WorkerCrashedError", "NodeDiedError",
             "OwnerDiedError", "RaySystemError")
    kinds = tuple(k for k in (getattr(getattr(ray, "exceptions", None), n, None) for n in names) if isinstance(k, type))
    return bool(kinds) and isinstance(e, kinds)


def _note_lost(ray, before: set[str], report: RayReport) -> list[str]:
    """The nodes alive at a pass's start that are not now (added to the report)."""
    lost = sorted(before - _alive_nodes(ray))
    report.lost_nodes += [n for n in lost if n not in report.lost_nodes]
    return lost


def _alive_nodes(ray) -> set[str]:
    try:
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:   # noqa: BLE001 -- the GCS itself is gone: no node to compare
        return set()


def _addresses(ray) -> dict[str, str]:
    try:
        return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    except Exception:   # noqa: BLE001
        return {}


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """(host, port) of ``host:port`` or ``ray://host:port``; None for ``auto`` and other forms Ray resolves."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def connect(ray, address: str, progress: bool, timeout: Optional[float] = None) -> None:
    """Join the Ray cluster at ``address``, or fail within ``timeout`` seconds with an error naming it.

    ``ray.init`` retries an address that does not answer for a minute or more (then may abort the process), so the
    head's port is tried first (``_PORT_CHECK_S``), and ``ray.init`` runs in a thread that is given up on at the
    deadline (a port that answers but is not a Ray head).

    Raises:
        EmbeddingIndexError: nothing listens at the address, it is not a Ray head, or Ray refused to join.
    """
    start = time.monotonic()
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    hp = _host_port(address)
    if hp is not None:
        try:
            socket.create_connection(hp, timeout=min(_PORT_CHECK_S, timeout)).close()
        except OSError as e:
            raise EmbeddingIndexError(
                f"--ray {address}: no Ray head answers at {hp[0]}:{hp[1]} ({e.strerror or e or 'timed out'}): start "
                f"one there (ray start --head --port {hp[1]}) or give the head's address as HOST:PORT") from None
    box: dict = {}

    def init() -> None:
        try:
            ray.init(address=address, log_to_driver=progress)
        except BaseException as e:   # noqa: BLE001 -- handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=init, name="ray-init", daemon=True)
    thread.start()
    thread.join(max(1.0, timeout - (time.monotonic() - start)))
    if thread.is_alive():
        raise EmbeddingIndexError(f"--ray {address}: something answers there but no Ray cluster joined within "
                                  f"{timeout:.0f} s: is it the head's GCS port (ray start --head --port ...), "
                                  f"running Ray {ray.__version__}?")
    if "error" in box:
        raise EmbeddingIndexError(f"--ray {address}: cannot join the Ray cluster: {box['error']}") from None


class RayEmbedder:
    """The ``embed`` argument of ``index_shards``: start (or join) Ray, run the pipeline, stop what it started.

    ``report`` is the last run's ``RayReport``."""

    def __init__(self, model_dir: str, address: Optional[str], workers: int, batch_size: int, precision: str,
                 progress: bool, device: str = "auto", part_rows: int = _PART_ROWS, retries: int = RETRIES,
                 flip_average: bool = False):
        self.ray = _ray()
        self.model_dir, self.address, self.workers, self.batch_size = model_dir, address, workers, batch_size
        self.precision, self.progress, self.device = precision, progress, device
        self.part_rows, self.retries, self.flip_average = part_rows, retries, flip_average
        self.report: Optional[RayReport] = None

    def __call__(self, pending: Sequence[str], parts: Parts) -> None:
        ray = self.ray
        started = not ray.is_initialized()
        if started:
            if self.address is None:   # local: one CPU per actor plus one for the read tasks, a small object store
                ray.init(num_cpus=self.workers + 1, object_store_memory=512 << 20, include_dashboard=False,
                         log_to_driver=self.progress)
            else:
                connect(ray, self.address, self.progress)
        self.report = RayReport()
        try:
            embed_with_ray(pending, parts, self.model_dir, self.workers, self.batch_size, self.precision,
                           self.progress, part_rows=self.part_rows, device=self.device, retries=self.retries,
                           report=self.report, flip_average=self.flip_average)
        finally:
            if started:
                ray.shutdown()


def ray_embedder(model_dir: str, address: Optional[str], workers: int, batch_size: int, precision: str,
                 progress: bool, device: str = "auto", **kw) -> Callable[[Sequence[str], Parts], None]:
    """A ``RayEmbedder`` (``kw``: ``part_rows``, ``retries``, ``flip_average``)."""
    return RayEmbedder(model_dir, address, workers, batch_size, precision, progress, device, **kw)
