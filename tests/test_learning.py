"""The loop learns: from a random model on a trivially learnable reward, every main objective
goes from chance to above 0.9 in a few seconds; rewards and advantages stay attached to their rows."""

from __future__ import annotations

import json

import pytest
import torch

from driftless.objectives import group_advantages, shape_rewards
from driftless.rollout import Sampler, SamplingParams
from driftless.tasks import CharTokenizer
from driftless.train import load_config, train
from driftless.train.loop import Run

SMALL_RUN = ["model.warm_start=false", "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1",
             "model.d_ff=128", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=8",
             "rollout.group_size=8", "rollout.max_new_tokens=2", "train.steps=30", "train.eval_every=30",
             "train.eval_problems=64", "train.checkpoint_every=1000", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2",
             "objective.reward_mode=±1", "objective.advantage=group-mean"]


@pytest.mark.parametrize("objective", ["pg", "tis", "sc", "ppo+tis", "reinforce-zero"])
def test_the_loop_learns_a_trivial_reward_from_scratch(tmp_path, objective):
    cfg = load_config(None, [*SMALL_RUN, f"objective.name={objective}"])
    run_dir = train(cfg, tmp_path / objective, progress=False)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    initial = json.loads((run_dir / "initial_eval.json").read_text())["eval_reward"]
    chance = 1 / 64
    assert initial < 0.1  # a random model is at chance
    assert sum(m["reward"] for m in lines[:3]) / 3 < 0.15
    assert sum(m["reward"] for m in lines[-5:]) / 5 > 0.9, [round(m["reward"], 2) for m in lines]
    assert lines[-1]["eval_reward"] > 0.9 > 10 * chance


def test_the_loop_does_not_learn_with_the_rewards_of_other_rows(tmp_path, monkeypatch):
    """Negative control: shuffling rewards across rows (a row-alignment bug) leaves it at chance."""
    real = shape_rewards

    def shuffled(success, group, mode):
        perm = torch.randperm(len(success), generator=torch.Generator().manual_seed(len(success)))
        return real(success[perm], group, mode)
    monkeypatch.setattr("driftless.rollout.worker.shape_rewards", shuffled)
    cfg = load_config(None, [*SMALL_RUN, "objective.name=pg"])
    lines = [json.loads(line) for line in (train(cfg, tmp_path / "shuffled", progress=False) / "metrics.jsonl")
             .read_text().splitlines()]
    assert sum(m["reward"] for m in lines[-5:]) / 5 < 0.5


def test_rewards_and_advantages_follow_their_rows_when_rows_finish_out_of_order():
    """Rows end at different steps (EOS at different lengths); each row's reward is its own."""
    tok = CharTokenizer()

    class EndsAfterOwnLength(torch.nn.Module):
        """Row r of the prompt says how many tokens to emit before EOS, via its last prompt token."""
        vocab_size, max_seq_len = 64, 32

        def new_cache(self, b):
            return {"last": None}

        def _next(self, last):
            logits = torch.full((last.shape[0], 64), -30.0)
            n = (last - tok.stoi["0"]).clamp(min=0)  # a digit d: emit '7' d times then EOS
            logits[:, tok.stoi["7"]] = 0.0
            return logits, n

        def prefill(self, tokens, lengths, cache):
            last = tokens[torch.arange(tokens.shape[0]), lengths - 1]
            cache["budget"] = (last - tok.stoi["0"]).clamp(min=0)
            cache["emitted"] = torch.zeros_like(last)
            return self._logits(cache).unsqueeze(1).expand(-1, tokens.shape[1], -1)

        def _logits(self, cache):
            logits = torch.full((cache["budget"].shape[0], 64), -30.0)
            done = cache["emitted"] >= cache["budget"]
            logits[:, tok.stoi["7"]] = torch.where(done, -30.0, 0.0)
            logits[:, tok.eos_id] = torch.where(done, 0.0, -30.0)
            return logits

        def decode(self, tokens, positions, cache):
            cache["emitted"] = cache["emitted"] + 1
            return self._logits(cache)

    sampler = Sampler(EndsAfterOwnLength(), head_k=0, eos_id=tok.eos_id, pad_id=tok.pad_id)
    sampler.version = 0
    digits = [5, 0, 3, 1, 4, 2]
    prompts = [tok.encode(f"1+{d}") for d in digits]
    batch = sampler.generate(prompts, SamplingParams(greedy=True), 10, seed=0, group=[0, 0, 0, 1, 1, 1])
    completions = [tok.decode(c) for c in batch.completions()]
    assert completions == ["7" * d for d in digits]  # rows finished at different steps, none mixed up
    # reward: 1 iff the completion has an odd length; the advantage of each row follows it
    success = torch.tensor([float(len(c) % 2) for c in completions])
    reward = shape_rewards(success, batch.group, "±1")
    adv = group_advantages(reward, batch.group, "group-mean")
    assert reward.tolist() == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    assert torch.allclose(adv.double(), torch.tensor([2 / 3, -4 / 3, 2 / 3, 4 / 3, -2 / 3, -2 / 3], dtype=torch.float64))
    assert batch.action_mask.sum(1).tolist() == [d + 1 for d in digits]  # the EOS is an action too


def test_run_step_scores_each_row_with_its_own_problem(tmp_path, monkeypatch):
    """Inside Run.step: problems are repeated group_size times and scored in row order."""
    cfg = load_config(None, [*SMALL_RUN, "objective.name=pg", "rollout.prompts_per_step=3", "rollout.group_size=2"])
    run = Run(cfg, tmp_path / "r", progress=False)
    seen = []
    real_score = run.source.worker.task.score

    def spy(problem, completion):
        seen.append(problem.text)
        return real_score(problem, completion)
    monkeypatch.setattr(run.source.worker.task, "score", spy)
    run.step()
    assert len(seen) == 6 and seen[0] == seen[1] and seen[2] == seen[3] and seen[4] == seen[5]
    assert len(set(seen)) == 3
