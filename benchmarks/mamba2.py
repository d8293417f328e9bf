"""The Mamba-2 layer (:mod:`moetrain.model.mixers.mamba2`) against transformers' own torch path
(Granite 4.0-H's ``GraniteMoeHybridMambaLayer`` without its CUDA kernels: the chunked scan
``mamba2_chunk_scan``), the same weights: forward + backward time and peak memory, side by
side, alternating.

    .venv/bin/python benchmarks/mamba2.py                       # S = 4096
    .venv/bin/python benchmarks/mamba2.py --seq-lens 4096 16384 --rounds 5

Granite-4.0-H-Small's layer shrunk: d_model 256, 8 heads of 64 (expand 2), one group, state
128, convolution of width 4, chunks of 256 for both; batch 1, fp32, one thread, CPU. Each
measurement runs in a fresh subprocess (``side_by_side.measure_step``: one warm-up pass, the
peak RSS of one pass over the RSS before it, the median CPU time of ``--repeats`` passes); a
round runs both paths, in alternating order from round to round; the ratios are the median over
rounds of each round's ratio, with their range.
"""

from __future__ import annotations

from side_by_side import layer_main, map_large_blocks, measure_step

D, HEADS, HEAD_DIM, STATE, CHUNK = 256, 8, 64, 128, 256
PATHS = ("moetrain", "transformers")


def _child(path: str, s: int, repeats: int) -> dict:
    map_large_blocks()
    import torch
    from transformers.models.granitemoehybrid.configuration_granitemoehybrid import (
        GraniteMoeHybridConfig,
    )
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMambaLayer,
    )

    from moetrain.config.layer_plan import mixer_spec
    from moetrain.model.mixers import MixerInputs, build_mixer
    from tests.helpers.configs import tiny_config

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = tiny_config(
        {
            "model.d_model": D,
            "model.n_layers": 1,
            "model.max_seq_len": s + 1,
            "model.layer_types": ["linear_attention"],
            "model.linear_attention": "mamba2",
            "model.mamba_num_heads": HEADS,
            "model.mamba_head_dim": HEAD_DIM,
            "model.mamba_state_dim": STATE,
            "model.mamba_chunk_size": CHUNK,
        }
    ).model
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    ours.init_own_parameters()
    for name, p in ours.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            torch.nn.init.normal_(p, 0, 0.02)
    inputs = MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0))
    layer = (lambda x: ours(x, inputs)) if path == "moetrain" else None
    if path == "transformers":
        hf = GraniteMoeHybridConfig(
            hidden_size=D,
            num_hidden_layers=1,
            mamba_n_heads=HEADS,
            mamba_d_head=HEAD_DIM,
            mamba_d_state=STATE,
            mamba_expand=HEADS * HEAD_DIM // D,
            mamba_chunk_size=CHUNK,
            layer_types=["mamba"],
        )
        theirs = GraniteMoeHybridMambaLayer(hf, 0).train()
        state = {k.replace("wo.", "out_proj."): v for k, v in ours.state_dict().items()}
        theirs.load_state_dict(state)
        layer = theirs
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, s, D, generator=gen, requires_grad=True)
    grad = torch.randn(1, s, D, generator=gen)

    def step() -> None:
        layer(x).backward(grad)
        x.grad = None

    return measure_step(step, repeats)


def main() -> None:
    def header(rounds: int, repeats: int) -> str:
        return (
            f"Mamba-2 layer fwd+bwd, batch 1, d_model {D}, {HEADS} heads of {HEAD_DIM}, one group, "
            f"state {STATE}, chunks of {CHUNK}, fp32, 1 thread; {rounds} alternating rounds, "
            f"median of {repeats} passes each"
        )

    layer_main(__file__, __doc__, PATHS, _child, header)


if __name__ == "__main__":
    main()
