"""Dense Hugging Face families, the sources of sparse upcycling: their config and weight names.

- ``llama`` (LlamaForCausalLM), ``mistral`` (MistralForCausalLM), ``qwen2`` (Qwen2ForCausalLM,
  q/k/v biases: ``model.qkv_bias``), ``qwen3`` (Qwen3ForCausalLM, per-head q/k norm).

A dense model is a moetrain model without MoE layers (``moe.first_k_dense = n_layers``) whose
dense FFN is the SwiGLU of ``intermediate_size``; its weights use the names of moetrain's dense
layers (:func:`moetrain.convert.hf.dense_key_map`). Plain RoPE only (Llama 3's ``rope_type:
llama3`` scaling is refused), no MLP or output-projection biases, no sliding window shorter than
the context.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, MoEConfig
from moetrain.convert.formats import model_config_from_hf, transformers_config
from moetrain.convert.hf import dense_key_map

DENSE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DENSE_MODEL_TYPES = {v: k for k, v in DENSE_ARCHITECTURES.items()}


def dense_family(hf_dict: dict[str, Any]) -> str | None:
    """The dense family of a ``config.json`` dict, None when it is not one of them."""
    arch = (hf_dict.get("architectures") or [None])[0]
    fam = DENSE_MODEL_TYPES.get(arch) or hf_dict.get("model_type")
    return fam if fam in DENSE_ARCHITECTURES else None


def dense_config_from_hf(hf_dict: dict[str, Any]) -> Config:
    """The moetrain config of a dense Hugging Face model: every layer dense.

    Raises ConfigError naming the Hugging Face field moetrain cannot represent.
    """
    fam = dense_family(hf_dict)
    if fam is None:
        raise ConfigError(
            f"architectures: {hf_dict.get('architectures')} is not a dense family moetrain "
            f"upcycles; supported: {list(DENSE_ARCHITECTURES.values())}"
        )
    hf = transformers_config(hf_dict, fam)
    model = model_config_from_hf(hf)
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf, flag, False):
            raise ConfigError(f"{flag}: moetrain attention and FFNs have no such biases")
    window = getattr(hf, "sliding_window", None)
    windowed = getattr(hf, "use_sliding_window", fam == "mistral")
    if windowed and window is not None and window < model.max_seq_len:
        raise ConfigError(
            f"sliding_window: {window} < max_position_embeddings={model.max_seq_len}; "
            "moetrain attends to the whole context"
        )
    model.qkv_bias = fam == "qwen2"
    model.qk_norm = fam == "qwen3"
    moe = MoEConfig(first_k_dense=model.n_layers, aux_loss_coef=0.0, z_loss_coef=0.0)
    cfg = Config(model=model, moe=moe)
    cfg.data.seq_len = min(cfg.data.seq_len, model.max_seq_len)
    cfg.validate()
    return cfg


def dense_hf_names(cfg: Config, family: str) -> dict[str, str]:
    """moetrain key -> Hugging Face key for every weight of a dense model's layers, for the
    layers as ``cfg`` places them (the FFN of a layer that ``cfg`` makes MoE is left out: it is
    the upcycling source, :func:`ffn_names`)."""
    dense = Config(model=cfg.model, moe=MoEConfig(first_k_dense=cfg.model.n_layers))
    names = dense_key_map(dense, family)
    for layer in cfg.moe.moe_layers(cfg.model.n_layers):
        for w in ("w1", "w2", "w3"):
            del names[f"layers.{layer}.ffn.{w}.weight"]
    return names


def ffn_names(layer: int) -> dict[str, str]:
    """The dense SwiGLU of ``layer``: moetrain's ``w1`` / ``w3`` / ``w2`` -> Hugging Face keys
    (gate (F, D), up (F, D), down (D, F))."""
    hf = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    return {w: f"model.layers.{layer}.mlp.{p}.weight" for w, p in hf.items()}
