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


FP32_SECTION = """\
model:
  vision: {backbone: vit, patch_size: 8, trainable_blocks: 2, depth: 4}
train: {frozen_features: 3, batch_size: 32, precision: auto, budget: 10m}
fp32:
  model: {vision: {trainable_blocks: 1}}
  train: {frozen_features: 1}
"""


def test_a_precision_section_applies_only_at_its_precision_and_under_set(tmp_path):
    from clip_mini.config import precision_settings

    path = tmp_path / "c.yaml"
    path.write_text(FP32_SECTION)
    plain = load_config(path)
    assert (plain.model.vision.trainable_blocks, plain.train.frozen_features) == (2, 3)
    assert load_config(path, precision="bf16") == plain
    fp32 = load_config(path, precision="fp32")
    assert (fp32.model.vision.trainable_blocks, fp32.train.frozen_features, fp32.train.batch_size) == (1, 1, 32)
    assert fp32.model.vision.depth == 4   # the rest of the section's neighbours kept
    assert load_config(path, ["train.frozen_features=2"], precision="fp32").train.frozen_features == 2   # --set wins
    assert precision_settings(path, "fp32") == ["model.vision.trainable_blocks=1", "train.frozen_features=1"]
    assert precision_settings(path, "bf16") == [] and precision_settings(None, "fp32") == []
    # a saved run config holds the values that ran, not the section
    save_config(fp32, tmp_path / "run.yaml")
    assert "fp32:" not in (tmp_path / "run.yaml").read_text() and load_config(tmp_path / "run.yaml") == fp32


@pytest.mark.parametrize("section, message", [
    ("fp32: 4\n", r"the fp32 section must be a mapping"),
    ("fp32:\n  train: {frozen_featurez: 1}\n", r"train\.frozen_featurez"),
])
def test_a_bad_precision_section_is_named(tmp_path, section, message):
    path = tmp_path / "c.yaml"
    path.write_text("train: {batch_size: 8}\n" + section)
    with pytest.raises(ConfigError, match=message):
        load_config(path, precision="fp32")


def test_the_train_command_loads_the_section_of_the_precision_it_will_run(tmp_path, capsys):
    import yaml

    from clip_mini.cli.train import main
    from clip_mini.runtime.devices import resolve_precision

    path = tmp_path / "c.yaml"
    path.write_text(FP32_SECTION)
    run = tmp_path / "run"

    def printed(*sets):
        assert main(["--config", str(path), "--print-config", "--out", str(run)] +
                    [a for s in sets for a in ("--set", s)]) == 0
        return yaml.safe_load(capsys.readouterr().out)

    assert printed("train.precision=fp32")["model"]["vision"]["trainable_blocks"] == 1
    # a run of fixed epochs (no budget) trains the file's own settings
    assert printed("train.precision=fp32", "train.budget=null")["model"]["vision"]["trainable_blocks"] == 2
    assert printed("train.precision=bf16")["model"]["vision"]["trainable_blocks"] == 2
    assert printed("train.precision=fp32", "model.vision.trainable_blocks=3")["model"]["vision"]["trainable_blocks"] == 3
    # auto: as this machine decides it (asked of the CPU, not assumed)
    auto = resolve_precision("auto", "cpu")
    assert printed("train.device=cpu")["model"]["vision"]["trainable_blocks"] == (1 if auto == "fp32" else 2)
    # a resumed run keeps the precision its run directory recorded, whatever this CPU would pick
    run.mkdir()
    other = "bf16" if auto == "fp32" else "fp32"
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"precision": other}}))
    assert main(["--config", str(path), "--print-config", "--out", str(run), "--resume", "--set",
                 "train.device=cpu"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["vision"]["trainable_blocks"] == (1 if other == "fp32"
                                                                                              else 2)
