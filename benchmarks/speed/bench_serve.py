"""Load on `clip-mini serve`: concurrent clients on loopback sending text queries; throughput and latency.

    python benchmarks/speed/bench_serve.py [--sizes 10000 100000] [--clients 1 8 32] [--seconds 8] [--workers 1]
    python benchmarks/speed/bench_serve.py --arm mixed [--uploads 4] [--text-clients 1 4] [--seconds 20]
    python benchmarks/speed/bench_serve.py --arm 1m [--rows 1000000] [--clients 1 8] [--seconds 8]

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

The 1m arm (``--arm 1m``, issue 51: serving a million photos) makes one index of ``--rows`` rows (1M: 256-dim
float16, 512 MB) and measures, first with ``--workers 1``, then ``--workers 2``:

* start-up: from starting the process to the line it prints once model and index are loaded, to the first 200 of
  ``/healthz`` and of a search, and the server's own time to open the index (``index_open_s`` in ``/api/info``:
  checksums, memory map, items); once with a fresh checksum cache (the embeddings are hashed, as on the first start
  after ``clip-mini index``) and once more (the checksum remembered). Target: the index opens in <= 2 s.
* latency: C clients as above, after the torch model loaded in the background at start (not measured), with the CPU
  seconds each serving process used (how the load split between workers), the exact-search kernels that served
  (``exact_kernels``, from ``/api/info``: the int8 pass over the codes ``clip-mini index`` writes beside the rows,
  where ``auto`` picks it) and the queries per search pass (``mean_batch``). Targets at 8 clients: p50 <= 50 ms,
  p99 <= 200 ms, no failures.
* memory, after the latency points: each process's RSS and proportional set size (PSS, from
  ``/proc/PID/smaps_rollup``: a page shared by two processes counts half in each), its anonymous (private) PSS,
  and the RSS and PSS of its mappings of the embeddings file and of their int8 codes (``/proc/PID/smaps``). The rows
  count once at most between the workers, and no worker keeps a float32 copy; where the int8 pass serves, each
  worker holds its own packed copy of the codes (``codes_mb``, in its anonymous PSS: onnxruntime's int8 product
  packs its constant operand) and reads the rows only where it re-scores; without codes, every worker has read all
  the rows first (each maps all of the file, RSS, and holds half of it, PSS).
* a swap (the ``--swap-workers`` server): ``--swap-clients`` clients search while another process writes and
  publishes a whole new generation of the same size, as ``clip-mini index --add`` does; every request is recorded
  with its start, latency and the generation that answered. Reported per phase: before the writer, while it writes
  (it competes for the cores), from the new manifest until the first answer from the new generation (the server's
  reload), and after; with the server's time to open the new generation. Target: no failures, p99 <= 200 ms during
  the reload.

Writes ``benchmarks/results/speed/serve_1m.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402

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


async def _client(port: int, stop_at: float, seed: int, latencies: list, failures: list,
                  records: list | None = None) -> None:
    """Search back to back until ``stop_at`` (a ``perf_counter`` time). ``records``, when given, gets one
    ``(wall-clock start, seconds, generation or None)`` per request (failures: generation None)."""
    # A bare asyncio HTTP/1.1 client: httpx's AsyncClient capped this benchmark at ~32 requests/s with 32
    # connections (its pool, not the server: the same server answered 326/s to this client, 10k rows).
    rng = np.random.default_rng(seed)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop_at:
            target = "/api/search?" + urlencode({"q": CAPTIONS[rng.integers(len(CAPTIONS))], "k": 10})
            wall, t, gen = time.time(), time.perf_counter(), None
            try:
                status, body = await _get(reader, writer, target)
                answer = json.loads(body) if status == 200 else {}
                ok = status == 200 and len(answer["results"]) == 10
                gen = answer.get("generation") if ok else None
                if not ok:
                    failures.append(f"HTTP {status}: {body[:200]!r}")
            except Exception as e:   # a transport error is a failed request, counted and shown; reconnect
                ok = False
                failures.append(f"{type(e).__name__}: {e}")
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if ok:
                latencies.append(time.perf_counter() - t)
            if records is not None:
                records.append((wall, time.perf_counter() - t, gen))
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


# -- the 1M arm: latency, shared memory, start-up and a swap of generations on one large index ---------------------
TARGETS_1M = {"p50_ms": 50, "p99_ms": 200, "failures": 0, "index_open_s": 2.0}
_KB = re.compile(r"^(\w+):\s+(\d+) kB$")
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def process_memory(pid: int, mapped_name: str) -> dict:
    """One process's memory from /proc (Linux), in MB: resident (RSS) and proportional set size (PSS: each page
    divided among the processes that map it) from ``smaps_rollup``, the anonymous (private heap) part of the PSS,
    and the RSS and PSS of its mappings of the file named ``mapped_name`` (the embeddings) from ``smaps``."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        roll = {m.group(1): int(m.group(2)) for m in map(_KB.match, f.read().splitlines()) if m}
    mapped = {"Rss": 0, "Pss": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _MAPPING.match(line):   # a mapping's header: address, perms, offset, device, inode, path
                fields = line.split(maxsplit=5)
                inside = len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(mapped_name)
            elif inside:
                m = _KB.match(line.strip())
                if m and m.group(1) in mapped:
                    mapped[m.group(1)] += int(m.group(2))
    mb = lambda kb: round(kb / 1024, 1)   # noqa: E731
    return {"pid": pid, "rss_mb": mb(roll["Rss"]), "pss_mb": mb(roll["Pss"]),
            "pss_anon_mb": mb(roll.get("Pss_Anon", 0)), "embeddings_rss_mb": mb(mapped["Rss"]),
            "embeddings_pss_mb": mb(mapped["Pss"])}


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()   # after the command name: state, ppid, ...


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (uvicorn's workers, and multiprocessing's helpers)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(_stat_fields(int(d))[1]) == pid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return sorted(out)


def cpu_seconds(pid: int) -> float:
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(proc: subprocess.Popen, workers: int) -> dict[int, str]:
    """A server's processes by role: with one worker the process itself serves ("server"); with ``--workers N`` it
    supervises ("parent") N worker processes ("worker"), beside multiprocessing's helpers ("helper": no app)."""
    if workers == 1:
        return {proc.pid: "server", **{p: "helper" for p in child_pids(proc.pid)}}
    roles = {proc.pid: "parent"}
    for p in child_pids(proc.pid):
        with open(f"/proc/{p}/cmdline", "rb") as f:
            spawned = b"multiprocessing.spawn" in f.read()   # uvicorn's workers; the resource tracker is not one
        roles[p] = "worker" if spawned else "helper"
    return roles


def start_timed(index: Path, workers: int, env: dict, log: Path) -> tuple[subprocess.Popen, str, dict]:
    """Start ``clip-mini serve`` and time, from the moment the process is started: the line it prints once the
    model and index are loaded (in the parent process), the first 200 of ``/healthz`` and then of a search."""
    import threading

    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as stderr:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "clip_mini", "serve", "--index", str(index), "--port",
                                 str(port), "--workers", str(workers)], stdout=subprocess.PIPE, stderr=stderr,
                                text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    timings: dict = {"workers": workers}

    def read_stdout():
        for line in proc.stdout:
            if line.startswith("serving ") and "printed_s" not in timings:
                timings["printed_s"] = round(time.perf_counter() - t0, 3)

    threading.Thread(target=read_stdout, daemon=True).start()
    deadline = t0 + 300
    with httpx.Client(timeout=60) as client:
        while True:
            if proc.poll() is not None or time.perf_counter() > deadline:
                proc.kill()
                raise RuntimeError(f"clip-mini serve did not answer: {log.read_text()[-2000:]}")
            try:
                if client.get(f"{url}/healthz").status_code == 200:
                    timings["first_health_s"] = round(time.perf_counter() - t0, 3)
                    break
            except httpx.TransportError:
                time.sleep(0.02)
        r = client.get(f"{url}/api/search", params={"q": "a dog running on grass", "k": 10})
        if r.status_code != 200:
            raise RuntimeError(f"first search answered {r.status_code}: {r.text[:300]}")
        timings["first_search_s"] = round(time.perf_counter() - t0, 3)
        info = client.get(f"{url}/api/info").json()
    timings.update(index_open_s=info["index_open_s"], generation=info["generation"],
                   float32_rows_in_memory=info["backend"]["float32_rows_in_memory"])
    return proc, url, timings


def wait_attention(url: str, answers: int = 8) -> None:
    """Until the torch model that every worker loads in the background at start is loaded (not measured): asked on
    fresh connections, so that with several workers each is likely asked."""
    import httpx

    deadline, loaded = time.monotonic() + 300, 0
    while loaded < answers and time.monotonic() < deadline:
        state = httpx.get(f"{url}/api/info", timeout=30).json()["towers"]["attention"]
        loaded = loaded + 1 if state != "loading" else 0
        time.sleep(0.1 if state != "loading" else 0.5)


def touch_all_rows(proc: subprocess.Popen, workers: int, port: int, mapped_name: str, rows_mb: float) -> bool:
    """Search on fresh connections until every serving process has read all the rows (each exact search reads them
    all), so that their memory is measured with the whole mapping resident; whether that happened within 60 s."""
    async def burst():
        async def one(i):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                await _get(reader, writer, "/api/search?" + urlencode({"q": CAPTIONS[i % len(CAPTIONS)], "k": 10}))
            finally:
                writer.close()
        await asyncio.gather(*(one(i) for i in range(8)))

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        serving = [p for p, role in server_processes(proc, workers).items() if role in ("server", "worker")]
        if len(serving) == workers and all(process_memory(p, mapped_name)["embeddings_rss_mb"] >= 0.99 * rows_mb
                                           for p in serving):
            return True
        asyncio.run(burst())
    return False


def latency_point(proc: subprocess.Popen, workers: int, url: str, clients: int, seconds: float,
                  warmup: float) -> dict:
    """``drive`` plus the CPU seconds each serving process used meanwhile (how the load split among workers), and
    from the serving process that answers ``/api/info`` (one of them, with several workers): the exact-search
    kernels that served the point's searches (warm-up included) and the mean number of queries a search pass
    answered (``mean_batch``)."""
    import httpx

    serving = [p for p, role in server_processes(proc, workers).items() if role in ("server", "worker")]
    before = {p: cpu_seconds(p) for p in serving}
    info = httpx.get(f"{url}/api/info", timeout=30).json()["backend"]
    point = asyncio.run(drive(int(url.rsplit(":", 1)[1]), clients, seconds, warmup))
    point["worker_cpu_s"] = [round(cpu_seconds(p) - before[p], 2) for p in serving]
    after = httpx.get(f"{url}/api/info", timeout=30).json()["backend"]
    if workers == 1:   # with several, the two answers may come from different workers
        kernels = {k: v - info.get("exact_kernels", {}).get(k, 0) for k, v in after.get("exact_kernels", {}).items()}
        point["exact_kernels"] = {k: v for k, v in kernels.items() if v}
        point["mean_batch"] = round((after["batched_queries"] - info["batched_queries"])
                                    / max(after["batches"] - info["batches"], 1), 2)
    else:
        point["exact_kernels_one_worker"] = after.get("exact_kernels", {})
    point["meets_targets"] = (point["failures"] == 0 and point.get("p50_ms", 1e9) <= TARGETS_1M["p50_ms"]
                              and point.get("p99_ms", 1e9) <= TARGETS_1M["p99_ms"])
    return point


def _phase(records: list, lo: float, hi: float) -> dict:
    lat = np.array([r[1] for r in records if lo <= r[0] < hi and r[2] is not None]) * 1000
    failed = sum(1 for r in records if lo <= r[0] < hi and r[2] is None)
    out = {"seconds": round(hi - lo, 2), "requests": len(lat) + failed, "failures": failed}
    if len(lat):
        out.update({f"p{p}_ms": round(float(np.percentile(lat, p)), 2) for p in (50, 99)},
                   max_ms=round(float(lat.max()), 2))
    return out


async def _swap_under_load(port: int, clients: int, writer_cmd: list[str], before_s: float, after_s: float,
                           new_generation: int) -> tuple[list, dict]:
    """C clients search while a writer process publishes generation ``new_generation``; every request recorded
    with its wall-clock start, latency and the generation that answered. Returns the records and the writer's
    timeline (wall clock: started, rows written, manifest published, finished)."""
    records: list = []
    failures: list = []
    stop_at = [time.perf_counter() + 600]   # moved once the new generation has answered

    async def client(i):
        # _client takes a fixed end: run it in slices so that moving stop_at takes effect
        while time.perf_counter() < stop_at[0]:
            await _client(port, min(stop_at[0], time.perf_counter() + 2.0), 3000 + i, [], failures, records)

    async def conduct():
        await asyncio.sleep(before_s)
        proc = await asyncio.create_subprocess_exec(*writer_cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0:
            stop_at[0] = 0
            raise RuntimeError(f"the writer failed: {err.decode()[-2000:]}")
        timeline = json.loads(out.decode().strip().splitlines()[-1])
        deadline = time.perf_counter() + 300
        while not any(r[2] == new_generation for r in records) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(after_s)
        stop_at[0] = time.perf_counter()
        return timeline

    *_, timeline = await asyncio.gather(*(client(i) for i in range(clients)), conduct())
    return records, timeline


def swap_phases(records: list, timeline: dict, new_generation: int) -> dict:
    """Latency before the writer starts, while it writes, from the new manifest's publication until the server
    answers from the new generation (the server's reload), and after."""
    first = min((r[0] + r[1] for r in records if r[2] == new_generation), default=None)
    start, end = min(r[0] for r in records), max(r[0] for r in records)
    out = {"writer": {k: round(v - timeline["started"], 3) for k, v in timeline.items()},
           "before": _phase(records, start, timeline["started"]),
           "writing": _phase(records, timeline["started"], timeline["published"])}
    if first is None:
        out["switched"] = False
        out["after_publish"] = _phase(records, timeline["published"], end + 1)
        return out
    out.update(switched=True, switch_s=round(first - timeline["published"], 3),
               reloading=_phase(records, timeline["published"], first), after=_phase(records, first, end + 1),
               old_answers_after_switch=sum(1 for r in records if r[0] >= first and r[2] not in (None, new_generation)))
    return out


def write_generation_main(index: Path, model: Path, rows: int, image: Path, generation: int) -> None:
    """The swap's writer, run as its own process (as ``clip-mini index --add`` would be): a whole new generation of
    ``rows`` rows published the way every writer publishes; prints its timeline as JSON."""
    started = time.time()
    make_index(index, model, rows, image, generation=generation, seed=generation)
    published = os.stat(index / "manifest.json").st_mtime_ns / 1e9
    rows_written = os.stat(index / f"embeddings-{generation}.npy").st_mtime_ns / 1e9
    print(json.dumps({"started": started, "rows_written": rows_written, "published": published,
                      "finished": time.time()}))


def run_1m(args, tmp: Path, model: Path, image: Path) -> dict:
    """The four measurements of issue 51 item 2 on one synthetic index of ``--rows`` rows (see the docstring)."""
    import httpx

    from clip_mini.retrieval.engine import QueryEngine

    n = args.rows
    t = time.perf_counter()
    index = make_index(tmp / "index", model, n, image)
    build_s = time.perf_counter() - t
    QueryEngine.load(model).encode_text(["export the towers before anything is timed"])   # ONNX export, once
    manifest = json.loads((index / "manifest.json").read_text())
    rows_mb = (index / manifest["files"]["embeddings"]).stat().st_size / 2 ** 20
    codes_file = index / manifest["files"]["embeddings"].replace(".npy", ".int8")
    out = {"rows": n, "dim": manifest["dim"], "dtype": manifest["dtype"], "embeddings_mb": round(rows_mb, 1),
           "int8_codes_mb": round(codes_file.stat().st_size / 2 ** 20, 1) if codes_file.exists() else None,
           "build_s": round(build_s, 1), "clients": args.clients, "seconds": args.seconds,
           "targets": TARGETS_1M, "startup": {}, "latency": {}}
    caches: list[Path] = []

    def env(fresh: bool) -> dict:
        """CLIP_MINI_CACHE_DIR: where checksums of unchanged files are remembered; a fresh one makes the server
        hash the embeddings as it would on its first start after `clip-mini index`."""
        if fresh:
            caches.append(tmp / f"cache-{len(caches)}")
        return {**os.environ, "CLIP_MINI_CACHE_DIR": str(caches[-1])}

    def stop(proc):
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    for workers in (1, 2):
        # start-up: a fresh checksum cache (the embeddings are hashed), then again (the checksum is remembered)
        for label, fresh in (("checksum_hashed", True), ("checksum_remembered", False)):
            proc, url, timings = start_timed(index, workers, env(fresh), tmp / f"serve-{workers}-{label}.log")
            out["startup"][f"w{workers}_{label}"] = timings
            print(json.dumps({"startup": timings}), flush=True)
            if fresh:
                stop(proc)
        try:
            port = int(url.rsplit(":", 1)[1])
            # the generation this server opened (the swap below publishes the next one)
            emb_name = f"embeddings-{timings['generation']}.npy"
            # the int8 codes beside the rows (``search.codes``): where the int8 pass serves, the workers read them in
            # place (one copy in the page cache) and read the rows only where they re-score; else every search reads
            # all the rows
            codes_name = emb_name.replace(".npy", ".int8")
            codes_mb = (index / codes_name).stat().st_size / 2 ** 20 if (index / codes_name).exists() else None
            wait_attention(url)
            touched = None if codes_mb else touch_all_rows(proc, workers, port, emb_name, rows_mb)
            for c in args.clients:
                point = {"workers": workers, "rows": n, **latency_point(proc, workers, url, c, args.seconds,
                                                                         args.warmup)}
                out["latency"][f"w{workers}_c{c}"] = point
                print(json.dumps(point), flush=True)
            procs = [{"role": role, **process_memory(p, emb_name),
                      **{f"codes_{k.split('_', 1)[1]}": v for k, v in process_memory(p, codes_name).items()
                         if k.startswith("embeddings_")}}
                     for p, role in server_processes(proc, workers).items()]
            served = [m for m in procs if m["role"] in ("server", "worker")]
            mem = {"read_whole": "int8 codes (packed per worker)" if codes_mb else "embeddings",
                   "codes_mb": round(codes_mb, 1) if codes_mb else None, "every_worker_read_all_rows": touched,
                   "processes": procs,
                   **{f"worker_{key}": [m[key] for m in served]
                      for key in ("pss_mb", "pss_anon_mb", "embeddings_rss_mb", "embeddings_pss_mb", "codes_rss_mb",
                                  "codes_pss_mb")}}
            for key in ("pss_mb", "rss_mb", "embeddings_pss_mb", "embeddings_rss_mb", "codes_pss_mb", "codes_rss_mb"):
                mem[f"total_{key}"] = round(sum(m[key] for m in procs), 1)
            # counted once: no worker keeps a float32 copy of its own (private memory the mapping figures would not
            # show; the rule is the same in every worker, so one worker's answer) and the PSS of the mappings of
            # the rows (and of the codes file) adds up to one file at most; searched without codes, every worker
            # also has all of the rows resident (the RSS counts them once per worker)
            info = httpx.get(f"{url}/api/info", timeout=30).json()
            mem["float32_rows_bytes"] = info["backend"]["float32_rows_bytes"]
            mem["embeddings_counted_once"] = (mem["float32_rows_bytes"] == 0
                                              and mem["total_embeddings_pss_mb"] <= 1.02 * rows_mb
                                              and mem["total_codes_pss_mb"] <= 1.02 * (codes_mb or 0)
                                              and (codes_mb is not None or (
                                                  touched and abs(mem["total_embeddings_pss_mb"] - rows_mb)
                                                  <= 0.02 * rows_mb
                                                  and mem["total_embeddings_rss_mb"] >= 0.99 * workers * rows_mb)))
            out[f"memory_w{workers}"] = mem
            print(json.dumps({f"memory_w{workers}": mem}), flush=True)
            if workers == args.swap_workers:
                gen = info["generation"]
                cmd = [sys.executable, str(Path(__file__).resolve()), "--write-generation", str(index),
                       "--model-dir", str(model), "--rows", str(n), "--image", str(image),
                       "--generation", str(gen + 1)]
                records, timeline = asyncio.run(_swap_under_load(port, args.swap_clients, cmd, args.swap_before,
                                                                 args.swap_after, gen + 1))
                swap = {"workers": workers, "clients": args.swap_clients, "rows": n, "from_generation": gen,
                        **swap_phases(records, timeline, gen + 1)}
                info = httpx.get(f"{url}/api/info", timeout=30).json()
                swap.update(server_generation_after=info["generation"], new_index_open_s=info["index_open_s"],
                            reload_error=info["reload_error"])
                swap["failures"] = sum(1 for r in records if r[2] is None)
                worst = swap.get("reloading", swap.get("after_publish", {}))
                swap["meets_targets"] = (swap["switched"] and swap["failures"] == 0
                                         and worst.get("p99_ms", 1e9) <= TARGETS_1M["p99_ms"])
                out["swap"] = swap
                print(json.dumps({"swap": swap}), flush=True)
        finally:
            stop(proc)
    lat = out["latency"]
    out["meets_targets"] = {
        "latency_8_clients": {w: lat[f"{w}_c8"]["meets_targets"] for w in ("w1", "w2") if f"{w}_c8" in lat},
        "index_open_s": all(s["index_open_s"] <= TARGETS_1M["index_open_s"] for s in out["startup"].values()),
        "workers_share_embeddings": out["memory_w2"]["embeddings_counted_once"],
        "swap": out.get("swap", {}).get("meets_targets")}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--clients", type=int, nargs="+", help="concurrent clients per point (default 1 8 32; 1m arm: 1 8)")
    p.add_argument("--max-clients", type=int, default=64, help="refuse more concurrent clients than this")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point (at most 60)")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=1, help="clip-mini serve --workers")
    p.add_argument("--arm", choices=["text", "mixed", "1m"], default="text",
                   help="text clients alone, text clients while uploads flood the image pool, or the 1M-row index "
                        "(latency, memory of --workers 2, start-up, a swap of generations)")
    p.add_argument("--rows", type=int, default=1_000_000, help="1m arm: rows of the index")
    p.add_argument("--swap-workers", type=int, choices=[1, 2], default=1, help="1m arm: the server that swaps")
    p.add_argument("--swap-clients", type=int, default=8, help="1m arm: clients searching during the swap")
    p.add_argument("--swap-before", type=float, default=3.0, help="1m arm: seconds of searching before the writer")
    p.add_argument("--swap-after", type=float, default=3.0, help="1m arm: seconds after the new generation answers")
    for hidden in ("--write-generation", "--model-dir", "--image"):   # internal: the 1m arm's writer process
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--generation", type=int, help=argparse.SUPPRESS)
    p.add_argument("--uploads", type=int, default=4, help="mixed arm: upload clients (uploads always in flight)")
    p.add_argument("--text-clients", type=int, nargs="+", default=[1, 4], help="mixed arm: text clients per point")
    p.add_argument("--out", help="default benchmarks/results/speed/serve.json (text), serve_mixed.json (mixed) or "
                                 "serve_1m.json (1m)")
    args = p.parse_args(argv)
    if args.write_generation:
        write_generation_main(Path(args.write_generation), Path(args.model_dir), args.rows, Path(args.image),
                              args.generation)
        return {}
    name = {"text": "serve", "mixed": "serve_mixed", "1m": "serve_1m"}[args.arm]
    args.out = args.out or str(ROOT / f"benchmarks/results/speed/{name}.json")
    args.clients = args.clients or ([1, 8] if args.arm == "1m" else [1, 8, 32])
    if (max(args.clients + args.text_clients + [args.swap_clients]) > args.max_clients
            or not 0 < args.seconds <= 60):
        p.error(f"at most {args.max_clients} clients and 60 s per point")
    if args.arm == "1m" and not (args.rows >= 100 and 0 <= args.swap_before <= 60 and 0 <= args.swap_after <= 60):
        p.error("--rows must be at least 100, and --swap-before / --swap-after within 0..60 s")
    load_before, machine = os.getloadavg(), machine_info()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "model")
        image = tmp / "query.png"
        from PIL import Image

        Image.new("RGB", (64, 64), (200, 40, 40)).save(image)
        if args.arm == "1m":
            out = {"benchmark": "bench_serve 1m", **run_1m(args, tmp, model, image),
                   "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                   "model": "configs/tiny.yaml architecture, untrained", "k": 10, "machine": machine,
                   "loadavg_before": [round(x, 2) for x in load_before],
                   "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
            return write_result(args.out, scrub_paths(out))
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
