"""Load on `clip-mini serve`: concurrent clients on loopback sending text queries; throughput and latency.

    python benchmarks/speed/bench_serve.py [--sizes 10000 100000] [--clients 1 8 32] [--seconds 8] [--workers 1]

For each index size a model directory with the ``configs/tiny.yaml`` architecture (untrained: speed does not
depend on the weights) and a synthetic index of random unit rows are made as ``bench_startup.py`` makes them.
``clip-mini serve`` runs as its own process on a free 127.0.0.1 port; this process drives C concurrent clients
(asyncio, one keep-alive HTTP/1.1 connection each) for a fixed time after a warm-up, each sending
``GET /api/search?q=...&k=10`` with captions drawn from a fixed list, back to back. Reported per (size, clients):
requests, failures (any non-200 answer or transport error), requests/s, and p50/p90/p99/max latency as the client
sees it. Clients and server share the machine's cores, so the figures are a floor for a dedicated server.
Bounded: at most ``--max-clients`` clients and ``--seconds`` per point. Writes ``benchmarks/results/speed/serve.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402

from benchmarks.speed.bench_startup import make_index, make_model  # noqa: E402
from benchmarks.lib.repo_paths import scrub_paths  # noqa: E402

CAPTIONS = [f"a {size} {colour} {shape} {where}" for size in ("small", "large") for colour in
            ("red", "green", "blue", "yellow") for shape in ("circle", "square", "star") for where in
            ("on the left", "in the center", "at the bottom")] + [
    "a dog running on grass", "two children playing in the water at the beach", "a man riding a bicycle"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index: Path, workers: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clip_mini", "serve", "--index", str(index), "--port", str(port),
                             "--workers", str(workers)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"clip-mini serve exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("clip-mini serve did not answer within 300 s")


async def _get(reader, writer, target: str) -> tuple[int, bytes]:
    """One HTTP/1.1 keep-alive GET; (status, body). uvicorn answers JSON with a Content-Length."""
    writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
    length = {k.strip().lower(): v.strip() for k, v in headers.items()}["content-length"]
    return int(head[0].split()[1]), await reader.readexactly(int(length))


async def _client(port: int, stop_at: float, seed: int, latencies: list, failures: list) -> None:
    # A bare asyncio HTTP/1.1 client: httpx's AsyncClient capped this benchmark at ~32 requests/s with 32
    # connections (its pool, not the server: the same server answered 326/s to this client, 10k rows).
    rng = np.random.default_rng(seed)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop_at:
            target = "/api/search?" + urlencode({"q": CAPTIONS[rng.integers(len(CAPTIONS))], "k": 10})
            t = time.perf_counter()
            try:
                status, body = await _get(reader, writer, target)
                ok = status == 200 and len(json.loads(body)["results"]) == 10
                if not ok:
                    failures.append(f"HTTP {status}: {body[:200]!r}")
            except Exception as e:   # a transport error is a failed request, counted and shown; reconnect
                ok = False
                failures.append(f"{type(e).__name__}: {e}")
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if ok:
                latencies.append(time.perf_counter() - t)
    finally:
        writer.close()


async def drive(port: int, clients: int, seconds: float, warmup: float) -> dict:
    await asyncio.gather(*(_client(port, time.perf_counter() + warmup, i, [], []) for i in range(clients)))
    latencies: list[float] = []
    failures: list[str] = []
    start = time.perf_counter()
    await asyncio.gather(*(_client(port, start + seconds, 1000 + i, latencies, failures) for i in range(clients)))
    elapsed = time.perf_counter() - start
    lat = np.array(latencies) * 1000
    pct = {f"p{p}_ms": round(float(np.percentile(lat, p)), 2) for p in (50, 90, 99)} if len(lat) else {}
    return {"clients": clients, "seconds": round(elapsed, 2), "requests": len(latencies) + len(failures),
            "failures": len(failures), "failure_examples": failures[:3],
            "requests_per_s": round(len(latencies) / elapsed, 1), **pct,
            "max_ms": round(float(lat.max()), 2) if len(lat) else None}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-clients", type=int, default=64, help="refuse more concurrent clients than this")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point (at most 60)")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=1, help="clip-mini serve --workers")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/serve.json"))
    args = p.parse_args(argv)
    if max(args.clients) > args.max_clients or not 0 < args.seconds <= 60:
        p.error(f"at most {args.max_clients} clients and 60 s per point")
    load_before = os.getloadavg()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "model")
        image = tmp / "query.png"
        from PIL import Image

        Image.new("RGB", (64, 64), (200, 40, 40)).save(image)
        for n in args.sizes:
            index = make_index((tmp / f"index-{n}"), model, n, image)
            proc, url = start_server(index, args.workers)
            try:
                import httpx

                info = httpx.get(f"{url}/api/info", timeout=30).json()
                for c in args.clients:
                    port = int(url.rsplit(":", 1)[1])
                    point = {"rows": n, "workers": args.workers, **asyncio.run(drive(port, c, args.seconds,
                                                                                     args.warmup))}
                    after = httpx.get(f"{url}/api/info", timeout=30).json()["backend"]
                    # queries per search pass over the rows, warm-up included (one worker process only)
                    batches = after["batches"] - info["backend"]["batches"]
                    point["mean_batch"] = round((after["batched_queries"] - info["backend"]["batched_queries"])
                                                / max(batches, 1), 2)
                    info["backend"] = after
                    print(json.dumps(point), flush=True)
                    points.append(point)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    out = {"benchmark": "bench_serve", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
           "model": "configs/tiny.yaml architecture, untrained", "k": 10, "backend": info["backend"],
           "points": points,
           "zero_failures_at_32_clients": all(pt["failures"] == 0 for pt in points if pt["clients"] == 32)
           if any(pt["clients"] == 32 for pt in points) else None,
           "machine": machine_info(),
           "loadavg_before": [round(x, 2) for x in load_before],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(scrub_paths(out), indent=2) + "\n")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
