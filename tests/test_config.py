"""Config loading: defaults, overrides, unknown keys and bad values named before any work."""
import pytest

from clip_mini.config import Config, ConfigError, load_config, save_config


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["train.epochs=3", "model.vision.width=64", "model.vision.heads=4", "model.text.pretrained=minilm",
                             "train.betas=[0.9, 0.95]", "data.sep=null"])
    assert isinstance(cfg, Config)
    assert cfg.train.epochs == 3 and cfg.model.vision.width == 64 and cfg.model.vision.heads == 4 and cfg.model.text.pretrained == "minilm"
    assert cfg.train.betas == (0.9, 0.95)
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("override, key", [
    ("train.epochz=3", "train.epochz"),
    ("model.vision.width=-4", "model.vision.width"),
    ("train.lr=abc", "train.lr"),
    ("train.precision=fp64", "train.precision"),
    ("model.vision.patch_size=7", "model.vision.patch_size"),
    ("train.batch_size=0", "train.batch_size"),
    ("model.text.dropout=1.5", "model.text.dropout"),
    ("data.hflip=maybe", "data.hflip"),
    ("train.epochs=2.5", "train.epochs"),
    ("bogus.section=1", "bogus"),
    ("train.lr=.nan", "train.lr"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    bad.write_bytes(b"train:\n  epochs: \xff\xfe\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["train.epochs"])


def test_the_old_resize_mode_key_still_loads(tmp_path):
    # data.resize_mode moved to the model's preprocessing (model.vision.resize_mode); old configs keep working
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  resize_mode: center_crop\n")
    assert load_config(old).model.vision.resize_mode == "center_crop"
    assert load_config(None, ["data.resize_mode=center_crop"]).model.vision.resize_mode == "center_crop"
    both = tmp_path / "both.yaml"
    both.write_text("data:\n  resize_mode: center_crop\nmodel:\n  vision:\n    resize_mode: squash\n")
    with pytest.raises(ConfigError, match="model.vision.resize_mode"):
        load_config(both)
