"""clip_mini: a small CLIP-style image–text dual encoder (timm ViT + DistilBERT).

    import clip_mini
    model = clip_mini.load("runs/tiny/best")
    text_features = model.encode_text(["a red circle"])          # (1, d) float32, L2-normalised
    image_features = model.encode_image(["photo.jpg"])           # (1, d)
"""
import os

# Nothing may reach the network at run time: the HF hub and albumentations' update check are switched off
# before either library is imported anywhere in the package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from clip_mini.version import __version__  # noqa: E402


def load(model_dir, device: str = "cpu", batch_size: int = 64):
    """Load a model directory as an ``Embedder`` with ``encode_text`` / ``encode_image``."""
    from clip_mini.embed import Embedder

    return Embedder.load(model_dir, device=device, batch_size=batch_size)


def __getattr__(name):
    # Lazy: `import clip_mini` stays cheap (the CLI's start-up time depends on it).
    if name == "CLIPModel":
        from clip_mini.model import CLIPModel

        return CLIPModel
    if name == "Embedder":
        from clip_mini.embed import Embedder

        return Embedder
    if name == "EmbeddingIndex":
        from clip_mini.retrieval.index import EmbeddingIndex

        return EmbeddingIndex
    raise AttributeError(f"module 'clip_mini' has no attribute {name!r}")


__all__ = ["load", "CLIPModel", "Embedder", "EmbeddingIndex", "__version__"]
