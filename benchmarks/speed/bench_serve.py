"""Load on `clip-mini serve`: concurrent clients on loopback sending text queries; throughput and latency.

    python benchmarks/speed/bench_serve.py [--sizes 10000 100000] [--clients 1 8 32] [--seconds 8] [--workers 1]
    python benchmarks/speed/bench_serve.py --arm mixed [--uploads 4] [--text-clients 1 4] [--seconds 20]

For each index size a model directory with the ``configs/tiny.yaml`` architecture (untrained: speed does not
depend on the weights) and a synthetic index of random unit rows are made as ``bench_startup.py`` makes them.
``clip-mini serve`` runs as its own process on a free 127.0.0.1 port; this process drives C concurrent clients
(asyncio, one keep-alive HTTP/1.1 connection each) for a fixed time after a warm-up, each sending
``GET /api/search?q=...&k=10`` with captions drawn from a fixed list, back to back. Reported per (size, clients):
requests, failures (any non-200 answer or transport error), requests/s, and p50/p90/p99/max latency as the client
sees it. Clients and server share the machine's cores, so the figures are a floor for a dedicated server.
Bounded: at most ``--max-clients`` clients and ``--seconds`` per point. Writes ``benchmarks/results/speed/serve.json``.

The mixed arm (``--arm mixed``) is text search while image queries flood the server: ``--uploads`` clients each
post a 6000x6000 PNG (36 MP of one colour, ~120 KB on the wire, within the upload limits) back to back, so that
many uploads are always in flight, while C text clients search as above. Reported per C: the text latencies, the
uploads answered (200, or 503 when the image pool is full) and their latency, and the server's resident memory
(sampled every 50 ms from /proc; its peak over the measured seconds, and the process's lifetime peak VmHWM).
Targets (issue 41): text p99 <= 250 ms and server RSS <= 2 GB with 4 uploads in flight on 2 cores. Writes
``benchmarks/results/speed/serve_mixed.json``.
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
                             "--workers", str(workers)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"clip-mini serve exited: {proc.stderr.read()}")
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
    return await _answer(reader, writer)


async def _post(reader, writer, target: str, content_type: str, body: bytes) -> tuple[int, bytes]:
    writer.write(f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return await _answer(reader, writer)


async def _answer(reader, writer) -> tuple[int, bytes]:
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


def _multipart(data: bytes, name: str) -> tuple[str, bytes]:
    boundary = "clipminibench0123456789"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return f"multipart/form-data; boundary={boundary}", body


async def _uploader(port: int, stop_at: float, ctype: str, body: bytes, out: dict) -> None:
    """Post the image back to back until ``stop_at``: one upload of this client is always in flight."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            try:
                status, answer = await _post(reader, writer, "/api/search/image?k=10", ctype, body)
            except Exception as e:
                out["errors"].append(f"{type(e).__name__}: {e}")
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                continue
            out["status"][status] = out["status"].get(status, 0) + 1
            if status == 200:
                out["latencies"].append(time.perf_counter() - t)
            elif status != 503:
                out["errors"].append(f"HTTP {status}: {answer[:200]!r}")
            else:
                await asyncio.sleep(0.05)   # refused at once: don't spin
    finally:
        writer.close()


class RssSampler:
    """The server's resident memory from /proc every ``every_s`` seconds, on a thread (Linux only)."""

    def __init__(self, pid: int, every_s: float = 0.05):
        import threading

        self.pid, self.every_s, self.samples = pid, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def status_kb(self, field: str) -> int | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            kb = self.status_kb("VmRSS")
            if kb is not None:
                self.samples.append(kb)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


async def drive_mixed(port: int, text_clients: int, uploads: int, upload: tuple[str, bytes], seconds: float,
                      warmup: float) -> dict:
    """Text clients and upload clients together; latencies of both after ``warmup`` seconds of the same load."""
    start = time.perf_counter()
    stop_at = start + warmup + seconds
    up = {"latencies": [], "status": {}, "errors": []}
    text_latencies: list[float] = []
    failures: list[str] = []

    async def text_client(i: int) -> None:
        await asyncio.sleep(warmup)
        await _client(port, stop_at, 2000 + i, text_latencies, failures)

    await asyncio.gather(*(_uploader(port, stop_at, *upload, up) for _ in range(uploads)),
                         *(text_client(i) for i in range(text_clients)))
    lat = np.array(text_latencies) * 1000
    ulat = np.array(up["latencies"]) * 1000
    return {"text_clients": text_clients, "uploads_in_flight": uploads, "seconds": seconds,
            "text_requests": len(text_latencies) + len(failures), "text_failures": len(failures),
            "text_failure_examples": failures[:3], "text_requests_per_s": round(len(text_latencies) / seconds, 1),
            **{f"text_p{p}_ms": round(float(np.percentile(lat, p)), 2) for p in (50, 90, 99)},
            "text_max_ms": round(float(lat.max()), 2),
            "uploads_answered": {str(k): v for k, v in sorted(up["status"].items())},
            "upload_errors": up["errors"][:3],
            "upload_p50_ms": round(float(np.percentile(ulat, 50)), 1) if len(ulat) else None,
            "upload_max_ms": round(float(ulat.max()), 1) if len(ulat) else None}


def run_mixed(args, tmp: Path, model: Path, image: Path) -> dict:
    """The mixed arm: one server over ``--sizes[0]`` rows, one point per ``--text-clients``."""
    import httpx
    from PIL import Image

    big = tmp / "big.png"
    Image.new("RGB", (6000, 6000), (200, 40, 40)).save(big)
    upload = _multipart(big.read_bytes(), "big.png")
    n = args.sizes[0]
    index = make_index(tmp / f"index-{n}", model, n, image)
    proc, url = start_server(index, 1)
    port = int(url.rsplit(":", 1)[1])
    points = []
    try:
        info = httpx.get(f"{url}/api/info", timeout=30).json()
        deadline = time.monotonic() + 300   # the attention model loads in the background at start: not measured
        while info["towers"]["attention"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.5)
            info = httpx.get(f"{url}/api/info", timeout=30).json()
        sampler = RssSampler(proc.pid)
        idle_rss = sampler.status_kb("VmRSS")
        for c in args.text_clients:
            with RssSampler(proc.pid) as during:
                point = asyncio.run(drive_mixed(port, c, args.uploads, upload, args.seconds, args.warmup))
            point.update(rows=n, server_rss_idle_mb=round(idle_rss / 1024, 1),
                         server_rss_peak_mb=round(max(during.samples) / 1024, 1),
                         server_vmhwm_mb=round(sampler.status_kb("VmHWM") / 1024, 1))
            point["meets_targets"] = point["text_p99_ms"] <= 250 and point["server_rss_peak_mb"] <= 2048
            print(json.dumps(point), flush=True)
            points.append(point)
        after = httpx.get(f"{url}/api/info", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"benchmark": "bench_serve mixed", "upload": {"image": "6000x6000 RGB PNG, one colour",
                                                         "bytes": big.stat().st_size},
            "limits": after["limits"], "towers": after["towers"], "backend": after["backend"], "points": points,
            "targets": {"text_p99_ms": 250, "server_rss_mb": 2048},
            "all_meet_targets": all(pt["meets_targets"] for pt in points)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-clients", type=int, default=64, help="refuse more concurrent clients than this")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point (at most 60)")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=1, help="clip-mini serve --workers")
    p.add_argument("--arm", choices=["text", "mixed"], default="text",
                   help="text clients alone, or text clients while uploads flood the image pool")
    p.add_argument("--uploads", type=int, default=4, help="mixed arm: upload clients (uploads always in flight)")
    p.add_argument("--text-clients", type=int, nargs="+", default=[1, 4], help="mixed arm: text clients per point")
    p.add_argument("--out", help="default benchmarks/results/speed/serve.json (text) or serve_mixed.json (mixed)")
    args = p.parse_args(argv)
    name = "serve" if args.arm == "text" else "serve_mixed"
    args.out = args.out or str(ROOT / f"benchmarks/results/speed/{name}.json")
    if max(args.clients + args.text_clients) > args.max_clients or not 0 < args.seconds <= 60:
        p.error(f"at most {args.max_clients} clients and 60 s per point")
    load_before = os.getloadavg()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "model")
        image = tmp / "query.png"
        from PIL import Image

        Image.new("RGB", (64, 64), (200, 40, 40)).save(image)
        if args.arm == "mixed":
            out = {**run_mixed(args, tmp, model, image),
                   "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                   "model": "configs/tiny.yaml architecture, untrained", "k": 10, "machine": machine_info(),
                   "loadavg_before": [round(x, 2) for x in load_before],
                   "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
            Path(args.out).write_text(json.dumps(scrub_paths(out), indent=2) + "\n")
            print(f"wrote {args.out}")
            return out
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
