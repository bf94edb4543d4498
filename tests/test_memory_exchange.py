"""The memory estimate under context and expert parallelism, and for a Hub mixture of experts: in process, on the meta
device and fake tensors (scripts/estimate_memory.py's path). The measured side is tests/test_memory_measured.py's
cp and ep cells (slow) and docs/BENCHMARKS.md's table."""

from __future__ import annotations

import json

import pytest

from parallel_train.config.load import load_config
from parallel_train.data.sources import load_data
from parallel_train.parallel.activation_memory import PartBytes
from parallel_train.parallel.exchange_memory import exchange_bytes
from parallel_train.parallel.memory_estimate import build_shapes, estimate
from parallel_train.parallel.mesh import MeshLayout

GPT = ["model.n_layer=4", "model.n_embd=64", "model.n_head=2", "model.block_size=64", "train.batch_size=4", "data.path=synthetic"]


def rank0(world: int, *keys: str, base=GPT):
    cfg, _ = load_config([*base, *keys])
    data = load_data(cfg)
    return estimate(cfg, world, data.vocab_size, data.train_set[0])[1][0]


def test_context_parallel_cuts_each_ranks_activations_and_shards_over_dp_shard_x_cp():
    """parallel.cp=2: rank 0 keeps its half of every sequence (the forward runs the GPT's own all-to-all exchange on the
    fake process group), so about half of one process's activations (a little more: the exchange's copies); FSDP2
    shards and gathers over dp_shard x cp: cp=2 holds half of every weight and gathers blocks whole (cp=2 x dp_shard=2:
    the measured cell cp2xfsdp2)."""
    one, cp = rank0(1), rank0(2, "parallel.cp=2")
    assert 0.5 <= cp.activations / one.activations <= 0.56, (cp.activations, one.activations)
    assert cp.breakdown["blocks.1"] < 0.55 * one.breakdown["blocks.1"]
    # half of every weight, and two blocks plus the root gathered whole from both ranks (fp32: 4 bytes each)
    block = sum(p.numel() for p in next(iter(build_shapes(load_config(GPT)[0].model, 65).blocks.children())).parameters())
    assert cp.param_numel == one.param_numel // 2 and cp.fsdp_buffers == 4 * (2 * block + one.param_numel - 4 * block)


def test_the_all_to_all_buffers_are_one_layers_exchanged_tensors_sent_and_received():
    """Context parallel: q, k, v and the output of the largest attention, a copy each way; expert parallel: k rows per
    token (a block input's row each), each way; a layout without either has none."""
    kept = PartBytes(inputs={"blocks.0": 1000}, blocks={"blocks.0"}, attention=4000)
    moe = load_config([*GPT, "model.n_experts=4", "model.experts_per_token=2"])[0].model
    assert exchange_bytes(moe, MeshLayout(cp=2), kept) == 8000
    assert exchange_bytes(moe, MeshLayout(dp_shard=2, ep=2), kept) == 2 * 2 * 1000
    assert exchange_bytes(moe, MeshLayout(dp_shard=2), kept) == 0


def test_expert_parallel_counts_its_dispatched_rows_in_backwards_scratch():
    """ep=2 on the GPT's experts: the scratch is at least the dispatched rows sent and received (2 x k x tokens x width
    x 4 bytes), measured on the estimate's forward."""
    got = rank0(2, "model.n_experts=4", "model.experts_per_token=2", "parallel.ep=2")
    assert got.working >= 2 * 2 * (4 * 64 * 64 * 4)


@pytest.fixture
def qwen3_moe(tmp_path):
    """A tiny Qwen3-MoE's config.json (transformers' own save_pretrained; no weights: the estimate reads shapes)."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64}
    config |= {"intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256, "head_dim": 16}
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    return ["model.name=hf", f"model.hf_path={tmp_path}", "model.hf_pretrained=false", "data.path=synthetic"]


def test_a_hub_mixture_of_experts_is_estimated_as_a_real_forward_keeps(qwen3_moe, monkeypatch):
    """transformers' experts run torch's grouped matmul, whose meta kernel refuses fp32 on fake tensors (the estimate
    stopped with "Expected inputs of BF16 type"): the estimate runs them through transformers' own fallback. And a
    model that builds its own masks (no known layout: Qwen3-MoE's taken away here) made a (B, 1, T, T) mask on fake
    position ids that a run never has (the measured cells ran at 1.07, 1.03-1.04 without it). Each layer's estimate now
    equals what a real forward keeps, and under FSDP2 each decoder layer's bytes are still its own (found before
    fully_shard renames the layers' class, which left them all on the model before)."""
    import contextlib

    import torch

    from parallel_train.models import hf_layouts
    from parallel_train.parallel.activation_memory import block_names, kept_per_part

    monkeypatch.delitem(hf_layouts.LAYOUTS, "qwen3_moe")  # the model's own forward, which builds its masks

    keys = [*qwen3_moe, "model.block_size=64", "train.batch_size=2"]
    one = rank0(1, base=keys)
    model = build_shapes(load_config(keys)[0].model, 256).train()  # real weights, random
    x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    real = kept_per_part(model, model, x, y, None, contextlib.nullcontext(), block_names(model)).kept
    assert [one.breakdown[f"model.layers.{i}"] for i in (0, 1)] == [real[f"model.layers.{i}"] for i in (0, 1)], (one.breakdown, real)
    assert rank0(2, "parallel.dp_shard=2", base=keys).breakdown["model.layers.1"] == one.breakdown["model.layers.1"]
