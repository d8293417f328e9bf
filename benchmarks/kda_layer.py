"""The Kimi Delta Attention layer (:mod:`moetrain.model.mixers.kda`) against transformers' own
torch path (``KimiLinearDeltaAttention`` without fla's kernels: ``chunk_kimi_delta_attention``):
forward + backward time and peak memory of the whole layer (projections, short convolutions,
the per-channel gated delta rule, the gated norm), side by side, alternating.

    .venv/bin/python benchmarks/kda_layer.py                       # S = 4096
    .venv/bin/python benchmarks/kda_layer.py --seq-lens 4096 8192 --rounds 5

Kimi Linear's head shape with fewer heads: batch 1, d_model 512, 4 heads of 128, convolutions of
width 4, the same weights in both layers (transformers' initialisation: A in [1, 16], dt_bias
the inverse softplus of steps in [1e-3, 0.1]), fp32, one thread, CPU. Each measurement runs in
a fresh subprocess (:func:`side_by_side.measure_step`: peak RSS of one pass over the RSS before
it, then the median CPU time of ``--repeats`` passes under ``moetrain train``'s allocator).
"""

from __future__ import annotations

from side_by_side import layer_main, map_large_blocks, measure_step

D_MODEL, HEADS, DIM, WIDTH = 512, 4, 128, 4
PATHS = ("moetrain", "transformers")


def _layers():  # noqa: ANN202
    """(moetrain's layer, transformers' layer) with the same weights."""
    import torch
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    from moetrain.config.layer_plan import mixer_spec
    from moetrain.model.mixers import build_mixer
    from tests.helpers.configs import tiny_config

    cfg = tiny_config(
        {
            "model.d_model": D_MODEL,
            "model.n_layers": 2,
            "model.n_heads": 4,
            "model.n_kv_heads": 4,
            "model.layer_types": ["linear_attention", "full_attention"],
            "model.linear_attention": "kda",
            "model.linear_num_heads": HEADS,
            "model.linear_head_dim": DIM,
            "model.linear_conv_kernel_dim": WIDTH,
        }
    ).model
    torch.manual_seed(0)
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.02)
    ours.init_own_parameters()
    attn = {"head_dim": DIM, "num_heads": HEADS, "short_conv_kernel_size": WIDTH}
    hf = KimiLinearConfig(hidden_size=D_MODEL, num_hidden_layers=2, linear_attn_config=attn)
    theirs = KimiLinearDeltaAttention(hf, 0)
    state = {}
    for name, t in ours.state_dict().items():
        if name.startswith(("f_a_proj", "f_b_proj", "dt_bias", "A_log")):
            name = f"forget_gate.{name}"
        state[name.replace("wo.", "o_proj.")] = t
    state["forget_gate.A_log"] = state["forget_gate.A_log"].view(1, 1, -1, 1)
    convs = [state.pop(f"{p}_conv1d.weight") for p in "qkv"]
    state["conv1d.weight"] = torch.cat(convs)
    theirs.load_state_dict(state)
    return ours, theirs


def _child(path: str, s: int, repeats: int) -> dict:
    map_large_blocks()
    import torch

    from moetrain.model.mixers import MixerInputs

    torch.set_num_threads(1)
    ours, theirs = _layers()
    x = torch.randn(1, s, D_MODEL, generator=torch.Generator().manual_seed(1)).requires_grad_()
    grad = torch.randn(1, s, D_MODEL, generator=torch.Generator().manual_seed(2))
    inputs = MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0))
    layer = ours if path == "moetrain" else theirs

    def step() -> None:
        y = ours(x, inputs) if path == "moetrain" else theirs(x)
        y.backward(grad)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    return measure_step(step, repeats)


def main() -> None:
    def header(rounds: int, repeats: int) -> str:
        return (
            f"fwd+bwd of the layer, batch 1, d_model {D_MODEL}, {HEADS} heads of {DIM}, "
            f"convolutions of {WIDTH}, fp32, 1 thread; {rounds} alternating rounds, median of "
            f"{repeats} passes each"
        )

    layer_main(__file__, __doc__, PATHS, _child, header)


if __name__ == "__main__":
    main()
