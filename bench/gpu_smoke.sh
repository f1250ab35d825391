#!/usr/bin/env bash
# The scaled learner on a GPU machine (not in CI; docs/scale.md): a locally built Qwen3 checkpoint and data file,
# then a few steps of model.kind=hf with train.device=cuda, train.precision=bf16 and train.parallel=fsdp over the
# visible GPUs (at least 2 for fsdp; with one GPU it runs device=cuda + bf16 on one rank), a resume from the
# sharded checkpoint, and what it checked. Nothing is downloaded: the model is built from a config.
#
#     bash bench/gpu_smoke.sh            # from the repository root, after `make install`
set -euo pipefail
PY=${PY:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
OUT=${OUT:-runs/gpu-smoke}
rm -rf "$OUT"
mkdir -p "$OUT"
GPUS=$($PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.device_count())")
echo "CUDA devices: $GPUS ($($PY -c 'import torch; print(torch.cuda.get_device_name(0))'))"
$PY -m driftless export-task "$OUT/data" >/dev/null
$PY -m driftless make-model "$OUT/model" --data "$OUT/data/train.jsonl" --eval-data "$OUT/data/eval.jsonl" >/dev/null
COMMON=(configs/hf.yaml "model.hf_path=$OUT/model" "task.path=$OUT/data/train.jsonl"
        "task.eval_path=$OUT/data/eval.jsonl" train.device=cuda train.precision=bf16 model.execution=fast
        train.micro_batch_tokens=2048 train.eval_every=2 train.checkpoint_every=2 train.progress=false)
if [ "$GPUS" -ge 2 ]; then
  LAUNCH=("$TORCHRUN" --nproc-per-node 2 -m driftless train)
  RANKS=(train.learner_ranks=2 train.parallel=fsdp)
else
  LAUNCH=("$PY" -m driftless train)
  RANKS=()
fi
"${LAUNCH[@]}" "${COMMON[@]}" "${RANKS[@]}" train.steps=2 --run-dir "$OUT/run" --no-progress
"${LAUNCH[@]}" "${COMMON[@]}" "${RANKS[@]}" train.steps=4 --run-dir "$OUT/run" --resume --no-progress
$PY - "$OUT/run" <<'EOF'
import json, math, sys
from pathlib import Path
run = Path(sys.argv[1])
lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
assert [r["step"] for r in lines] == [0, 1, 2, 3], [r["step"] for r in lines]
assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in lines)
dcp = (run / "checkpoints/step_000004/dcp/.metadata").exists()
print(json.dumps({"checked": ["cuda", "bf16", "fsdp 2 ranks" if dcp else "one rank", "resume from step 2",
                              "4 finite steps"], "eval_reward": lines[-1].get("eval_reward"),
                  "kl_k3": [r.get("kl_k3") for r in lines], "sharded_checkpoint": dcp}, indent=2))
EOF
