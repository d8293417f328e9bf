"""The one weight mapper between moetrain's ``Transformer`` and a family's Hugging Face files:
:class:`WeightMap`, built from the model's own tensor names and the family's declared
:class:`~moetrain.convert.families.layout.Layout`.

``moetrain convert`` writes with it, a part at a time (the dense weights, then one MoE layer's
experts); ``moetrain import`` and ``checkpoint.init_from`` read with it, each expert-parallel
rank only its own experts, from the files' names or from transformers v5's in-memory ones,
whichever the source holds. Every moetrain tensor has exactly one entry
(:mod:`moetrain.convert.weight_entries`: which tensors of the files hold it, and the transform);
the files' other tensors are ``fillers`` (zeros that the family's class always holds) and
``copies`` (the multi-token-prediction layers' copies of the embedding and head).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection

import torch

from moetrain.config import Config, ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.convert.families import family
from moetrain.convert.families.layout import (
    NOT_GATED,
    SWIGLU,
    V5_FUSED,
    Fused,
    Layout,
    PerExpert,
    Stacked,
)
from moetrain.convert.mixer_names import MIXER_NAMES, block_name, rename
from moetrain.convert.weight_entries import (
    Column,
    Entry,
    Experts,
    FusedFiles,
    GroupedRows,
    HeadHalves,
    IntegerTable,
    Joined,
    NoSelectionBias,
    PerExpertFiles,
    RowParts,
    SelectionBias,
    Shape,
    StackedFiles,
    TensorSource,
    UnusedSelectionBias,
)
from moetrain.model import param_names as pn
from moetrain.model.moe.experts import expert_param_names
from moetrain.model.transformer import Transformer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# tensors a file may hold that the model has none of: read only to check that they are zero
ZERO_ONLY = re.compile(r"self_attn\.[qkvo]_proj\.bias$")
TOKEN_EXPERTS = block_name(pn.token_experts(0), None)  # hash routing's table, in a block
# a moetrain tensor of block i: layers.<i>.*
_OUR_BLOCK = re.compile(r"layers\.(\d+)\.")


def under(block: str, name: str) -> str:
    """``name`` inside module ``block`` (``Layout.moe_block``; "" the decoder layer itself)."""
    return f"{block}.{name}" if block else name


def decoder_layer(name: str) -> int:
    """The decoder-layer index of a Hugging Face tensor name (-1 outside the layers)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def in_memory(layout: Layout) -> Layout:
    """transformers v5's in-memory names of ``layout`` (``Layout.in_memory``; per-expert and
    fused experts as :data:`~moetrain.convert.families.layout.V5_FUSED`)."""
    r, bias = layout.in_memory, layout.selection_bias
    return dataclasses.replace(
        layout,
        renames={**layout.renames, **layout.in_memory_renames},
        mixer_renames={},
        joined=bool(layout.in_memory_joined),
        base=r.get(layout.base, layout.base),
        embed=r.get(layout.embed, layout.embed),
        lm_head=r.get(layout.lm_head, layout.lm_head),
        final_norm=_rebased(layout.final_norm, layout.base, r.get(layout.base, layout.base)),
        moe_block=r.get(layout.moe_block, layout.moe_block),
        dense_block=r.get(layout.dense_block, layout.dense_block),
        router=r.get(layout.router, layout.router),
        selection_bias=r.get(bias, bias) if bias else None,
        hyper_head=tuple(r.get(h, h) for h in layout.hyper_head),
        experts=(
            layout.experts
            if isinstance(layout.experts, Stacked)
            else layout.in_memory_experts or V5_FUSED
        ),
    )


def _rebased(name: str, base: str, new_base: str) -> str:
    """``name`` under ``new_base`` where it lies under ``base``."""
    return new_base + name.removeprefix(base) if name.startswith(base) else name


def _meta_shapes(cfg: Config) -> dict[str, Shape]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Transformer(cfg.model, cfg.moe).state_dict().items()}


class _Plan:
    """The entries, fillers and copies of one layout (:class:`WeightMap` builds one, two when
    it reads)."""

    def __init__(self, cfg: Config, fmt: str, layout: Layout, shapes: dict[str, Shape]) -> None:
        self.cfg, self.fmt, self.layout, self.shapes = cfg, fmt, layout, shapes
        self.entries: list[Entry] = []
        self.fillers: dict[str, tuple[Shape, str]] = {}  # HF name -> (shape, beside which)
        self.copies: dict[str, str] = {}  # HF name -> the moetrain tensor it copies
        names = [n for n in shapes if not pn.parse_experts(n)]
        top = {
            pn.EMBED: f"{layout.base}{layout.embed}.weight",
            pn.FINAL_NORM: f"{layout.final_norm}.weight",
            pn.FINAL_NORM_BIAS: f"{layout.final_norm}.bias",
            pn.LM_HEAD_BIAS: f"{layout.lm_head}.bias",
        }
        if not cfg.model.tie_embeddings:
            top[pn.LM_HEAD] = f"{layout.lm_head}.weight"
        for ours, theirs in zip(pn.HC_TENSORS, layout.hyper_head, strict=True):
            top[pn.hyper_head(ours)] = layout.base + theirs
        for name in names:
            if name in top:
                self.entries.append(Entry((name,), (top[name],)))
        for i in range(cfg.model.n_blocks):
            self._block(i, [n for n in names if n.startswith(f"layers.{i}.")])
        unmapped = [n for n in names if n not in top and not n.startswith("layers.")]
        if unmapped and unmapped != [pn.LM_HEAD]:
            raise ConfigError(f"{unmapped[0]}: no {fmt} equivalent for this tensor")
        for i in cfg.moe.moe_layers(cfg.model.n_blocks):
            self.entries.append(self._experts(i))

    def _block_rules(self, i: int) -> dict[str, str]:
        """A block's names that are the same whatever its mixer: norms, FFN, MTP's own."""
        lay, moe = self.layout, self.layout.moe_block
        rules = {block_name(pn.attn_norm(0)): "input_layernorm"}
        ffn_norm = "post_attention_layernorm"
        if self.cfg.model.norm_placement(i) != "pre":  # sandwich or post norms
            mixer_out, ffn_norm, ffn_out = lay.sandwich_norms
            rules[block_name(pn.post_norm(0, "attn"))] = mixer_out
            rules[block_name(pn.post_norm(0, "ffn"))] = ffn_out
        rules[block_name(pn.ffn_norm(0))] = ffn_norm
        mlp = NOT_GATED if self.cfg.model.ffn_activation == "relu2" else SWIGLU
        for w, p in mlp.items():
            rules[block_name(pn.dense_ffn(0, w))] = f"{lay.dense_block}.{p}"
            rules[block_name(pn.dense_branch(0, w))] = f"{lay.dense_block}.{p}"
            rules[block_name(pn.shared_expert(0, w))] = under(moe, f"{lay.shared_expert}.{p}")
        for ours, theirs in zip(pn.LATENT_PROJECTIONS, lay.latent, strict=True):
            rules[block_name(pn.latent_projection(0, ours))] = under(moe, theirs)
        rules[block_name(pn.router_gate(0))] = under(moe, lay.router)
        rules[block_name(pn.shared_gate(0))] = under(moe, lay.shared_gate)
        for which, theirs in zip(pn.BRANCH_NORMS, lay.branch_norms, strict=True):
            rules[block_name(pn.branch_norm(0, which))] = theirs
        for which, theirs in zip(("input_scale", "expert_scale"), lay.router_scalars, strict=True):
            rules[block_name(pn.router_scalar(0, which), None)] = under(moe, theirs)
        rules[block_name(pn.layer_scalar(0), None)] = lay.layer_scalar
        for hc in (
            block_name(pn.hyper_connection(0, b, t), None)
            for b in pn.HC_BRANCHES
            for t in pn.HC_TENSORS
        ):
            rules[hc] = hc  # (transformers' names; Layout.hyper_head)
        rules[TOKEN_EXPERTS] = under(moe, f"{lay.router}.{lay.hash_table}")
        return rules

    def _mtp_rules(self, i: int) -> tuple[dict[str, str], str]:
        """A multi-token-prediction block's own weights (norms, projection) and their prefix
        (none for a decoder layer)."""
        lay, n = self.layout.mtp, self.cfg.model.n_layers
        if lay is None or i < n:
            return {}, ""
        rules = {block_name(pn.mtp_norm(0, which)): getattr(lay, which) for which in pn.MTP_NORMS}
        rules[block_name(pn.mtp_projection(0))] = lay.eh_proj
        return rules, lay.own_prefix(n, i)

    def _prefix(self, i: int) -> str:
        """Block ``i``'s decoder layer in the files (a multi-token-prediction block's where the
        layout puts it)."""
        mtp, n = self.layout.mtp, self.cfg.model.n_layers
        if mtp is not None and i >= n:
            return mtp.block_prefix(n, i)
        per_layer = max(len(self.layout.sublayers), 1)  # (Layout.sublayers)
        return f"{self.layout.base}layers.{i // per_layer}."

    def _block(self, i: int, names: list[str]) -> None:
        lay, moe = self.layout, self.cfg.moe
        mtp = lay.mtp is not None and i >= self.cfg.model.n_layers
        prefix = self._prefix(i)
        shared = [pn.shared_expert(i, w) for w in pn.SWIGLU_WEIGHTS]
        if lay.shared_fused is not None and shared[0] in names:  # [gate; up] and down
            gate_up, down = (prefix + n for n in lay.shared_fused)
            self.entries += [Joined(tuple(shared[:2]), (gate_up,)), Entry((shared[2],), (down,))]
        bias = pn.expert_bias(i)
        if bias in names and moe.is_hash_layer(i):
            self.entries.append(UnusedSelectionBias((bias,), (), self.fmt, moe.routed_choices))
        elif bias in names and lay.selection_bias is not None:
            theirs = prefix + under(lay.moe_block, lay.selection_bias)
            self.entries.append(SelectionBias((bias,), (theirs,), lay.selection_bias_row))
        elif bias in names:
            self.entries.append(NoSelectionBias((bias,), (), self.fmt, moe.routed_choices))
        done = {bias, *shared} if lay.shared_fused is not None else {bias}
        qkv = pn.attn(i, "in_proj_qkv")
        if lay.linear_fused and qkv in names:
            done |= self._fused_linear_attention(i, prefix)
        if lay.linear_qkv_apart and qkv in names:  # its q, k, v projections and convolutions
            m, conv = self.cfg.model, pn.attn(i, "conv1d")
            keys = m.linear_num_key_heads * m.linear_key_head_dim
            sizes = (keys, keys, self.shapes[qkv][0] - 2 * keys)
            for ours, theirs in ((qkv, "{}_proj"), (conv, "{}_conv1d")):
                files = tuple(f"{prefix}linear_attn.{theirs.format(p)}.weight" for p in "qkv")
                self.entries.append(RowParts((ours,), files, sizes))
            done |= {qkv, conv}
        wq = pn.attn(i, "wq")
        if lay.attention_gate and self.cfg.model.attention_output_gate and wq in names:
            theirs = (f"{prefix}self_attn.q_proj.weight", f"{prefix}{lay.attention_gate}.weight")
            self.entries.append(HeadHalves((wq,), theirs, self.cfg.model.n_heads))
            done.add(wq)
        rest = {n: n.removeprefix(f"layers.{i}.") for n in names if n not in done}
        spec = mixer_spec(self.cfg.model, i)
        by_kind = lay.mixer_renames.get(spec.kind, {}) if spec is not None else {}
        common, (own, own_prefix) = self._block_rules(i), self._mtp_rules(i)
        known = {**common, **own}
        mixer = next(
            (t for t in MIXER_NAMES if all(rename({**known, **t}, r) for r in rest.values())),
            None,
        )
        for name, r in rest.items():
            mine = rename(own, r)
            theirs = rename({**common, **(mixer or {})}, r)
            if mine is None and theirs is None:
                raise ConfigError(f"{name}: no {self.fmt} equivalent for this tensor")
            if mine is not None:
                full = own_prefix + mine
            else:
                named = rename(by_kind, theirs) or rename(lay.renames, theirs) or theirs
                if lay.sublayers:  # (this block's sublayer of its decoder layer)
                    named = rename(lay.sublayers[i % len(lay.sublayers)], named) or named
                full = prefix + named
            kind = Column if (theirs or "") in lay.columns else Entry
            kind = IntegerTable if r == TOKEN_EXPERTS else kind
            self.entries.append(kind((name,), (full,)))
        self._join(prefix)
        self._fill(i, prefix, mixer or {})
        if mtp and lay.mtp.embed_copy is not None:
            head = pn.EMBED if self.cfg.model.tie_embeddings else pn.LM_HEAD
            self.copies[prefix + lay.mtp.embed_copy] = pn.EMBED
            self.copies[prefix + lay.mtp.head_copy] = head

    def _fused_linear_attention(self, i: int, prefix: str) -> set[str]:
        """Qwen3-Next's Gated DeltaNet projections, fused per query/key head (q, k, v, z and
        b, a of each head's group together); the moetrain tensors they hold."""
        m = self.cfg.model
        hk, keys = m.linear_num_key_heads, m.linear_num_key_heads * m.linear_key_head_dim
        values, hv = m.linear_num_value_heads * m.linear_value_head_dim, m.linear_num_value_heads
        qkv, z, b, a = (pn.attn(i, w) for w in pn.GDN_WEIGHTS[:4])
        theirs = f"{prefix}linear_attn.in_proj_"
        self.entries += [
            GroupedRows((qkv, z), (theirs + "qkvz.weight",), hk, ((keys, keys, values), (values,))),
            GroupedRows((b, a), (theirs + "ba.weight",), hk, ((hv,), (hv,))),
        ]
        return {qkv, z, b, a}

    def _join(self, prefix: str) -> None:
        """The tensors of ``Layout.in_memory_joined`` in this block as one entry each (joined
        in memory, apart in the files)."""
        for memory, files in self.layout.in_memory_joined.items():
            names = [f"{prefix}{rename(self.layout.renames, f) or f}.weight" for f in files]
            parts = [e for e in self.entries if e.theirs[0] in names]
            if len(parts) != len(names):
                continue
            self.entries = [e for e in self.entries if e not in parts]
            ours = tuple(p.ours[0] for p in sorted(parts, key=lambda e: names.index(e.theirs[0])))
            joined = (f"{prefix}{memory}.weight",)
            self.entries.append(Joined(ours, joined) if self.layout.joined else Entry(ours, names))

    def _fill(self, i: int, prefix: str, mixer: dict[str, str]) -> None:
        """The zeros a family's class always holds: q/k/v biases, a shared expert of size 0."""
        lay, model, moe = self.layout, self.cfg.model, self.cfg.moe
        if lay.qkv_bias_always and not model.qkv_bias:
            for p in ("wq", "wk", "wv"):
                weight = pn.attn(i, p)
                theirs = prefix + mixer[block_name(pn.attn(0, p))] + ".bias"
                self.fillers[theirs] = ((self.shapes[weight][0],), weight)
        if lay.shared_expert_always and not moe.num_shared_experts and moe.is_moe_layer(i):
            block, d = prefix + under(lay.moe_block, ""), model.d_model
            for w, p in SWIGLU.items():
                shape = (d, 0) if w == "w2" else (0, d)
                self.fillers[f"{block}{lay.shared_expert}.{p}.weight"] = (shape, pn.router_gate(i))
            self.fillers[f"{block}{lay.shared_gate}.weight"] = ((1, d), pn.router_gate(i))

    def _experts(self, i: int) -> Experts:
        ours = tuple(pn.experts(i, w) for w in expert_param_names(self.cfg.moe.expert_biases))
        block, files = self._prefix(i) + under(self.layout.moe_block, ""), self.layout.experts
        n, gated = self.cfg.moe.num_experts, self.cfg.moe.gated
        if isinstance(files, PerExpert):
            weights = pn.SWIGLU_WEIGHTS if gated else pn.SWIGLU_WEIGHTS[1:]  # (w3: up)
            theirs = tuple(
                f"{block}experts.{e}.{files.names[w]}.weight" for e in range(n) for w in weights
            )
            return PerExpertFiles(ours, theirs, n, gated)
        if isinstance(files, Fused):
            return FusedFiles(ours, (block + files.gate_up, block + files.down), n, gated)
        theirs = (block + files.gate_up, block + files.down)
        theirs += tuple(t + "_bias" for t in theirs)
        return StackedFiles(ours, theirs[: len(ours)], n, files.interleaved)


def _held(present: Collection[str], files: Entry, *others: Entry) -> Entry:
    """The first entry whose tensors ``present`` holds: the files' names, else transformers
    v5's in-memory ones, else its saves' (the files' when none: what is missing is named by
    them)."""
    return next((e for e in (files, *others) if all(n in present for n in e.theirs)), files)


class WeightMap:
    """moetrain's tensors <-> ``fmt``'s files, for the model ``cfg`` describes (the module
    docstring). ``present``: the names a source holds, when reading from it (each entry then
    takes the names the source has: the files', or transformers v5's in-memory ones). Builds no
    real model (the names and shapes come from one on the meta device) and checks nothing of
    what ``fmt`` can represent (:func:`~moetrain.convert.formats.check_format` does)."""

    def __init__(self, cfg: Config, fmt: str, present: Collection[str] | None = None) -> None:
        self.cfg, self.fmt = cfg, fmt
        self.shapes = _meta_shapes(cfg)
        layout = family(fmt).layout
        plan = _Plan(cfg, fmt, layout, self.shapes)
        self.entries, self.fillers, self.copies = plan.entries, plan.fillers, plan.copies
        others = [in_memory(layout)] if in_memory(layout) != layout else []
        if layout.saved_renames:  # (transformers' saves' names)
            renames = {**layout.renames, **layout.saved_renames}
            others.append(dataclasses.replace(layout, renames=renames, mixer_renames={}))
        others += [layout.saved] if layout.saved is not None else []  # (transformers' saves)
        if present is not None and others:
            alts = [_Plan(cfg, fmt, o, self.shapes).entries for o in others]
            self.entries = [_held(present, *e) for e in zip(self.entries, *alts, strict=True)]
        self._of = {name: entry for entry in self.entries for name in entry.ours}

    @property
    def moe_layers(self) -> list[int]:
        """The layers (and multi-token-prediction blocks) whose experts stream apart."""
        return self.cfg.moe.moe_layers(self.cfg.model.n_blocks)

    def hf_name(self, ours: str) -> str:
        """The files' name of the moetrain tensor ``ours`` (one stored alone)."""
        return self._of[ours].theirs[0]

    def hf_tensors(self, layer: int | None = None) -> list[tuple[str, Shape, bool]]:
        """``(name, shape, kept in fp32 or torch.int64 for an integer table)`` of every tensor
        of the files in one streamed part:
        the dense weights with the fillers and copies (``layer`` None), or MoE layer ``layer``'s
        experts."""
        out = []
        for entry in self.entries:
            if (entry.layer if isinstance(entry, Experts) else None) != layer:
                continue
            shapes = entry.hf_shapes([self.shapes[k] for k in entry.ours])
            keep = torch.int64 if entry.keep_int64 else entry.keep_fp32
            out += [(n, s, keep) for n, s in zip(entry.theirs, shapes, strict=True)]
        if layer is None:
            out += [(name, shape, False) for name, (shape, _) in self.fillers.items()]
            out += [(name, self.shapes[ours], False) for name, ours in self.copies.items()]
        return out

    def to_hf(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Any part of a moetrain state dict that holds whole entries (the whole, the dense
        weights, one MoE layer's experts) -> the files' tensors (contiguous). ConfigError naming
        a tensor that ``fmt`` cannot hold."""
        out: dict[str, torch.Tensor] = {}
        done: set[str] = set()
        for name in part:
            entry = self._of.get(name)
            if name in done or (entry is None and self._tied_head(name)):
                continue
            if entry is None:
                raise ConfigError(f"{name}: no {self.fmt} equivalent for this tensor")
            ours = [part[k] for k in entry.ours]  # (KeyError: an entry split over two parts)
            out.update(zip(entry.theirs, entry.to_hf(ours), strict=True))
            done.update(entry.ours)
        for name, (shape, beside) in self.fillers.items():
            if beside in part:
                out[name] = torch.zeros(shape)
        for name, ours in self.copies.items():
            if ours in part:
                out[name] = part[ours]
        return {k: v.detach().contiguous() for k, v in out.items()}

    def _tied_head(self, name: str) -> bool:
        return name == pn.LM_HEAD and self.cfg.model.tie_embeddings

    def read_dense(
        self,
        source: TensorSource,
        skip: Collection[str] = (),
        only: Collection[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Every moetrain tensor but the experts' (and ``skip``) from ``source``; ``only``: just
        the entries these names hold whole (one unit of the model; the attention biases
        checked are then those of the blocks it names). ConfigError naming an attention bias
        that the source holds non-zero and the model has none of."""
        skip = set(skip)
        wanted = None if only is None else set(only)
        entries = [
            e
            for e in self.entries
            if not isinstance(e, Experts)
            and not set(e.ours) & skip
            and (wanted is None or set(e.ours) <= wanted)
        ]
        loaded = source.load([n for e in entries for n in e.theirs])
        out: dict[str, torch.Tensor] = {}
        for e in entries:
            out.update(zip(e.ours, e.from_hf([loaded.pop(n) for n in e.theirs]), strict=True))
        if self.cfg.model.tie_embeddings and pn.EMBED in out:
            out[pn.LM_HEAD] = out[pn.EMBED]
        mapped, blocks = {n for e in self.entries for n in e.theirs}, range(self.cfg.model.n_blocks)
        if wanted is not None:
            blocks = {int(m.group(1)) for m in map(_OUR_BLOCK.match, wanted) if m}
        extra = [  # (in the blocks read: a multi-token-prediction layer left unread is not)
            n
            for n in source.names()
            if ZERO_ONLY.search(n) and n not in mapped and decoder_layer(n) in blocks
        ]
        for name, t in source.load(extra).items():
            if bool(t.ne(0).any()):
                raise ConfigError(f"{name}: non-zero attention bias; moetrain attention has none")
        return out

    def read_experts(
        self,
        source: TensorSource,
        layer: int,
        experts: tuple[int, int] | None = None,
        into: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """MoE layer ``layer``'s experts ``[start, stop)`` (default all) from ``source``, stacked
        as moetrain holds them; ``into``: a model's tensors of those names to fill in place
        where the layout allows it."""
        entry = self._of[pn.experts(layer, "w13")]
        start, stop = experts or (0, self.cfg.moe.num_experts)
        return dict(zip(entry.ours, entry.read(source, start, stop, into), strict=True))
