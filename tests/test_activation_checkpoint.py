"""model.activation_checkpointing = none | full | selective (models/activation_checkpoint.py): every mode trains exactly
like none, on one process and under FSDP2, for our GPT and a Hugging Face model; each mode recomputes what it says
(counted as the matmuls dispatched during backward), so a mode that silently fell back to another would fail here."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_tiny
from helpers import TINY, check, launch_env, run, train_losses, warm_cmd
from parallel_train.config.load import config_from_dict, load_config
from parallel_train.errors import UserError
from parallel_train.models.activation_checkpoint import MATMULS
from parallel_train.models.gpt import GPT
from parallel_train.models.hf import HFCausalLM, HFConfig

# (activation_checkpointing, selective_ac)
MODES = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def loss_grads_recomputed(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss, gradients, and the matmuls backward ran beyond a plain backward's own (the recomputed ones)."""
    torch.manual_seed(1)  # the same dropout masks in every mode; checkpoint replays them in the recomputation
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    with CountMatmuls() as counted:
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, counted.count


def assert_modes_equal_none(build, x: torch.Tensor, recomputed_per_mode: dict[tuple[str, str], int]) -> None:
    results = {mode: loss_grads_recomputed(build(*mode), x) for mode in MODES}
    loss0, grads0, backward_only = results[("none", "op")]
    for mode, (loss, grads, count) in results.items():
        assert loss == pytest.approx(loss0, abs=1e-6), mode
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=f"{mode} {name}")
        assert count - backward_only == recomputed_per_mode[mode], (mode, count - backward_only)


def test_gpt_every_mode_equals_none_and_recomputes_what_it_says():
    L = 4  # blocks of 6 Linear layers each (q, k, v, proj; fc, proj): all with biases, so addmm

    def build(mode: str, option: str) -> GPT:
        keys = ["model.n_layer=4", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "model.dropout=0.1"]
        cfg, _ = load_config([*keys, f"model.activation_checkpointing={mode}", f"model.selective_ac={option}"])
        torch.manual_seed(0)
        return GPT(cfg.model, 50)

    x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    # full reruns every block's 6 matmuls; op keeps every other matmul's output (recomputes 3 per block); 2: blocks 0 and 2
    assert_modes_equal_none(build, x, {MODES[0]: 0, MODES[1]: 6 * L, MODES[2]: 3 * L, MODES[3]: 6 * 2})


def test_a_pipeline_stage_counts_blocks_by_their_name():
    """selective_ac=2 in a stage holding blocks 1-3 recomputes block 2 alone (layer index % 2 == 0), as the
    whole model does; counted by place in the stage it would be blocks 1 and 3. A launch of it: slow, below."""
    from parallel_train.parallel.pipeline.split import stage_module

    def backward_matmuls(mode: str, blocks=("blocks.1", "blocks.2", "blocks.3")) -> int:
        keys = ["model.n_layer=4", "model.n_head=2", "model.n_embd=32", "model.block_size=16", f"model.activation_checkpointing={mode}"]
        cfg, _ = load_config([*keys, "model.selective_ac=2"])
        stage = stage_module(GPT(cfg.model, 50), [*blocks, "ln_f", "head"])
        out = stage(torch.randn(2, 16, 32, requires_grad=True))
        with CountMatmuls() as counted:
            out.sum().backward()
        return counted.count

    one_block = backward_matmuls("full", ["blocks.2"]) - backward_matmuls("none", ["blocks.2"])
    assert one_block > 0 and backward_matmuls("selective") - backward_matmuls("none") == one_block


def test_hf_llama_every_mode_equals_none_and_recomputes_what_it_says(tmp_path):
    folder = hf_tiny.make_models(tmp_path)["llama"]
    layers = 2  # hf_tiny's Llama: 2 decoder layers of 7 matmuls each (q, k, v, o; gate, up, down)

    def build(mode: str, option: str) -> HFCausalLM:
        cfg = HFConfig(name="hf", hf_path=str(folder), block_size=8, activation_checkpointing=mode, selective_ac=option)
        return HFCausalLM(cfg, 256).train()

    x = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0))
    # torch stops a recomputation once backward has what it needs: down (the layer's last matmul, whose output backward
    # does not keep) is never rerun. full: 6 per layer; op: matmuls 1, 3, 5 kept, 2, 4, 6 rerun; 2: layer 0 only
    # (transformers' every_n_layers: index % 2 == 0)
    assert_modes_equal_none(build, x, {MODES[0]: 0, MODES[1]: 6 * layers, MODES[2]: 3 * layers, MODES[3]: 6})


def test_true_and_false_are_aliases_and_a_bad_option_is_one_line():
    assert load_config(["model.activation_checkpointing=true"])[0].model.activation_checkpointing == "full"
    assert load_config(["model.activation_checkpointing=false"])[0].model.activation_checkpointing == "none"
    # a config.yaml saved before the modes existed (resume compares it with the new one)
    assert config_from_dict({"model": {"activation_checkpointing": True}}).model.activation_checkpointing == "full"
    with pytest.raises(UserError, match=r"model.selective_ac: 'every' is neither op nor a positive whole number"):
        load_config(["model.activation_checkpointing=selective", "model.selective_ac=every"])
    with pytest.raises(UserError, match=r"model.activation_checkpointing: must be one of none, full, selective"):
        load_config(["model.activation_checkpointing=some"])


# no evaluation or checkpoint on the way: the modes are compared by their training losses (1 s less per launch)
NO_EVAL = ("eval.interval=0", "checkpoint.interval=0")
BASE = (*TINY, "model.n_layer=4", "model.dropout=0.1", "train.max_steps=4", "train.log_interval=1", *NO_EVAL)


def assert_modes_equal(tmp_path, layout: str, modes, reference: str) -> None:
    """Real launches with dropout, one per checkpointing mode of `modes` on `layout`, against the same layout without
    checkpointing: the same layout draws the same dropout masks, which checkpointing must replay exactly."""
    losses = {}
    for m, o in modes:
        name = f"{m}_{o}"
        keys = (layout, f"model.activation_checkpointing={m}", f"model.selective_ac={o}", f"output_dir={tmp_path / name}")
        check(run(warm_cmd(2, *BASE, *keys), env=launch_env(tmp_path)))
        losses[name] = train_losses(tmp_path / name)
    want = losses[reference]
    for name, got in losses.items():
        assert len(got) == 4 and got.keys() == want.keys(), (name, got)
        assert all(got[s] == pytest.approx(want[s], abs=1e-6) for s in got), (name, got, want)


@pytest.mark.multiprocess
def test_every_mode_under_fsdp2_equals_none(tmp_path):
    """FSDP2 on 2 ranks, full and selective op against FSDP2 without checkpointing. Selective every other block wraps
    its blocks as full does (which blocks: counted above, in process): under FSDP2 in the slow test below."""
    assert_modes_equal(tmp_path, "parallel.dp_shard=2", MODES[:3], "none_op")


@pytest.mark.slow  # a second launch of full's wrapping under FSDP2, on every other block
@pytest.mark.multiprocess
def test_selective_every_other_block_under_fsdp2_equals_none(tmp_path):
    assert_modes_equal(tmp_path, "parallel.dp_shard=2", (MODES[0], MODES[3]), "none_op")


@pytest.mark.slow  # a second launch of the checkpointing path above, in pipeline stages (a unit test covers the block count)
@pytest.mark.multiprocess
def test_selective_every_other_block_in_pipeline_stages_equals_none(tmp_path):
    """Selective every-other-block in a 2-stage pipeline (blocks counted by their name, not their place in the stage)
    against the same pipeline without."""
    assert_modes_equal(tmp_path, "parallel.pipeline_stages=2", (MODES[0], MODES[3]), "none_op")
