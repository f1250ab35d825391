"""Peak memory of the own trainer on SmolLM2 (`make real`), by phase; prints JSON (docs/real-model.md).

    .venv/bin/python bench/memory_phases.py train.micro_batch_tokens=256        # peak RSS by phase
    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/memory_phases.py train.micro_batch_tokens=256
    PROFILE=1 .venv/bin/python bench/memory_phases.py train.micro_batch_tokens=128   # + torch.profiler's memory
                                                                                    # timeline of the 2nd update

Two steps of `driftless train configs/smollm2.yaml` (sc+tis, top-32 head, 16 tokens, SGD 0.05), any `a.b=c`
overrides after; a thread samples the resident set every 3 ms and keeps each phase's peak (rollout, update, its
backward, publish). With PROFILE=1 the second update runs under torch.profiler (slow) and the tensor bytes at its
peak are printed by category (parameter, gradient, activation, autograd_detail, ...).
"""
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
phase = ["start"]; peaks = {}
def rss():
    with open("/proc/self/statm") as f: return int(f.read().split()[1]) * PAGE
stop = False
def watch():
    while not stop:
        r = rss(); p = phase[-1]
        peaks[p] = max(peaks.get(p, 0), r)
        time.sleep(0.003)
threading.Thread(target=watch, daemon=True).start()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        phase.append(label)
        try: return f(*a, **k)
        finally: phase.pop()
    setattr(obj, name, g)
from driftless.train import learner as L

_upd = L.Learner.update
ncall = [0]
def update(self, *a, **k):
    ncall[0] += 1
    if ncall[0] != 2 or not os.environ.get("PROFILE"):
        return _upd(self, *a, **k)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        out = _upd(self, *a, **k)
    path = os.environ.get("TIMELINE", "runs/memory-timeline.json")
    prof.export_memory_timeline(path, device="cpu")
    import numpy as np
    _, sizes = json.loads(Path(path).read_text())
    S = np.array(sizes); i = int(np.argmax(S.sum(1)))
    names = ["?", "parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail", "none"]
    print(json.dumps({"tensor_peak_gb": round(float(S[i].sum()) / 1e9, 3),
                      "at_peak_gb": {n: round(float(x) / 1e9, 3) for n, x in zip(names, S[i]) if x}}))
    return out
L.Learner.update = update
wrap(L.Learner, "update", "update")
wrap(L.Learner, "publish", "publish")
orig_backward = torch.Tensor.backward
def bw(self, *a, **k):
    phase.append("backward")
    try: return orig_backward(self, *a, **k)
    finally: phase.pop()
torch.Tensor.backward = bw
from driftless.rollout import worker as W

wrap(W.RolloutWorker, "produce", "rollout")

from driftless.cli import main

extra = sys.argv[1:]
M = "runs/models/smollm2-135m-instruct"; D = "runs/data/arithmetic-question"
with tempfile.TemporaryDirectory() as tmp:
    rc = main(["train", "configs/smollm2.yaml", "objective.name=sc+tis", "objective.params={top_k: 32}", "rollout.head_k=32",
               "rollout.ignore_eos=true", "optim.lr=0.05", "train.steps=2", "train.eval_every=3", "train.eval_problems=1",
               "train.eval_samples=0", "train.checkpoint_every=3", *extra, "--run-dir", tmp, "--no-progress"])
stop = True
print(json.dumps({"extra": extra, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "by_phase_gb": {k: round(v / 1e9, 3) for k, v in peaks.items()}}))
