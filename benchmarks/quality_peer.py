"""The reference run of ``benchmarks/quality.py``: Hugging Face ``MixtralForCausalLM`` trained
through DeepSpeed ZeRO with the training math of a moetrain config, one process per rank:

    torchrun --nproc_per_node N benchmarks/quality_peer.py --out DIR CONFIG [key=value ...]

What it shares with ``moetrain train CONFIG``:
- the first weights: moetrain's model built under ``seed`` exactly as the trainer builds it,
  moved into Mixtral's layout by moetrain's converter (the first logits are checked equal);
- the batches (moetrain's loader, same seed, rank and world) and the validation batches;
- the optimizer (AdamW with moetrain's decay / no-decay rule), learning-rate schedule, clipping
  and DeepSpeed config;
- the loss: cross-entropy plus, per MoE layer, ``aux_loss_coef`` times moetrain's load-balancing
  loss (``E * sum_e f_e * P_e``, f over every rank's tokens of the micro-step) and
  ``z_loss_coef`` times the router z-loss, both from the router logits transformers returns.
  transformers' own auxiliary loss (all layers' logits at once) is switched off.

Writes ``DIR/metrics.jsonl`` with moetrain's field names (``step``, ``loss``, ``ce_loss``,
``lr``, ``grad_norm``; ``val_loss`` at ``train.eval_every``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def moetrain_aux_losses(router_logits, top_k: int, num_experts: int):  # noqa: ANN001, ANN201
    """Per layer: moetrain's ``global_micro_batch`` load-balancing loss and router z-loss from
    one layer's ``(T, E)`` router logits (moetrain/model/moe/router.py)."""
    aux, z = [], []
    for logits_TE in router_logits:
        logits_TE = logits_TE.float()
        probs_TE = torch.softmax(logits_TE, dim=-1)
        ids_TK = torch.topk(probs_TE, top_k, dim=-1).indices
        with torch.no_grad():
            counts_E = torch.bincount(ids_TK.flatten(), minlength=num_experts).float()
            if dist.get_world_size() > 1:
                dist.all_reduce(counts_E)
            frac_E = counts_E / counts_E.sum().clamp_min(1)
        t = max(logits_TE.shape[0], 1)
        aux.append(num_experts * torch.sum(frac_E * probs_TE.sum(0) / t))
        z.append(torch.logsumexp(logits_TE, dim=-1).pow(2).sum() / t)
    return aux, z


def hf_from_moetrain_init(cfg, out: Path):  # noqa: ANN001, ANN201
    """Mixtral holding the weights ``moetrain train`` starts from (seed ``cfg.seed``)."""
    import transformers
    from safetensors.torch import save_file

    from moetrain.convert.formats import hf_config
    from moetrain.convert.hf import to_hf_state_dict
    from moetrain.model import Transformer

    torch.manual_seed(cfg.seed)  # what Trainer does before building the model
    ours = Transformer(cfg.model, cfg.moe)
    init = out / "init"
    if dist.get_rank() == 0:
        hf_cfg = hf_config(cfg, "mixtral")
        hf_cfg.output_router_logits, hf_cfg.router_aux_loss_coef = True, 0.0
        hf_cfg.save_pretrained(init)
        save_file(
            to_hf_state_dict(ours.state_dict(), cfg, "mixtral"), str(init / "model.safetensors")
        )
    dist.barrier()
    hf = transformers.MixtralForCausalLM.from_pretrained(
        init, dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=ids).logits, ours.eval()(ids).logits, atol=1e-5, rtol=1e-5
        )
    return hf.train()


def param_groups(model, optim):  # noqa: ANN001, ANN201
    """moetrain.s rule (optim/groups.py): 1-D tensors, biases and the embedding do not decay."""
    from moetrain.optim.groups import is_no_decay

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        ours = "embed.weight" if name == "model.embed_tokens.weight" else name
        (no_decay if is_no_decay(ours, p, optim.decay_embeddings) else decay).append(p)
    return [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import deepspeed

    from moetrain.config import load_config
    from moetrain.data.splits import build_loader
    from moetrain.optim.schedule import LRSchedule
    from moetrain.parallel.deepspeed import deepspeed_config
    from moetrain.train.trainer import tokens_per_step, total_steps

    cfg = load_config(args.config, args.overrides)
    t = cfg.train
    torch.set_num_threads(t.threads_per_rank or int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)
    model = hf_from_moetrain_init(cfg, args.out)
    tps, steps = tokens_per_step(cfg, world), total_steps(cfg, world)
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        fused=True,
    )
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=lambda o: LRSchedule(o, cfg.optim, steps, tps),
        config=deepspeed_config(cfg, world),
    )

    def loader(split: str):  # noqa: ANN202
        return build_loader(
            cfg.data,
            split,
            t.micro_batch_size,
            rank,
            world,
            cfg.seed,
            vocab_size=cfg.model.vocab_size,
        )

    def losses(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        out = engine(input_ids=batch["input_ids"])
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch["labels"].flatten())
        aux, z = moetrain_aux_losses(out.router_logits, cfg.moe.top_k, cfg.moe.num_experts)
        total = ce + cfg.moe.aux_loss_coef * sum(aux) + cfg.moe.z_loss_coef * sum(z)
        return total, ce

    def evaluate() -> float:
        engine.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for batch in loader("val").iter_eval(t.eval_steps):
                sums += torch.stack(
                    [losses(batch)[1].double(), torch.ones((), dtype=torch.float64)]
                )
        dist.all_reduce(sums)
        engine.train()
        return float(sums[0] / sums[1])

    train = iter(loader("train"))
    metrics = open(args.out / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        lr = engine.get_lr()[0]
        parts = torch.zeros(2, dtype=torch.float64)
        for _ in range(t.grad_accum_steps):
            total, ce = losses(next(train))
            engine.backward(total)
            engine.step()
            parts += torch.stack([total.detach().double(), ce.detach().double()])
        parts /= t.grad_accum_steps
        dist.all_reduce(parts)
        parts /= world
        record = {
            "step": step,
            "loss": float(parts[0]),
            "ce_loss": float(parts[1]),
            "lr": lr,
            "grad_norm": float(engine.get_global_grad_norm()),
        }
        if t.eval_every and (step % t.eval_every == 0 or step == steps):
            record["val_loss"] = evaluate()
        if metrics is not None and (step % t.log_every == 0 or "val_loss" in record or step == 1):
            record["elapsed_s"] = time.perf_counter() - t0
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
    dist.barrier()


if __name__ == "__main__":
    main()
