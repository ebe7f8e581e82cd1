"""``clip-mini eval`` and the test ledger: val unless test is named, and a test scoring's line is on record before
the split is scored, completed with the numbers after, and left (as failed) by a scoring that crashes."""
import json

import pytest
import yaml

from clip_mini.cli.main import main
from clip_mini.eval import ledger, validation
from clip_mini.eval.scoring import evaluate_retrieval


@pytest.fixture(scope="module")
def split_config(tmp_path_factory) -> str:
    """A config over 60 generated shapes with a val and a test split of 10 images each."""
    from clip_mini.data.synthetic import generate

    root = tmp_path_factory.mktemp("evalledger")
    shapes = generate(root / "shapes", n=60, seed=0, size=32)
    cfg = root / "shapes.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"captions": str(shapes / "captions.csv"), "val": 10, "test": 10,
                                            "cache": False}}))
    return str(cfg)


def _eval(argv, capsys) -> tuple[int, dict, str]:
    code = main(["eval", *argv, "--json", "--precision", "fp32", "--device", "cpu"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else {}, err


def test_eval_scores_val_unless_test_is_named_and_val_writes_no_line(model_dir, split_config, ledger_path, capsys):
    code, out, err = _eval(["--model", str(model_dir), "--data", split_config], capsys)
    assert code == 0 and out["split"] == "val" and out["n_images"] == 10, err
    assert "no --split given: scoring the val split" in err
    assert not ledger_path.exists()


def test_eval_split_test_writes_its_line_before_scoring_and_the_numbers_after(model_dir, split_config, ledger_path,
                                                                              capsys, monkeypatch):
    seen = []
    real = validation.evaluate_model

    def scoring(*args, **kwargs):
        seen.append([(r["status"], r["test"]) for r in ledger.read_ledger()])   # what a crash here would leave
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, "evaluate_model", scoring)
    code, out, err = _eval(["--model", str(model_dir), "--data", split_config, "--split", "test"], capsys)
    assert code == 0 and out["split"] == "test" and out["n_images"] == 10, err
    assert seen == [[("scoring", None)]]
    (line,) = ledger.read_ledger()
    assert line["status"] == "done" and line["source"] == "clip-mini eval" and line["test_images"] == 10
    assert line["variant"] == model_dir.as_posix() and line["config"] == split_config
    keys = ("t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "rsum", "loss")
    assert line["test"]["model"] == pytest.approx({k: out[k] for k in keys}, abs=1e-6)   # the CLI prints rounded
    assert len(line["config_hash"]) == 64 and line["precision"] == "fp32"


def test_eval_flip_average_scores_mirrored_rows_and_records_it(model_dir, split_config, ledger_path, capsys):
    code, plain, _ = _eval(["--model", str(model_dir), "--data", split_config], capsys)
    flip_code, flip, err = _eval(["--model", str(model_dir), "--data", split_config, "--flip-average"], capsys)
    assert code == flip_code == 0, err
    assert plain["flip_average"] is False and flip["flip_average"] is True and flip["n_images"] == 10
    assert flip["loss"] != pytest.approx(plain["loss"], rel=1e-6)   # other image rows
    api = evaluate_retrieval(model_dir, split_config, progress=False, precision="fp32", device="cpu",
                             flip_average=True)
    assert api["loss"] == pytest.approx(flip["loss"], rel=1e-6)
    capsys.readouterr()   # the data summary the API call printed
    code, out, err = _eval(["--model", str(model_dir), "--data", split_config, "--split", "test", "--flip-average"],
                           capsys)
    (line,) = ledger.read_ledger()   # a test scoring says how its rows were made
    assert code == 0 and out["flip_average"] is True and line["flip_average"] is True, err


def test_a_crash_while_scoring_test_leaves_the_line(model_dir, split_config, ledger_path, monkeypatch):
    def crash(*args, **kwargs):
        raise MemoryError("the test split did not fit")

    monkeypatch.setattr(validation, "evaluate_model", crash)
    with pytest.raises(MemoryError):
        evaluate_retrieval(model_dir, split_config, split="test", progress=False, device="cpu")
    (line,) = ledger.read_ledger()
    assert line["status"] == "failed" and line["error"] == "MemoryError: the test split did not fit"
    assert line["test"] == {}


def test_a_test_split_refused_from_the_config_alone_writes_no_line(model_dir, split_config, ledger_path, capsys):
    code = main(["eval", "--model", str(model_dir), "--data", split_config, "--split", "test", "--set",
                 "data.test=0"])
    assert code == 2 and "split 'test'" in capsys.readouterr().err
    assert not ledger_path.exists()   # nothing was read: nothing to count
