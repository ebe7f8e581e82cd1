"""Masked-mean text pooling (``model.text.pooling: mean``): padding-invariant, and the ONNX query path agrees."""
import numpy as np
import torch

from clip_mini.config import TextConfig, load_config
from clip_mini.model.clip import CLIPModel
from clip_mini.model.text import TextEncoder, train_tokenizer
from conftest import NARROW, tiny_sets

CAPTIONS = ["a red circle", "a small blue square at the top", "a green star left of a yellow triangle"]


def test_mean_pooling_ignores_padding_and_differs_from_cls():
    tok = train_tokenizer(CAPTIONS, 100)
    torch.manual_seed(0)
    enc = TextEncoder(TextConfig(**NARROW["text"], dropout=0.0, pooling="mean"), len(tok)).eval()
    short = tok(["a red circle"], return_tensors="pt")
    padded = tok(["a red circle", CAPTIONS[2]], padding="longest", return_tensors="pt")
    assert padded["input_ids"].shape[1] > short["input_ids"].shape[1]
    a = enc(short["input_ids"], short["attention_mask"])
    torch.testing.assert_close(a, enc(padded["input_ids"], padded["attention_mask"])[:1], atol=1e-5, rtol=1e-5)
    hidden = enc.bert(**short).last_hidden_state
    torch.testing.assert_close(a, hidden.mean(1))
    assert not torch.allclose(a, hidden[:, 0])


def test_onnx_query_encoder_follows_the_pooling_of_the_model(tmp_path):
    from clip_mini.retrieval.query import TextQueryEncoder

    cfg = load_config(None, tiny_sets(NARROW) + ["model.text.pooling=mean"])
    torch.manual_seed(0)
    model = CLIPModel.build(cfg.model, captions=CAPTIONS).eval()
    model.save_pretrained(tmp_path / "m")
    queries = ["a red circle", "a small blue square at the top"]
    fast = TextQueryEncoder.load(tmp_path / "m").encode_text(queries)
    with torch.no_grad():
        tokens = model.tokenize(queries)
        ref = model.encode_text(tokens["input_ids"], tokens["attention_mask"]).numpy()
    np.testing.assert_allclose(fast, ref, atol=1e-5)
