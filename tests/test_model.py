"""Models: shapes, canonical part names, forward with parts removed (what a pipeline stage does)."""

from __future__ import annotations

import pytest
import torch

from parallel_train.losses import loss_fn, token_losses
from parallel_train.models import build_model
from parallel_train.models.gpt import GPTConfig
from parallel_train.models.mlp import MLPConfig


def tiny_gpt(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, **kw), vocab_size=11)


def test_gpt_shapes_and_names():
    model = tiny_gpt()
    idx = torch.randint(0, 11, (3, 8))
    assert model(idx).shape == (3, 8, 11)
    top = [name for name, _ in model.named_children()]
    assert top == ["tok_emb", "pos_emb", "drop", "blocks", "ln_f", "head"]
    assert {"blocks.1.attn.q.weight", "blocks.1.attn.k.weight", "blocks.1.attn.v.weight"} <= dict(model.named_parameters()).keys()
    assert model.flops_per_token() > 6 * 1000


def test_gpt_initial_loss_is_near_uniform():
    model = tiny_gpt()
    idx = torch.randint(0, 11, (4, 8))
    loss = loss_fn(model(idx), idx)
    assert abs(loss.item() - torch.log(torch.tensor(11.0)).item()) < 0.3
    assert token_losses(model(idx), idx).shape == (4, 8)


def test_gpt_runs_as_two_stages_with_parts_removed():
    full = tiny_gpt()
    idx = torch.randint(0, 11, (2, 8))
    expected = full(idx)
    first, second = tiny_gpt(), tiny_gpt()
    first.blocks = torch.nn.ModuleDict({"0": first.blocks["0"]})
    first.ln_f = first.head = None
    second.tok_emb = second.pos_emb = None
    second.blocks = torch.nn.ModuleDict({"1": second.blocks["1"]})
    torch.testing.assert_close(second(first(idx)), expected)


def test_seed_mlp():
    model = build_model(MLPConfig(name="mlp"), vocab_size=0)
    assert [n for n, _ in model.named_children()] == ["fc1", "act", "fc2"]
    assert model(torch.randn(64, 10)).shape == (64, 10)
    assert sum(p.numel() for p in model.parameters()) == 10 * 50 + 50 + 50 * 10 + 10


def test_metrics_are_ratios_of_sums_over_samples_and_skip_padding():
    from parallel_train.eval_metrics import TASK_METRICS, add_stats, metric_stats, metric_values

    metrics = {name: TASK_METRICS[name] for name in ("loss", "accuracy")}
    logits = torch.tensor([[[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]], [[0.0, 5.0], [0.0, 5.0], [5.0, 0.0]]])  # (B=2, T=3, V=2)
    targets = torch.tensor([[0, 0, -100], [1, 1, 1]])  # sample 0: 1 of 2 real targets right; sample 1: 2 of 3
    totals = None
    for i in range(2):  # one sample per batch, as if on two ranks
        totals = add_stats(totals, metric_stats(logits[i : i + 1], targets[i : i + 1], metrics))
    values = metric_values(totals, metrics)
    assert values["accuracy"] == pytest.approx(3 / 5)  # over all real targets, not the mean of 1/2 and 2/3
    assert values["loss"] == pytest.approx(token_losses(logits, targets).sum().item() / 5)  # per real token, not per sample
    # Classification (the seed MLP): one target per sample.
    values = metric_values(add_stats(None, metric_stats(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]), metrics)), metrics)
    assert values["accuracy"] == 0.5
