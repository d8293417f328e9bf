"""Decoder-only transformer: embeddings, pre-norm blocks (a token mixer and a dense or MoE FFN, as
the layer plan says), LM head.

Shape legend: B batch, S sequence, D d_model, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.layer_plan import layer_plan
from moetrain.config.mixers.gqa import has_global_rope
from moetrain.model.block import Block
from moetrain.model.cache import InferenceCache
from moetrain.model.doc_attention import Documents
from moetrain.model.head_exchange import HeadExchange
from moetrain.model.hyper_connections import HyperConnection, HyperHead, expand_streams
from moetrain.model.layers import LayerNorm, RMSNorm, make_norm
from moetrain.model.loss import LMHead, softcap
from moetrain.model.mixers import MixerInputs, MixerLoss, TokenMixer
from moetrain.model.moe.experts import GroupedExperts
from moetrain.model.moe.layer import MoELayer, MoEOutput
from moetrain.model.mtp import MTPBlock, mtp_targets, shift_left
from moetrain.model.rope import global_rope_tables, model_rope_tables

ROPE_TABLE_ROWS = 8192  # positions the RoPE tables are built for at first (they grow on demand)


@dataclass
class TransformerOutput:
    """logits (B, S, V), None when the chunked loss skipped them; loss = ce_loss + moe_loss +
    the weighted mtp_loss (only with labels); moe: one per MoE layer (the MTP blocks' last);
    mtp_losses: each multi-token-prediction depth's cross-entropy, mtp_loss their mean."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    moe_loss: torch.Tensor | None = None
    moe: list[MoEOutput] = field(default_factory=list)
    mtp_loss: torch.Tensor | None = None
    mtp_losses: list[torch.Tensor] = field(default_factory=list)
    # the mixers' own training losses (in ``loss``) with their metrics: sparse attention's
    # indexer KL (only a training forward with labels computes them)
    mixer_losses: list[MixerLoss] = field(default_factory=list)


class Transformer(nn.Module):
    """The language model; parameter names are the stable ones in docs/CONTRACTS.md. With
    ``model.mtp_depth`` its ``layers`` end with the multi-token-prediction blocks
    (:mod:`moetrain.model.mtp`), which only the training loss runs.

    ``local_experts=(start, stop)``: every MoE layer builds only global experts
    ``[start, stop)`` (an expert-parallel rank); the weights equal those of the full model.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        moe_cfg: MoEConfig,
        local_experts: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        # the init draws start from the generator's state here, whatever the constructors of the
        # pieces draw: a model built on the meta device and initialised unit by unit (ZeRO-3,
        # parallel/zero3.py) gets the same weights
        rng = torch.get_rng_state()
        self.cfg, self.moe_cfg = model_cfg, moe_cfg
        self.embed = nn.Embedding(model_cfg.vocab_size, model_cfg.d_model)
        self.plan = layer_plan(model_cfg, moe_cfg)
        self.layers = nn.ModuleList(
            (MTPBlock if spec.mtp else Block)(spec, model_cfg, moe_cfg, local_experts)
            for spec in self.plan
        )
        self.norm = make_norm(model_cfg, model_cfg.d_model)
        # model.hc_streams > 1: the streams' final collapse, before the final norm
        self.hc_head = None
        if model_cfg.hc_streams > 1:
            m = model_cfg
            self.hc_head = HyperHead(m.d_model, m.hc_streams, m.hc_eps, m.norm_eps)
        self.lm_head = LMHead(model_cfg.d_model, model_cfg.vocab_size, bias=model_cfg.lm_head_bias)
        self.tie_weights()
        # the RoPE tables of the first positions, grown (exactly) when a forward needs more:
        # a long context (Llama 4 Scout's 10M positions) costs nothing until it is used
        # (and the sliding layers' own, model.sliding_rope_theta: rope_local_cos / _sin)
        for name, local in self._rope_buffers():
            rows = min(model_cfg.max_seq_len, ROPE_TABLE_ROWS)
            cos, sin = model_rope_tables(model_cfg, rows, local=local)
            self.register_buffer(f"{name}cos", cos, persistent=False)
            self.register_buffer(f"{name}sin", sin, persistent=False)
        # the global layers' own tables (model.global_*: Gemma 4's), grown alike; else None
        cos, sin = (
            global_rope_tables(model_cfg, self.rope_cos.shape[0])
            if has_global_rope(model_cfg)
            else (None, None)
        )
        self.register_buffer("rope_cos_global", cos, persistent=False)
        self.register_buffer("rope_sin_global", sin, persistent=False)
        self.head_exchange: HeadExchange | None = None  # sequence parallelism (set_head_exchange)
        if self.embed.weight.device.type != "meta":  # (a meta model is filled by loading)
            torch.set_rng_state(rng)
            self.init_weights()
        alone = [m for b in self.layers if b.attn is not None for m in b.attn.trains_alone()]
        if alone:  # a training stage of some mixer's own parts (their parameters alone train)
            self.requires_grad_(False)
            for module in alone:
                module.requires_grad_(True)

    def set_head_exchange(self, ex: HeadExchange | None) -> None:
        """Sequence parallelism (:mod:`moetrain.model.head_exchange`): the model's inputs are
        then this rank's slice ``ex.rank`` of ``ex.size`` equal slices of every sequence (its
        labels the same slice; ``doc_ids_BS`` the whole rows), RoPE takes the slice's global
        positions and every mixer mixes the whole sequences through ``ex``. None: one device
        again."""
        self.head_exchange = ex
        for block in self.layers:
            if block.attn is not None:
                block.attn.set_head_exchange(ex)

    def tie_weights(self) -> None:
        """With ``model.tie_embeddings``, make ``lm_head.weight`` the embedding's Parameter
        (again: ``to_empty`` from the meta device gives each module a Parameter of its own);
        a head bias (``model.lm_head_bias``) stays the head's own."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _rope_buffers(self) -> list[tuple[str, bool]]:
        """The RoPE tables' buffer name prefixes, with whether they are the sliding layers'."""
        local = [("rope_local_", True)] if self.cfg.sliding_rope_theta is not None else []
        return [("rope_", False), *local]

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place (a model built on the meta device and moved with
        ``to_empty`` has uninitialised buffers; every other tensor is a loaded weight)."""
        for name, local in self._rope_buffers():
            cos, sin = model_rope_tables(self.cfg, self.rope_cos.shape[0], local=local)
            getattr(self, f"{name}cos").copy_(cos)
            getattr(self, f"{name}sin").copy_(sin)
        if self.rope_cos_global is not None:
            cos, sin = global_rope_tables(self.cfg, self.rope_cos.shape[0])
            self.rope_cos_global.copy_(cos)
            self.rope_sin_global.copy_(sin)

    @torch.no_grad()
    def rope_rows(self, n: int) -> None:
        """Make the RoPE tables hold at least ``n`` positions (at most ``max_seq_len``),
        doubling them; the new tables keep the old ones' dtype and device."""
        have = self.rope_cos.shape[0]
        if n <= have:
            return
        size = min(self.cfg.max_seq_len, max(n, 2 * have))
        for name, local in self._rope_buffers():
            cos, sin = model_rope_tables(self.cfg, size, local=local)
            setattr(self, f"{name}cos", cos.to(self.rope_cos))
            setattr(self, f"{name}sin", sin.to(self.rope_sin))
        if self.rope_cos_global is not None:
            cos, sin = global_rope_tables(self.cfg, size)
            self.rope_cos_global = cos.to(self.rope_cos_global)
            self.rope_sin_global = sin.to(self.rope_sin_global)

    def _rope(self, start: int, s: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE rows of positions ``start .. start + s - 1`` of a sequence of ``seq_len``:
        the tables' (grown as needed), or LongRoPE's long factors' where the sequence takes
        them (``ModelConfig.longrope_long``; computed for the call, as the model keeps no
        table of them)."""
        if not self.cfg.longrope_long(seq_len):
            self.rope_rows(start + s)
            return self.rope_cos[start : start + s], self.rope_sin[start : start + s]
        cos, sin = model_rope_tables(self.cfg, start + s, long=True)
        return cos[start:].to(self.rope_cos), sin[start:].to(self.rope_sin)

    def _local_rope(self, start: int, s: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sliding layers' RoPE rows of positions ``start .. start + s - 1`` (after
        :meth:`_rope` grew the tables), None without ``model.sliding_rope_theta``."""
        if self.cfg.sliding_rope_theta is None:
            return None
        return self.rope_local_cos[start : start + s], self.rope_local_sin[start : start + s]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; output projections (attention ``wo``, FFN and expert
        ``w2``) use init_std / sqrt(2 * n_layers); norm weights are ones; norm biases, the
        selection bias and every projection bias (q/k/v, output, router, experts, LM head)
        zeros; each mixer initialises the rest of its own (attention sinks: zeros). A
        zero-centred norm's weight (``model.zero_centered_norm``) is zeros: the same scale. One
        module at a time, in ``named_modules`` order (:meth:`init_module`)."""
        for name, module in self.named_modules():
            self.init_module(name, module)
        self.tie_weights()  # lm_head shares embed.weight; keep the embedding init

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """:meth:`init_weights`'s part for one module (``name``: its name in this model): its
        own parameters (and the MoE layer's selection bias), drawn from the global RNG, so that
        initialising every module in ``named_modules`` order is :meth:`init_weights`."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            is_out = name.endswith((".wo", ".w2"))
            nn.init.normal_(module.weight, 0.0, out_std if is_out else std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, GroupedExperts):
            module.reset_parameters(std, out_std)
        elif isinstance(module, RMSNorm):
            module.reset_parameters()  # ones (zeros when zero-centred)
        elif isinstance(module, LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, MoELayer):
            module.router.reset_parameters()
        elif isinstance(module, TokenMixer):
            module.init_own_parameters()
        elif isinstance(module, (HyperConnection, HyperHead)):
            module.reset_parameters(std)

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        doc_ids_BS: torch.Tensor | None = None,
        labels_BS: torch.Tensor | None = None,
        cache: InferenceCache | None = None,
        return_logits: bool = True,
        mtp_weight: float | None = None,
    ) -> TransformerOutput:
        """Logits for every position; with labels also the loss (labels of -100 are ignored;
        the cross-entropy is 0 when every label is).

        ``doc_ids_BS`` restricts attention to earlier tokens of the same document. ``cache``
        (inference): the tokens continue the cached ones at position ``cache.pos``; their keys
        and values are added to the cache, which then advances. ``return_logits=False`` with
        labels and ``model.loss_chunk_tokens`` > 0: the cross-entropy is computed in chunks of
        tokens without the full logits, and ``logits`` is None (what the trainer does).
        With labels and ``model.mtp_depth``, the multi-token-prediction loss is added, weighted
        by ``mtp_weight`` (default ``model.mtp_loss_weight``).
        """
        s = input_ids_BS.shape[1]
        start = cache.pos if cache is not None else 0
        ex = self.head_exchange
        if ex is not None:  # this rank's slice of every sequence, at its global positions
            if cache is not None or self.cfg.mtp_depth:
                raise ValueError("sequence parallelism: no cache and no multi-token prediction")
            if doc_ids_BS is not None and doc_ids_BS.shape[1] != s * ex.size:
                raise ValueError(
                    f"sequence parallelism: doc_ids_BS must hold the whole rows ({s} x "
                    f"{ex.size} positions); got {doc_ids_BS.shape[1]}"
                )
            start = ex.rank * s
        # the sequence's length (the whole rows' under sequence parallelism), which picks
        # LongRoPE's factors for every position of it
        seq_len = start + s if ex is None else s * ex.size
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        if cache is not None and (doc_ids_BS is not None or start + s > cache.max_len):
            raise ValueError("cache: no document mask, and at most cache.max_len positions")
        cos, sin = self._rope(start, s, seq_len)
        x_BSD = self.embed(input_ids_BS)
        if self.cfg.embedding_multiplier != 1.0:
            x_BSD = x_BSD * self.cfg.embedding_multiplier
        # the packed documents' layout, one for every layer: no S x S mask (doc_attention.py)
        docs = None if doc_ids_BS is None else Documents.from_ids(doc_ids_BS).to(x_BSD.device)
        inputs = MixerInputs(cos, sin, docs, doc_ids_BS, start if cache is not None else 0)
        inputs.local_rope = self._local_rope(start, s)
        inputs.token_ids_BS = input_ids_BS
        own = self._global_inputs(inputs, start, s)
        moe_outs: list[MoEOutput] = []
        embed_BSD = x_BSD
        if self.hc_head is not None:  # the residual streams (B, S, N, D)
            x_BSD = expand_streams(x_BSD, self.cfg.hc_streams)
        shortcut_BSD = None  # moe.shortcut: an MoE block's output, for the next block
        for i, block in enumerate(self.layers[: self.cfg.n_layers]):
            state = cache.layers[i] if cache is not None else None
            mixer = block.spec.mixer
            block_inputs = own if mixer and mixer.own_rope else inputs
            x_BSD, stats = block(x_BSD, block_inputs, state, shortcut_BSD)
            shortcut_BSD = None
            if stats is not None:
                moe_outs.append(stats)
                shortcut_BSD, stats.shortcut_BSD = stats.shortcut_BSD, None
        if cache is not None:
            cache.pos += s
        if self.hc_head is not None:
            x_BSD = self.hc_head(x_BSD)
        h_BSD = self.norm(x_BSD)

        chunk = self.cfg.loss_chunk_tokens
        chunked = labels_BS is not None and not return_logits and chunk > 0
        logits_BSV = None if chunked else self.head(h_BSD)
        out = TransformerOutput(logits=logits_BSV, moe=moe_outs)
        if labels_BS is None:
            out.moe_loss = self._moe_loss(moe_outs, h_BSD)
            return out
        out.ce_loss = self._cross_entropy(h_BSD, labels_BS, logits_BSV)
        if self.cfg.mtp_depth:
            args = (embed_BSD, inputs, labels_BS, doc_ids_BS, moe_outs, chunked)
            out.mtp_losses = self._mtp_losses(h_BSD, *args)
            out.mtp_loss = torch.stack(out.mtp_losses).mean()
        out.moe_loss = self._moe_loss(moe_outs, h_BSD)
        out.loss = out.ce_loss + out.moe_loss
        if out.mtp_loss is not None:
            weight = self.cfg.mtp_loss_weight if mtp_weight is None else mtp_weight
            out.loss = out.loss + weight * out.mtp_loss
        # (a copy: recomputing a checkpointed block in backward reports again)
        out.mixer_losses = list(inputs.losses)
        for own in out.mixer_losses:
            out.loss = out.loss + own.loss
        return out

    def _global_inputs(self, inputs: MixerInputs, start: int, s: int) -> MixerInputs:
        """The global layers' inputs (``model.global_*``): ``inputs`` with their own RoPE
        rows of the same positions (the documents, losses and selections shared)."""
        if self.rope_cos_global is None:
            return inputs
        rows = slice(start, start + s)  # (rope_rows grew both tables)
        cos, sin = self.rope_cos_global[rows], self.rope_sin_global[rows]
        return dataclasses.replace(inputs, cos=cos, sin=sin)

    def _moe_loss(self, moe_outs: list[MoEOutput], like: torch.Tensor) -> torch.Tensor:
        """The weighted balancing and z-losses of every MoE layer (fp32 scalar)."""
        m = self.moe_cfg
        moe_loss = like.new_zeros((), dtype=torch.float32)
        for stats in moe_outs:
            if m.aux_loss_coef > 0:
                moe_loss = moe_loss + m.aux_loss_coef * stats.aux_loss
            if m.z_loss_coef > 0:
                moe_loss = moe_loss + m.z_loss_coef * stats.z_loss
        return moe_loss

    def head(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The logits of final hidden states: the LM head's output divided by
        ``model.logits_scaling`` (untouched at 1.0), then soft-capped by
        ``model.final_logit_softcap`` (where set)."""
        logits_BSV = self.lm_head(h_BSD)
        scaling = self.cfg.logits_scaling
        if scaling != 1.0:
            logits_BSV = logits_BSV / scaling
        return softcap(logits_BSV, self.cfg.final_logit_softcap)

    def _cross_entropy(
        self, h_BSD: torch.Tensor, labels_BS: torch.Tensor, logits_BSV: torch.Tensor | None
    ) -> torch.Tensor:
        """Mean cross-entropy of the head over labelled tokens (chunked without logits); 0, not
        NaN, when no token is labelled. The chunked loss divides the hidden state (and the head
        bias) by ``model.logits_scaling`` instead of the logits (the same logits, up to
        rounding)."""
        if logits_BSV is None:
            return self.lm_head(
                h_BSD.flatten(0, 1),
                labels_BS.flatten(),
                self.cfg.loss_chunk_tokens,
                self.cfg.logits_scaling,
                self.cfg.final_logit_softcap,
            )
        labelled = (labels_BS != -100).sum().clamp_min(1)
        return (
            F.cross_entropy(
                logits_BSV.float().flatten(0, 1),
                labels_BS.flatten(),
                ignore_index=-100,
                reduction="sum",
            )
            / labelled
        )

    def _mtp_losses(
        self,
        h_BSD: torch.Tensor,
        embed_BSD: torch.Tensor,
        inputs: MixerInputs,
        labels_BS: torch.Tensor,
        doc_ids_BS: torch.Tensor | None,
        moe_outs: list[MoEOutput],
        chunked: bool,
    ) -> list[torch.Tensor]:
        """Each depth's cross-entropy (:mod:`moetrain.model.mtp`; ``chunked``: without its
        logits, as the main loss); the MTP blocks' MoE statistics are appended to
        ``moe_outs``. Each depth hands the next its hidden state after its ``head_norm``.
        Depth ``k`` runs on the positions whose input token is in the row (the first
        ``S - k``: causal attention gives them the same outputs), so that no position past the
        row's end reaches its MoE's routing statistics, bias update or capacity."""
        losses, s = [], embed_BSD.shape[1]
        for k, block in enumerate(self.layers[self.cfg.n_layers :], start=1):
            m = max(s - k, 1)
            docs_BS = doc_ids_BS[:, :m] if doc_ids_BS is not None else None
            docs = Documents.from_ids(docs_BS).to(h_BSD.device) if docs_BS is not None else None
            rows = MixerInputs(inputs.cos[:m], inputs.sin[:m], docs, docs_BS)
            x_BSD = block.block_input(h_BSD[:, :m], shift_left(embed_BSD, k, 0.0)[:, :m])
            out_BSD, stats = block(x_BSD, rows)
            if stats is not None:
                moe_outs.append(stats)
            h_BSD = block.head_norm(out_BSD)
            logits_BSV = None if chunked else self.head(h_BSD)
            targets_BS = mtp_targets(labels_BS, doc_ids_BS, k)[:, :m]
            losses.append(self._cross_entropy(h_BSD, targets_BS, logits_BSV))
        return losses

    def new_cache(self, batch: int, max_len: int | None = None) -> InferenceCache:
        """An empty generation cache for ``batch`` sequences of up to ``max_len`` tokens (default
        ``max_seq_len``): each decoder layer's mixer state (keys and values, latents, ...),
        in the model's dtype and device."""
        n = max_len or self.cfg.max_seq_len
        w = self.embed.weight
        states = [
            None if b.attn is None else b.attn.new_state(batch, n, w.dtype, w.device)
            for b in self.layers[: self.cfg.n_layers]
        ]
        return InferenceCache(states, n)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE FFNs in layer order (the multi-token-prediction blocks' last)."""
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoELayer)]
