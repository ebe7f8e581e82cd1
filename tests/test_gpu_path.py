"""The GPU path as far as a CPU can show it (issue 44): device and precision choices against mocked CUDA queries,
``--device`` carried through every indexing path, loader workers per process, the zero-shot text precision.

The real GPU runs are in tests/test_cuda_smoke.py (skipped here without CUDA)."""
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch

from clip_mini.runtime import devices


def _gpus(*capabilities):
    """Mock CUDA with one GPU per ``(major, minor)``; ``get_device_capability`` answers for the device asked about."""
    def capability(device=None):
        index = torch.device(device).index if device is not None else 0
        return capabilities[index or 0]

    return mock.patch.multiple(torch.cuda, is_available=mock.Mock(return_value=True),
                               device_count=mock.Mock(return_value=len(capabilities)),
                               get_device_capability=mock.Mock(side_effect=capability),
                               get_device_name=mock.Mock(return_value="Tesla V100-SXM2-16GB"),
                               # emulated bf16 counts as supported: exactly what "auto" must not trust
                               is_bf16_supported=mock.Mock(return_value=True))


def test_auto_precision_follows_the_chosen_gpus_compute_capability():
    with _gpus((7, 0), (8, 0), (9, 0)):
        assert devices.resolve_precision("auto", torch.device("cuda", 0)) == "fp32"   # V100: bf16 emulated
        assert devices.resolve_precision("auto", torch.device("cuda", 1)) == "bf16"   # A100
        assert devices.resolve_precision(None, torch.device("cuda", 2)) == "bf16"     # H100
        assert devices.resolve_precision("fp16", torch.device("cuda", 1)) == "fp16"   # asked for: kept
    with _gpus((7, 5)):   # T4
        assert devices.resolve_precision("auto", devices.resolve_device("cuda")) == "fp32"
        hint = devices.precision_hint("fp32", torch.device("cuda", 0))
        assert "compute capability 7.5" in hint and "--precision fp16" in hint
        assert devices.precision_hint("fp16", torch.device("cuda", 0)) is None
    with _gpus((8, 6)):
        assert devices.precision_hint("fp32", torch.device("cuda", 0)) is None   # bf16 is there: auto takes it
    assert devices.precision_hint("fp32", torch.device("cpu")) is None


def test_index_and_eval_offer_fp16():
    from clip_mini.cli.main import build_parser

    parse = build_parser().parse_args
    assert parse(["index", "--model", "m", "--images", "i", "--out", "o", "--precision", "fp16"]).precision == "fp16"
    assert parse(["eval", "--model", "m", "--data", "c.yaml", "--precision", "fp16"]).precision == "fp16"


def test_use_device_sets_the_current_gpu_and_tf32_before_anything_else(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(devices, "enable_tf32", lambda d: calls.append(("tf32", d)))
    assert devices.use_device("cpu") == torch.device("cpu") and calls == []
    assert devices.use_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert calls == [("set_device", torch.device("cuda", 1)), ("tf32", torch.device("cuda", 1))]


def test_the_embedder_makes_its_gpu_current_before_moving_the_model(monkeypatch, model_dir):
    # clip_mini.load(device="cuda:1"): without set_device, the model copy and pinned batches open a context on
    # GPU 0 too. Mocked: the order of set_device and the model's .to() is what counts.
    from clip_mini.model.clip import CLIPModel
    import clip_mini.embed as embed

    order = []
    monkeypatch.setattr(embed, "resolve_device", lambda d: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: order.append(("set_device", str(d))))
    monkeypatch.setattr(devices, "enable_tf32", lambda d: order.append(("tf32", str(d))))
    model = CLIPModel.from_pretrained(model_dir)
    monkeypatch.setattr(model, "to", lambda d: order.append(("to", str(d))) or model)
    e = embed.Embedder(model, device="cuda:1", precision="fp32")   # auto would ask the (mocked) GPU's capability
    assert e.device == torch.device("cuda", 1)
    assert order == [("set_device", "cuda:1"), ("tf32", "cuda:1"), ("to", "cuda:1")]


def test_loader_workers_share_the_allowed_cores_among_local_ranks(monkeypatch):
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert devices.loader_workers(None) == 4 and devices.default_workers(None, "cuda:0") == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")   # 8 ranks on 16 cores: 2 decoding processes each, not 4
    assert devices.loader_workers(None) == 2 and devices.default_workers(None, "cuda:0") == 2
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)   # taskset -c 0-2
    assert devices.loader_workers(None) == 1   # never 0 on a GPU: at least one process decodes ahead
    assert devices.loader_workers(3) == 3   # data.workers set: kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.loader_workers(None) == 0


def test_tf32_disabled_restores_what_was_set():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        with devices.tf32_disabled():
            assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_zero_shot_text_side_runs_at_the_requested_precision(model_dir):
    # The Embedder's own autocast (fp32: disabled) inside encode_text overrode the outer one, so the class prompts
    # ran fp32 whatever --precision said. bf16 autocast on a CPU changes the rows measurably; fp32 must not.
    import clip_mini
    from clip_mini.eval.scoring import class_text_features

    embedder = clip_mini.load(model_dir, device="cpu", precision="fp32")   # bf16 on a CPU that has it natively
    classes, templates = ["red circle", "blue square", "green triangle"], ["a {}", "a photo of a {}"]
    fp32 = class_text_features(embedder, classes, templates, "fp32")
    bf16 = class_text_features(embedder, classes, templates, "bf16")
    assert embedder.precision == "fp32"   # restored
    want = clip_mini.load(model_dir, device="cpu", precision="bf16").encode_text(
        [t.format(c) for c in classes for t in templates]).reshape(3, 2, -1).mean(1)
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(bf16, want, atol=1e-6)
    assert np.abs(bf16 - fp32).max() > 1e-4


# -- --device through the shard and Ray index paths ----------------------------------------------------------
def test_index_shards_builds_its_embedder_on_the_asked_device(monkeypatch, tmp_path):
    import clip_mini.embed
    import clip_mini.data.webdataset as wds
    import clip_mini.retrieval.wds_source as wds_source
    from clip_mini.cli.main import main

    seen = {}

    class Stop(Exception):
        pass

    def fake_load(model_dir, device="auto", batch_size=64, precision="fp32"):
        seen["device"] = device
        return types.SimpleNamespace(device=torch.device("cpu"))

    def fake_index(path, embedder, shards, **kw):
        seen["precision"] = kw["precision"]
        raise Stop

    monkeypatch.setattr(clip_mini.embed, "load", fake_load)
    monkeypatch.setattr(wds, "expand_shards", lambda pattern: ["a.tar"])
    monkeypatch.setattr(wds_source, "index_shards", fake_index)
    model = tmp_path / "m"   # an existing folder: a bare name would be looked up among the built-in models
    model.mkdir()
    with pytest.raises(Stop):
        main(["index", "--model", str(model), "--shards", "a.tar", "--out", str(tmp_path / "i"), "--device", "cpu",
              "--quiet"])
    # was: device auto whatever --device said
    assert seen == {"device": "cpu", "precision": devices.resolve_precision("auto", torch.device("cpu"))}
    # --ray: the driver's model stays on its CPU; the actors get --device and the unresolved precision
    import clip_mini.retrieval.ray_index as ray_index

    monkeypatch.setattr(ray_index, "ray_embedder", lambda *a, **kw: seen.update(ray=(a, kw)) or "embed")
    seen.clear()
    with pytest.raises(Stop):
        main(["index", "--model", str(model), "--shards", "a.tar", "--ray", "--out", str(tmp_path / "i"), "--device",
              "cuda:1", "--quiet"])
    assert seen["device"] == "cpu" and seen["precision"] == "auto"
    assert seen["ray"] == ((str(model), None, 2, 64, "auto", False), {"device": "cuda:1", "flip_average": False})


class _FakeRay:
    """Just enough of Ray Data for ``embed_with_ray`` to run its pipeline in this process, recording map_batches."""

    def __init__(self, gpus: int):
        self.gpus, self.map_kwargs = gpus, None
        fake = self
        self.data = types.SimpleNamespace(
            DataContext=types.SimpleNamespace(get_current=lambda: types.SimpleNamespace()),
            ActorPoolStrategy=lambda size: ("pool", size),
            from_items=lambda items, override_num_blocks: _FakeDataset(fake, items))

    def cluster_resources(self):
        return {"CPU": 4.0, **({"GPU": float(self.gpus)} if self.gpus else {})}

    def nodes(self):
        return []


class _FakeDataset:
    def __init__(self, ray, items):
        self.ray, self.items = ray, items

    def flat_map(self, fn):
        return self

    def map_batches(self, cls, **kw):
        self.ray.map_kwargs = kw
        return self

    def iter_batches(self, **kw):   # each shard's read gave one marker row (an empty shard)
        from clip_mini.retrieval.ray_index import ROW_FIELDS

        rows = [{**{f: 0 for f in ROW_FIELDS}, "shard": it["shard"], "key": "", "seq": 0, "of": 1, "mark": True,
                 "reason": "", "read_node": "n", "embed_node": "n"} for it in self.items]
        return iter([{k: [r[k] for r in rows] for k in rows[0]}] if rows else [])


@pytest.mark.parametrize("device,gpus,want_gpus,actor", [("cuda:1", 2, 1, "cuda"), ("auto", 2, 1, "auto"),
                                                         ("auto", 0, 0, "auto"), ("cpu", 2, 0, "cpu")])
def test_ray_actors_request_a_gpu_and_resolve_device_and_precision_themselves(monkeypatch, device, gpus,
                                                                               want_gpus, actor):
    import clip_mini.retrieval.ray_index as ray_index

    fake = _FakeRay(gpus)
    monkeypatch.setattr(ray_index, "_ray", lambda: fake)
    parts = types.SimpleNamespace(arrays=[], write=lambda *a: None)
    monkeypatch.setattr("clip_mini.data.webdataset.shard_identity_of", lambda u: (1, 1))
    ray_index.embed_with_ray(["a.tar"], parts, "m", 2, 8, "auto", False, device=device)
    assert fake.map_kwargs["num_gpus"] == want_gpus
    assert fake.map_kwargs["fn_constructor_kwargs"] == {"model_dir": "m", "precision": "auto", "device": device,
                                                        "flip_average": False}
    # inside the actor: its own device (Ray's GPU is cuda:0 of what it sees) and "auto" resolved for it
    loaded = {}

    def fake_load(model_dir, device="auto", **kw):
        loaded["device"] = device
        where = "cuda" if device == "cuda" or (device == "auto" and gpus) else "cpu"   # Ray gave it a GPU
        return types.SimpleNamespace(device=torch.device(where), model=mock.Mock())

    monkeypatch.setattr("clip_mini.embed.load", fake_load)
    monkeypatch.setattr("clip_mini.model.clip.ImageForward", lambda model, precision, device, flip=False: precision)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with _gpus((8, 0), (8, 0)):
        got = ray_index.EmbedActor("m", "auto", device)
    assert loaded["device"] == actor
    assert got.precision == ("bf16" if want_gpus else devices.resolve_precision("auto", torch.device("cpu")))


def test_ray_refuses_a_gpu_device_on_a_cluster_without_one(monkeypatch):
    import clip_mini.retrieval.ray_index as ray_index
    from clip_mini.retrieval.format import EmbeddingIndexError

    with pytest.raises(EmbeddingIndexError, match="no GPU"):
        ray_index.actor_gpus(_FakeRay(0), "cuda")
