"""clip_mini.runtime.allocator: freed activations stay in the process, so the next step reuses them without page faults."""
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A training step's pattern: an MLP whose 48 MiB activations (above glibc's largest mmap threshold, as a ViT's
# attention maps are) are allocated in the forward and freed in the backward. Prints the faults of steps 5 to 9.
STEPS = r"""
import resource, sys, torch
if sys.argv[1] == "keep":
    from clip_mini.runtime.allocator import keep_freed_memory
    assert keep_freed_memory()
torch.manual_seed(0)
net = torch.nn.Sequential(*[m for _ in range(2) for m in (torch.nn.Linear(256, 3072), torch.nn.GELU(),
                                                           torch.nn.Linear(3072, 256))])
x = torch.randn(4096, 256)
for i in range(10):
    if i == 5:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    net(x).square().mean().backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
ACTIVATION_PAGES = 4096 * 3072 * 4 // 4096   # one hidden activation (4096 x 3072 fp32)


def _faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_memory_is_reused_without_page_faults():
    plain, kept = _faults_per_step("plain"), _faults_per_step("keep")
    # Without the setting glibc gives the heap top (or the mmap'd blocks) back and every step faults them in again;
    # if that ever stops being so, the setting has nothing left to do and this says it.
    assert plain > 4 * ACTIVATION_PAGES, plain
    # a heap that still grows once (another process on the cores shifts the order of frees) may fault a couple of
    # activations in; a heap handing memory back faults every activation, every step
    assert kept <= 4 * ACTIVATION_PAGES and kept < plain / 10, (kept, plain)


def test_both_programs_set_it():
    from clip_mini.cli import main as cli
    from clip_mini.cli import train as train_cli

    with mock.patch("clip_mini.runtime.allocator.keep_freed_memory") as keep:
        assert cli.main(["search", "a dog", "--index", "/nonexistent/index"]) == 2
    keep.assert_called_once()
    with mock.patch("clip_mini.runtime.allocator.keep_freed_memory") as keep, \
            mock.patch.object(train_cli, "run", return_value=0) as run:
        assert train_cli.main(["--config", str(ROOT / "configs/tiny.yaml")]) == 0
    keep.assert_called_once()
    run.assert_called_once()


def test_refuses_quietly_off_glibc():
    from clip_mini.runtime import allocator

    with mock.patch.object(allocator.sys, "platform", "darwin"):
        assert allocator.keep_freed_memory() is False
