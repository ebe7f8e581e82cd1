"""Tokenizer inputs: captions cut by max_length are counted and reported once; padding is always on the right."""
import json

import pytest

from clip_mini.model import text as text_mod
from clip_mini.model.text import count_truncated, load_tokenizer, report_truncation, train_tokenizer

CAPTIONS = ["a red circle", "a blue square at the top left", "two green triangles", "a big yellow star"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CAPTIONS * 3, vocab_size=200)


def test_count_truncated_counts_captions_longer_than_max_length_special_tokens_included(tokenizer):
    # whole words in the vocab: a caption of w words is w + 2 tokens ([CLS] ... [SEP])
    caps = ["a red circle", "a blue square at the top left", "two green triangles"]   # 5, 9, 5 tokens
    assert count_truncated(tokenizer, caps, 9) == (0, 9)
    assert count_truncated(tokenizer, caps, 8) == (1, 9)
    assert count_truncated(tokenizer, caps, 4) == (3, 9)
    # the count agrees with what truncating tokenization actually cuts
    cut = tokenizer(caps, truncation=True, max_length=4)["input_ids"]
    full = tokenizer(caps)["input_ids"]
    assert sum(a != b for a, b in zip(cut, full)) == 3


def test_count_truncated_works_in_chunks(tokenizer, monkeypatch):
    monkeypatch.setattr(text_mod, "_TRUNCATION_CHUNK", 2)
    caps = ["a red circle"] * 3 + ["a blue square at the top left"] * 2
    assert count_truncated(tokenizer, caps, 6) == (2, 9)


def test_report_truncation_says_so_once_and_returns_the_count(tokenizer, capsys, monkeypatch):
    monkeypatch.setattr(text_mod, "_reported", set())
    caps = ["a blue square at the top left", "a red circle"]
    assert report_truncation(tokenizer, caps, 6, "train") == 1
    assert report_truncation(tokenizer, caps, 6, "train") == 1     # e.g. the next epoch's evaluation
    out = capsys.readouterr().out.splitlines()
    assert out == ["text: 1 of 2 train captions are longer than model.text.max_length=6 tokens and are truncated "
                   "(longest: 9 tokens)"]
    assert report_truncation(tokenizer, caps, 9, "train") == 0
    assert capsys.readouterr().out == ""                            # nothing cut, nothing said


def test_a_left_padding_tokenizer_directory_is_loaded_with_right_padding(tokenizer, tmp_path):
    from transformers import DistilBertTokenizerFast

    tokenizer.save_pretrained(str(tmp_path))
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["padding_side"] = "left"
    cfg_path.write_text(json.dumps(cfg))
    assert DistilBertTokenizerFast.from_pretrained(str(tmp_path)).padding_side == "left"   # HF would honour it

    with pytest.warns(RuntimeWarning, match="pads on the left"):
        tok = load_tokenizer(tmp_path)
    batch = tok(["a red circle", "a blue square at the top left"], padding="longest", return_tensors="pt")
    assert (batch["input_ids"][:, 0] == tok.cls_token_id).all()          # [CLS] first, never [PAD]
    assert batch["attention_mask"][0].tolist() == [1] * 5 + [0] * 4     # padding after the caption
    assert batch["input_ids"][0, -1] == tok.pad_token_id


def test_a_right_padding_directory_loads_without_warning(tokenizer, tmp_path, recwarn):
    tokenizer.save_pretrained(str(tmp_path))
    assert load_tokenizer(tmp_path).padding_side == "right"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
