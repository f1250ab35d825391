"""A checkpoint shaped like the real ones (SmolLM2-135M-Instruct): tied input / output embeddings, a chat template
with a default system prompt, the pad token equal to the end token. Saved, verified, resumed, published to the
sampler and through a view; and the memory-bounded scorer (output layer on the response positions only) against
the full-logits one."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_until_killed

pytest.importorskip("transformers")

from driftless.models.hf import HFPolicy
from driftless.models.io import aliases, clone_state, load_weights, save_weights
from driftless.recipes.make_model import make_model
from driftless.rollout import Snapshot
from driftless.rollout.scoring import score_batch
from driftless.tasks import Countdown, CountdownConfig
from driftless.tasks.export import task_rows, write_jsonl
from driftless.train import Run, load_config
from driftless.train.checkpoint import latest_checkpoint, load_checkpoint, verify
from driftless.train.loop import TIMING_KEYS

SYSTEM = "You are a helpful AI assistant named Stand-in"
# SmolLM2's template, its default system prompt renamed
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    task = Countdown(CountdownConfig(2, 1, 12, 100))
    train, held = task_rows(task, "train", draws=2000), task_rows(task, "eval", draws=2000)
    write_jsonl(train, root / "data/train.jsonl")
    write_jsonl(held, root / "data/eval.jsonl")
    make_model(root / "model", rows_train=train, rows_eval=held, vocab_size=300, hidden=32, layers=1, heads=2,
               kv_heads=1, intermediate=64, max_positions=96, sft_steps=20, sft_batch=16, tie_embeddings=True,
               progress=False)
    config = json.loads((root / "model/config.json").read_text())
    assert config["tie_word_embeddings"] is True
    tok_config = json.loads((root / "model/tokenizer_config.json").read_text())
    tok_config["pad_token"] = "<|im_end|>"  # as SmolLM2: pad = eos
    (root / "model/tokenizer_config.json").write_text(json.dumps(tok_config))
    (root / "model/chat_template.jinja").write_text(TEMPLATE)
    return root


def cfg(root, *extra):
    return load_config(None, [
        "model.kind=hf", f"model.hf_path={root}/model", "model.max_seq_len=96", "task.name=dataset",
        f"task.path={root}/data/train.jsonl", f"task.eval_path={root}/data/eval.jsonl", "task.reward=countdown",
        "rollout.prompts_per_step=3", "rollout.group_size=4", "rollout.max_new_tokens=10", "rollout.head_k=8",
        "train.eval_problems=6", "train.progress=false", "train.steps=3", "train.eval_every=3",
        "train.checkpoint_every=1", "optim.lr=1e-2", *extra])


def tied_names(policy) -> bool:
    model = policy.model
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_tied_weights_save_once_and_come_back_tied(tied, tmp_path):
    policy = HFPolicy(tied / "model")
    state = policy.state_dict()
    assert aliases(state) == {"model.lm_head.weight": "model.model.embed_tokens.weight"}
    save_weights(state, tmp_path / "w.safetensors")
    loaded = load_weights(tmp_path / "w.safetensors")
    assert loaded["model.lm_head.weight"] is loaded["model.model.embed_tokens.weight"]
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    copy = clone_state(state)  # one copy per shared tensor
    assert copy["model.lm_head.weight"] is copy["model.model.embed_tokens.weight"]
    other = HFPolicy(tied / "model")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(loaded)  # strict: both names filled
    assert tied_names(other) and all(torch.equal(a, b) for a, b in zip(other.parameters(), policy.parameters()))


def test_a_tied_run_checkpoints_resumes_exactly_and_publishes_tied(tied, tmp_path):
    config = cfg(tied, "objective.name=sc+tis", "objective.params={top_k: 8}", "mismatch.view=noise:0.05")
    Run(config, tmp_path / "a").run()
    run_until_killed(Run(config, tmp_path / "b"), 2)  # after the checkpoint of step 2 (1-based: steps 0, 1 done)
    resumed = Run(config, tmp_path / "b")
    resumed.run(resume=True)
    a, b = ([{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
             for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab")
    assert a == b and len(a) == 3 and a[-1]["version"] == 3
    ckpt = latest_checkpoint(tmp_path / "b")
    state = verify(ckpt)
    assert state["step"] == 3
    saved = load_checkpoint(ckpt)
    assert saved["model"]["model.lm_head.weight"] is saved["model"]["model.model.embed_tokens.weight"]
    learner = resumed.learner.policy
    assert tied_names(learner)
    assert all(torch.equal(saved["model"][k], v) for k, v in learner.state_dict().items())
    sampler = resumed.source.worker.sampler.policy  # the sampler's copy: tied, and the view's noise on the one matrix
    assert tied_names(sampler)
    embed = "model.model.embed_tokens.weight"
    assert not torch.equal(sampler.state_dict()[embed], learner.state_dict()[embed])  # noise 0.05 applied
    published = resumed.learner.publish()
    assert published.state["model.lm_head.weight"] is published.state[embed]


def test_the_default_system_prompt_reaches_the_model_and_pad_is_eos(tied, tmp_path):
    run = Run(cfg(tied), tmp_path / "run")
    assert run.text.pad_id == run.text.eos_ids[0]
    run.source.worker.load(run.learner.publish())
    batch, _ = run.source.worker.produce(0)
    prompt = run.text.show(batch.prompts()[0])
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("temperature,shared_prompts", [(1.0, False), (0.7, False), (1.0, True)])
def test_scoring_the_response_positions_only_equals_the_full_logits(tied, tmp_path, temperature, shared_prompts):
    """In float64 the response-positions path gives the full logits' values to 1e-10 and their gradients to 1e-7
    relative. With each group's prompt run once (``HFPolicy.action_hidden_states``) the values are as exact; the
    gradients agree to 1e-5 relative: transformers' RMSNorm computes in float32 whatever the model's dtype, and the
    prompt's keys and values gather their gradients from the group's rows in another order."""
    run = Run(cfg(tied, f"rollout.temperature={temperature}"), tmp_path / "run")
    run.source.worker.load(Snapshot.of(run.learner.policy, 0))
    batch, _ = run.source.worker.produce(0)
    policy = run.learner.policy.double()
    assert policy.output_weight is not None
    rows, cols = batch.action_mask[:, 1:].nonzero(as_tuple=True)
    if shared_prompts:  # 3 prompts x 4 samples: the path runs 3 prompts, not 12
        assert policy.action_hidden_states(batch.tokens, batch.prompt_len, rows, cols) is not None
    else:
        policy.action_hidden_states = lambda *args: None  # every row's whole sequence
    fused = score_batch(policy, batch, head_k=8)

    class Full(torch.nn.Module):  # the same model without output_weight: the full [B, L, V] logits path
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.vocab_size, self.max_seq_len = inner.vocab_size, inner.max_seq_len

        def forward(self, tokens):
            return self.inner.model(input_ids=tokens.long(), use_cache=False).logits

    full = score_batch(Full(policy), batch, head_k=8)
    mask = batch.action_mask
    for name in ("logp", "entropy"):
        assert torch.allclose(getattr(fused, name)[mask], getattr(full, name)[mask], atol=1e-10, rtol=0)
        assert torch.equal(getattr(fused, name)[~mask], torch.zeros_like(getattr(fused, name)[~mask]))
    assert torch.allclose(fused.head_logp[mask], full.head_logp[mask], atol=1e-10, rtol=0)
    weights = torch.randn(mask.shape, dtype=torch.float64) * mask
    grads = []
    for view in (fused, full):
        policy.zero_grad()
        ((view.logp * weights).sum() + (view.entropy * weights).sum() + view.head_logp[mask].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    rtol = 1e-5 if shared_prompts else 1e-7
    for n in grads[0]:
        scale = float(grads[1][n].abs().max())
        atol = 1e-9 + (1e-6 * scale if shared_prompts else 0.0)
        assert torch.allclose(grads[0][n], grads[1][n], atol=atol, rtol=rtol), n
