"""The ``moetrain`` command line: prepare | train | convert | generate | plan | report | print-config.

Heavy imports (torch, deepspeed, datasets) happen inside the subcommands so that ``--help`` and
``print-config`` stay fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from moetrain.config import Config, ConfigError, read_config_data


def load_config(path: str, overrides: list[str]) -> Config:
    """The command's config; with ``checkpoint.init_from`` the model shape comes from that
    source (a setting that contradicts it is refused, naming the key and both values), or,
    when run_dir has a checkpoint to resume, from that checkpoint."""
    from moetrain.config import config_from_dict

    data = read_config_data(path, overrides)
    if not (data.get("checkpoint") or {}).get("init_from"):
        return config_from_dict(data)
    from moetrain.init_from.source import resolve_config_data, resolve_resumed_config_data
    from moetrain.train.start import resume_candidate

    resumed = resume_candidate(config_from_dict(data, validate=False))
    if resumed is not None:  # the source is not opened: it may be gone
        return resolve_resumed_config_data(data, resumed)
    return resolve_config_data(data)[0]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. moe.top_k=1"
    )


def _cmd_print_config(args: argparse.Namespace) -> int:
    from moetrain.model_numbers import human, model_numbers
    from moetrain.optim.summary import update_table

    cfg = load_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")
    n = model_numbers(cfg)
    print("# derived")
    print(f"total_params: {n.total_params}  # {human(n.total_params)}")
    print(f"active_params_per_token: {n.active_params}  # {human(n.active_params)}")
    print(f"embedding_params: {n.embedding_params}  # {human(n.embedding_params)}")
    print(f"expert_params: {n.expert_params}  # {human(n.expert_params)}")
    print(f"moe_layers: {n.num_moe_layers}")
    print(
        f"train_flops_per_token: {n.flops_per_token:.4g}  "
        f"# 6 x active matmul params + attention, at seq_len={cfg.data.seq_len}"
    )
    print(f"# updates (optim.name={cfg.optim.name}): parameters per update rule, by kind")
    for line in update_table(cfg):
        print(f"update_{line}")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from moetrain.data.prepare import prepare

    prepare(load_config(args.config, args.overrides))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from moetrain.train.loop import run_training

    cfg = load_config(args.config, args.overrides)
    run_training(cfg, reset_optimizer=args.reset_optimizer)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from moetrain.checkpoint.catalog import resolve_checkpoint
    from moetrain.convert.export import convert_checkpoint

    out = convert_checkpoint(
        resolve_checkpoint(args.checkpoint),
        args.out_dir,
        dtype=args.dtype,
        fmt=args.format,
        overwrite=args.overwrite,
        tokenizer=args.tokenizer,
        drop_mtp=args.drop_mtp,
    )
    print(f"moetrain: wrote {out}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from moetrain.checkpoint.format import TrainerState, tokenizer_path
    from moetrain.convert.importer import import_hf_checkpoint

    out = import_hf_checkpoint(
        args.hf_dir, args.checkpoint, args.step, args.overrides, tokenizer=args.tokenizer
    )
    print(f"moetrain: wrote {out}")
    init = TrainerState.read(out).init or {}
    if init.get("not_taken"):
        print(f"moetrain: imported {init['not_taken']}")
    if init.get("dequantized"):
        print(f"moetrain: read its weights ({init['dequantized']}) dequantized to fp32")
    if tokenizer_path(out) is None:
        print(
            f"moetrain: warning: {args.hf_dir} has no tokenizer (tokenizer.json or "
            "tokenizer.model), so neither has the checkpoint: moetrain convert of it needs "
            "--tokenizer PATH (or import again with --tokenizer)"
        )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from moetrain.checkpoint.catalog import resolve_checkpoint
    from moetrain.generate import generate_text

    sampling = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
    options = {name: getattr(args, name) for name in sampling}
    completion = generate_text(resolve_checkpoint(args.path), args.prompt, **options)
    print(args.prompt + completion)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from moetrain.plan import format_plan, plan

    cfg = load_config(args.config, args.overrides)
    pl = plan(cfg, args.gpus, gpu=args.gpu, mfu=args.mfu, gpus_per_node=args.gpus_per_node)
    print(format_plan(pl))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from moetrain.monitor.report import make_report

    for path in make_report(args.run_dir):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from moetrain.convert.families import FORMATS  # the registry (no torch, no transformers)

    parser = argparse.ArgumentParser(
        prog="moetrain", description="Pretrain decoder-only Mixture-of-Experts language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("print-config", help="resolved config + parameter and FLOP counts")
    _add_config_args(p)
    p.set_defaults(func=_cmd_print_config)

    p = sub.add_parser("prepare", help="train/reuse the tokenizer and write token shards")
    _add_config_args(p)
    p.set_defaults(func=_cmd_prepare)

    p = sub.add_parser("train", help="train (under any launcher, or a plain single process)")
    _add_config_args(p)
    p.add_argument(
        "--reset-optimizer",
        action="store_true",
        help="when resuming with another layout, load weights only and start a fresh optimizer",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("convert", help="checkpoint -> Hugging Face model directory")
    p.add_argument(
        "checkpoint", help="a checkpoint directory, or a run_dir (its newest complete checkpoint)"
    )
    p.add_argument("out_dir", help="the Hugging Face model directory to write")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", *FORMATS],
        help="Hugging Face architecture (auto: the one that computes the same function)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument("--tokenizer", help="the tokenizer to export when the checkpoint carries none")
    p.add_argument(
        "--drop-mtp",
        action="store_true",
        help="leave out the multi-token-prediction modules (the main model is unchanged), e.g. "
        "for a family whose files cannot hold them",
    )
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "import", help="Hugging Face MoE directory (or a dense one, upcycled) -> checkpoint"
    )
    p.add_argument("hf_dir", help="a Hugging Face model directory")
    p.add_argument("checkpoint", help="the checkpoint directory to write")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config settings, e.g. moe.num_experts=8 moe.top_k=2 to upcycle a dense model",
    )
    p.add_argument("--step", type=int, default=0, help="step number recorded in the checkpoint")
    p.add_argument(
        "--tokenizer", help="the tokenizer the checkpoint carries (default: HF_DIR's own)"
    )
    p.set_defaults(func=_cmd_import)

    p = sub.add_parser("generate", help="sample a completion with a KV cache")
    p.add_argument(
        "path", help="a checkpoint or run directory, or a converted Hugging Face directory"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("plan", help="memory per GPU, FLOPs and throughput estimate")
    _add_config_args(p)
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs in the job")
    p.add_argument("--gpu", default="h100", help="GPU type (h100, h200, a100, ...)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    p.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per node (expert all-to-all fan-out)"
    )
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("report", help="PNG plots and a text summary of a run directory")
    p.add_argument("run_dir", help="the run's run_dir (holds metrics.jsonl)")
    p.set_defaults(func=_cmd_report)
    parser.set_defaults(commands=sub.choices)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's arguments; ``key=value`` overrides may come before or after its options
    (``moetrain plan CONFIG --gpus 8 moe.top_k=1``)."""
    parser = build_parser()
    commands = parser.get_default("commands")
    if not argv or argv[0] not in commands:
        return parser.parse_args(argv)  # --help, or an unknown command's error
    args = commands[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # DeepSpeed's launcher appends --local_rank=N; the rank also arrives in LOCAL_RANK.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    args = parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    from moetrain.checkpoint.format import CheckpointError
    from moetrain.data.errors import DataError
    from moetrain.parallel.watchdog import CollectiveFailure

    try:
        return func(args)
    except ConfigError as e:
        print(f"moetrain: config error: {e}", file=sys.stderr)
        return 2
    except (DataError, CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"moetrain: error: {e}", file=sys.stderr)
        return 2
    except (CollectiveFailure, TimeoutError) as e:  # a rank went missing: not a usage error
        print(f"moetrain: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
