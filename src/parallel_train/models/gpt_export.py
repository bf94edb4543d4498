"""The template's GPT (models/gpt.py) as a Hugging Face model folder: the llama flavor (`model.flavor=llama`) dense ->
`LlamaForCausalLM`, with model.n_experts -> `MixtralForCausalLM`; the gpt2 flavor dense -> `GPT2LMHeadModel` (exact
GELU, `activation_function="gelu"`; q, k, v joined into c_attn, Linear weights transposed into its Conv1D, absent
biases written as zeros). `AutoModelForCausalLM.from_pretrained` loads each with the GPT's logits
(tests/test_gpt_flavor.py). scripts/export.py --format hf writes it from a run or checkpoint.

The names, GPT -> transformers (`model.layers.i.` for `blocks.i.`):

    tok_emb, ln_f, head           model.embed_tokens, model.norm, lm_head (tied: tie_word_embeddings, written once)
    ln_1, ln_2                    input_layernorm, post_attention_layernorm
    attn.q, .k, .v, .proj         self_attn.q_proj, k_proj, v_proj, o_proj
    mlp.gate, .fc, .proj          mlp.gate_proj, up_proj, down_proj (dense)
    mlp.router                    mlp.gate (Mixtral's router)
    mlp.gate, .fc, .proj [E,...]  mlp.experts.gate_up_proj [E, 2 x hidden, C] (gate first), down_proj [E, C, hidden]:
                                  transformers 5's fused experts, which save_pretrained writes per expert (w1, w3,
                                  w2, Mixtral's own checkpoint names) and from_pretrained fuses again

As models/hf_export.py does: the model is built on the meta device, the renamed weights assigned, and save_pretrained
writes them with the run's tokenizer where it has a Hugging Face form. A gpt2-flavor GPT with experts has no transformers
class (every transformers MoE has rotary positions, RMSNorm and gated experts): refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parallel_train.errors import UserError
from parallel_train.models import hf_export, hf_loading
from parallel_train.models.gpt import RMS_EPS

ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "proj": "o_proj"}
DENSE_MLP = {"gate": "gate_proj", "fc": "up_proj", "proj": "down_proj"}
NORMS = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}


def refuse_gpt2(cfg: Any, source: str) -> None:
    """One line for what has no transformers class: the gpt2 flavor's experts."""
    if getattr(cfg, "flavor", "gpt2") != "llama" and cfg.n_experts:
        raise UserError(
            f"{source} trained model.flavor=gpt2 with model.n_experts={cfg.n_experts} (learned positions, LayerNorm, GELU "
            "experts), which no transformers MoE class loads with its logits; train with model.flavor=llama to export it as "
            "Mixtral, or export --format safetensors"
        )


def hf_config(cfg: Any, vocab_size: int) -> Any:
    """The transformers config of the GPT `cfg` describes: Llama, or Mixtral with model.n_experts."""
    import transformers

    if cfg.flavor == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size,
            n_positions=cfg.block_size,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=4 * cfg.n_embd,
            activation_function="gelu",  # F.gelu, exact (GPT-2's own is the tanh approximation)
            layer_norm_epsilon=1e-5,  # nn.LayerNorm's
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=4 * cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        head_dim=cfg.n_embd // cfg.n_head,
        hidden_act="silu",
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        use_cache=True,  # for inference: generate() uses the cache
    )
    if not cfg.n_experts:
        return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    return transformers.MixtralConfig(
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
        sliding_window=None,
        **common,
    )


def hf_state(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The GPT's canonical weights under transformers' names (the module docstring's table)."""
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["ln_f.weight"]}
    if not tied:
        out["lm_head.weight"] = state["head.weight"]
    layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("blocks.")})
    for i in layers:
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out |= {h + f"{hf}.weight": state[b + f"{ours}.weight"] for ours, hf in NORMS.items()}
        out |= {h + f"self_attn.{hf}.weight": state[b + f"attn.{ours}.weight"] for ours, hf in ATTENTION.items()}
        if b + "mlp.router.weight" in state:  # experts: stacked (in, out) per expert -> transformers' (out, in)
            gate, up, down = (state[b + f"mlp.{n}"].transpose(1, 2) for n in ("gate", "fc", "proj"))
            out[h + "mlp.gate.weight"] = state[b + "mlp.router.weight"]
            out[h + "mlp.experts.gate_up_proj"] = torch.cat((gate, up), dim=1).contiguous()
            out[h + "mlp.experts.down_proj"] = down.contiguous()
        else:
            out |= {h + f"mlp.{hf}.weight": state[b + f"mlp.{ours}.weight"] for ours, hf in DENSE_MLP.items()}
    return out


def gpt2_state(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The gpt2 flavor's weights under GPT2LMHeadModel's names: Conv1D weights are (in, out), our Linear's transposed;
    q, k, v joined into c_attn; a bias model.bias=false left out is zeros (the same function)."""

    def bias(name: str, size: int) -> torch.Tensor:
        return state.get(name, torch.zeros(size, dtype=state["tok_emb.weight"].dtype))

    out = {"transformer.wte.weight": state["tok_emb.weight"], "transformer.wpe.weight": state["pos_emb.weight"]}
    out |= {"transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": bias("ln_f.bias", state["ln_f.weight"].numel())}
    if not tied:
        out["lm_head.weight"] = state["head.weight"]
    for i in sorted({int(k.split(".")[1]) for k in state if k.startswith("blocks.")}):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [b + f"attn.{n}" for n in ("q", "k", "v")]
        out[h + "attn.c_attn.weight"] = torch.cat([state[n + ".weight"].t() for n in qkv], dim=1)
        out[h + "attn.c_attn.bias"] = torch.cat([bias(n + ".bias", state[n + ".weight"].shape[0]) for n in qkv])
        for ours, hf in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            weight = state[b + ours + ".weight"]
            out[h + hf + ".weight"], out[h + hf + ".bias"] = weight.t(), bias(b + ours + ".bias", weight.shape[0])
        for norm in ("ln_1", "ln_2"):
            weight = state[b + norm + ".weight"]
            out[h + norm + ".weight"], out[h + norm + ".bias"] = weight, bias(b + norm + ".bias", weight.numel())
    return {k: v.contiguous() for k, v in out.items()}


def export_gpt(cfg: Any, state: dict[str, torch.Tensor], out: Path, tokenizer: Any, source: str, dtype: str | None = None) -> str:
    """Write `out` (checkpoint/writer.py's `write_folders` gives a new folder) as a Llama or Mixtral model folder, its
    weights in `dtype` (default: float32). Returns one line saying what was written."""
    refuse_gpt2(cfg, source)
    dtype = dtype or "float32"  # the GPT's weights as its checkpoints hold them
    config = hf_config(cfg, state["tok_emb.weight"].shape[0])
    with torch.device("meta"):
        model = hf_loading.import_transformers().AutoModelForCausalLM.from_config(config, dtype=hf_loading.DTYPES[dtype])
    weights = (gpt2_state if cfg.flavor == "gpt2" else hf_state)(state, cfg.tie_embeddings)
    hf_export.load_weights(model, {k: v.to(hf_loading.DTYPES[dtype]) for k, v in weights.items()}, source)
    model.save_pretrained(out)
    saved = hf_export.hf_tokenizer(tokenizer)
    if saved is not None:
        saved.save_pretrained(out)
    kind = type(model).__name__
    note = "" if saved is not None or tokenizer is None else " (no tokenizer files: the run's tokenizer has no Hugging Face form)"
    return f"Hugging Face model folder ({kind}): {out}{note}"
