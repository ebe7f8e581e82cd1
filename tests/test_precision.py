"""One rule picks the compute dtype: bf16 only where the device computes it natively, fp32 elsewhere.

The CPU's answer is faked through its flags (and oneDNN's ISA cap), never assumed: no test here depends on what
this machine has. Training decides once, says so, stores the choice in the run's config, metrics and checkpoint,
and keeps it on resume.
"""
import json
import warnings
from pathlib import Path

import pytest
import torch

import clip_mini.runtime.isa as isa
from clip_mini.config import ConfigError, load_config
from clip_mini.runtime.devices import PrecisionError, resolve_precision
from conftest import NARROW, tiny_sets

CPU = torch.device("cpu")
NO_BF16 = {"avx2", "avx512f", "avx512_vnni"}                # an Ice Lake Xeon
BF16 = {"avx2", "avx512f", "avx512_bf16"}                   # an AMD EPYC (Zen 4)
AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.fixture
def flags(monkeypatch):
    """Set this process's CPU flags (and no oneDNN cap unless a test sets one)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)

    def set_flags(f):
        monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(f))
    return set_flags


@pytest.mark.parametrize("cpu_flags, cap, want, kind", [
    (NO_BF16, None, "fp32", "no_bf16"),
    ({"avx2"}, None, "fp32", "no_bf16"),                     # a laptop: no AVX-512 at all
    (BF16, None, "bf16", "avx512_bf16"),
    (AMX, None, "bf16", "amx"),
    (AMX, "AVX512_CORE_BF16", "bf16", "avx512_bf16"),        # an AMX box kept off AMX: the EPYC kind
    (AMX, "AVX512_CORE_VNNI", "fp32", "no_bf16"),            # ... capped below bf16: the no-bf16 kind
    (AMX, "avx512_core_amx", "bf16", "amx"),
])
def test_auto_picks_bf16_only_where_native(flags, monkeypatch, cpu_flags, cap, want, kind):
    flags(cpu_flags)
    if cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert resolve_precision("auto", CPU) == want
    assert resolve_precision(None, CPU) == want
    assert isa.cpu_kind() == kind
    record = isa.cpu_record()
    assert record["kind"] == kind and record["auto_precision"] == want
    assert record["avx512_bf16"] == ("avx512_bf16" in cpu_flags) and record["amx_bf16"] == ("amx_bf16" in cpu_flags)


def test_explicit_choices_are_kept_and_bf16_without_native_support_warns_once_per_line(flags):
    flags(NO_BF16)
    assert resolve_precision("fp32", CPU) == "fp32"
    with pytest.warns(RuntimeWarning, match=r"emulated.*slower than fp32") as seen:
        assert resolve_precision("bf16", CPU) == "bf16"
    assert len(seen) == 1
    flags(BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_precision("bf16", CPU) == "bf16"   # native: no warning


def test_unknown_precision_is_refused_naming_the_choices(flags):
    flags(BF16)
    with pytest.raises(PrecisionError, match=r"'bf32'.*auto, fp32, bf16, fp16"):
        resolve_precision("bf32", CPU)
    with pytest.raises(ConfigError, match=r"train\.precision.*auto"):
        load_config(None, ["train.precision=bf32"])


def test_bf16_on_a_gpu_without_bf16_units_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    gpu = torch.device("cuda", 0)
    with pytest.raises(PrecisionError, match="Tesla T4.*no bf16 units"):
        resolve_precision("bf16", gpu)
    assert resolve_precision("auto", gpu) == "fp32"


def test_auto_is_the_default_and_every_shipped_config_says_auto():
    assert load_config(None).train.precision == "auto"
    for path in sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")):
        assert load_config(path).train.precision == "auto", path.name


def test_embedder_and_eval_follow_the_same_rule(flags, tmp_path):
    from conftest import make_model_dir

    import clip_mini
    from clip_mini.eval.scoring import _resolve_precision

    model_dir = make_model_dir(tmp_path / "m")
    flags(NO_BF16)
    assert clip_mini.load(model_dir).precision == "fp32"
    assert _resolve_precision(None, "cpu") == "fp32"
    flags(AMX)
    assert clip_mini.load(model_dir).precision == "bf16"
    assert _resolve_precision("auto", "cpu") == "bf16"
    assert clip_mini.load(model_dir, precision="fp32").precision == "fp32"


def test_one_rule_no_second_copy_of_the_flag_check():
    """Only runtime/isa.py reads the bf16 flags: every other place asks it (through resolve_precision)."""
    pkg = Path(__file__).resolve().parents[1] / "clip_mini"
    readers = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                     if any(s in p.read_text(encoding="utf-8")
                            for s in ('"avx512_bf16"', "'avx512_bf16'", "_is_avx512_bf16_supported",
                                      "_is_amx_tile_supported")))
    assert readers == ["runtime/isa.py"]


@pytest.mark.slow
@pytest.mark.parametrize("cpu_flags, want", [(NO_BF16, "fp32"), (AMX, "bf16")])
def test_training_decides_once_says_so_stores_it_and_keeps_it_on_resume(flags, tmp_path, capsys, cpu_flags, want):
    from clip_mini.data import generate
    from clip_mini.train import train
    from clip_mini.train.checkpoint import find_latest, load_checkpoint

    shapes = generate(tmp_path / "shapes", n=60, seed=0, size=32)
    over = tiny_sets(NARROW) + [
        "model.text.vocab_size=100", "model.text.max_length=16", "data.val=12", "train.batch_size=16",
        "train.epochs=2", "train.threads=1", "train.device=cpu", f"data.captions={shapes / 'captions.csv'}",
        f"train.out_dir={tmp_path / 'run'}"]
    flags(cpu_flags)
    result = train(load_config(None, over), stop_after=2)   # a pause after 2 steps
    out = capsys.readouterr().out
    assert f"precision: {want} (auto: this CPU" in out
    run = tmp_path / "run"
    assert load_config(run / "config.yaml").train.precision == want
    ckpt = load_checkpoint(find_latest(run / "checkpoints"))
    assert ckpt["config"]["train"]["precision"] == want
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["precision"] for r in rows if r["kind"] == "epoch"} == {want}
    assert result["stopped"]
    # resumed on a CPU of the other kind: the run keeps the precision it started with
    flags(AMX if want == "fp32" else NO_BF16)
    result = train(load_config(None, over), resume="auto")
    assert "precision: %s (kept from the checkpoint)" % want in capsys.readouterr().out
    assert result["precision"] == want and not result["stopped"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["precision"] for r in rows if r["kind"] == "epoch"} == {want}
