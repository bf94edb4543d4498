"""bf16 through the layers (issue 28 item 4): under train.mixed_precision=bf16 tensor parallelism alone and pipeline stages
without data-parallel replicas compute in bf16 by FSDP2's policy over one data-parallel rank (parallel/sharding.py,
`fsdp_wraps`), as FSDP2 runs always did: what the layers save for backward is bf16, not autocast's fp32 residual stream
beside bf16 copies; the weights the optimizer steps and the checkpoints hold stay fp32, under their own names.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY, check, launch_env, run, summary, train_losses, warm_cmd
from parallel_train.config.load import load_config
from parallel_train.models import MODELS
from parallel_train.optim import build_optimizer
from parallel_train.parallel.build import build_engine
from parallel_train.parallel.memory_estimate import fake_world
from parallel_train.parallel.model_init import start_model
from parallel_train.parallel.precision import make_precision

GPT = ("model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "model.vocab_size=65", "data.path=synthetic")
LAYOUTS = {"tp2": ("parallel.tp=2",), "pp2": ("parallel.pipeline_stages=2", "parallel.microbatches=2")}


def rank0_engine(*keys: str):
    """The bf16 engine rank 0 of a 2-rank run builds (inside `fake_world(2)`), and its precision."""
    cfg, _ = load_config([*GPT, "train.mixed_precision=bf16", *keys])
    accelerator = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=2, print=lambda *a: None)
    precision = make_precision("bf16", accelerator.device, 2)
    model, init = start_model(MODELS[cfg.model.name], cfg.model, 65, 0)
    return build_engine(cfg, accelerator, model, init, lambda m: build_optimizer(m, cfg.train), precision, None), precision


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layers_save_bf16_and_the_optimizer_steps_fp32(layout):
    """The engine a 2-rank run builds (rank 0 of torch's fake process group: shapes and dtypes are real, collectives do
    nothing), one forward and backward: every fp32 tensor the layers save is at most a statistic per head and token
    (attention's log-sum-exp); under autocast the norms saved the fp32 residual stream, batch x context x width.
    Parameters and the gradients the optimizer reads are fp32."""
    batch, heads, context = 2, 2, 16
    with fake_world(2):
        engine, precision = rank0_engine(*LAYOUTS[layout])
        module = engine.model if engine.model is not None else engine.stage_mods[0]  # a pipeline: rank 0's stage
        fp32_saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = getattr(t, "_local_tensor", t)
            if local.dtype == torch.float32 and not isinstance(t, torch.nn.Parameter):
                fp32_saved.append(local.numel())
            return t

        x = torch.randint(0, 65, (batch, context))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision.autocast(engine.autocast):
            out = module(x)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        assert fp32_saved and max(fp32_saved) <= batch * heads * context, sorted(fp32_saved)[-5:]
        assert {q.dtype for q in engine.params} == {torch.float32}
        assert {q.grad.dtype for q in engine.params if q.grad is not None} == {torch.float32}


def test_a_zero_bubble_pipeline_without_replicas_computes_in_bf16_too():
    """zbv splits each backward into the input's gradient and, later, the weights'; its stages stay unsharded from
    forward to the weights' gradient (pipeline/distributed.py), so FSDP2's policy serves it as any schedule."""
    with fake_world(2):
        engine, _ = rank0_engine(
            "parallel.pipeline_stages=2", "parallel.microbatches=4", "parallel.schedule=zbv", "parallel.stages_per_rank=2"
        )
        assert not engine.autocast and all(hasattr(m, "set_requires_gradient_sync") for m in engine.stage_mods)
        assert "by FSDP2's policy" in engine.name


# Slow: two launches; the default suite runs the same policy over one rank in tests/test_pipeline.py's bf16 pipeline
# (a real 2-process run: losses and fp32 canonical weights) and in the test above (in process).
@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_parallel_in_bf16_continues_on_one_process_like_autocast(tmp_path):
    """TP 2 in bf16 (FSDP2's policy over one rank), its step-3 checkpoint continued on one process in bf16 (autocast):
    the checkpoint holds fp32 weights under the unsplit model's names, and the steps after it agree with the TP run's
    within bf16's rounding, as the first steps agree with an fp32 run's."""
    env, tp, one = launch_env(tmp_path), tmp_path / "tp2", tmp_path / "one"
    log = check(run(warm_cmd(2, *TINY, "parallel.tp=2", "train.mixed_precision=bf16", f"output_dir={tp}"), env=env)).output
    assert "computed in bf16, gradients reduced in fp32 (over one data-parallel rank" in log
    ckpt = tp / "checkpoints" / "step_0000003"
    check(run(warm_cmd(1, *TINY, "train.mixed_precision=bf16", f"resume={ckpt}", f"output_dir={one}"), env=env))
    weights, unsplit = (load_file(str(out / "model.safetensors")) for out in (tp, one))
    assert weights.keys() == unsplit.keys() and {w.dtype for w in weights.values()} == {torch.float32}
    assert summary(one)["mixed_precision"] == "bf16"
    got, want = train_losses(one), train_losses(tp)
    assert all(got[s] == pytest.approx(want[s], rel=2e-3) for s in (4, 5, 6)), (got, want)
