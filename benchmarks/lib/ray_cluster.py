"""A real multi-node Ray cluster on one machine, for tests and benchmarks: each node is started with ``ray start``
(the head with ``--head``, the others with ``--address HEAD``) on its own IP (the head on the machine's, which Ray
picks, as it does for 127.0.0.1; the workers on 127.0.0.2, 127.0.0.3, ... of the loopback), with its own ports and
object store, so Ray sees separate nodes that exchange objects over TCP.

Every process a node starts (GCS, raylet, agents, workers) carries an environment marker unique to the cluster and
node, and ``ray start`` runs in a new session; ``kill(node)`` and ``stop()`` end exactly those processes, found by
that marker, never through ``ray stop`` (which stops every Ray instance of the machine). Needs Ray installed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

MARKER = "CLIP_MINI_RAY_CLUSTER_NODE"
# The GCS calls a node dead after 3 missed checks 0.5 s apart (Ray's defaults: 5 x 3 s), so a killed node is
# noticed in seconds; no usage report is sent (nothing leaves the machine). Token authentication is off for every
# node alike: unset, a head turns it on when ~/.ray/auth_token exists (which a local ray.init writes) and a worker
# does not, and the worker cannot join.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
           "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "0",
           "RAY_AUTH_MODE": "disabled"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalCluster:
    """``LocalCluster(cpus_per_node=2).start(workers=1)``: a head and ``workers`` worker nodes (the head has
    ``head_cpus``, default ``cpus_per_node``), then ``address``
    (``HOST:PORT`` of the head), ``node_ids`` (``{"head": id, "worker1": id, ...}``) and ``ips``; ``stop()``."""

    def __init__(self, cpus_per_node: int = 2, object_store_mb: int = 100, head_cpus: Optional[int] = None):
        self.cpus, self.store = cpus_per_node, object_store_mb
        self.head_cpus = cpus_per_node if head_cpus is None else head_cpus
        self.root = Path(tempfile.mkdtemp(prefix="cmray-", dir="/tmp"))   # short: Ray's socket paths live under it
        self.tag = uuid.uuid4().hex
        self.port = free_port("")
        self.address = f"127.0.0.1:{self.port}"   # the head's IP once it runs
        self.node_ids: dict[str, str] = {}
        self.ips: dict[str, str] = {}
        self.log: list[str] = []

    def _ray_start(self, name: str, ip: Optional[str], args: list[str], cpus: int) -> None:
        cwd = self.root / name   # the node's processes work in their own folder
        cwd.mkdir()
        env = {**os.environ, **RAY_ENV, MARKER: f"{self.tag}:{name}"}
        for flag in ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                     "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port"):
            args = args + [flag, str(free_port(ip or ""))]
        cmd = [str(Path(sys.executable).parent / "ray"), "start", *(["--node-ip-address", ip] if ip else []),
               "--num-cpus", str(cpus), "--object-store-memory", str(self.store << 20), "--disable-usage-stats", *args]
        done = subprocess.run(cmd, cwd=cwd, env=env, start_new_session=True, capture_output=True, text=True,
                              timeout=180)
        self.log.append(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
        if done.returncode != 0:
            raise RuntimeError(f"ray start ({name}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")

    def start(self, workers: int = 1, worker_resources: Optional[dict] = None, timeout: float = 60) -> "LocalCluster":
        import ray

        self._ray_start("head", None, ["--head", "--port", str(self.port), "--include-dashboard", "false",
                                               "--temp-dir", str(self.root / "tmp")], self.head_cpus)
        for i in range(1, workers + 1):
            name, ip = f"worker{i}", f"127.0.0.{i + 1}"
            self.ips[name] = ip
            self._ray_start(name, ip, ["--address", self.address, "--temp-dir", str(self.root / "tmp"),
                                       "--resources", json.dumps({**(worker_resources or {}), name: 1})], self.cpus)
        ray.init(address=self.address, log_to_driver=False)
        try:
            deadline = time.time() + timeout
            while True:
                alive = [n for n in ray.nodes() if n["Alive"]]
                if len(alive) == workers + 1 or time.time() > deadline:
                    break
                time.sleep(0.5)
            if len(alive) != workers + 1:
                raise RuntimeError(f"the cluster has {len(alive)} live nodes, not {workers + 1}")
            for n in alive:
                name = next((k for k in n["Resources"] if k.startswith("worker") and k[6:].isdigit()), "head")
                self.node_ids[name] = n["NodeID"]
                if name == "head":
                    self.ips["head"] = n["NodeManagerAddress"]
                    self.address = f"{n['NodeManagerAddress']}:{self.port}"
                elif n["NodeManagerAddress"] != self.ips[name]:
                    raise RuntimeError(f"node {name} runs at {n['NodeManagerAddress']}, not {self.ips[name]}")
            if len(set(self.ips.values())) != len(self.ips):
                raise RuntimeError(f"two nodes share an IP: {self.ips}")
        finally:
            ray.shutdown()
        return self

    def pids(self, name: Optional[str] = None) -> list[int]:
        """Every live process of node ``name`` (of any node: None), by the marker in its environment."""
        want = f"{MARKER}={self.tag}:{name or ''}".encode()
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    env = (d / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if any(e.startswith(want) for e in env):
                    found.append(int(d.name))
        return found

    def kill(self, name: Optional[str] = None, timeout: float = 20) -> list[int]:
        """SIGKILL every process of node ``name`` (all nodes: None), as a machine that dies; the pids killed."""
        killed: list[int] = []
        deadline = time.time() + timeout
        while True:
            left = self.pids(name)   # again: a process may have been started meanwhile (a worker being spawned)
            if not left or time.time() > deadline:
                return killed
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)
