"""Parameter groups, freezing, the learning-rate schedule, and config checks that run before any work."""
import math

import pytest
import torch

from clip_mini.config import ConfigError, load_config
from clip_mini.model.clip import CLIPModel
from clip_mini.train.build import check_train_config
from clip_mini.cli.train import main
from clip_mini.train.optim import build_optimizer, freeze_towers, lr_factor, param_groups, set_lr, set_train_mode
from conftest import NARROW, tiny_sets

TINY = tiny_sets(NARROW) + ["model.text.vocab_size=200"]
TINY += ["train.device=cpu"]   # bit-exact checks are a CPU property: pinned there on a GPU host too


def _model(overrides=()):
    cfg = load_config(None, TINY + list(overrides))
    torch.manual_seed(0)
    return CLIPModel.build(cfg.model, captions=["a red circle", "a blue square left of a star"]), cfg


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_groups_split_towers_and_exempt_biases_norms_tokens_and_scale():
    model, cfg = _model(["train.lr=1e-3", "train.lr_image=2e-3", "train.lr_text=3e-4", "train.lr_head=5e-3"])
    groups = {g["name"]: g for g in param_groups(model, cfg.train)}
    assert set(groups) == {f"{t}.{d}" for t in ("image", "text", "head") for d in ("decay", "no_decay")}
    assert groups["image.decay"]["lr"] == 2e-3 and groups["text.no_decay"]["lr"] == 3e-4
    assert groups["head.decay"]["lr"] == 5e-3
    no_decay = set().union(*(_names(model, g) for n, g in groups.items() if n.endswith("no_decay")))
    decay = set().union(*(_names(model, g) for n, g in groups.items() if n.endswith(".decay")))
    assert all(groups[n]["weight_decay"] == 0.0 for n in groups if n.endswith("no_decay"))
    assert {"logit_scale", "visual.trunk.cls_token", "visual.trunk.pos_embed",
            "text.bert.embeddings.position_embeddings.weight"} <= no_decay
    assert all(n.endswith("bias") or "norm" in n.lower() or n in {"logit_scale", "visual.trunk.cls_token",
               "visual.trunk.pos_embed", "text.bert.embeddings.position_embeddings.weight"} for n in no_decay)
    assert "visual.trunk.blocks.0.attn.qkv.weight" in decay and "image_head.proj.weight" in decay
    assert decay | no_decay == {n for n, _ in model.named_parameters()} and not decay & no_decay


def test_frozen_tower_gets_no_gradient_and_stays_in_eval_mode():
    model, cfg = _model(["model.vision.trainable=false"])
    assert freeze_towers(model) == ["image"]
    opt = build_optimizer(model, cfg.train)
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in trained for p in model.visual.parameters())
    assert any(id(p) in trained for p in model.image_head.parameters())   # its head still learns
    set_train_mode(model, True)
    assert model.text.training and not model.visual.training


def test_text_trainable_layers_lock_the_embeddings_and_lower_blocks():
    model, cfg = _model(["model.text.n_layers=3", "model.text.trainable_layers=1", "model.text.dropout=0.1"])
    assert freeze_towers(model) == ["text (all but its last 1 blocks)"]
    locked = {n for n, p in model.text.named_parameters() if not p.requires_grad}
    assert locked == {n for n, _ in model.text.named_parameters() if ".embeddings." in n or ".layer.0." in n
                      or ".layer.1." in n}
    opt = build_optimizer(model, cfg.train)
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert {n for n, p in model.text.named_parameters() if id(p) in trained} == (
        {n for n, _ in model.text.named_parameters()} - locked)
    set_train_mode(model, True)   # the locked part runs without dropout, the last block with it
    assert not model.text.bert.embeddings.training and not model.text.bert.transformer.layer[1].training
    assert model.text.bert.transformer.layer[2].training and model.visual.training
    # one step: the last block and the heads move, the locked part does not
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tok = model.tokenize(["a red circle", "a blue square left of a star", "a star"])
    logits, _ = model(torch.randn(3, 3, 32, 32), tok["input_ids"], tok["attention_mask"])
    torch.nn.functional.cross_entropy(logits, torch.arange(3)).backward()
    assert all(model.get_parameter(f"text.{n}").grad is None for n in locked)
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert not {f"text.{n}" for n in locked} & moved
    assert "text.bert.transformer.layer.2.ffn.lin1.weight" in moved and "text_head.proj.weight" in moved


@pytest.mark.parametrize("overrides, message", [
    (["model.text.n_layers=2", "model.text.trainable_layers=3"], r"trainable_layers must be in \[1, 2\]"),
    (["model.text.trainable_layers=0"], r"trainable_layers must be in .*model\.text\.trainable=false"),
    (["model.text.pretrained=minilm", "model.text.trainable_layers=7"], r"trainable_layers must be in \[1, 6\]"),
    (["model.text.trainable=false", "model.text.trainable_layers=1"], r"model\.text\.trainable=false locks"),
])
def test_text_trainable_layers_checks_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_schedule_warms_up_then_follows_a_cosine():
    total, warm = 100, 10
    f = [lr_factor(s, total, warm, min_ratio=0.1) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[warm - 1] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:warm - 1], f[1:warm]))
    assert all(a >= b for a, b in zip(f[warm:], f[warm + 1:]))
    assert f[-1] == pytest.approx(0.1)
    mid = warm + (total - 1 - warm) // 2
    assert f[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (mid - warm) / (total - 1 - warm))))
    assert lr_factor(0, 10, 0) == 1.0


def test_set_lr_scales_each_groups_own_base_rate():
    model, cfg = _model(["train.lr_text=1e-4", "train.lr=1e-3"])
    opt = build_optimizer(model, cfg.train)
    assert set_lr(opt, 0.5) == pytest.approx(5e-4)
    assert {round(g["lr"], 8) for g in opt.param_groups} == {5e-4, 5e-5}


@pytest.mark.parametrize("override, key", [
    ("train.best_metric=accuracy", "train.best_metric"),
    ("data.val=0", "data.val"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("train.betas=[0.9, 1.5]", "train.betas"),
    ("train.threads=0", "train.threads"),
])
def test_trainer_checks_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_train_config(load_config(None, [override]))


@pytest.mark.parametrize("argv, key", [
    (["--set", "train.epochz=3"], "train.epochz"),
    (["--set", "train.lr=-1"], "train.lr"),
    (["--set", "train.precision=fp8"], "train.precision"),
    (["--set", "train.best_metric=acc"], "train.best_metric"),
])
def test_cli_rejects_bad_config_before_any_work(argv, key, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and key in err and "Traceback" not in err
    assert not out.exists()   # nothing written, no data read


def test_cli_reports_a_missing_config_file(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_layer_decay_gives_each_block_its_rate_and_off_leaves_the_groups_as_they_were():
    sets = ["train.lr_image=1e-3", "train.lr_text=4e-4", "train.lr_head=5e-3", "model.text.n_layers=3"]
    model, cfg = _model(sets)
    plain = param_groups(model, cfg.train)
    model2, cfg2 = _model(sets + ["train.lr_layer_decay=0.5"])
    decayed = param_groups(model2, cfg2.train)
    off_model, off_cfg = _model(sets + ["train.lr_layer_decay=1"])
    assert [(g["name"], g["lr"], len(g["params"])) for g in param_groups(off_model, off_cfg.train)] == [
        (g["name"], g["lr"], len(g["params"])) for g in plain]
    rate = {n: g["lr"] for g in decayed for n in _names(model2, g)}
    depth = len(model2.visual.trunk.blocks)
    for i in range(depth):   # the top block at the tower's rate, each one below at half the one above
        assert rate[f"visual.trunk.blocks.{i}.attn.qkv.weight"] == pytest.approx(1e-3 * 0.5 ** (depth - 1 - i))
        assert rate[f"visual.trunk.blocks.{i}.norm1.bias"] == rate[f"visual.trunk.blocks.{i}.attn.qkv.weight"]
    assert rate["visual.trunk.patch_embed.proj.weight"] == pytest.approx(1e-3 * 0.5 ** depth)
    assert rate["visual.trunk.cls_token"] == pytest.approx(1e-3 * 0.5 ** depth)
    assert rate["visual.trunk.norm.weight"] == pytest.approx(1e-3)   # after the blocks: the top block's rate
    for i in range(3):
        assert rate[f"text.bert.transformer.layer.{i}.ffn.lin1.weight"] == pytest.approx(4e-4 * 0.5 ** (2 - i))
    assert rate["text.bert.embeddings.position_embeddings.weight"] == pytest.approx(4e-4 * 0.5 ** 3)
    assert rate["image_head.proj.weight"] == 5e-3 and rate["logit_scale"] == 5e-3   # heads: no depth
    # the same parameters, decayed or not exactly as without layer decay
    def by_decay(groups, model):
        return {kind: set().union(*(_names(model, g) for g in groups if g["name"].endswith("." + kind)))
                for kind in ("decay", "no_decay")}
    assert by_decay(decayed, model2) == by_decay(plain, model)
    assert all(g["base_lr"] == g["lr"] for g in decayed)
    # the schedule scales every group alike
    opt = build_optimizer(model2, cfg2.train)
    set_lr(opt, 0.5)
    assert all(g["lr"] == pytest.approx(g["base_lr"] * 0.5) for g in opt.param_groups)


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5"])
def test_layer_decay_outside_zero_one_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="train.lr_layer_decay"):
        load_config(None, TINY + [f"train.lr_layer_decay={value}"])
