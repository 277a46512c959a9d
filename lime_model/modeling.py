"""LIMe decoder as a Hugging Face model; ``routing="none"`` is exactly LLaMA.

Differences from ``transformers``' ``LlamaForCausalLM`` are confined to ``LimeAttention``:
its raw K/V go through ``self_attn.router`` (which also appends them to the per-forward
``lime_model.kv_buffer.KVBuffer``) before RoPE, and the cache stores the *routed* K/V, since
routing is per position. Every parameter name is LLaMA's, so LLaMA state dicts load unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .config import LimeConfig
from .kv_buffer import KVBuffer
from .router import LimeRouter, build_router


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x (B, heads, T, head_dim)`` with ``cos``/``sin (B, T, head_dim)``: the formula of
    ``transformers``' ``apply_rotary_pos_emb``, one tensor at a time, so that keys recomputed in
    backward go through exactly the forward's operations."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class LimeAttention(nn.Module):
    """LLaMA attention whose K/V heads are routed mixtures of all buffered layers' K/V heads."""

    def __init__(self, config: LimeConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        hidden, kv_dim = config.hidden_size, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        # a flag `_init_weights` reads; torch's stubs type a module's attributes as tensors or modules
        self.k_proj.torch_default_init = self.v_proj.torch_default_init = config.kv_proj_torch_init  # type: ignore[assignment]
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=False)
        self.router = build_router(config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        kv_buffer: KVBuffer | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states ``(B, T, hidden)`` -> ``(B, T, hidden)`` and the attention weights (eager only)."""
        B, T, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        keys, values = self.mix_kv(
            hidden_states, self.k_proj(hidden_states), self.v_proj(hidden_states), kv_buffer
        )

        cos, sin = position_embeddings
        query, keys = rope(query, cos, sin), rope(keys, cos, sin)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)

        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        with self.recomputed_in_backward(
            kv_buffer, hidden_states, keys, values, position_embeddings, cache
        ) as (keys, values):
            output, weights = attention(
                self,
                query,
                keys,
                values,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                **kwargs,
            )
        return self.o_proj(output.reshape(B, T, -1)), weights

    @contextlib.contextmanager
    def recomputed_in_backward(
        self,
        kv_buffer: KVBuffer | None,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A context, giving the ``keys`` and ``values`` attention is to read, in which autograd keeps,
        for the routed keys (after RoPE) and values that attention saves for backward, a recipe that
        recomputes them from ``kv_buffer`` instead (``config.recompute_routed_kv``, static routers, grad
        enabled, no cache; else it gives them unchanged and does nothing). The recipe repeats the
        forward's operations (in the buffer's dtype, autocast or not), so gradients keep their bits.
        Tensors are matched by identity, so under autocast they are cast here to its dtype, as attention
        would cast them (RoPE's fp32 cos/sin make the keys fp32): attention then saves these, not copies.
        Implementations that save views of them (eager) keep those as usual. The recipe holds nothing
        of ``hidden_states`` but its shape, dtype and device: under autocast the tensor itself (fp32,
        of which the projections keep a bf16 copy) would stay alive until backward for the recipe alone."""
        router = self.router
        if not (
            self.config.recompute_routed_kv
            and torch.is_grad_enabled()
            and cache is None  # cached K/V are more than this call's routed heads
            and router is not None
            and not router.input_dependent
            and kv_buffer is not None  # every routed model's forward passes one
        ):
            yield keys, values
            return
        cos, sin = position_embeddings
        device = keys.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            keys, values = keys.to(dtype), values.to(dtype)
        dtypes = (keys.dtype, values.dtype)
        # all a static router reads of the attention input, without its data (see the docstring)
        like = hidden_states.new_empty(*hidden_states.shape[:-1], 0)

        def recompute(which: int) -> torch.Tensor:
            heads = router.reread(kv_buffer, like, which)
            return (rope(heads, cos, sin) if which == 0 else heads).to(dtypes[which])

        routed = [keys, values]

        def pack(t: torch.Tensor):
            which = next((i for i, x in enumerate(routed) if t is x), None)
            return t if which is None else partial(recompute, which)

        def unpack(saved):
            return saved() if isinstance(saved, partial) else saved

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield keys, values
        finally:
            routed.clear()  # the hooks outlive this call; they must not keep the tensors alive

    def mix_kv(
        self, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_buffer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw ``keys``/``values`` ``(B, T, kv * head_dim)`` -> the heads attention reads, each
        ``(B, kv, T, head_dim)``: routed by ``self.router`` (LIMe), else unchanged (LLaMA). Subclasses
        mixing K/V across layers override this; ``kv_buffer`` is the per-forward cross-layer store
        their model's ``LimeModel.run_layers`` passes."""
        if self.router is not None:
            return self.router(kv_buffer, hidden_states, keys, values)
        B, T, _ = keys.shape
        return (
            keys.view(B, T, -1, self.head_dim).transpose(1, 2),
            values.view(B, T, -1, self.head_dim).transpose(1, 2),
        )


class LimeDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (as LLaMA)."""

    attention_class: type[LimeAttention] = LimeAttention

    def __init__(self, config: LimeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = LlamaMLP(config)
        # (hyper-connections' blocks norm with nn.LayerNorm)
        self.input_layernorm: LlamaRMSNorm | nn.LayerNorm = LlamaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.post_attention_layernorm: LlamaRMSNorm | nn.LayerNorm = LlamaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """``(B, T, hidden) -> (B, T, hidden)``; ``kwargs`` go to attention (mask, RoPE, cache, buffer)."""
        attn_out, _ = self.self_attn(self.input_layernorm(hidden_states), **kwargs)
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LimePreTrainedModel(PreTrainedModel):
    config_class: type[PreTrainedConfig] = LimeConfig  # the baselines' own configs subclass it
    config: LimeConfig
    base_model_prefix = "model"
    _no_split_modules = ["LimeDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": LimeDecoderLayer, "attentions": LimeAttention}

    def _init_weights(self, module: Any) -> None:
        """LLaMA's init (normal(0, initializer_range) matrices and embeddings, unit norms), except:

        * routers: each router class's own ``reset_parameters`` (identity on the own heads);
        * modules flagged ``torch_default_init`` (LIMe's k/v projections, every layer): PyTorch's default
          ``nn.Linear`` init, ``kaiming_uniform_(a=sqrt(5))`` = uniform(+-1/sqrt(fan_in)), as the official
          code's raw ``kv_proj_weight``, which HF's init never touches. ``routing="none"`` keeps HF's
          normal init there, as the official LLaMA baseline (a plain ``LlamaForCausalLM``) does
          (``config.kv_proj_init`` overrides either, for ablations);
        * modules flagged ``own_init`` (the baselines' cross-layer mixing weights): their ``reset_parameters``.
        """
        if isinstance(module, LimeRouter) or getattr(module, "own_init", False):
            module.reset_parameters()  # each router/mixing class owns its init (identity-like)
        elif getattr(module, "torch_default_init", False):
            module.reset_parameters()
        else:
            super()._init_weights(module)


class LimeModel(LimePreTrainedModel):
    """The decoder stack: embeddings, L blocks sharing one K/V buffer per forward, final RMSNorm."""

    decoder_layer_class: type[LimeDecoderLayer] = LimeDecoderLayer

    def __init__(self, config: LimeConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``input_ids (B, T)`` or ``inputs_embeds (B, T, hidden)`` -> ``last_hidden_state (B, T, hidden)``.

        One ``KVBuffer`` per call collects every layer's raw K/V for the routers; with a cache it
        covers only the new positions, which is all routing needs (it mixes K/V of the same position).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.training and self.config.recompute_routed_kv:
            use_cache = (
                False  # a cache would keep the K/V it recomputes (as transformers does under checkpointing)
            )
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past
            position_ids = position_ids.unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = self.run_layers(
            inputs_embeds,
            attention_mask=causal_mask,
            position_embeddings=self.rotary_emb(inputs_embeds, position_ids=position_ids),
            position_ids=position_ids,
            cache=cache,
            **kwargs,
        )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)

    def deferred_weights(self, device: torch.device) -> dict[int, torch.Tensor]:
        """Layer -> its router's weight, where its sources' backward can compute its gradient
        (``LimeRouter.deferred_weight``, ``KVBuffer.defer_weight_grads``); none unless every such
        weight is on ``device`` already (an offloaded layer's arrive only for its own forward)."""
        routers = [cast(LimeAttention, layer.self_attn).router for layer in self.layers]
        weights = {i: router.deferred_weight() for i, router in enumerate(routers) if router is not None}
        kept = {i: w for i, w in weights.items() if w is not None}
        return kept if all(w.device == device for w in kept.values()) else {}

    def run_layers(self, hidden_states: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        """The blocks on the embeddings ``(B, T, hidden)`` -> the last block's output ``(B, T, hidden)``.

        ``layer_kwargs`` (mask, RoPE, cache, ...) go to every block; the blocks of a LIMe model also share
        one ``KVBuffer``. Baselines that carry earlier layers forward differently override this.
        """
        kv_buffer = None
        if self.config.routing_spec.enabled:
            kv_buffer = KVBuffer(
                self.config.num_hidden_layers, self.config.num_key_value_heads, self.config.head_dim
            )
            if kv_buffer.defers_weight_grads(hidden_states.device):  # else no weight is even looked at
                kv_buffer.defer_weight_grads(self.deferred_weights(hidden_states.device))
        for layer in self.layers:
            hidden_states = layer(hidden_states, kv_buffer=kv_buffer, **layer_kwargs)
        return hidden_states


class LimeForCausalLM(LimePreTrainedModel, GenerationMixin):
    """LIMe (or, with ``routing="none"``, LLaMA) with a language-modelling head."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    base_model_class: type[LimeModel] = LimeModel

    def __init__(self, config: LimeConfig) -> None:
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits ``(B, T, vocab)``; with ``labels`` also the shifted next-token cross-entropy."""
        if "past_key_values" in kwargs:  # the name generate() and older callers use
            cache = kwargs.pop("past_key_values")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


def register_auto(causal_lm: type[LimeForCausalLM]) -> None:
    """Register ``causal_lm``, its base model and config with the Auto classes, so
    ``AutoModelForCausalLM.from_pretrained(DIR)`` loads checkpoints of its ``model_type``.

    Both classes are also marked for transformers' custom-code saving: ``save_pretrained`` then copies
    their module and every module it imports relatively (this package's imports among the model files
    are all relative) into the folder and writes an ``auto_map`` into ``config.json``, so the folder
    loads with ``trust_remote_code=True`` where ``lime_model`` is not installed. Where it is, a plain
    ``from_pretrained`` still takes these registered classes (local code wins when trust is not given).
    """
    config = causal_lm.config_class
    AutoConfig.register(config.model_type, config, exist_ok=True)
    AutoModel.register(config, causal_lm.base_model_class, exist_ok=True)
    AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)
    config.register_for_auto_class()
    causal_lm.register_for_auto_class("AutoModelForCausalLM")


register_auto(LimeForCausalLM)
