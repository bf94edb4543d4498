"""The optimizer's parameter groups and the learning-rate schedules (in-process)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from transformers.optimization import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup, get_wsd_schedule

from hf_tiny import gpt2_config, llama_config
from parallel_train.config.load import load_config
from parallel_train.config.sections import TrainConfig
from parallel_train.errors import UserError
from parallel_train.models import build_model
from parallel_train.models.gpt import GPTConfig
from parallel_train.optim import build_optimizer, build_scheduler, decay_start, lr_at

# Peak 1, floor 0.1, 2 warm-up steps, the decay ends at step 12; wsd decays over the last quarter (steps 9-12).
SHAPE = dict(learning_rate=1.0, min_lr=0.1, warmup_steps=2, lr_decay_steps=12, lr_decay_fraction=0.25)
COSINE_AT_4 = 0.1 + 0.5 * (1 + math.cos(math.pi * 0.2)) * 0.9  # 2 of the 10 decay steps done


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("cosine", {0: 0.0, 1: 0.5, 2: 1.0, 4: COSINE_AT_4, 7: 0.55, 12: 0.1, 20: 0.1}),
        ("linear", {0: 0.0, 1: 0.5, 2: 1.0, 4: 0.82, 7: 0.55, 12: 0.1, 20: 0.1}),
        ("wsd", {0: 0.1, 1: 0.55, 2: 1.0, 4: 1.0, 9: 1.0, 10: 0.7, 11: 0.4, 12: 0.1, 20: 0.1}),
        ("constant", {0: 1.0, 4: 1.0, 20: 1.0}),
    ],
)
def test_each_schedule_at_a_few_steps(schedule, expected):
    cfg = TrainConfig(lr_schedule=schedule, **SHAPE)
    assert {step: lr_at(step, cfg) for step in expected} == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("warmup, total", [(0, 10), (1, 10), (2, 12), (5, 8), (10, 40)])
@pytest.mark.parametrize("kind", ["linear", "cosine", "wsd"])
def test_each_schedule_equals_transformers_at_every_step(kind, warmup, total):
    """linear and cosine with min_lr=0 (where transformers' decay to) are its get_linear_schedule_with_warmup and
    get_cosine_schedule_with_warmup, wsd is its get_wsd_schedule with a linear decay to min_lr, warm-up included:
    step 0 runs at 0 (wsd's at min_lr), as a Trainer's first update does. Compared up to the decay's end (after it
    transformers' cosine rises again, this template's stays at min_lr)."""
    cfg = TrainConfig(
        **{**SHAPE, "lr_schedule": kind, "min_lr": 0.1 if kind == "wsd" else 0.0, "warmup_steps": warmup, "lr_decay_steps": total}
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "linear":
        theirs = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total)
    elif kind == "cosine":
        theirs = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total)
    else:
        stable = decay_start(cfg) - warmup
        theirs = get_wsd_schedule(
            optimizer, warmup, num_decay_steps=total - warmup - stable, num_stable_steps=stable, decay_type="linear", min_lr_ratio=0.1
        )
    ours = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), cfg)
    for step in range(total + 1):
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), abs=1e-12), (step, ours.get_last_lr(), theirs.get_last_lr())
        assert lr_at(step, cfg) == pytest.approx(theirs.get_last_lr()[0], abs=1e-12)
        for scheduler in (ours, theirs):
            scheduler.optimizer.step()
            scheduler.step()


def test_wsd_whose_warm_up_outlasts_the_decay_is_refused():
    """Issue 34: wsd with train.warmup_steps past train.lr_decay_steps climbed, then fell straight to min_lr at the
    end of the warm-up, never reaching train.learning_rate (no stable phase, no decay): refused in one line."""
    cfg = TrainConfig(lr_schedule="wsd", **{**SHAPE, "warmup_steps": 14})
    assert max(lr_at(step, cfg) for step in range(30)) < cfg.learning_rate and lr_at(14, cfg) == cfg.min_lr
    for warmup in (12, 14):
        with pytest.raises(UserError, match=rf"^train.warmup_steps={warmup}: .*before train.lr_decay_steps=12") as e:
            load_config(["train.lr_schedule=wsd", f"train.warmup_steps={warmup}", "train.lr_decay_steps=12"])
        assert "\n" not in str(e.value)
    load_config(["train.lr_schedule=wsd", "train.warmup_steps=11", "train.lr_decay_steps=12"])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_a_resumed_scheduler_continues_at_the_exact_rate(schedule):
    """What a checkpoint keeps of the schedule: the scheduler's state dict (its step) and the optimizer's (each
    group's current rate). Loaded into a new optimizer and scheduler, the next rates are bit-identical to the
    uninterrupted ones (the schedule's shape is the config's: its lambda is not saved)."""
    cfg = TrainConfig(lr_schedule=schedule, **{**SHAPE, "learning_rate": 3e-3, "min_lr": 3e-4})

    def pair():
        optimizer = build_optimizer(torch.nn.Linear(3, 2), cfg, fused=False)
        return optimizer, build_scheduler(optimizer, cfg)

    optimizer, scheduler = pair()
    rates = []
    for _ in range(14):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
        if len(rates) == 5:
            saved = copy.deepcopy((optimizer.state_dict(), scheduler.state_dict()))
    optimizer, scheduler = pair()
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] == rates[4]
    for expected in rates[5:]:
        optimizer.step()
        scheduler.step()
        assert [g["lr"] for g in optimizer.param_groups] == [expected, expected]


def decayed_names(model: torch.nn.Module, cfg: TrainConfig) -> tuple[set[str], int]:
    """The names of the parameters in a weight-decaying group, and the number of groups."""
    optimizer = build_optimizer(model, cfg, fused=False)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}, len(optimizer.param_groups)


@pytest.mark.parametrize(
    "name, make",
    [
        ("gpt", lambda: build_model(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=True), vocab_size=11)),
        ("llama", lambda: transformers.AutoModelForCausalLM.from_config(llama_config())),
        ("gpt2", lambda: transformers.AutoModelForCausalLM.from_config(gpt2_config())),
    ],
)
def test_matrices_decay_as_transformers_trainer_does_and_all_decays_everything(name, make):
    """weight_decay_params=matrices: what transformers' Trainer decays (its rule goes by module type and name: no
    LayerNorm, no bias, no norm); for GPT, whose names differ, every weight of 2+ dims (embeddings and Linear weights),
    no LayerNorm gain and no bias. all: one group, every parameter decayed, as torch.optim.AdamW(model.parameters())."""
    model = make()
    every = {n for n, _ in model.named_parameters()}
    matrices, groups = decayed_names(model, TrainConfig(weight_decay=0.1))
    assert groups == 2 and matrices == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert any("bias" in n or "ln" in n or "norm" in n for n in every - matrices)
    if name != "gpt":
        # its list names a tied weight under both names (GPT-2's lm_head.weight is transformer.wte.weight): once here
        assert matrices == set(transformers.Trainer.get_decay_parameter_names(None, model)) & every
    else:
        assert {"tok_emb.weight", "blocks.0.attn.q.weight"} <= matrices and "blocks.0.ln1.weight" not in matrices
    assert decayed_names(model, TrainConfig(weight_decay=0.1, weight_decay_params="all")) == (every, 1)
