"""ONNX copies of a model directory's two towers, so queries run in onnxruntime without torch.

Each graph is a whole ``encode_*`` call: tower, projection head and L2 normalisation.

    text.onnx    input_ids, attention_mask (batch, length) int64  ->  text_features (batch, dim) float32
    image.onnx   pixels (batch, 3, S, S) float32 (the eval transform's output)  ->  image_features (batch, dim)
    *.onnx.data  each graph's weights (ONNX external data, memory-mapped by onnxruntime; see ``weights_file``)
    onnx.json    the model fingerprint they were exported from, every file's sha256, opset and exporter versions

Where they live: ``<model_dir>/onnx/`` (written by ``export_if_missing`` when a model is indexed, or on first
use), or ``<cache>/onnx/<fingerprint>/`` when the model directory is read-only (``<cache>`` is the image
cache's root, ``$CLIP_MINI_CACHE_DIR`` first). Every load checks the files against ``onnx.json`` and
``onnx.json`` against the model's fingerprint, so a damaged file or an export of another model is refused with
its name (``OnnxError``); ``ensure_onnx(..., repair=True)`` re-exports instead.

The export uses torch's TorchScript exporter (``dynamo=False``): the dynamo exporter needs ``onnxscript``, which
this project does not install, and the traced graphs are checked against torch to 1e-4 in the tests.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from clip_mini.fileio.checksums import cache_root, known_sha256
from clip_mini.fileio.atomic import atomic_dir, sha256_file
from clip_mini.errors import OnnxError
from clip_mini.fileio.manifest import read_manifest

ONNX_DIR = "onnx"
INDEX = "onnx.json"
TOWERS = {"text": "text.onnx", "image": "image.onnx"}
OPSET = 17


def candidate_dirs(model_dir: Path, fingerprint: str) -> list[Path]:
    """Where the ONNX files of a model may be, in the order they are looked for and written."""
    return [Path(model_dir) / ONNX_DIR, cache_root() / "onnx" / fingerprint]


def verify_onnx(folder: Path, fingerprint: str, towers: tuple[str, ...] = ("text", "image")) -> dict[str, Path]:
    """Check ``folder``'s files against its ``onnx.json`` and the model's fingerprint; paths of ``towers``."""
    index_path = folder / INDEX
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        files, their_fp = index["files"], index["fingerprint"]
    except FileNotFoundError:
        raise OnnxError(f"{index_path} not found") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise OnnxError(f"{index_path} is not a readable ONNX index: {e}") from None
    if their_fp != fingerprint:
        raise OnnxError(f"{index_path} was exported from model {their_fp}, not {fingerprint}")
    out = {}
    for tower in towers:
        name = TOWERS[tower]
        # the graph, and its weights file when the export keeps them outside (every export since weights_file)
        for part in (name, weights_file(name)) if weights_file(name) in files else (name,):
            path = folder / part
            if not path.is_file():
                raise OnnxError(f"{path} not found")
            if known_sha256(path) != files.get(part):
                raise OnnxError(f"{path} is corrupt: its sha256 does not match {INDEX}")
        out[tower] = folder / name
    return out


def weights_file(name: str) -> str:
    """The file holding an exported graph's weights (ONNX external data) beside the graph ``name``.

    onnxruntime memory-maps external weights instead of parsing them out of the protobuf, so a session over the
    MiniLM text tower starts several times sooner, which matters to a cold text query."""
    return name + ".data"


def ensure_onnx(model_dir: str | Path, tower: str, repair: bool = False) -> Path:
    """Path of ``tower``'s verified ONNX file for ``model_dir``, exporting both towers first if there is none.

    A damaged or foreign copy raises ``OnnxError`` (naming the file) unless ``repair``, which exports afresh.
    """
    model_dir = Path(model_dir)
    fingerprint = read_manifest(model_dir, verify=False)["fingerprint"]
    for folder in candidate_dirs(model_dir, fingerprint):
        if (folder / INDEX).exists():
            try:
                return verify_onnx(folder, fingerprint, (tower,))[tower]
            except OnnxError:
                if not repair:
                    raise
    from clip_mini.model.clip import CLIPModel

    folder = _export_somewhere(CLIPModel.from_pretrained(model_dir), model_dir)   # verifies the weights first
    return verify_onnx(folder, fingerprint, (tower,))[tower]


def export_if_missing(model, model_dir: str | Path) -> None:
    """Give ``model_dir`` a verified export made from ``model`` (already loaded, e.g. by ``clip-mini index``), so
    that later queries never import torch. Models on a GPU are left to the first query."""
    fingerprint = model.fingerprint
    for folder in candidate_dirs(Path(model_dir), fingerprint):
        try:
            verify_onnx(folder, fingerprint)
            return
        except OnnxError:
            continue
    if next(model.parameters()).device.type == "cpu":
        _export_somewhere(model, Path(model_dir))


def _export_somewhere(model, model_dir: Path) -> Path:
    errors = []
    for folder in candidate_dirs(model_dir, model.fingerprint):
        try:
            return export_onnx(model, folder)
        except OSError as e:   # OutputError included: a read-only model directory falls through to the user cache
            errors.append(f"{folder}: {e}")
    raise OnnxError(f"cannot write the ONNX export of {model_dir}: " + "; ".join(errors))


def export_onnx(model, out_dir: str | Path, fingerprint: Optional[str] = None) -> Path:
    """Export ``model`` (a ``CLIPModel``) to ``out_dir`` (replaced atomically): text.onnx, image.onnx, onnx.json."""
    fingerprint = fingerprint or model.fingerprint
    training = model.training
    model.eval()   # the graphs are eval mode (no dropout); a training caller gets its mode back below
    size = model.preprocess.image_size
    try:
        _export(model, out_dir, fingerprint, size)
    finally:
        model.train(training)
    return Path(out_dir)


def _export(model, out_dir: str | Path, fingerprint: str, size: int) -> None:
    import warnings

    import torch

    with atomic_dir(out_dir) as tmp, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the TorchScript exporter's deprecation and tracer warnings
        ids = torch.ones(2, 5, dtype=torch.int64)
        text_axes = {"input_ids": {0: "batch", 1: "length"}, "attention_mask": {0: "batch", 1: "length"},
                     "text_features": {0: "batch"}}
        torch.onnx.export(_encoder(model, "encode_text"), (ids, torch.ones_like(ids)), str(tmp / TOWERS["text"]),
                          dynamo=False, input_names=["input_ids", "attention_mask"], output_names=["text_features"],
                          dynamic_axes=text_axes, opset_version=OPSET)
        pixels = torch.zeros(1, 3, size, size)
        torch.onnx.export(_encoder(model, "encode_image"), (pixels,), str(tmp / TOWERS["image"]), dynamo=False,
                          input_names=["pixels"], output_names=["image_features"],
                          dynamic_axes={"pixels": {0: "batch"}, "image_features": {0: "batch"}}, opset_version=OPSET)
        for name in TOWERS.values():
            _externalise(tmp / name)
        index = {"fingerprint": fingerprint, "opset": OPSET, "torch": torch.__version__,
                 "files": {part: sha256_file(tmp / part) for name in TOWERS.values()
                           for part in (name, weights_file(name))}}
        (tmp / INDEX).write_text(json.dumps(index, indent=1), encoding="utf-8")


def _externalise(path: Path) -> None:
    """Rewrite the graph at ``path`` with its weights in ``weights_file`` beside it (see there for why)."""
    import onnx

    graph = onnx.load(str(path))
    onnx.save_model(graph, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=weights_file(path.name), size_threshold=1024)
    os.chmod(path.with_name(weights_file(path.name)), path.stat().st_mode & 0o777)   # onnx writes it 0600


def _encoder(model, method: str):
    """``model.<method>`` as a module of its own, so the exported graph starts at the tower's inputs."""
    import torch

    class Encode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            return getattr(self.model, method)(*inputs)

    return Encode()
