"""Multi-token prediction (DeepSeek-V3's MTP, its report's section 2.2): ``model.mtp_depth``
sequential modules after the last decoder layer, sharing the embedding and the LM head.

Module ``k`` (1-based) is block ``layers.<n_layers + k - 1>`` with three norms and a projection.
At position ``i`` it combines the previous depth's hidden state ``h^{k-1}_i`` with the embedding
of token ``t_{i+k}`` and predicts ``t_{i+k+1}``::

    x_i   = eh_proj([enorm(embed(t_{i+k})) ; hnorm(h^{k-1}_i)])
    h^k   = head_norm(block_k(x))           (causal, the main model's document mask and positions)
    p^k_i = softmax(lm_head(h^k_i))

``h^0`` is the main model's output after its final norm, and ``h^k`` the block's output after
``head_norm`` (the released files' ``shared_head.norm``): what transformers' ``MtpModel`` hands
depth ``k + 1`` (its ``post_norm``), as Megatron-Core's MTP layers do; vLLM's DeepSeek MTP
chains the output before that norm, which differs from depth 2 on (released DeepSeek-V3
checkpoints have one depth). The concatenation order, embedding first, is theirs too. Depth
``k``'s target at ``i`` is
``labels[i + k]``, kept only where position ``i + k`` is in the row and in ``i``'s document: the
main loss predicts that label from there, so no depth crosses a boundary the main loss does not.
The loss of depth ``k`` is the mean cross-entropy over its kept targets; the model's MTP loss is
the mean over depths, weighted by ``model.mtp_loss_weight`` (:meth:`ModelConfig.mtp_weight`).

Depth ``k`` runs on the row's first ``S - k`` positions only (no input token past the row's end
reaches its block). With a document mask, the positions whose token ``k`` ahead opens the next
document (``k`` per boundary) do run: their targets are dropped, but they pass through the
block, and an MoE block routes them (its loads, balancing losses, selection-bias update and
capacity count them), as a block's routing cannot tell which of its tokens carry a loss.

Shape legend: B batch, S sequence, D d_model.
"""

from __future__ import annotations

import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.layer_plan import LayerSpec
from moetrain.model.block import Block
from moetrain.model.cpu_matmul import Linear
from moetrain.model.layers import make_norm
from moetrain.model.loss import IGNORE_INDEX

# how depth k + 1 receives depth k's hidden state, recorded in every checkpoint (a checkpoint
# without the record handed it over before head_norm)
MTP_CHAIN = "after_head_norm"


class MTPBlock(Block):
    """A multi-token-prediction module: a block with ``enorm``, ``hnorm``, ``eh_proj`` (2D -> D)
    in front and ``head_norm`` before the shared head."""

    def __init__(
        self,
        spec: LayerSpec,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        local_experts: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(spec, cfg, moe_cfg, local_experts)
        d = cfg.d_model
        self.enorm = make_norm(cfg, d)
        self.hnorm = make_norm(cfg, d)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.head_norm = make_norm(cfg, d)

    def block_input(self, h_BSD: torch.Tensor, next_embed_BSD: torch.Tensor) -> torch.Tensor:
        """``eh_proj([enorm(next_embed) ; hnorm(h)])``."""
        joined = torch.cat([self.enorm(next_embed_BSD), self.hnorm(h_BSD)], dim=-1)
        return self.eh_proj(joined)


def shift_left(t_BS: torch.Tensor, k: int, fill: float | int) -> torch.Tensor:
    """``t`` moved ``k`` positions left along dim 1 (position ``i`` holds ``t[:, i + k]``), the
    last ``k`` positions ``fill``."""
    k = min(k, t_BS.shape[1])
    tail = t_BS.new_full((t_BS.shape[0], k, *t_BS.shape[2:]), fill)
    return torch.cat([t_BS[:, k:], tail], dim=1)


def mtp_targets(labels_BS: torch.Tensor, doc_ids_BS: torch.Tensor | None, k: int) -> torch.Tensor:
    """Depth ``k``'s targets: ``labels[i + k]`` where position ``i + k`` is in the row and in
    ``i``'s document, ``-100`` elsewhere."""
    targets_BS = shift_left(labels_BS, k, IGNORE_INDEX)
    if doc_ids_BS is not None:
        same_doc_BS = shift_left(doc_ids_BS, k, -1) == doc_ids_BS
        targets_BS = targets_BS.masked_fill(~same_doc_BS, IGNORE_INDEX)
    return targets_BS
