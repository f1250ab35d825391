"""Does Ray's object store stay flat over hundreds of updates? Prints JSON.

    .venv/bin/python bench/ray_store.py                       # 300 updates, η = 1, learner in an actor
    .venv/bin/python bench/ray_store.py --steps 500 --learner local

Runs ``rollout.runtime=ray`` on the first-token task with TinyLM's default sizes (1.6 M
parameters: a 6.4 MB snapshot, well above Ray's inline limit, so every snapshot lives in the
plasma store) and reads the store's own accounting (``memory_summary``: MiB and object count)
after every publish. The driver keeps η + 2 snapshot references; Ray frees an unreferenced object
asynchronously, so the count read right after a publish can include a few not yet reclaimed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--learner", choices=("local", "ray"), default="ray")
    args = ap.parse_args()

    import ray

    from driftless.train import Run, load_config
    from driftless.train.sources.ray import object_store_usage

    config = load_config(None, [
        "model.warm_start=false", "task.name=first-token", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=2", f"train.steps={args.steps}", f"train.eval_every={args.steps}",
        "train.eval_problems=16", f"train.checkpoint_every={args.steps}", "optim.name=adamw", "optim.lr=1e-3",
        "optim.schedule=constant", "train.progress=false", "rollout.runtime=ray", "rollout.ray_num_cpus=2",
        f"rollout.staleness_bound={args.eta}", f"train.learner_runtime={args.learner}"])
    samples: list[tuple[int, int, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(config, tmp)
        publish = run.source.published

        def measured():
            publish()
            samples.append((run.learner.version, *object_store_usage(ray)))
        run.source.published = measured
        t0 = time.perf_counter()
        run.run()
        wall = time.perf_counter() - t0
    time.sleep(2.0)
    after = object_store_usage(ray)
    mib = [s[1] for s in samples]
    objects = [s[2] for s in samples]
    tenth = max(1, len(samples) // 10)
    print(json.dumps({
        "updates": len(samples), "staleness_bound": args.eta, "learner": args.learner,
        "references_kept": args.eta + 2, "wall_s": wall,
        "store_mib_first_tenth_median": statistics.median(mib[:tenth]),
        "store_mib_last_tenth_median": statistics.median(mib[-tenth:]),
        "store_mib_max": max(mib), "store_objects_max": max(objects),
        "store_objects_median": statistics.median(objects),
        "store_mib_every_50": [s[1] for s in samples[::50]],
        "store_after_close_mib_objects": list(after),
    }, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
