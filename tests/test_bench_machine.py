"""Every benchmark result records the CPU it ran on (model and the instruction sets that move its numbers)."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import machine  # noqa: E402

AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx2 fma f16c avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8 avx512_fp16
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx2
"""
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma f16c avx512f avx512_bf16 avx512_vnni\n"


def test_cpu_model_and_flags_read_the_first_processor():
    model, flags = machine.cpu_model_and_flags(AMX)
    assert model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert flags == ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
                     "amx_bf16", "amx_int8"]
    model, flags = machine.cpu_model_and_flags(EPYC)
    assert model == "AMD EPYC" and "amx_bf16" not in flags and "avx512_bf16" in flags


def test_cpu_model_falls_back_without_a_model_line():
    model, flags = machine.cpu_model_and_flags("processor\t: 0\nFeatures\t: fp asimd\n")
    assert model and flags == []


def test_machine_info_on_this_machine():
    info = machine.machine_info()
    assert info["cpu_model"] and info["cores"] >= 1 and isinstance(info["isa"], list)
    assert set(info["isa"]) <= set(machine.ISA_FLAGS)


def test_every_benchmark_that_writes_results_records_the_machine():
    missing = []
    scripts = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(scripts) > 20
    for script in scripts:
        text = script.read_text()
        writes = re.search(r"atomic_write_(json|text)\(|json\.dump\(|\.write_text\(|write_result\(", text)
        # openclip_peer.py writes one variant's scores for quality_flickr8k.py, whose report records the machine;
        # results_md.py writes markdown from the JSONs; ledger.py stamps each line with the CPU itself
        if writes and script.name not in ("results_md.py", "ledger.py", "run_all.py",
                                          "openclip_peer.py"):
            if "machine_info()" not in text:
                missing.append(script.name)
    assert not missing, f"benchmarks writing results without machine_info(): {missing}"
