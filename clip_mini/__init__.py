"""clip_mini: a small CLIP-style image–text dual encoder (timm ViT + DistilBERT).

    import clip_mini
    clip_mini.list_models()                                      # built-in models, e.g. ["photos"]
    model = clip_mini.load("photos")                             # a built-in name, or a model directory:
    model = clip_mini.load("runs/tiny/best")                     # device="auto": CUDA when available, else CPU
    text_features = model.encode_text(["a red circle"])          # (1, d) float32, L2-normalised
    image_features = model.encode_image("photo.jpg")             # (d,) for a single image

Every error raised for bad input derives from ``clip_mini.ClipMiniError``.
"""
import importlib
import os

# Nothing may reach the network at run time: the HF hub and albumentations' update check are switched off
# before either library is imported anywhere in the package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from clip_mini.errors import ClipMiniError, InputError  # noqa: E402
from clip_mini.version import __version__  # noqa: E402


def load(model_dir, device: str = "auto", batch_size: int = 64, precision: str = "auto"):
    """Load a model directory or a built-in model as an ``Embedder`` with ``encode_text`` / ``encode_image``.

    Args:
        model_dir: a model directory (``runs/<name>/best``), or the name of a built-in model (``list_models()``;
            the first use builds it once into the user cache from its towers' PyPI packages).
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        batch_size: default inputs per forward pass.
        precision: "auto" (bf16 where the device computes it natively, else fp32), "fp32", "bf16" or "fp16".
    """
    from clip_mini.embed import load as _load

    return _load(model_dir, device=device, batch_size=batch_size, precision=precision)


# Lazy: `import clip_mini` stays cheap (the CLI's start-up time depends on it). name -> defining module.
_LAZY = {
    "list_models": "clip_mini.builtin.registry",   # names of the built-in models (clip-mini models)
    "CLIPModel": "clip_mini.model.clip",
    "Embedder": "clip_mini.embed",
    "EmbeddingIndex": "clip_mini.retrieval.index",
    "resolve_device": "clip_mini.runtime.devices",
    "keep_freed_memory": "clip_mini.runtime.allocator",   # what train.py and clip-mini set; a process-wide choice
    # the error classes the README lists (and the rest of the package's), all subclasses of ClipMiniError
    "ConfigError": "clip_mini.config",
    "DataError": "clip_mini.data.readers",
    "ImageError": "clip_mini.data.images",
    "ModelDirError": "clip_mini.fileio.manifest",
    "EmbeddingIndexError": "clip_mini.retrieval.format",
    "OutputError": "clip_mini.fileio.atomic",
    "EvalError": "clip_mini.eval.scoring",
    "TokenizerError": "clip_mini.model.text",
    "WeightsError": "clip_mini.model.weights",
    "UnreadableFileError": "clip_mini.fileio.bounded_read",
    "DeviceError": "clip_mini.runtime.devices",
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'clip_mini' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)


__all__ = ["load", "ClipMiniError", "InputError", "__version__", *_LAZY]
