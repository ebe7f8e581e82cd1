"""Training checkpoints: atomic writes, checksums, rotation, and the RNG state needed for an exact resume.

Layout of ``<run>/checkpoints/``:

* ``ckpt-<step>.pt``: a ``torch.save`` dict of tensors and plain Python values only (model and optimiser state
  dicts, RNG states as uint8/int64 tensors, counters, the resolved config; with ``train.ema``, ``"ema"``: the
  averaged weights, name to tensor, train/ema.py), so it loads with ``torch.load(weights_only=True)``: nothing is
  unpickled.
* ``latest.json``: ``{"latest": name, "files": {name: {"step", "sha256"}}}``, the kept checkpoints.

A checkpoint is written to a temporary file, fsynced and renamed into place, and its checksum recorded in
``latest.json`` (itself replaced atomically) only afterwards, so a run killed at any instant leaves either the
previous complete state or the new one; a file that was damaged later fails its checksum with a clear error.
"""
from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from clip_mini.errors import CheckpointError
from clip_mini.fileio.atomic import atomic_write_json, atomic_write_with, sha256_file

FORMAT_VERSION = 1
INDEX = "latest.json"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


# -- RNG state ------------------------------------------------------------------------------------------------
def rng_state(device: Optional[torch.device] = None) -> dict[str, Any]:
    """Every RNG a training step of this process may draw from, as tensors and ints (``weights_only``-loadable):
    the CPU generators and, on a GPU, the generator of this process's own GPU (``device``), the only one it
    advances. Under torchrun each rank's state differs; the trainer gathers them all (``rng_ranks``)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]), "numpy_has_gauss": int(np_state[3]), "numpy_gauss": float(np_state[4]),
        "python": torch.tensor(py_state[1], dtype=torch.int64), "python_gauss": py_state[2],
    }
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: Optional[torch.device] = None) -> None:
    """Restore what ``rng_state`` captured; the GPU generator onto ``device`` (this process's GPU)."""
    torch.set_rng_state(state["torch"])
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    random.setstate((3, tuple(int(v) for v in state["python"].tolist()), state["python_gauss"]))
    cuda = state.get("cuda")
    if cuda is None or device is None or torch.device(device).type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):   # older checkpoints: get_rng_state_all() of rank 0's process
        index = torch.device(device).index or 0
        if index >= len(cuda):
            warnings.warn(f"the checkpoint holds GPU random states for {len(cuda)} GPU(s), none for {device}; its "
                          "generator starts afresh (dropout masks will differ from an uninterrupted run)",
                          RuntimeWarning, stacklevel=2)
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def rank_rng(ckpt: dict[str, Any], rank: int, world_size: int) -> Optional[dict[str, Any]]:
    """This rank's saved random state: its own entry of ``rng_ranks`` when the checkpoint was written by as many
    processes. Else (an older checkpoint, or another process count; warned about) rank 0 gets rank 0's state and
    the other ranks None: they keep their own fresh seeding rather than all repeating rank 0's masks."""
    ranks = ckpt.get("rng_ranks")
    if isinstance(ranks, list) and len(ranks) == world_size:
        return ranks[rank]
    if world_size > 1 or (isinstance(ranks, list) and len(ranks) > 1):
        saved = len(ranks) if isinstance(ranks, list) else "an unknown number of"
        if rank == 0:
            warnings.warn(f"resuming {world_size} process(es) from a checkpoint of {saved} process(es): random "
                          "states (dropout masks) and the data sharding will not match an uninterrupted run",
                          RuntimeWarning, stacklevel=2)
    return ckpt["rng"] if rank == 0 else None


# -- save / rotate --------------------------------------------------------------------------------------------
def read_index(ckpt_dir: str | Path) -> dict:
    """``latest.json`` of a checkpoint folder (an empty index when there is none yet)."""
    path = Path(ckpt_dir) / INDEX
    if not path.is_file():
        return {"latest": None, "files": {}}
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(index, dict) or not isinstance(index.get("files"), dict):
        raise CheckpointError(f"{path}: not a clip_mini checkpoint index")
    return index


def save_checkpoint(ckpt_dir: str | Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``ckpt-<state['step']>.pt`` atomically, record it in ``latest.json`` and keep the newest ``keep``.

    Returns:
        The checkpoint's path.
    """
    ckpt_dir = Path(ckpt_dir)
    name = f"ckpt-{int(state['step'])}.pt"
    digest = {}

    def write(tmp: Path) -> None:
        torch.save({"format_version": FORMAT_VERSION, **state}, tmp)
        digest["sha256"] = sha256_file(tmp)   # of the exact bytes renamed into place

    atomic_write_with(ckpt_dir / name, write)
    index = read_index(ckpt_dir)
    files = {n: v for n, v in index["files"].items() if n != name and (ckpt_dir / n).is_file()}
    files[name] = {"step": int(state["step"]), "sha256": digest["sha256"]}
    kept = dict(sorted(files.items(), key=lambda kv: kv[1]["step"])[-keep:])
    atomic_write_json(ckpt_dir / INDEX, {"latest": name, "files": kept})
    # Deleting only after the index stops naming a file: a kill in between leaves an orphan, never a hole.
    for path in ckpt_dir.iterdir():
        if (_NAME.match(path.name) and path.name not in kept) or path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
    return ckpt_dir / name


# -- load / resume --------------------------------------------------------------------------------------------
def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and check a checkpoint (checksum verified when its folder's ``latest.json`` lists it).

    Raises:
        CheckpointError: missing file, checksum mismatch, truncated or foreign file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    entry = read_index(path.parent)["files"].get(path.name)
    if entry is not None and sha256_file(path) != entry["sha256"]:
        raise CheckpointError(f"{path} is corrupt: its sha256 does not match {path.parent / INDEX}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # torch raises RuntimeError / UnpicklingError / EOFError / zip errors for bad files
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt?): {e}") from None
    required = ("format_version", "step", "epoch", "pos", "model", "optimizer", "rng", "config")
    if not isinstance(state, dict) or any(k not in state for k in required):
        raise CheckpointError(f"{path}: not a clip_mini training checkpoint (needs keys {', '.join(required)})")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state['format_version']}, this version reads "
                              f"{FORMAT_VERSION}")
    return state


def find_latest(ckpt_dir: str | Path) -> Optional[Path]:
    """Newest intact checkpoint in ``ckpt_dir``, or None; damaged newer ones are skipped with a warning."""
    ckpt_dir = Path(ckpt_dir)
    index = read_index(ckpt_dir)
    for name, entry in sorted(index["files"].items(), key=lambda kv: -kv[1]["step"]):
        path = ckpt_dir / name
        if path.is_file() and sha256_file(path) == entry["sha256"]:
            return path
        warnings.warn(f"skipping damaged or missing checkpoint {path}", RuntimeWarning, stacklevel=2)
    return None


def resolve_resume(resume: Optional[str], run_dir: str | Path) -> Optional[Path]:
    """``None`` -> no resume; ``"auto"`` -> newest intact checkpoint of the run (None if none yet); else a path."""
    if resume is None:
        return None
    if resume == "auto":
        return find_latest(Path(run_dir) / "checkpoints")
    path = Path(resume)
    if path.is_dir():   # a run directory or its checkpoints folder
        found = find_latest(path / "checkpoints" if (path / "checkpoints").is_dir() else path)
        if found is None:
            raise CheckpointError(f"no checkpoint to resume from in {path}")
        return found
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    return path
