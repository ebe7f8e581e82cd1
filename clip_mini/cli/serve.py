"""``clip-mini serve``: load the model and index once and run the app under uvicorn.

    clip-mini serve --index indexes/shapes [--model runs/tiny/best] [--host 127.0.0.1] [--port 8000] [--workers N]
    CLIP_MINI_TOKEN=... clip-mini serve --index indexes/shapes --host 0.0.0.0    # reachable from other machines

With ``--workers N`` uvicorn starts N processes, each loading the model and index itself (it needs an import
string and a factory for that: the settings travel in an environment variable). The index and model are checked
in this process first, so a bad one is reported before anything binds. Nothing here imports the web stack until
the command runs: ``clip-mini --help`` stays fast, and works without the ``serve`` extra.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys

from clip_mini.cli.common import MODEL_HELP, add_device, command_parser, resolve_model_arg
from clip_mini.serve.server import SERVE_CONFIG_ENV, TOKEN_ENV, ServeError, allowed_hosts, exposure


def add_arguments(sub) -> argparse.ArgumentParser:
    p = command_parser(
        sub, "serve", "search service and web page over an index (HTTP)",
        "Serve an index over HTTP: a search page (text, or an image dropped on it), a JSON API, thumbnails,\n"
        "originals and attention maps. The index is reloaded when `clip-mini index --add` publishes a new\n"
        "generation. Bound to 127.0.0.1 unless --host says otherwise; another host needs --token (or\n"
        "$CLIP_MINI_TOKEN) or --no-auth. See docs/serving.md.",
        "clip-mini serve --index indexes/photos",
        "CLIP_MINI_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(24))') "
        "clip-mini serve --index indexes/photos --host 0.0.0.0 --port 8080")
    p.add_argument("--index", required=True, help="index directory (reloaded when a new generation is published)")
    p.add_argument("--model", help=MODEL_HELP[:-1] + "; default: the one recorded in the index)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--workers", type=int, default=1, help="server processes, each with its own model and index")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between checks for a new index generation")
    p.add_argument("--token", help=f"require this token on every request but /healthz (default: ${TOKEN_ENV}); "
                                   "browsers log in once at /login. Needed for a non-loopback --host")
    p.add_argument("--no-auth", action="store_true",
                   help="serve a non-loopback --host without a token (anyone who reaches the port can search)")
    p.add_argument("--lazy-attention", action="store_true",
                   help="load the attention model (torch: about 1 GB resident) on the first attention map instead "
                        "of in the background at start")
    add_device(p)   # where the torch model runs (attention maps); queries run in onnxruntime
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise ServeError(f"--port must be in 1..65535, got {args.port}")
    if args.workers < 1:
        raise ServeError(f"--workers must be at least 1, got {args.workers}")
    if args.poll <= 0:
        raise ServeError(f"--poll must be positive, got {args.poll}")
    token, warning = exposure(args.host, args.token, args.no_auth)
    # Concurrency comes from serving requests side by side; BLAS threads inside each small query product only
    # fight over the same cores, which makes each query slower under load, not faster. Set before numpy loads,
    # which nothing above has imported; a user's setting wins.
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    try:
        import uvicorn

        from clip_mini.serve.app import ServeConfig, Service, create_app
    except ImportError as e:
        raise ServeError(f"clip-mini serve needs the serve extra ({e}): pip install 'clip-mini[serve]'") from None
    device = args.device
    if device not in ("auto", "cpu"):   # checked (exit 2) before anything loads; "auto" leaves torch unimported
        from clip_mini.runtime.devices import resolve_device

        device = str(resolve_device(device))
    resolve_model_arg(args)   # the workers get the model directory, not the name
    cfg = ServeConfig(index=args.index, model=args.model, poll_s=args.poll, allowed_hosts=allowed_hosts(args.host),
                      device=device, token=token, preload_attention=not args.lazy_attention)
    service = Service(cfg)
    gen = service.watcher.current
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {args.index} ({len(gen.index)} images, generation {gen.number} opened in {gen.open_s:.2f} s, "
          f"model {service.engine.fingerprint}) on http://{host}:{args.port}/", flush=True)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    from clip_mini.serve.protocol import uvicorn_settings

    run = dict(host=args.host, port=args.port, **uvicorn_settings())
    if args.workers == 1:
        uvicorn.run(create_app(cfg, service), **run)
    else:
        # The workers load their own; this process only supervises them. Collected now (the service's parts refer
        # to each other), so it does not hold the towers and a mapping of the index while it does.
        del service, gen
        gc.collect()
        os.environ[SERVE_CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))
        uvicorn.run("clip_mini.serve.server:app_from_env", factory=True, workers=args.workers, **run)
    return 0
