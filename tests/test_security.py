"""Nothing a user passes is unpickled; nothing reaches the network on import."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("clip_mini", "benchmarks") for p in (ROOT / d).rglob("*.py")) + \
    [ROOT / "train.py", ROOT / "infer.py"]


def _unsafe_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                    if a.name in ("pickle", "cPickle", "dill", "joblib", "shelve", "marshal")]
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "dill", "joblib", "shelve", "marshal"):
            bad.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kwargs = {k.arg: k.value for k in node.keywords}
        if name.endswith("torch.load"):
            flag = kwargs.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                bad.append(f"{path.name}:{node.lineno} torch.load without weights_only=True")
        if name.endswith(("np.load", "numpy.load")):
            flag = kwargs.get("allow_pickle")
            if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                bad.append(f"{path.name}:{node.lineno} np.load with allow_pickle")
        if name in ("eval", "exec"):
            bad.append(f"{path.name}:{node.lineno} {name}()")
        if name.endswith(("yaml.load", "yaml.unsafe_load", "yaml.full_load")):
            bad.append(f"{path.name}:{node.lineno} {name} (use yaml.safe_load)")
        if name.endswith("from_pretrained") and "trust_remote_code" in kwargs:
            bad.append(f"{path.name}:{node.lineno} trust_remote_code")
    return bad


def test_source_has_no_unsafe_loads():
    found = [b for p in SOURCES if p.exists() for b in _unsafe_calls(p)]
    assert found == []


def test_scanner_catches_unsafe_code(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text("import pickle\nimport torch, numpy as np, yaml\ntorch.load('x')\n"
                   "torch.load('x', weights_only=False)\nnp.load('x', allow_pickle=True)\nyaml.load(s)\n")
    assert len(_unsafe_calls(src)) == 5


def test_package_sets_offline_flags_before_any_import():
    # albumentations is imported when a transform is built (clip_mini.data.transforms), with the flag already set
    code = ("import os, sys\nimport clip_mini\n"
            "assert os.environ['HF_HUB_OFFLINE'] == '1'\nassert os.environ['NO_ALBUMENTATIONS_UPDATE'] == '1'\n"
            "from clip_mini.config import PreprocessConfig\nfrom clip_mini.data import build_eval_transform\n"
            "build_eval_transform(PreprocessConfig())\nassert 'albumentations' in sys.modules\nprint('ok')")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "NO_ALBUMENTATIONS_UPDATE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
