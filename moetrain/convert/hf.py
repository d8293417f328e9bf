"""Weight mapping between moetrain's Transformer and Hugging Face models of any registered
family (:mod:`moetrain.convert.families`; each says how its names differ from Llama's in its
:class:`~moetrain.convert.families.WeightNames`).

The Hugging Face side uses each family's per-expert key layout (Mixtral
``block_sparse_moe.experts.M.w1.weight``; the others ``mlp.experts.M.gate_proj.weight``), which
transformers v4 loads as is and v5 fuses at load time, or the fused layout of the families
whose files hold experts fused (Granite-MoE's ``block_sparse_moe.input_linear.weight``
(E, 2F, D) = [gate; up] and ``output_linear.weight`` (E, D, F): ``WeightNames.fused_experts``;
its shared expert's gate and up are one tensor too, ``WeightNames.shared_fused``, joined and
split by :func:`joined_key_map`). :func:`from_hf_state_dict` also accepts v5's fused
in-memory layout (``mlp.experts.gate_up_proj`` (E, 2F, D) / ``down_proj`` (E, D, F),
``mlp.gate.weight``). Expert weights: moetrain ``w13`` (E, D, 2F) = ``[w1 | w3]`` and ``w2``
(E, F, D); HF stores ``w1`` (gate), ``w3`` (up) and ``w2`` (down) per expert, transposed
(``nn.Linear`` layout (out, in)).

Multi-token-prediction blocks (``model.mtp_depth``, families with ``Family.mtp``) take the
layout of DeepSeek-V3's released files: ``model.layers.<n_layers + k - 1>.`` holds the block
under the usual names plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``, and
copies of the shared embedding and head (``embed_tokens``, ``shared_head.head``), which
inference engines read there (:func:`mtp_copies`; an import reads the originals).

Mapping works on any part of a state dict (the converter streams the dense weights, then one
layer of experts at a time).
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable

import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.config import Config, ConfigError
from moetrain.convert.families import family
from moetrain.convert.families.base import SWIGLU
from moetrain.convert.formats import check_format
from moetrain.model import param_names as pn
from moetrain.model.moe.experts import expert_param_names, pack_w13, unpack_w13

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
# multi-head latent attention (DeepSeek's names); a query LoRA replaces wq with wq_a, q_norm, wq_b
_MLA = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj"}
_MLA_QUERY_LORA = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"}
# a multi-token-prediction block's own weights: moetrain norm -> HF name in the layer
_MTP_NORMS = {"enorm": "enorm", "hnorm": "hnorm", "head_norm": "shared_head.norm"}


def _layer(layer: int) -> str:
    return f"model.layers.{layer}."


def fused_experts(fmt: str, layer: int) -> str:
    """The prefix of transformers v5's fused expert tensors of a layer (``gate_up_proj``
    (E, 2F, D), ``down_proj`` (E, D, F)); some files are saved that way."""
    return f"{_layer(layer)}{family(fmt).names.v5_block}.experts."


def fused_expert_names(fmt: str, layer: int, have: Container[str]) -> tuple[str, str] | None:
    """The names of a layer's fused expert tensors, gate_up (E, 2F, D) and down (E, D, F),
    among ``have``: transformers v5's in-memory ones where ``have`` holds them, else the
    family's own where its files hold experts fused; None: one tensor per expert, or gpt-oss's
    interleaved layout or Llama 4's (:func:`stacked_expert_names`)."""
    if family(fmt).names.stacked_experts is not None:
        return None
    v5 = fused_experts(fmt, layer)
    if v5 + "gate_up_proj" in have:
        return v5 + "gate_up_proj", v5 + "down_proj"
    names = family(fmt).names
    if names.fused_experts is None:
        return None
    block = f"{_layer(layer)}{names.moe_block}."
    gate_up, down = names.fused_experts
    return f"{block}{gate_up}.weight", f"{block}{down}.weight"


# moetrain's stacked expert tensor -> its name under the MoE block's experts (gpt-oss, Llama 4)
_STACKED = {
    "w13": "gate_up_proj",
    "w2": "down_proj",
    "w13_bias": "gate_up_proj_bias",
    "w2_bias": "down_proj_bias",
}


def stacked_expert_names(cfg: Config, fmt: str, layer: int) -> dict[str, str]:
    """moetrain expert tensor name (``w13``, ``w2``, their biases) -> HF key, for a family
    whose files hold the experts stacked in moetrain's orientation (``WeightNames.
    stacked_experts``: gpt-oss's interleaved layout, Llama 4's concatenated one)."""
    prefix = fused_experts(fmt, layer)
    return {w: prefix + _STACKED[w] for w in expert_param_names(cfg.moe.expert_biases)}


def interleave(t: torch.Tensor) -> torch.Tensor:
    """``[gate | up]`` along the last dim (moetrain's w13 and its bias) -> gate and up
    interleaved (gpt-oss's gate_up_proj: gate the even columns)."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave`."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def from_stacked(fmt: str, weight: str, t: torch.Tensor) -> torch.Tensor:
    """``fmt``'s stacked tensor of moetrain's expert ``weight`` (same orientation: w13
    (E, D, 2F), w2 (E, F, D)) -> moetrain's (gpt-oss's gate and up de-interleaved)."""
    interleaved = family(fmt).names.stacked_experts == "interleaved"
    return deinterleave(t) if interleaved and weight.startswith("w13") else t


def to_stacked(fmt: str, weight: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`from_stacked`."""
    interleaved = family(fmt).names.stacked_experts == "interleaved"
    return interleave(t) if interleaved and weight.startswith("w13") else t


def in_memory_name(fmt: str, key: str) -> str:
    """transformers v5's in-memory name of the HF key ``key`` (files saved with fused experts
    use it): the MoE block is ``mlp`` there (Mixtral's ``block_sparse_moe``; Granite keeps
    its name), a family's selection bias may sit elsewhere (ERNIE's
    ``gate.moe_statics.e_score_correction_bias``), and its router may be named otherwise
    (Granite's ``router.layer`` is ``router`` there)."""
    names = family(fmt).names
    key = key.replace(f".{names.moe_block}.", f".{names.v5_block}.")
    if names.expert_bias_v5 and key.endswith(f".{names.v5_block}.{names.expert_bias}"):
        key = key.removesuffix(names.expert_bias) + names.expert_bias_v5
    router = f".{names.v5_block}.{names.router}.weight"
    if key.endswith(router):
        key = key.removesuffix(router) + f".{names.v5_block}.{names.v5_router}.weight"
    return key


def hf_shape(fmt: str, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape in ``fmt``'s files of the moetrain tensor ``key`` of shape ``shape`` (a
    selection bias stored as one row (1, E) where the family does; otherwise ``shape``)."""
    if family(fmt).names.expert_bias_row and pn.is_expert_bias(key):
        return (1, *shape)
    return shape


def expert_key(fmt: str, layer: int, expert: int, name: str) -> str:
    """HF per-expert key of moetrain's ``w1``/``w3``/``w2`` of one expert."""
    names = family(fmt).names
    return f"{_layer(layer)}{names.moe_block}.experts.{expert}.{names.expert[name]}.weight"


def expert_shapes(cfg: Config, fmt: str, layer: int) -> dict[str, tuple[int, ...]]:
    """HF per-expert key -> shape of every expert weight of MoE layer ``layer`` (the two
    fused tensors where ``fmt``'s files hold experts fused)."""
    d, f, e = cfg.model.d_model, cfg.moe.expert_hidden, cfg.moe.num_experts
    if family(fmt).names.stacked_experts is not None:
        shapes = {"w13": (e, d, 2 * f), "w2": (e, f, d), "w13_bias": (e, 2 * f), "w2_bias": (e, d)}
        return {hf: shapes[w] for w, hf in stacked_expert_names(cfg, fmt, layer).items()}
    if family(fmt).names.fused_experts is not None:
        gate_up, down = fused_expert_names(fmt, layer, ())
        return {gate_up: (e, 2 * f, d), down: (e, d, f)}
    return {
        expert_key(fmt, layer, e, w): shape
        for e in range(cfg.moe.num_experts)
        for w, shape in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f)))
    }


def is_expert_tensor(fmt: str, key: str) -> bool:
    """Whether the HF key ``key`` of ``fmt`` holds expert weights (per expert, or fused)."""
    names = family(fmt).names
    blocks = "|".join(map(re.escape, {names.moe_block, names.v5_block}))
    tensors = [r"experts\."]
    if names.fused_experts is not None:
        tensors += [rf"{re.escape(n)}\.weight$" for n in names.fused_experts]
    pattern = rf"model\.layers\.\d+\.({blocks})\.({'|'.join(tensors)})"
    return re.match(pattern, key) is not None


def ffn_key_map(layer: int, block: str = "mlp") -> dict[str, str]:
    """The dense SwiGLU of ``layer``: moetrain key -> HF key (gate and up (F, D), down (D, F))
    under the decoder layer's module ``block`` (``WeightNames.dense_block``)."""
    return {pn.dense_ffn(layer, w): f"{_layer(layer)}{block}.{p}.weight" for w, p in SWIGLU.items()}


def attention_names(cfg: Config) -> dict[str, str]:
    """moetrain -> HF name of each attention weight's module (grouped-query or latent)."""
    if cfg.model.attention != "mla":
        return _ATTN
    query = _MLA_QUERY_LORA if cfg.model.q_lora_rank is not None else {"wq": "q_proj"}
    return {**query, **_MLA, "wo": "o_proj"}


def cat_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """moetrain's ``w13`` (E, D, 2F) -> the fused gate_up (E, 2F, D) = [gate; up]."""
    w1, w3 = unpack_w13(w13)
    return torch.cat([w1.mT, w3.mT], dim=1)


def dense_key_map(cfg: Config, fmt: str) -> dict[str, str]:
    """moetrain key -> HF key for every non-expert weight (and a family's expert bias)."""
    model, moe, names = cfg.model, cfg.moe, family(fmt).names
    # the norms' tensors: a weight, and a bias with LayerNorm
    kinds = ("weight", "bias") if model.norm == "layernorm" else ("weight",)
    out = {pn.EMBED: "model.embed_tokens.weight", pn.FINAL_NORM: "model.norm.weight"}
    if model.norm == "layernorm":
        out[pn.FINAL_NORM_BIAS] = "model.norm.bias"
    if not model.tie_embeddings:
        out[pn.LM_HEAD] = "lm_head.weight"
    if model.lm_head_bias:  # (the head's own, tied or not)
        out[pn.LM_HEAD_BIAS] = "lm_head.bias"
    for i in range(model.n_blocks):
        dst = _layer(i)
        if i >= model.n_layers:
            out[pn.mtp_projection(i)] = dst + "eh_proj.weight"
            for ours, theirs in _MTP_NORMS.items():
                for kind in kinds:
                    out[pn.mtp_norm(i, ours, kind)] = f"{dst}{theirs}.{kind}"
        for kind in kinds:
            out[pn.attn_norm(i, kind)] = f"{dst}input_layernorm.{kind}"
            out[pn.ffn_norm(i, kind)] = f"{dst}post_attention_layernorm.{kind}"
        for ours, theirs in attention_names(cfg).items():
            out[pn.attn(i, ours)] = f"{dst}self_attn.{theirs}.weight"
            if model.o_bias if ours == "wo" else model.qkv_bias:
                out[pn.attn(i, ours, "bias")] = f"{dst}self_attn.{theirs}.bias"
        if model.attention_sinks:
            out[pn.attn_sinks(i)] = dst + "self_attn.sinks"
        if model.qk_norm:
            out[pn.qk_norm(i, "q")] = dst + "self_attn.q_norm.weight"
            out[pn.qk_norm(i, "k")] = dst + "self_attn.k_norm.weight"
        if not moe.is_moe_layer(i):
            out |= ffn_key_map(i, names.dense_block)
            continue
        block = f"{dst}{names.moe_block}."
        out[pn.router_gate(i)] = f"{block}{names.router}.weight"
        if moe.router_bias:
            out[pn.router_gate(i, "bias")] = f"{block}{names.router}.bias"
        if names.expert_bias:
            out[pn.expert_bias(i)] = block + names.expert_bias
        if moe.num_shared_experts > 0 and names.shared_fused is not None:
            out[pn.shared_expert(i, "w2")] = f"{dst}{names.shared_fused[1]}.weight"
        elif moe.num_shared_experts > 0:  # (fused: w1 and w3 are joined_key_map's)
            for w, p in SWIGLU.items():
                out[pn.shared_expert(i, w)] = f"{block}{names.shared_expert}.{p}.weight"
        if moe.shared_expert_gate:
            out[pn.shared_gate(i)] = f"{block}{names.shared_gate}.weight"
    return out


def joined_key_map(cfg: Config, fmt: str) -> dict[str, tuple[str, ...]]:
    """HF key -> the moetrain keys its tensor joins along dim 0, in order: the shared expert's
    gate and up (w1, w3) of a family that stores them as one (``WeightNames.shared_fused``)."""
    names, moe = family(fmt).names, cfg.moe
    if names.shared_fused is None or moe.num_shared_experts == 0:
        return {}
    return {
        f"{_layer(i)}{names.shared_fused[0]}.weight": (
            pn.shared_expert(i, "w1"),
            pn.shared_expert(i, "w3"),
        )
        for i in moe.moe_layers(cfg.model.n_blocks)
    }


def joined_shapes(
    cfg: Config, fmt: str, shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of each joined tensor (:func:`joined_key_map`), from the moetrain
    tensors' ``shapes``."""
    out = {}
    for theirs, ours in joined_key_map(cfg, fmt).items():
        first = shapes[ours[0]]
        out[theirs] = (sum(shapes[k][0] for k in ours), *first[1:])
    return out


def mtp_copies(cfg: Config) -> dict[str, str]:
    """HF key -> moetrain key of the shared embedding and head that each multi-token-prediction
    layer of the file holds a copy of."""
    m = cfg.model
    head = pn.EMBED if m.tie_embeddings else pn.LM_HEAD
    out = {}
    for i in range(m.n_layers, m.n_blocks):
        out[_layer(i) + "embed_tokens.weight"] = pn.EMBED
        out[_layer(i) + "shared_head.head.weight"] = head
    return out


def stored_mtp_depth(names: Iterable[str], n_layers: int, declared: int) -> int:
    """How many of the ``declared`` multi-token-prediction layers after ``n_layers`` decoder
    layers the tensor ``names`` hold (transformers' own saves have none); a layer holding
    tensors but not its projection is a CheckpointError naming the missing tensor."""
    have = set(names)
    depth = 0
    while depth < declared and f"{_layer(n_layers + depth)}eh_proj.weight" in have:
        depth += 1
    partial = sorted(n for n in have if n.startswith(_layer(n_layers + depth)))
    if depth < declared and partial:  # a layer without its projection: not a module
        raise CheckpointError(
            f"tensor {_layer(n_layers + depth)}eh_proj.weight is missing: multi-token-prediction "
            f"layer {n_layers + depth} holds {len(partial)} other tensors ({partial[0]}, ...)"
        )
    return depth


def zero_qkv_biases(cfg: Config, fmt: str) -> dict[str, tuple[str, int]]:
    """For a family whose q/k/v projections always have biases (Qwen2-MoE) and a model
    without them: moetrain projection key -> (HF bias key, length), written as zeros."""
    m = cfg.model
    if not family(fmt).names.qkv_bias_always or m.qkv_bias:
        return {}
    heads = {"wq": m.n_heads, "wk": m.n_kv_heads, "wv": m.n_kv_heads}
    return {
        pn.attn(i, ours): (f"{_layer(i)}self_attn.{_ATTN[ours]}.bias", n * m.attention_head_dim)
        for i in range(m.n_blocks)
        for ours, n in heads.items()
    }


def zero_shared_expert(cfg: Config, fmt: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """For a family whose MoE layers always hold a gated shared expert (Qwen2-MoE) and a model
    without one: moetrain router key of each MoE layer -> the HF tensors of a shared expert of
    hidden size 0 (which computes nothing, as ``shared_expert_intermediate_size: 0`` says) and
    of its gate -> their shapes, written as zeros beside the router."""
    names, moe, d = family(fmt).names, cfg.moe, cfg.model.d_model
    if not names.shared_expert_always or moe.num_shared_experts:
        return {}
    out = {}
    for i in moe.moe_layers(cfg.model.n_blocks):
        block = f"{_layer(i)}{names.moe_block}."
        shapes = {
            f"{block}{names.shared_expert}.{p}.weight": (d, 0) if w == "w2" else (0, d)
            for w, p in SWIGLU.items()
        }
        out[pn.router_gate(i)] = shapes | {f"{block}{names.shared_gate}.weight": (1, d)}
    return out


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: Config, fmt: str
) -> dict[str, torch.Tensor]:
    """A moetrain state dict, or any part of one, -> HF keys of ``fmt`` (contiguous tensors).

    Raises ConfigError for a setting or a tensor (non-zero expert bias) ``fmt`` cannot hold.
    """
    check_format(fmt, cfg.model, cfg.moe)
    keys, zeros = dense_key_map(cfg, fmt), zero_qkv_biases(cfg, fmt)
    no_shared = zero_shared_expert(cfg, fmt)
    joined = joined_key_map(cfg, fmt)
    joined_part = {k for ours in joined.values() for k in ours}
    fused_files = family(fmt).names.fused_experts is not None
    stacked = family(fmt).names.stacked_experts is not None
    out: dict[str, torch.Tensor] = {}
    for theirs, ours in joined.items():
        if any(k in state_dict for k in ours):
            out[theirs] = torch.cat([state_dict[k] for k in ours], dim=0)
    for theirs, ours in mtp_copies(cfg).items():
        if ours in state_dict:
            out[theirs] = state_dict[ours]
    for key, t in state_dict.items():
        if expert := pn.parse_experts(key):
            layer, weight = expert
            if stacked:  # gpt-oss, Llama 4: moetrain's orientation
                out[stacked_expert_names(cfg, fmt, layer)[weight]] = to_stacked(fmt, weight, t)
                continue
            fused = fused_expert_names(fmt, layer, ()) if fused_files else None
            if fused is not None:  # gate_up (E, 2F, D) = [gate; up], down (E, D, F)
                out[fused[weight == "w2"]] = t.mT if weight == "w2" else cat_gate_up(t)
                continue
            if weight == "w13":
                parts = dict(zip(("w1", "w3"), unpack_w13(t), strict=True))
            else:
                parts = {"w2": t}
            for name, w in parts.items():
                for e in range(w.shape[0]):
                    out[expert_key(fmt, layer, e, name)] = w[e].t()
        elif key in keys:
            out[keys[key]] = t.reshape(hf_shape(fmt, key, tuple(t.shape)))
            if key in zeros:
                out[zeros[key][0]] = torch.zeros(zeros[key][1])
            for theirs, shape in no_shared.get(key, {}).items():
                out[theirs] = torch.zeros(shape)
        elif key in joined_part:
            continue  # (joined above)
        elif pn.is_expert_bias(key):
            if bool(t.ne(0).any()):
                raise ConfigError(
                    f"{key}: non-zero expert bias cannot be represented in {fmt} (it changes "
                    "which experts are selected)"
                )
        elif not (cfg.model.tie_embeddings and key == pn.LM_HEAD):
            raise ConfigError(f"{key}: no {fmt} equivalent for this tensor")
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf_state_dict(
    hf_state_dict: dict[str, torch.Tensor],
    cfg: Config,
    fmt: str,
    expert_layers: Iterable[int] | None = None,
    dense: bool = True,
) -> dict[str, torch.Tensor]:
    """HF state dict of ``fmt`` (per-expert or v5 fused layout) -> moetrain state dict.

    ``expert_layers``: the MoE layers whose experts to map (default all); ``dense``: whether to
    map the non-expert weights. Streaming readers pass one layer at a time.
    """
    check_format(fmt, cfg.model, cfg.moe)
    sd, moe, names = hf_state_dict, cfg.moe, family(fmt).names
    block = names.moe_block
    v5_router = f".{names.v5_block}.{names.v5_router}.weight"
    router = f".{block}.{names.router}.weight"
    if v5_router != router:  # the router under its v5 in-memory name (in_memory_name)
        sd = {
            (k.removesuffix(v5_router) + router if k.endswith(v5_router) else k): v
            for k, v in sd.items()
        }
    if names.expert_bias_v5:  # the selection bias under its v5 in-memory name
        v5 = f".{block}.{names.expert_bias_v5}"
        sd = {
            (k.removesuffix(v5) + f".{block}.{names.expert_bias}" if k.endswith(v5) else k): v
            for k, v in sd.items()
        }

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"{fmt} state dict has no {key!r}")
        return sd[key]

    out: dict[str, torch.Tensor] = {}
    if dense:
        names = dense_key_map(cfg, fmt)
        out = {ours: get(theirs) for ours, theirs in names.items()}
        for theirs, ours in joined_key_map(cfg, fmt).items():
            out |= dict(zip(ours, get(theirs).chunk(len(ours), dim=0), strict=True))
        if cfg.model.tie_embeddings:
            out[pn.LM_HEAD] = out[pn.EMBED]
        mapped = set(names.values())
        for key, t in sd.items():
            bias = re.search(r"self_attn\.[qkvo]_proj\.bias$", key)
            if bias and key not in mapped and bool(t.ne(0).any()):
                raise ConfigError(f"{key}: non-zero attention bias; moetrain attention has none")
        for i in moe.moe_layers(cfg.model.n_blocks):
            bias = pn.expert_bias(i)
            if bias in out:
                out[bias] = out[bias].float().reshape(moe.num_experts)
            else:
                out[bias] = torch.zeros(moe.num_experts)
    layers = range(cfg.model.n_blocks) if expert_layers is None else expert_layers
    for i in layers:
        if not moe.is_moe_layer(i):
            continue
        if family(fmt).names.stacked_experts is not None:
            for w, theirs in stacked_expert_names(cfg, fmt, i).items():
                out[pn.experts(i, w)] = from_stacked(fmt, w, get(theirs))
            continue
        fused = fused_expert_names(fmt, i, sd)
        if fused is not None:  # fused layout (transformers v5's, or the family's files')
            f = moe.expert_hidden
            gate_up = get(fused[0])  # (E, 2F, D)
            out[pn.experts(i, "w13")] = pack_w13(gate_up[:, :f].mT, gate_up[:, f:].mT)
            out[pn.experts(i, "w2")] = get(fused[1]).transpose(1, 2)
        else:
            w1, w3, w2 = (
                torch.stack([get(expert_key(fmt, i, e, n)).t() for e in range(moe.num_experts)])
                for n in ("w1", "w3", "w2")
            )
            out[pn.experts(i, "w13")], out[pn.experts(i, "w2")] = pack_w13(w1, w3), w2
    return {k: v.detach().contiguous() for k, v in out.items()}
