"""Transformers adapter: any local causal-LM directory or a transformers config as a Policy.

    from driftless.models.hf import HFPolicy
    policy = HFPolicy("path/to/local/model")          # never downloads (local_files_only)
    policy = HFPolicy(Qwen3Config(...))               # random init from a config

Scoring is the model's own full forward; sampling goes through its own KV path
(``past_key_values``) with right-padded prompts, a 2-D attention mask with holes for the pad
slots, and explicit per-row ``position_ids``, so the Sampler records the same fields as with TinyLM.
Needs the ``hf`` extra (``pip install driftless[hf]``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn


def _transformers():
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("the transformers adapter needs the 'hf' extra: pip install 'driftless[hf]'") from err
    return transformers


@dataclass
class HFCache:
    past: object = None
    mask: torch.Tensor | None = None
    batch_size: int = 0


class HFPolicy(nn.Module):
    execution = "fast"
    weights_on_state_dict = True  # a sampler view's weight formats act on the state dict (mismatch.views)

    def __init__(self, source, *, dtype=torch.float32, attn_implementation: str = "sdpa",
                 max_seq_len: int | None = None):
        super().__init__()
        tf = _transformers()
        # transformers renamed torch_dtype -> dtype and past_key_values -> cache; support both
        major = int(tf.__version__.split(".")[0])
        dtype_kw = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
        if isinstance(source, tf.PretrainedConfig):
            self.model = tf.AutoModelForCausalLM.from_config(source, attn_implementation=attn_implementation,
                                                             **dtype_kw)
        elif isinstance(source, nn.Module):
            self.model = source
        else:
            self.model = tf.AutoModelForCausalLM.from_pretrained(
                str(source), local_files_only=True, attn_implementation=attn_implementation, **dtype_kw
            )
        self.model.eval()
        context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        if max_seq_len is not None and max_seq_len > context:
            raise ValueError(f"model.max_seq_len={max_seq_len} exceeds the checkpoint's context "
                             f"(max_position_embeddings={context})")
        self._max_seq_len = max_seq_len or context  # sequences are capped here (model.max_seq_len)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps = "logits_to_keep" in params  # transformers >= 4.50: logits at chosen positions only
        self.routes: list | None = None  # when a list, each MoE router's own top-k ids [B, T, k] are appended
        self.replay: torch.Tensor | None = None  # [B, T, layers, k] expert ids to use instead (R3; −1: its own)
        self._routers = self._hook_routers()
        self._shape = None  # (B, T) of the forward running now: the routers see [B·T, D]
        self.checkpointed = False  # train.activation_checkpointing (checkpoint_activations)
        # True when the caller takes gradients with .backward() into .grad, never torch.autograd.grad (the Learner
        # sets it): action_hidden_states then runs the shared prompts' backward after the responses'
        # (_prompt_backward_last), a whole model's gradient less at the peak
        self.prompt_backward_last = False
        self._numerics = None

    # ------------------------------------------------------------------ sampler numerics
    @property
    def numerics(self):
        """The sampler's quantized execution (``ops.numerics.Numerics``) with activation and KV formats only:
        every ``nn.Linear``'s input is fake-quantized per token (the output layer's included, as TinyLM's), and K
        and V are fake-quantized once, when written to the cache (after the rotary embedding, per token and head).
        Weight formats act on the state dict instead (``mismatch.views.QuantView``), once per sync; a trainer's
        forward numerics (``mismatch.trainer_numerics``) are TinyLM's only and refused here by name."""
        return self._numerics

    @numerics.setter
    def numerics(self, value) -> None:
        if value is not None and (value.weight is not None or value.backward is not None or value.native):
            raise ValueError(f"{type(self).__name__}: numerics with weight, backward or native formats ({value}) "
                             "need TinyLM's numerics hook; on a transformers model weight formats act on the state "
                             "dict (the sampler's views) and the trainer runs at full precision "
                             "(mismatch.trainer_numerics=fp)")
        if value is not None and value.act is not None and (self.route_shape is not None or any(
                p.dim() > 2 for p in self.model.parameters())):
            raise ValueError(f"{type(self).__name__}: activation views ({value.act}) quantize nn.Linear inputs, and "
                             "this mixture of experts computes its experts and routers outside nn.Linear; use "
                             "weight-only views, KV views or noise on it")
        self._numerics = value if value is not None and (value.act is not None or value.kv is not None) else None
        act = self._numerics is not None and self._numerics.act is not None
        for module in self.model.modules():
            if not isinstance(module, nn.Linear):
                continue
            mine = module.__dict__.get("forward")
            if isinstance(mine, _QuantizedInput):  # ours: put back what it wrapped
                if mine.instance_forward is None:
                    del module.forward
                else:
                    module.forward = mine.instance_forward
            if act:
                module.forward = _QuantizedInput(module, self._numerics)

    def _new_past(self) -> dict:
        """The cache keyword of a sampler forward: a cache that fake-quantizes K and V as they are written when the
        numerics have a KV format, else none (the model makes its own)."""
        if self._numerics is None or self._numerics.kv is None:
            return {}
        return {self._cache_kw: _quantized_write_cache(self._numerics.kv_write, self.model.config)}

    # ------------------------------------------------------------------ mixture of experts
    def _hook_routers(self) -> list:
        """The top-k routers of a mixture-of-experts checkpoint (transformers 5's ``mlp.gate`` modules with
        ``top_k`` and ``num_experts``, returning (logits, weights, ids): Qwen3-MoE, OLMoE, Mixtral), each given a
        forward hook (``_RouteHook``) that records its ids and, under replay, swaps in the recorded ones with the
        gate weights recomputed from its full softmax. Nothing in transformers is patched."""
        routers = [m for name, m in self.model.named_modules()
                   if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")]
        for layer, router in enumerate(routers):
            router.register_forward_hook(_RouteHook(self, layer))
        return routers

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) of a mixture-of-experts checkpoint; None for a dense one."""
        return (len(self._routers), int(self._routers[0].top_k)) if self._routers else None

    @property
    def n_experts(self) -> int:
        return int(self._routers[0].num_experts) if self._routers else 0

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    def checkpoint_activations(self) -> None:
        """Activation checkpointing (``train.activation_checkpointing``): each decoder layer keeps its input only
        and runs again in the backward (transformers' ``gradient_checkpointing_enable``, non-reentrant). Only the
        layers are flagged as training (transformers checkpoints a layer when it is), not their attention or MLP,
        so no dropout turns on: the values and gradients are those without checkpointing."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x: the new name
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = [m for m in self.model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not layers:
            raise ValueError(f"train.activation_checkpointing: {type(self.model).__name__} has no checkpointable "
                             "layers (transformers' GradientCheckpointingLayer)")
        for layer in layers:
            layer.training = True
        self.checkpointed = True

    def _check(self, tokens):
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be a non-empty [B, T] tensor, got shape {tuple(tokens.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"{tokens.shape[1]} positions exceed the context ({self.max_seq_len})")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check(tokens)
        self._shape = tuple(tokens.shape)
        return self.model(input_ids=tokens.long(), use_cache=False).logits.float()

    @property
    def output_weight(self) -> torch.Tensor | None:
        """The output layer's weight ``[V, D]`` when the logits are exactly ``last_hidden_state @ weight.T`` (no bias,
        no logit scaling or soft-capping): the scorer then projects only the positions it needs, chunk by chunk
        (``ops.linear_logprobs``), instead of ``[B, T, V]`` logits. None otherwise (the full forward is used)."""
        head = self.model.get_output_embeddings()
        config = self.model.config
        if hasattr(getattr(head, "weight", None), "full_tensor"):  # FSDP2-sharded (a DTensor): gathered only inside
            return None                                               # the wrapped forward, so the full forward runs
        if (not isinstance(head, nn.Linear) or head.bias is not None or getattr(config, "final_logit_softcapping", None)
                or getattr(config, "logit_scale", None) not in (None, 1, 1.0) or head.weight.shape[0] < self.vocab_size
                or not hasattr(self.model, self.model.base_model_prefix)):
            return None
        return head.weight

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[B, T, D]`` (after the last norm): ``forward`` without the output layer."""
        self._check(tokens)
        self._shape = tuple(tokens.shape)
        base = getattr(self.model, self.model.base_model_prefix)
        return base(input_ids=tokens.long(), use_cache=False).last_hidden_state

    def action_hidden_states(self, tokens: torch.Tensor, prompt_len: torch.Tensor, rows: torch.Tensor,
                             cols: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states ``[N, D]`` at positions ``(rows, cols)`` of ``tokens`` (each at or after its row's
        last prompt position ``prompt_len - 1``), with each distinct prompt run once: rows that share a prompt (a
        GRPO group's samples) share its keys and values (``select_cache_rows``: differentiable, a fixed-order backward),
        and only the responses run per row. The same values as ``hidden_states(tokens)[rows, cols]`` up to float
        rounding (other GEMM shapes), at a fraction of the tokens when groups are large and prompts long. None when
        no prompt repeats, or for what this path does not cover (a mixture of experts, a position before a
        prompt's end): the caller then runs the whole sequences."""
        self._check(tokens[:, :-1])  # what the whole-sequence forward would check
        b = tokens.shape[0]
        if self.route_shape is not None or b < 2 or rows.numel() == 0 or (self.checkpointed and torch.is_grad_enabled()):
            return None  # (a checkpointed layer keeps no cache to share)
        plen = prompt_len.to(tokens.device).long()
        if bool((cols < plen[rows] - 1).any()):
            return None
        distinct = distinct_prompts(tokens, plen)
        if distinct is None:
            return None
        unique_rows, inverse = distinct
        uplen = plen[unique_rows]
        width = int(uplen.max())
        span = torch.arange(width, device=tokens.device)
        prompt_mask = (span[None, :] < uplen[:, None]).long()
        base = getattr(self.model, self.model.base_model_prefix)
        self._shape = (len(unique_rows), width)
        head = base(input_ids=tokens[unique_rows, :width].long(), attention_mask=prompt_mask,
                    position_ids=span[None, :].expand(len(unique_rows), width), use_cache=True)
        hidden_prompt = head.last_hidden_state  # [U, width, D]
        ends = cols.new_zeros(b).scatter_reduce(0, rows, cols + 1, "amax")  # inputs end per row
        n_in = (ends - plen).clamp(min=0)  # response inputs per row: positions plen .. ends-1
        wide = int(n_in.max())
        if wide == 0:
            return hidden_prompt[inverse[rows], cols]
        cache = self._cache_of(head)
        if self.prompt_backward_last and torch.is_grad_enabled():
            hidden_prompt = _prompt_backward_last(cache, hidden_prompt)
        select_cache_rows(cache, inverse)  # each row's prompt keys and values, graph kept
        j = torch.arange(wide, device=tokens.device)
        at = (plen[:, None] + j[None, :]).clamp(max=tokens.shape[1] - 1)
        inputs = tokens.gather(1, at).long()
        mask = torch.cat([prompt_mask[inverse], (j[None, :] < n_in[:, None]).long()], 1)
        self._shape = (b, wide)
        tail = base(input_ids=inputs, attention_mask=mask, position_ids=plen[:, None] + j[None, :],
                    use_cache=True, **{self._cache_kw: cache}).last_hidden_state  # [B, wide, D]
        at_prompt = (cols == plen[rows] - 1)[:, None]
        flat = (inverse[rows] * width + cols.clamp(max=width - 1))  # index_select: a deterministic backward
        from_prompt = hidden_prompt.reshape(-1, hidden_prompt.shape[-1]).index_select(0, flat)
        from_tail = tail[rows, (cols - plen[rows]).clamp(min=0, max=wide - 1)]
        return torch.where(at_prompt, from_prompt, from_tail)

    def _cache_of(self, out):
        return getattr(out, "cache", None) if self._cache_kw == "cache" else out.past_key_values

    def new_cache(self, batch_size: int) -> HFCache:
        return HFCache(batch_size=batch_size)

    def prefill(self, tokens, lengths, cache: HFCache):
        self._check(tokens)
        t = tokens.shape[1]
        mask = (torch.arange(t, device=tokens.device)[None, :] < lengths[:, None]).long()
        positions = torch.arange(t, device=tokens.device)[None, :].expand(tokens.shape[0], t)
        self._shape = tuple(tokens.shape)
        out = self.model(input_ids=tokens.long(), attention_mask=mask, position_ids=positions, use_cache=True,
                         **self._new_past())
        cache.past, cache.mask = self._cache_of(out), mask
        return out.logits.float()

    def prefill_last(self, tokens, lengths, cache: HFCache):
        """``prefill``'s logits at each row's last prompt position only, ``[B, V]``: the output layer runs on the
        distinct last positions (transformers' ``logits_to_keep``), not on ``[B, T, V]`` (1.3 GB for 128 prompts
        of 52 tokens at a 49k vocabulary)."""
        if not self._keeps:
            return self.prefill(tokens, lengths, cache)[torch.arange(tokens.shape[0]), lengths - 1]
        distinct = None if self.route_shape is not None else distinct_prompts(tokens, lengths)
        if distinct is not None:  # a group's samples share one prompt: prefill it once, each row its own cache view
            rows, inverse = distinct
            last = self.prefill_last(tokens[rows], lengths[rows], cache)
            select_cache_rows(cache.past, inverse)
            cache.mask = cache.mask[inverse]
            return last[inverse]
        self._check(tokens)
        t = tokens.shape[1]
        mask = (torch.arange(t, device=tokens.device)[None, :] < lengths[:, None]).long()
        positions = torch.arange(t, device=tokens.device)[None, :].expand(tokens.shape[0], t)
        self._shape = tuple(tokens.shape)
        keep = torch.unique(lengths - 1)  # sorted
        out = self.model(input_ids=tokens.long(), attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=keep, **self._new_past())
        cache.past, cache.mask = self._cache_of(out), mask
        column = torch.searchsorted(keep, lengths - 1)
        return out.logits[torch.arange(tokens.shape[0], device=tokens.device), column].float()

    def decode(self, tokens, positions, cache: HFCache):
        cache.mask = torch.cat([cache.mask, torch.ones(cache.mask.shape[0], 1, dtype=torch.long,
                                                           device=cache.mask.device)], dim=1)
        self._shape = (tokens.shape[0], 1)
        out = self.model(input_ids=tokens[:, None].long(), attention_mask=cache.mask,
                         position_ids=positions[:, None].long(), use_cache=True, **{self._cache_kw: cache.past})
        cache.past = self._cache_of(out)
        return out.logits[:, -1].float()


class _QuantizedInput:
    """A linear layer's forward with its input fake-quantized (the sampler's activation format), then the layer's
    own forward (a subclass's, or an instance-level wrapper another library set, which is restored on reset)."""

    def __init__(self, linear: nn.Linear, numerics):
        self.instance_forward = linear.__dict__.get("forward")
        self.forward = linear.forward
        self.numerics = numerics

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.forward(self.numerics.act.fake(x, self.numerics.ste), *args, **kwargs)


def _quantized_write_cache(write, config=None):
    """A transformers ``DynamicCache`` whose keys and values pass through ``write`` when they are stored; the
    attention of the same forward reads them back from it, so a token sees its own K and V quantized as well (the
    KV-cache views' "quantized once, when written")."""
    from transformers.cache_utils import DynamicCache

    class QuantizedWriteCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(write(key_states), write(value_states), layer_idx, *args, **kwargs)

    # the model's own cache is DynamicCache(config=...) where it takes one (sliding-window layers): the same here
    takes_config = "config" in inspect.signature(DynamicCache.__init__).parameters
    return QuantizedWriteCache(config=config) if takes_config and config is not None else QuantizedWriteCache()


def _cache_layers(cache) -> list | None:
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        return None
    return [layer for layer in layers if isinstance(layer.keys, torch.Tensor) and layer.keys.numel()]


def _prompt_backward_last(cache, hidden: torch.Tensor) -> torch.Tensor:
    """Cut the graph between the prompt pass and the responses' pass, the prompt's backward run once the responses'
    is done: the responses' pass reads the prompt's keys and values (and, for the first action, its last hidden
    state) through detached leaves, and a multi-grad hook on them runs the prompt pass's backward with their
    gradients (a reentrant backward, as reentrant checkpointing does). The gradient is the same up to float
    rounding (each weight's two uses summed into ``.grad`` one after the other, not first in autograd's buffer);
    what changes is memory: one graph reading every weight twice makes autograd hold the responses' share of every
    weight's gradient until the prompt's arrives, a whole model's gradient more at the peak (0.54 GB on
    SmolLM2-135M). Keys and values are replaced in ``cache`` in place; the hidden state's leaf is returned. Only
    for a caller that takes gradients with ``.backward()``: the prompt's share goes to ``.grad``, which
    ``torch.autograd.grad`` would not see (``HFPolicy.prompt_backward_last``)."""
    layers = _cache_layers(cache)
    if layers is None:  # an older cache layout: one graph, as before
        return hidden
    outputs = [hidden] + [t for layer in layers for t in (layer.keys, layer.values)]
    if not all(t.requires_grad for t in outputs):
        return hidden
    leaves = [t.detach().requires_grad_() for t in outputs]
    for i, layer in enumerate(layers):
        layer.keys, layer.values = leaves[1 + 2 * i], leaves[2 + 2 * i]

    handle = []

    def prompt_backward(grads) -> None:
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
        outputs.clear()  # the prompt pass's graph goes with its backward
        handle.pop().remove()  # the leaves' hooks hold autograd nodes that hold the leaves: a cycle gc cannot see
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    handle.append(torch.autograd.graph.register_multi_grad_hook(leaves, prompt_backward, mode="all"))
    return leaves[0]


def select_cache_rows(cache, rows: torch.Tensor) -> None:
    """Row ``rows[i]`` of every layer's keys and values as row i (a prompt's cache given to each of its samples), by
    ``index_select``: its backward (``index_add``) sums a shared prompt's gradients in one fixed order, where
    transformers' ``batch_select_indices`` indexes (``index_put`` with accumulation, whose order follows the CPU
    threads: the same run gave other bits after a resume)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        cache.batch_select_indices(rows)
        return
    for layer in layers:
        if isinstance(layer.keys, torch.Tensor) and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def distinct_prompts(tokens: torch.Tensor, prompt_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the first row of each distinct prompt ``[U]``, each row's index among them ``[B]``) when some rows share a
    prompt (the same length and tokens: a GRPO group's samples); None when every prompt is distinct."""
    first: dict[tuple, int] = {}  # each distinct prompt -> its index among the distinct ones
    inverse = [first.setdefault(tuple(tokens[i, : int(prompt_len[i])].tolist()), len(first))
               for i in range(tokens.shape[0])]
    if len(first) == len(inverse):
        return None
    rows = [0] * len(first)
    for i in reversed(range(len(inverse))):
        rows[inverse[i]] = i
    return (torch.tensor(rows, device=tokens.device), torch.tensor(inverse, device=tokens.device))


# Routers whose gate weights are a softmax over all experts at the top-k ids, renormalized: by their
# ``norm_topk_prob`` attribute ("attr") or always (True). Replay recomputes exactly that; other routers (sigmoid
# scores with a bias, group selection, scaling: DeepSeek-V3 and kin) are recorded but refuse replay by name.
REPLAYABLE_ROUTERS = {"Qwen2MoeTopKRouter": "attr", "Qwen3MoeTopKRouter": "attr", "OlmoeTopKRouter": "attr",
                      "MixtralTopKRouter": True}


class _RouteHook:
    """A router's forward hook. An object, not a closure: ``copy.deepcopy`` of the policy (the Eq. 1 scorer, the
    clean evaluator) copies it with the policy, so the copy's hooks read the copy's ``routes`` and ``replay``."""

    def __init__(self, policy: HFPolicy, layer: int):
        self.policy, self.layer = policy, layer

    def __call__(self, module, inputs, output):
        policy = self.policy
        if policy.routes is None and policy.replay is None:
            return None
        if not (isinstance(output, tuple) and len(output) == 3):
            raise TypeError(f"{type(module).__name__} returned {type(output).__name__}, not (logits, weights, ids): "
                            "this transformers version's router is not supported for routes")
        logits, weights, ids = output
        b, t = policy._shape
        if policy.routes is not None:
            policy.routes.append(ids.detach().view(b, t, -1))
        if policy.replay is None:
            return None
        renormalize = REPLAYABLE_ROUTERS.get(type(module).__name__)
        if renormalize is None:
            raise ValueError(f"train.routing=replay: {type(module).__name__} computes its gate weights in a way "
                             f"driftless does not recompute (replayable: {', '.join(REPLAYABLE_ROUTERS)}); "
                             "use train.routing=recompute (its routes are still recorded and measured)")
        wanted = policy.replay[:, :t, self.layer].reshape(b * t, -1).to(ids.device).long()
        ids = torch.where((wanted >= 0).all(-1, keepdim=True), wanted, ids)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # the full softmax: the router keeps its gradient
        weights = probs.gather(-1, ids)
        if renormalize is True or (renormalize == "attr" and module.norm_topk_prob):
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids


def tiny_qwen3_config(vocab_size: int = 64, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                      intermediate: int = 128, max_positions: int = 128):
    """A tiny randomly initialisable Qwen3 config (no download), for tests and benchmarks."""
    tf = _transformers()
    return tf.Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
    )
