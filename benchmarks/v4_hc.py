"""DeepSeek-V4's hyper-connections alone, forward and backward, at the bench size (4 x 256
tokens, 4 streams of d 256, 20 Sinkhorn iterations), one thread, CPU time:

    .venv/bin/python benchmarks/v4_hc.py --rounds 20 --against main
    .venv/bin/python benchmarks/v4_hc.py --rounds 20 --against main --host-allocator system

Sides, alternating round by round, on the same weights and inputs: moetrain's modules
(``moetrain/model/hyper_connections.py``), the same modules at each git revision
``--against`` (with ``hyper_connection_ops.py`` where the revision has one) and transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` with its decoder layer's mixing rule
(the peer). ``--host-allocator``: glibc's malloc as ``train.host_allocator`` sets it (``keep``,
as ``moetrain train`` runs by default: freed blocks reused, not faulted in again) or left as it
is (``system``). Timed per side:

- ``branch``: one branch's hyper-connection: the coefficients, Sinkhorn, the collapse, a
  branch that reads the collapse (one multiply), the streams' mix, then backward of all of it
  against a fixed gradient (a layer has two; the bench model four layers);
- ``head``: the final collapse (``HyperHead``), forward and backward.

Printed: medians with ranges (ms) and each side's time over moetrain's per round (above 1:
moetrain faster), and the largest differences of the outputs and the gradients to moetrain's
(each over the tensor's largest entry).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
B, S, N, D, ITERS, EPS, NORM_EPS = 4, 256, 4, 256, 20, 1e-6, 1e-6


def _load(name: str, text: str):  # noqa: ANN202
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def module_at(rev: str):  # noqa: ANN201
    """``moetrain/model/hyper_connections.py`` as of git revision ``rev``, with the
    ``hyper_connection_ops.py`` of ``rev`` where it has one."""

    def show(path: str) -> str | None:
        done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True)
        return done.stdout.decode() if done.returncode == 0 else None

    tag = "".join(c if c.isalnum() else "_" for c in rev)
    text = show("moetrain/model/hyper_connections.py")
    if text is None:
        raise SystemExit(f"--against {rev}: no moetrain/model/hyper_connections.py there")
    ops = show("moetrain/model/hyper_connection_ops.py")
    if ops is not None:
        _load(f"hyper_connection_ops_{tag}", ops)
        text = text.replace("moetrain.model.hyper_connection_ops", f"hyper_connection_ops_{tag}")
    return _load(f"hyper_connections_{tag}", text)


def peer_modules():  # noqa: ANN201
    """transformers' modules, wrapped to moetrain's interface (the decoder layer's mix)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    cfg = DeepseekV4Config(
        hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, hc_eps=EPS, rms_norm_eps=NORM_EPS,
        num_hidden_layers=1,
    )  # fmt: skip

    class Branch(v4.DeepseekV4HyperConnection):
        def forward(self, streams):  # noqa: ANN001, ANN202
            post, comb, collapsed = super().forward(streams)
            return collapsed, (post, comb)

        @staticmethod
        def mix(streams, y, state):  # noqa: ANN001, ANN205
            post, comb = state
            dtype = streams.dtype
            carried = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
            return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + carried

    head = v4.DeepseekV4HyperHead(cfg)
    return Branch(cfg), head


def sides(revs: list[str]) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """name -> (branch, head) with moetrain's weights."""
    from moetrain.model.hyper_connections import HyperConnection, HyperHead

    torch.manual_seed(0)
    ours = (HyperConnection(D, N, ITERS, EPS, NORM_EPS), HyperHead(D, N, EPS, NORM_EPS))
    for m in ours:
        m.reset_parameters(0.02)
        with torch.no_grad():  # no constant parameter: base and scale drawn too
            m.base.normal_(0.0, 0.5)
            m.scale.uniform_(0.5, 1.5)
    out = {"moetrain": ours}
    for rev in revs:
        old = module_at(rev)
        before = (
            old.HyperConnection(D, N, ITERS, EPS, NORM_EPS),
            old.HyperHead(D, N, EPS, NORM_EPS),
        )
        for m, src in zip(before, ours, strict=True):
            m.load_state_dict(src.state_dict())
        out[f"at {rev}"] = before
    branch, head = peer_modules()
    branch.load_state_dict(ours[0].state_dict())
    hs = ours[1].state_dict()
    head.load_state_dict({"hc_fn": hs["fn"], "hc_base": hs["base"], "hc_scale": hs["scale"]})
    out["peer"] = (branch, head)
    return out


def paths(branch: torch.nn.Module, head: torch.nn.Module) -> dict[str, Callable[[], list]]:
    """The timed calls (module docstring); each returns its output and its gradients."""
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(B, S, N, D, generator=gen)
    w = torch.randn(B, S, D, generator=gen)
    g_streams, g_head = torch.randn(B, S, N, D, generator=gen), torch.randn(B, S, D, generator=gen)

    def run_branch() -> list:
        branch.zero_grad(set_to_none=True)
        x = streams.clone().requires_grad_(True)
        h, state = branch(x)
        out = branch.mix(x, h * w, state)
        out.backward(g_streams)
        return [out, x.grad, *(p.grad for p in branch.parameters())]

    def run_head() -> list:
        head.zero_grad(set_to_none=True)
        x = streams.clone().requires_grad_(True)
        out = head(x)
        out.backward(g_head)
        return [out, x.grad, *(p.grad for p in head.parameters())]

    return {"branch": run_branch, "head": run_head}


def cpu_ms(fn: Callable[[], object]) -> float:
    c = time.process_time()
    fn()
    return (time.process_time() - c) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--against", action="append", default=[], help="also time the modules of this git revision"
    )
    ap.add_argument("--host-allocator", choices=("keep", "system"), default="keep")
    args = ap.parse_args()
    from moetrain.train.host_allocator import settle_host_allocator, tune_host_allocator

    tune_host_allocator(args.host_allocator)
    torch.set_num_threads(1)
    calls = {name: paths(*mods) for name, mods in sides(args.against).items()}
    for name, side in calls.items():  # (warm-up) and the differences to moetrain
        for path, run in side.items():
            run()
            got, want = run(), calls["moetrain"][path]()
            diffs = [
                ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True)
            ]
            print(
                f"{name}, {path}: largest difference to moetrain over its largest entry, "
                f"output {diffs[0]:.1e}, gradients {max(diffs[1:]):.1e}"
            )
    settle_host_allocator()  # (after the first steps, as the trainer does)
    times = {(name, path): [] for name in calls for path in calls[name]}
    for _ in range(args.rounds):
        for name, side in calls.items():
            for path, run in side.items():
                times[name, path].append(cpu_ms(run))
    print(f"\nCPU ms per call, medians (ranges) of {args.rounds} rounds; side / moetrain per round")
    print("| path | side | ms | side / moetrain |")
    print("|---|---|---:|---:|")
    for path in ("branch", "head"):
        ref = times["moetrain", path]
        for name in calls:
            t = times[name, path]
            r = [a / b for a, b in zip(t, ref, strict=True)]
            print(
                f"| {path} | {name} | {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f}) | "
                f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f}x) |"
            )


if __name__ == "__main__":
    sys.exit(main())
