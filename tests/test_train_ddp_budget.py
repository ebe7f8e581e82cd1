"""A budget under DDP, with 2 gloo ranks on the CPU: the ranks agree on the image cache before filling it (one rank
without disk for it used to hang the other at the fill's barrier), and a re-fit one rank asks for happens on both
(rank 0 alone measures evaluations and saves, so its "late" must not be vetoed by the others)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = r'''
import json, sys
from pathlib import Path
import torch.distributed as dist
import clip_mini.train.prepare as prepare
from clip_mini.config import load_config
from clip_mini.train import train
from clip_mini.train.budget import Budget

rank, out, overrides = int(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
if rank == 1:   # this rank's disk has no room for the image cache: it decides on no cache alone
    prepare.make_image_cache = lambda *a, **k: None
if rank == 0:   # rank 0 finds the run late once, after step 12 (it alone times evaluations and saves)
    plain = Budget.off_course
    Budget.off_course = lambda self, step, total: step == 12 or plain(self, step, total)
from clip_mini.train.pace import Pace
refits, refit = [], Pace._refit
Pace._refit = lambda self, step, **k: refits.append(step) or refit(self, step, **k)
result = train(load_config(None, overrides))
(out / f"rank{rank}.json").write_text(json.dumps({"step": result["step"], "budget": result["budget"],
                                                  "refits": refits}))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_gloo_ranks_agree_on_the_cache_and_on_a_refit_one_rank_asks_for(tmp_path):
    from clip_mini.data import generate
    from test_train_budget import TINY

    shapes = generate(tmp_path / "shapes", n=400, seed=0, size=32)
    # 15 s (was 40): what is tested happens by step 12 (the fit at 10, the re-fit rank 0 asks for at 12), which a
    # budget of seconds reaches many times over; the run's length is not checked
    overrides = TINY + [f"data.captions={shapes / 'captions.csv'}", f"data.cache_dir={tmp_path / 'cache'}",
                        f"train.out_dir={tmp_path / 'run'}", "train.budget=15s", "train.warmup_steps=10",
                        "train.batch_size=16", "train.device=cpu"]
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(tmp_path), json.dumps(overrides)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]   # a hang (ranks disagreeing) ends here
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["step"] == ranks[1]["step"] == ranks[0]["budget"]["total"]
    assert ranks[0]["refits"] == ranks[1]["refits"] and 12 in ranks[1]["refits"]   # rank 1 too, though only rank 0
    # was late; each rank's own fit differs by its step times, the plan they ran is the smallest: the same total
    assert ranks[0]["budget"]["total"] == ranks[1]["budget"]["total"]
