"""``--ray ADDRESS`` joining a cluster (``ray_index.connect``): an address where nothing answers, or where something
answers that is not a Ray head, is an error naming the address within the deadline, never a hang. Ray itself is
stood in for (these run without it); ``tests/test_ray_two_node.py`` does the first case with Ray installed, and
joins a real two-node cluster."""
import socket
import threading
import time

import pytest

from clip_mini.retrieval import ray_index
from clip_mini.retrieval.format import EmbeddingIndexError


class _Ray:
    """``ray.init`` that blocks as it does on a port that is not a Ray head (or records a join)."""
    __version__ = "2.x"

    def __init__(self, block: bool):
        self.block, self.joined = block, []
        self.release = threading.Event()

    def init(self, address, **kw):
        if self.block:
            self.release.wait(60)
        self.joined.append(address)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address,host_port", [("10.0.0.5:6379", ("10.0.0.5", 6379)),
                                               ("ray://head.example:10001", ("head.example", 10001)),
                                               ("[::1]:6379", ("::1", 6379)), ("auto", None), ("head", None)])
def test_the_address_host_and_port(address, host_port):
    assert ray_index._host_port(address) == host_port


def test_nothing_listening_is_an_error_naming_the_address_at_once():
    fake = _Ray(block=False)
    address = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EmbeddingIndexError, match=f"--ray {address}: no Ray head answers at {address}"):
        ray_index.connect(fake, address, progress=False)
    assert time.monotonic() - t0 < 5 and not fake.joined   # ray.init was never tried


def test_a_port_that_answers_but_is_no_ray_head_is_an_error_at_the_deadline():
    fake = _Ray(block=True)
    with socket.socket() as server:   # accepts connections and never says a word
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(EmbeddingIndexError, match=f"--ray {address}: something answers there but no Ray "
                                                      "cluster joined within 2 s"):
            ray_index.connect(fake, address, progress=False, timeout=2)
        took = time.monotonic() - t0
        fake.release.set()
    assert 1.5 < took < 5


def test_a_head_that_answers_is_joined():
    fake = _Ray(block=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        ray_index.connect(fake, address, progress=False)
    assert fake.joined == [address]


def test_a_join_that_ray_refuses_names_the_address():
    class Refusing(_Ray):
        def init(self, address, **kw):
            raise RuntimeError("Version mismatch: the cluster runs Ray 2.0")

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(EmbeddingIndexError, match=f"--ray {address}: cannot join the Ray cluster: Version "):
            ray_index.connect(Refusing(block=False), address, progress=False)
