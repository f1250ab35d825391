"""driftless's objectives inside TRL's GRPO trainer (``pip install 'driftless[trl]'``; tested with TRL 1.16.0).

    from driftless.integrations.trl import DriftlessGRPOConfig, DriftlessGRPOTrainer

    args = DriftlessGRPOConfig(output_dir="out", objective="sc+tis", objective_params={"top_k": 32}, head_k=32, ...)
    trainer = DriftlessGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)
    trainer.train()

The three lines that change in a TRL script: the two imports and ``objective=`` (any driftless preset,
``driftless.objectives.PRESETS``, with its parameters).

**The sampler's side**, with vLLM (``use_vllm=True``, colocate or server): the engine is asked for the
top-``head_k`` log-probs of every generated token (TRL asks for none beyond the sampled token's) under
``processed_logprobs`` (after temperature, top-k and top-p: TRL's colocated engine sets it, a server is
checked); the sampled token's log q is read by its id (the engine lists the head by rank, the sampled
token last when it falls outside), the head carried next to TRL's ``sampling_per_token_logps``. A
colocated engine returns at most 20 (vLLM's default ``max_logprobs``, which TRL does not raise): a
larger ``head_k`` is refused there. With generation by transformers (``use_vllm=False``) the generation is asked for
its processed scores (``output_scores``: the logits after the sampling transform actually applied,
temperature then top-k then top-p), and log q of each generated token and the top-``head_k`` head
(ids and log q) are read from those, under that very transform. The sampled tokens are never
re-scored by the trainer and called q. With ``sampler_view`` (a driftless mismatch view such as
``"noise:0.05"`` or ``"w8a8"``) generation runs on a copy of the model carrying that view, synced
from the trainer before every generation: a mismatch injected on purpose, to measure it and its
corrections inside TRL.

**The trainer's side**: ``_compute_loss`` runs the model's own forward, takes log p at the sampled
tokens and at the head ids under the same transform (driftless's memory-bounded extraction when the
transform is a temperature only), and applies the objective, its reduction normalized over TRL's whole
generation batch across processes and gradient-accumulation steps (tokens, responses and rows counted
once per generation: ``Totals``). TRL's own vLLM importance-sampling correction is off (nothing is
applied twice). The objective's metrics (ratio tails, KL, ESS, head masses, masked and truncated
fractions) are logged under ``driftless/``.

Not supported (refused by name at construction): ``sampler_view`` with ``use_vllm=True``, ``beta != 0`` (use the preset's ``ref_kl_beta``),
``repetition_penalty`` / ``min_p`` (a transform the trainer does not reproduce), and any TRL version
outside the tested one.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from driftless.objectives import make
from driftless.objectives.reductions import Totals
from driftless.ops.logprobs import extract_logprobs
from driftless.rollout.sampling import SamplingParams, entropy_from_logprobs, sampling_logprobs

TESTED_TRL = ("1.16.",)  # the TRL releases this module was tested against
VLLM_MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the head a colocated engine (built by TRL) can return


def _trl():
    try:
        import trl
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("the TRL integration needs the 'trl' extra: pip install 'driftless[trl]'") from err
    if not trl.__version__.startswith(TESTED_TRL):
        raise ImportError(f"driftless.integrations.trl is tested with TRL {', '.join(v + '*' for v in TESTED_TRL)}; "
                          f"found {trl.__version__}")
    return trl


_trl_module = _trl()
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import pad


@dataclass
class DriftlessGRPOConfig(GRPOConfig):
    objective: str = field(default="sc+tis", metadata={"help": "a driftless objective preset (docs/objectives.md)"})
    objective_params: dict = field(default_factory=dict, metadata={"help": "the preset's parameters"})
    head_k: int = field(default=32, metadata={"help": "top-k head of q recorded per generated token"})
    sampler_view: str = field(default="none", metadata={"help": "a driftless mismatch view on the generating copy"})


# TRL settings of its own loss that the driftless objective replaces: refused unless left at TRL's default
_TRL_LOSS_SETTINGS = ("loss_type", "epsilon", "epsilon_high", "delta", "top_entropy_quantile", "entropy_coef",
                      "off_policy_mask_threshold", "importance_sampling_level", "use_liger_kernel")


class DriftlessGRPOTrainer(GRPOTrainer):
    def __init__(self, *args, **kwargs):
        config = kwargs.get("args")
        if not isinstance(config, DriftlessGRPOConfig):
            raise ValueError("DriftlessGRPOTrainer needs args=DriftlessGRPOConfig(...) (objective, head_k)")
        for name in ("tools", "environment_factory", "rollout_func"):
            if kwargs.get(name) is not None:
                raise ValueError(f"DriftlessGRPOTrainer: {name}= is not supported yet (multi-turn tool calls regenerate "
                                 "rows and mask tool tokens; the recorded head would not follow them)")
        fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
        for name in _TRL_LOSS_SETTINGS:
            f = fields.get(name)
            if f is not None and f.default is not dataclasses.MISSING and getattr(config, name) != f.default:
                raise ValueError(f"DriftlessGRPOTrainer: {name}={getattr(config, name)!r} configures TRL's own loss, "
                                 f"which the driftless objective replaces; set the objective's parameters instead")
        if config.generation_kwargs:
            raise ValueError(f"DriftlessGRPOTrainer: generation_kwargs={config.generation_kwargs!r} may change q "
                             "beyond temperature / top-k / top-p, which the trainer would not reproduce; refused")
        objective = make(config.objective, **(config.objective_params or {}))  # unknown presets refused here
        if config.use_vllm and config.sampler_view != "none":
            raise ValueError(f"DriftlessGRPOTrainer: sampler_view={config.sampler_view!r} acts on a transformers copy "
                             "of the model; with use_vllm=True the engine holds TRL's synced weights: use "
                             "use_vllm=False to inject a view")
        if config.use_vllm and config.vllm_mode == "colocate" and config.head_k > VLLM_MAX_LOGPROBS:
            raise ValueError(f"DriftlessGRPOTrainer: head_k={config.head_k} exceeds the {VLLM_MAX_LOGPROBS} log-probs a "
                             "token TRL's colocated vLLM engine returns (vLLM's max_logprobs, which TRL leaves at its "
                             f"default): use head_k <= {VLLM_MAX_LOGPROBS}, or vllm_mode='server' with "
                             "--max-logprobs raised")
        if config.beta != 0:
            raise ValueError(f"DriftlessGRPOTrainer: beta={config.beta} is TRL's reference KL, which the driftless "
                             "loss does not apply; use objective_params={'ref_kl_beta': ...}")
        if (config.repetition_penalty or 1.0) != 1.0 or config.min_p is not None:
            raise ValueError("DriftlessGRPOTrainer: repetition_penalty / min_p change q in a way the trainer's log p "
                             "does not reproduce; refused")
        if config.head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {config.head_k}")
        truncated = bool(config.top_k) or (config.top_p is not None and config.top_p < 1.0)
        if truncated and (config.num_iterations > 1 or (config.steps_per_generation or 1)
                          != config.gradient_accumulation_steps):
            raise ValueError("DriftlessGRPOTrainer: top_k / top_p with a reused generation (num_iterations > 1 or "
                             "steps_per_generation != gradient_accumulation_steps): TRL computes the anchor π0 under "
                             "temperature only, not the transform; refused")
        top_k, needs_full = objective.head_spec
        if objective.needs_head and (config.head_k == 0 or (top_k is not None and top_k > config.head_k)):
            raise ValueError(f"objective {config.objective!r} reads {top_k or 'all'} head ids but head_k="
                             f"{config.head_k}")
        config.vllm_importance_sampling_correction = False  # driftless's objective is the correction
        super().__init__(*args, **kwargs)
        vocab = int(self.model.config.vocab_size)
        if config.head_k > vocab:
            raise ValueError(f"head_k={config.head_k} is larger than the vocabulary ({vocab})")
        if needs_full and config.head_k < vocab:
            raise ValueError(f"objective {config.objective!r} centers over all of q's support: it needs head_k = the "
                             f"vocabulary ({vocab}), got {config.head_k}; or give objective_params={{'top_k': k}}")
        if self.use_vllm:
            self._check_engine(config)
        self.objective = objective
        self.sampling = SamplingParams(temperature=config.temperature, top_k=config.top_k or 0,
                                       top_p=config.top_p if config.top_p is not None else 1.0)
        self._pending_head: list | None = None
        self._sampler_model = None
        if config.sampler_view != "none":
            from driftless.mismatch import parse_view

            self._view = parse_view(config.sampler_view)
        else:
            self._view = None

    # ------------------------------------------------------------------ the sampler's side
    def _generating_model(self, unwrapped):
        if self._view is None:
            return unwrapped
        if self._sampler_model is None:  # built from the config: TRL patches the trainer model's forward in place
            from transformers import AutoModelForCausalLM

            self._sampler_model = AutoModelForCausalLM.from_config(copy.deepcopy(unwrapped.config)).to(
                device=unwrapped.device, dtype=next(unwrapped.parameters()).dtype)
            self._sampler_model.generation_config = copy.deepcopy(unwrapped.generation_config)
        with torch.no_grad():
            self._sampler_model.load_state_dict(unwrapped.state_dict())
            self._view.apply(self._sampler_model)
        self._sampler_model.eval()
        return self._sampler_model

    def _check_engine(self, config) -> None:
        """The vLLM engine returns q under the transform applied, with the head: asked for ``head_k`` log-probs a
        token (TRL asks for none beyond the sampled token's); a server is checked for both."""
        generation = self.vllm_generation
        if config.vllm_mode == "server" and self.accelerator.is_main_process:
            info = generation.vllm_client.get_server_info()["model_config"]
            if info.get("logprobs_mode") != "processed_logprobs":
                raise ValueError(f"the vLLM server runs with --logprobs-mode {info.get('logprobs_mode')}: its log q "
                                 "is not the sampled distribution's; restart it with --logprobs-mode processed_logprobs")
            cap = info.get("max_logprobs")
            if cap is not None and config.head_k > cap:
                raise ValueError(f"head_k={config.head_k} exceeds the vLLM server's --max-logprobs {cap}")
        generation.logprobs = config.head_k

    def _sync_engine_weights(self) -> None:
        """Push the trainer's weights to the engine. TRL's colocated sync calls the engine model's ``load_weights``,
        which works only while every layer still holds the parameter it was built with. vLLM's CPU backend replaces
        each linear layer's weight with a packed copy once loaded (oneDNN or its small-GEMM kernel, chosen by the
        CPU's instruction sets: on an AVX-512/AMX Xeon the first sync fails with "'Parameter' object has no
        attribute 'weight_loader'"), so there the weights go through vLLM's in-place reload (``reload_weights``,
        which restores each layer, loads and packs it again), as driftless's own vLLM sampler does."""
        generation = self.vllm_generation
        from vllm.platforms import current_platform

        if generation.mode != "colocate" or not current_platform.is_cpu():
            generation.sync_weights()
            return
        generation.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": generation._iter_named_params(), "is_checkpoint_format": True})
        generation.llm.reset_prefix_cache()

    def _generate_with_vllm(self, prompt_ids, num_generations):
        """TRL's vLLM generation, reading the sampled token's log q and the top-``head_k`` head from what the
        engine returns per token (the head plus the sampled token when it falls outside: sorted by rank, so the
        first entry is the most probable token, not necessarily the sampled one)."""
        from trl.extras.profiling import profiling_context

        if self.state.global_step != self._last_loaded_step:
            with profiling_context(self, "sync_weights"):
                self._sync_engine_weights()
            self._last_loaded_step = self.state.global_step
        _, completion_ids, logprobs, token_ids = self.vllm_generation.generate(
            prompts=prompt_ids, images=None, num_generations=num_generations,
            profiler=profiling_context(self, "vLLM.generate"))
        k, heads, sampled = self.args.head_k, [], []
        for row, (ids, lps, toks) in enumerate(zip(completion_ids, logprobs, token_ids)):
            row_logq, row_ids, row_head = [], [], []
            for t, token in enumerate(ids):
                entries = {tok: (float("nan") if lp is None else lp) for tok, lp in zip(toks[t], lps[t])}
                if token not in entries:
                    raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token} (row {row}, "
                                       f"position {t})")
                row_logq.append(entries[token])
                ranked = sorted(entries.items(), key=lambda e: -e[1])[:k]
                if len(ranked) < k:
                    raise RuntimeError(f"vLLM returned {len(ranked)} head entries for row {row}, position {t}; "
                                       f"head_k={k} were asked for")
                row_ids.append([tok for tok, _ in ranked])
                row_head.append([lp for _, lp in ranked])
            sampled.append(row_logq)
            heads.append((torch.tensor(row_ids, dtype=torch.long).reshape(len(ids), k),
                          torch.tensor(row_head, dtype=torch.float32).reshape(len(ids), k)))
        self._pending_head = heads if k else None
        return [list(ids) for ids in completion_ids], sampled

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if getattr(self, "use_transformers_continuous_batching", False) or multimodal_fields or images:
            raise ValueError("DriftlessGRPOTrainer records q from transformers or vLLM generation of text only")
        if self.use_vllm:
            return self._generate_with_vllm(prompt_ids, num_generations)
        from trl.models import unwrap_model_for_generation

        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        attention = pad([torch.ones_like(t) for t in prompts], padding_value=0, padding_side="left").to(device)
        with (unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                          gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                          generation_kwargs=self.generation_kwargs,
                                          gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
              as unwrapped, torch.no_grad(), self._dist.summon_full_params(self.model_wrapped, recurse=False)):
            out = self._generating_model(unwrapped).generate(
                input_ids=input_ids, attention_mask=attention, generation_config=self.generation_config,
                return_dict_in_generate=True, output_scores=True)
        completion = out.sequences[:, input_ids.shape[1]:]  # [B, T]
        logq = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # q under the transform applied: [B, T, V]
        token_logq = logq.gather(-1, completion[..., None]).squeeze(-1)
        k = min(self.args.head_k, logq.shape[-1])
        head = logq.topk(k, dim=-1) if k else None
        is_eos = torch.isin(completion, torch.tensor(self.eos_token_ids, device=device))
        full = torch.full_like(completion[:, 0], completion.shape[1])
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, full)
        ids = [c[:n].tolist() for c, n in zip(completion.cpu(), lengths.cpu())]
        logprobs = [lq[:n].tolist() for lq, n in zip(token_logq.cpu(), lengths.cpu())]
        self._pending_head = None if head is None else [(head.indices[i, :n], head.values[i, :n])
                                                        for i, n in enumerate(lengths.tolist())]
        return ids, logprobs

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mask = out["completion_mask"].bool()
        t = out["completion_ids"].shape[1]
        if self._pending_head is not None:
            def padded(index, fill):
                return torch.stack([torch.nn.functional.pad(h[index], (0, 0, 0, t - h[index].shape[0]), value=fill)
                                    for h in self._pending_head])
            out["sampler_topk_ids"], out["sampler_topk_logp"] = padded(0, 0), padded(1, 0.0)
            self._pending_head = None
        # the whole generation batch's denominators, across processes (0-d tensors pass TRL's buffering as is)
        counts = torch.tensor([float(mask.sum()), float(mask.any(1).sum()), float(mask.shape[0])],
                              device=mask.device)
        totals = self.accelerator.gather(counts[None]).sum(0)
        for i, name in enumerate(("tokens", "responses", "rows")):
            out[f"driftless_{name}"] = totals[i]
        return out

    # ------------------------------------------------------------------ the trainer's side
    def _trainer_view(self, model, inputs):
        prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
        ids = torch.cat([prompt, completion], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        t = completion.shape[1]
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -t - 1:-1]  # position j scores token j
        head_ids = inputs.get("sampler_topk_ids")
        s = self.sampling
        if s.top_k == 0 and s.top_p == 1.0:
            scaled = logits if s.temperature == 1.0 else logits / s.temperature
            return extract_logprobs(scaled, completion, head_ids)
        logp_all = sampling_logprobs(logits.float(), s)
        from driftless.ops.logprobs import TokenLogprobs

        return TokenLogprobs(logp=logp_all.gather(-1, completion[..., None]).squeeze(-1),
                             head_logp=None if head_ids is None else logp_all.gather(-1, head_ids),
                             entropy=entropy_from_logprobs(logp_all))

    def _totals(self, inputs, mode: str) -> Totals:
        """This optimizer step's share of the generation batch's denominators (exact when
        steps_per_generation equals gradient_accumulation_steps, TRL's default), divided by the processes:
        data parallelism averages their gradients, so each process's loss is P times its share."""
        tokens, responses, rows = (float(inputs[f"driftless_{n}"]) for n in ("tokens", "responses", "rows"))
        share = 1.0
        if mode == "train":
            share = self.current_gradient_accumulation_steps / self.args.steps_per_generation
        procs = self.accelerator.num_processes
        return Totals(tokens * share / procs, responses * share / procs, rows * share / procs,
                      self.args.max_completion_length)

    def driftless_batch(self, inputs) -> dict:
        """The objective's batch fields from TRL's inputs (what the loss reads; public for tests)."""
        mask = inputs["completion_mask"].bool()
        if "sampling_per_token_logps" not in inputs:
            raise ValueError("the batch has no sampler log-probs (sampling_per_token_logps): the objective needs q")
        batch = {"sampler_logp": torch.where(mask, inputs["sampling_per_token_logps"], 0.0), "action_mask": mask,
                 "advantage": inputs["advantages"]}
        if inputs.get("old_per_token_logps") is not None:
            batch["anchor_logp"] = torch.where(mask, inputs["old_per_token_logps"], 0.0)
        if "sampler_topk_logp" in inputs:
            batch["sampler_topk_logp"] = inputs["sampler_topk_logp"]
        return batch

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        view = self._trainer_view(model, inputs)
        batch = self.driftless_batch(inputs)
        loss, metrics = self.objective(view, batch, totals=self._totals(inputs, mode))
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                self._metrics[mode][f"driftless/{name}"].append(float(value))
        return loss
