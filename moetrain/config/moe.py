"""The MoE layers' section of the config (``moe``): routing, balancing, capacity, placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.checks import require
from moetrain.config.layer_plan import FFNKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, above, at_least, between


@dataclass
class MoEConfig:
    """Mixture-of-Experts FFN: routing, balancing, capacity, placement."""

    num_experts: int = field(default=8, metadata=at_least(1) | FUNCTION)
    top_k: int = field(default=2, metadata=at_least(1) | FUNCTION)  # at most num_experts
    expert_hidden: int = field(default=512, metadata=POSITIVE_INT | FUNCTION)
    # every n-th layer (after first_k_dense) is MoE
    moe_every: int = field(default=1, metadata=at_least(1) | FUNCTION)
    # the first k layers use a dense FFN (at most model.n_layers)
    first_k_dense: int = field(default=0, metadata=at_least(0) | FUNCTION)
    # each decoder layer's FFN instead (model.n_layers entries): "dense", "moe" or "none" (no
    # FFN: the block is its token mixer alone, Nemotron-H's mixer layers); then first_k_dense
    # and moe_every keep their defaults, and multi-token-prediction blocks are MoE
    layer_ffns: list[FFNKind] | None = field(default=None, metadata=FUNCTION)
    # the routing scores of the logits: softmax, sigmoid, or sqrtsoftplus (DeepSeek-V4's
    # sqrt(softplus(logit)), per expert like sigmoid)
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = field(
        default="softmax", metadata=FUNCTION
    )
    # True: top-k on the logits, then the score function over the k (softmax over the k, or
    # each one's sigmoid, renormalised with renormalize: Llama 4)
    topk_before_score: bool = field(default=False, metadata=FUNCTION)
    # renormalise the top-k weights to sum to 1
    renormalize: bool = field(default=True, metadata=FUNCTION)
    # multiply combine weights (DeepSeek-V3 style)
    route_scale: float = field(default=1.0, metadata=above(0) | FUNCTION)
    # the selection rule: "topk" (the score_func scores' top-k, the options above) or
    # "sparsemixer" (Phi-3.5-MoE's: top-2, each weight a softmax over the logits within
    # router_jitter_eps of that pick's, the second pick's without the first; model/moe/sparsemixer.py)
    router_type: Literal["topk", "sparsemixer"] = field(default="topk", metadata=FUNCTION)
    # sparsemixer only: logits with (best - logit) / max(|logit|, best) > 2 * eps are masked out
    # of a pick's softmax (Phi-3.5-MoE's router_jitter_noise)
    router_jitter_eps: float = field(default=0.01, metadata=at_least(0) | FUNCTION)
    # multiplicative uniform noise on router input, training only
    jitter: float = field(default=0.0, metadata=between(0, 1, high_open=True))
    # Switch/GShard load-balancing loss; 0 disables
    aux_loss_coef: float = field(default=0.01, metadata=at_least(0, "0 disables"))
    # ST-MoE router z-loss; 0 disables
    z_loss_coef: float = field(default=0.001, metadata=at_least(0, "0 disables"))
    # DeepSeek-V3 aux-loss-free balancing; 0 disables
    bias_update_rate: float = field(default=0.0, metadata=at_least(0, "0 disables"))
    # which tokens the load-balancing loss's expert fractions come from: micro_batch (this
    # rank's micro-batch), global_micro_batch (every rank's micro-batch of this micro-step),
    # sequence (each sequence on its own, DeepSeek-V3), global_batch (every rank's micro-batches
    # of this optimizer step so far; Megatron-Core's global_aux_loss); README "Load balancing"
    aux_loss_scope: Literal["micro_batch", "global_micro_batch", "sequence", "global_batch"] = (
        "global_micro_batch"
    )
    # 0 = dropless; else each expert keeps at most ceil(cf * T * k / E) of the copies routed to
    # it, T = the tokens of its expert-parallel group's micro-batches, lowest weight dropped first
    capacity_factor: float = field(default=0.0, metadata=at_least(0, "0 = dropless"))
    # group-limited routing (DeepSeek-V2/V3, GLM-4.5 n_group, topk_group): experts in n_group
    # equal groups; each token picks its topk_group best groups, then its top_k experts inside
    # them. 1 = off
    n_group: int = field(default=1, metadata=at_least(1) | FUNCTION)
    topk_group: int = field(default=1, metadata=at_least(1) | FUNCTION)  # at most n_group
    # a group's score: the sum of its two best selection scores (DeepSeek-V3, GLM-4.5) or its
    # best one (DeepSeek-V2's group_limited_greedy)
    group_score: Literal["top2_sum", "max"] = field(default="top2_sum", metadata=FUNCTION)
    num_shared_experts: int = field(default=0, metadata=at_least(0) | FUNCTION)
    # default num_shared_experts * expert_hidden
    shared_expert_hidden: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # sigmoid gate on the shared expert (Qwen2-MoE style)
    shared_expert_gate: bool = field(default=False, metadata=FUNCTION)
    # compute the shared expert while the expert-parallel all-to-alls are in flight (its
    # projections during the dispatch, its down projection during the combine; same values)
    shared_expert_overlap: bool = True
    grouped_mm: bool = True  # F.grouped_mm for experts; False = per-expert loop
    # experts recompute silu(gate) * up in backward instead of saving it (Megatron-Core's
    # moe_act recompute): 2F values kept per routed copy instead of 3F, ~3% more MoE-block time
    recompute_act: bool = False
    # renormalisation divides the top-k weights by max(their sum, renormalize_min) (ERNIE-4.5's
    # moe_norm_min); 0 = by the plain sum. Only with renormalize (and not topk_before_score)
    renormalize_min: float = field(default=0.0, metadata=at_least(0, "0 = plain sum") | FUNCTION)
    # renormalisation divides by the sum plus renormalize_eps (LFM2-MoE's 1e-6); 0 = the plain
    # sum. Only with renormalize (and not topk_before_score)
    renormalize_eps: float = field(default=0.0, metadata=at_least(0, "0 = plain sum") | FUNCTION)
    # a bias on the router's logits, layers.<i>.ffn.router.gate.bias (E,) (gpt-oss); it
    # shifts the routing scores themselves (unlike the selection bias moe.bias_update_rate moves)
    router_bias: bool = field(default=False, metadata=FUNCTION)
    # biases on every routed expert's projections, ffn.experts.w13_bias (E, 2F) = [gate | up]
    # and ffn.experts.w2_bias (E, D) (gpt-oss); expert parameters like w13 and w2
    expert_biases: bool = field(default=False, metadata=FUNCTION)
    # the routed experts' activation of gate a and up b: "swiglu" silu(a) * b, or
    # "clamped_swiglu" (gpt-oss) (min(b, l).clamp(-l) + 1) * a' * sigmoid(alpha * a'),
    # a' = min(a, l), with alpha = moe.swiglu_alpha and l = moe.swiglu_limit (both required);
    # "geglu" gelu_tanh(a) * b (Gemma's gelu_pytorch_tanh); or "relu2": relu(a)^2 of the up
    # projection a alone, not gated (Nemotron-H's; w13 is then (E, D, F)). Dense layers, the
    # dense branch and shared experts: model.ffn_activation
    activation: Literal["swiglu", "clamped_swiglu", "geglu", "relu2"] = field(
        default="swiglu", metadata=FUNCTION
    )
    swiglu_alpha: float | None = field(default=None, metadata=above(0) | FUNCTION)
    swiglu_limit: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # clamped_swiglu's offset c on the clamped up projection, (b' + c) * a' * sigmoid(alpha a'):
    # gpt-oss's 1; DeepSeek-V4's silu(min(a, l)) * clamp(b, -l, l) is alpha 1, offset 0
    swiglu_up_offset: float = field(
        default=1.0, metadata=at_least(0, "gpt-oss 1, DeepSeek-V4 0") | FUNCTION
    )
    # the routing weight w multiplies each routed copy's input instead of its output: expert e
    # computes expert_e(w * x), and the combine sums the outputs (Llama 4)
    score_on_input: bool = field(default=False, metadata=FUNCTION)
    # Gemma 4's router scalars: the router scores a weightless RMSNorm of its input (eps
    # model.norm_eps) times a learned per-channel scale ffn.router.input_scale (D,) times
    # D^-0.5 (ones at initialisation), and each chosen expert's combine weight (renormalised
    # or not) is multiplied by its learned ffn.router.expert_scale (E,) (ones)
    router_input_norm: bool = field(default=False, metadata=FUNCTION)
    expert_scale: bool = field(default=False, metadata=FUNCTION)
    # every MoE layer also runs a dense FFN (model.dense_hidden, model.ffn_activation) beside
    # its experts (Gemma 4's): with sandwich norms (model.block_norms: sandwich, required) the
    # FFN branch is ffn_post_norm(dense_post_norm(dense(ffn_norm(x))) +
    # moe_post_norm(moe(moe_norm(x)))), the router scoring the residual stream x itself
    dense_branch: bool = field(default=False, metadata=FUNCTION)

    # hash routing (DeepSeek-V4's hash_moe layers): the MoE layers at these transformer layer
    # indices pick each token's top_k experts from a fixed token id -> experts table
    # (ffn.router.token_experts (vocab_size, top_k) int64, a saved buffer, never trained; drawn
    # at initialisation from a generator seeded by the layer index, so identical on every rank);
    # the gate's scores of the chosen experts weight them (renormalize, route_scale as above).
    # null: every MoE layer routes by its scores
    hash_layers: list[int] | None = field(default=None, metadata=FUNCTION)

    # latent MoE (Nemotron 3 Super's moe_latent_size): the routed experts compute in a latent
    # of this size, x projected into it (ffn.latent_in, D -> latent_dim) before the dispatch
    # and their combined output back (ffn.latent_out) after the combine; the router and the
    # shared experts read x itself. null: the experts compute in d_model
    latent_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # a shortcut-connected MoE (LongCat-Flash's ScMoE): an MoE layer's block also runs a dense
    # FFN (model.dense_hidden) on the experts' input and adds it to the residual stream; the
    # experts' output joins the stream at the end of the next block, whose FFN is dense
    # (moe.layer_ffns alternating moe, dense; no multi-token prediction)
    shortcut: bool = field(default=False, metadata=FUNCTION)
    # zero-computation experts (LongCat-Flash's zero_expert_num): the router chooses its
    # top_k among num_experts + zero_experts; a copy routed to a zero expert returns the
    # token's input times its weight, with no computation, dispatch or capacity slot
    # (docs/MOE.md "Zero experts"). 0 = none
    zero_experts: int = field(default=0, metadata=at_least(0, "0 = none") | FUNCTION)

    def swiglu_clamp(self) -> tuple[float, float, float] | None:
        """``(alpha, limit, offset)`` of the clamped SwiGLU, None where unset (the experts'
        with ``moe.activation: clamped_swiglu``; the dense FFNs' and shared experts' with
        ``model.ffn_activation: clamped_swiglu``)."""
        if self.swiglu_alpha is None or self.swiglu_limit is None:
            return None
        return self.swiglu_alpha, self.swiglu_limit, self.swiglu_up_offset

    @property
    def gated(self) -> bool:
        """Whether the routed experts are gated (w13 holds a gate and an up projection)."""
        return self.activation != "relu2"

    def ffn_kind(self, layer: int) -> FFNKind:
        """Block ``layer``'s FFN (the layer plan's, :mod:`moetrain.config.layer_plan`): its
        entry of ``layer_ffns``; else after ``first_k_dense`` dense layers every
        ``moe_every``-th layer is MoE (the last of each group of ``moe_every``, as Qwen2-MoE's
        ``decoder_sparse_step`` counts) and the others dense."""
        if self.layer_ffns is not None and layer < len(self.layer_ffns):
            return self.layer_ffns[layer]
        if layer < self.first_k_dense:
            return "dense"
        return "moe" if (layer - self.first_k_dense + 1) % self.moe_every == 0 else "dense"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer``'s FFN is an MoE layer (:meth:`ffn_kind`)."""
        return self.ffn_kind(layer) == "moe"

    def moe_layers(self, n_layers: int) -> list[int]:
        """Transformer layer indices of the MoE layers, in order (position = MoE layer index)."""
        return [i for i in range(n_layers) if self.is_moe_layer(i)]

    @property
    def routed_choices(self) -> int:
        """How many experts the router scores: the routed ones and the zero experts."""
        return self.num_experts + self.zero_experts

    @property
    def shared_hidden(self) -> int:
        """Hidden size of the (single, merged) shared-expert SwiGLU."""
        return self.shared_expert_hidden or self.num_shared_experts * self.expert_hidden

    def _validate_groups(self) -> None:
        require(
            self.n_group >= 1 and self.num_experts % max(self.n_group, 1) == 0,
            "moe.n_group",
            f"must be >= 1 and divide moe.num_experts={self.num_experts}; got {self.n_group}",
        )
        require(
            1 <= self.topk_group <= self.n_group,
            "moe.topk_group",
            f"must be between 1 and moe.n_group={self.n_group}; got {self.topk_group}",
        )
        reachable = self.topk_group * (self.routed_choices // self.n_group)
        require(
            self.top_k <= reachable,
            "moe.topk_group",
            f"moe.top_k={self.top_k} experts must fit in topk_group={self.topk_group} groups of "
            f"{self.num_experts // self.n_group} experts; raise it to at least "
            f"{-(-self.top_k * self.n_group // self.num_experts)}",
        )

    def validate(self) -> None:
        require(
            self.layer_ffns is None or (self.first_k_dense == 0 and self.moe_every == 1),
            "moe.layer_ffns",
            "places every layer's FFN: leave moe.first_k_dense and moe.moe_every unset",
        )
        bound = "moe.num_experts + moe.zero_experts" if self.zero_experts else "moe.num_experts"
        require(
            1 <= self.top_k <= self.routed_choices,
            "moe.top_k",
            f"must be between 1 and {bound}={self.routed_choices}; got {self.top_k}",
        )
        if self.zero_experts:
            self._validate_zero_experts()
        self._validate_groups()
        require(
            not (self.shared_expert_gate and self.num_shared_experts == 0),
            "moe.shared_expert_gate",
            "needs moe.num_shared_experts >= 1",
        )
        clamped = self.activation == "clamped_swiglu"
        for key in ("swiglu_alpha", "swiglu_limit"):
            require(
                (getattr(self, key) is not None) == clamped,
                f"moe.{key}",
                "is set exactly with moe.activation=clamped_swiglu",
            )
        require(
            clamped or self.swiglu_up_offset == 1.0,
            "moe.swiglu_up_offset",
            "applies to moe.activation=clamped_swiglu only; leave it at 1.0",
        )
        if self.router_type == "sparsemixer":
            self._validate_sparsemixer()
        require(
            not self.hash_layers or not (self.topk_before_score or self.router_type != "topk"),
            "moe.hash_layers",
            "weights the table's experts by their scores: needs moe.router_type=topk and "
            "moe.topk_before_score=false",
        )
        require(
            self.renormalize_min == 0 or (self.renormalize and not self.topk_before_score),
            "moe.renormalize_min",
            "only applies with moe.renormalize=true and moe.topk_before_score=false",
        )
        require(
            self.renormalize_eps == 0 or (self.renormalize and not self.topk_before_score),
            "moe.renormalize_eps",
            "only applies with moe.renormalize=true and moe.topk_before_score=false",
        )

    def is_hash_layer(self, layer: int) -> bool:
        """Whether transformer layer ``layer``'s MoE routes by its token-id table
        (``moe.hash_layers``)."""
        return self.hash_layers is not None and layer in self.hash_layers

    def _validate_zero_experts(self) -> None:
        """What zero experts cannot be combined with (each would need a rule of its own)."""
        for key, bad, why in (
            ("router_type", self.router_type != "topk", "must be topk"),
            ("n_group", self.n_group != 1, "must be 1 (expert groups over the routed experts)"),
            ("topk_before_score", self.topk_before_score, "must be false"),
            ("expert_scale", self.expert_scale, "must be false (a scale per routed expert)"),
            ("latent_dim", self.latent_dim is not None, "must be null (identity in d_model)"),
            ("hash_layers", self.hash_layers is not None, "must be null (a table of routed ids)"),
        ):
            require(not bad, f"moe.{key}", f"{why} with moe.zero_experts > 0")

    def _validate_sparsemixer(self) -> None:
        """sparsemixer picks two experts from the softmax logits on its own terms."""
        for key, bad, why in (
            ("top_k", self.top_k != 2, "must be 2 (it picks two experts)"),
            ("score_func", self.score_func != "softmax", "must be softmax"),
            ("topk_before_score", self.topk_before_score, "must be false"),
            ("renormalize", self.renormalize, "must be false (its weights are its own)"),
            ("n_group", self.n_group != 1, "must be 1 (no expert groups)"),
            ("bias_update_rate", self.bias_update_rate != 0, "must be 0 (no selection bias)"),
        ):
            require(not bad, f"moe.{key}", f"{why} with moe.router_type=sparsemixer")
