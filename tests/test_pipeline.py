"""Pipeline parallelism: the splitter, the timeline, and real runs of both executors against the unsplit model.

The equivalence runs share one reference: the unsplit model, 1 process, batch 4 x 2 accumulation steps
(global batch 8). Every pipeline run sees the same 8 samples per step (data/text.py), so its per-step losses
and final weights must match the reference to float tolerance: the in-process executor (gpipe), the
multi-process executor with each schedule, and DP x PP (2 processes x 2 in-process stages, batch 4 each).
Checkpoints cross topologies on the way: a plain checkpoint resumes a pipeline run and vice versa.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY, check, launch_env, run, summary, train_losses, warm_cmd
from parallel_train.checkpoint.export import index_files, whole_tensor
from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.models import build_model
from parallel_train.models.gpt import GPTConfig
from parallel_train.models.mlp import MLPConfig
from parallel_train.parallel.parts import model_units
from parallel_train.parallel.pipeline.distributed import check_layout
from parallel_train.parallel.pipeline.inprocess import resolve_devices
from parallel_train.parallel.pipeline.split import balance, describe_stages, plan_stages, stage_module
from parallel_train.parallel.pipeline.timeline import bubble_fraction, draw, ideal_bubble

# dropout 0 (the default); batch 4 x 2 accumulation steps = global batch 8.
# SGD shows any error in gradient scaling (Adam would hide a constant factor), and with lr 1 the gradient
# norm crosses train.grad_clip=1.0 during the run: some steps are clipped (global norm), others not.
# eval.batch_size: a global validation batch of 8 whatever the layout (its default, train.batch_size x data-parallel
# ranks, differs between layouts that differ in accumulation).
SGD = (*TINY, "train.gradient_accumulation_steps=2", "train.optimizer=sgd", "train.learning_rate=1.0", "eval.batch_size=8")
# AdamW: its state (exp_avg, exp_avg_sq by parameter name) must travel between topologies.
ADAM = (*TINY, "train.gradient_accumulation_steps=2", "train.learning_rate=1e-2", "eval.batch_size=8")


def tiny_gpt(n_layer: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16), 65)


# ---------------------------------------------------------------- the splitter (no launch)


def test_auto_split_balances_parameters_and_keeps_groups():
    model = tiny_gpt()
    stages = plan_stages(model, 2)
    assert stages[0][:3] == ["tok_emb", "pos_emb", "drop"] and stages[-1][-2:] == ["ln_f", "head"]
    assert [n for s in stages for n in s] == list(model_units(model))  # every unit once, in order
    assert balance([1, 1, 1, 1], 2) == [2] and balance([10, 1, 1, 1, 1], 2) == [1]


def test_explicit_split_with_ranges_and_left_out_dropout():
    model = tiny_gpt()
    stages = plan_stages(model, 2, "tok_emb,pos_emb,blocks.0..1 | blocks.2..3,ln_f,head")
    assert stages == [["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]]
    assert plan_stages(model, 2, "tok_emb,pos_emb,blocks|ln_f,head")[0][-1] == "blocks.3"  # a whole row


def test_time_split_balances_measured_time_not_parameters():
    """A GPT-2-like imbalance: the 50k-token embedding holds most parameters and costs little; the output layer
    (as large) is by far the most expensive unit. split=time gives the head a stage alone. The planning is checked
    on fixed times in the measured proportions (the head costs more than the four blocks together, the embedding
    little), the measurement for its shape only: a ratio of measured times depends on the machine and its load, so
    it is measured, not asserted (docs/pipelines.md, "Parameters are a poor guide": the head 80% of the time)."""
    from parallel_train.models.gpt import GPT
    from parallel_train.parallel.model_init import start_model
    from parallel_train.parallel.pipeline.cost import unit_times

    model, init = start_model(GPT, GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16), 50_000, seed=0)  # on meta
    units = list(model_units(model))
    x = torch.randint(0, 50_000, (4, 16))
    measured = unit_times(model, units, x, x, torch.device("cpu"), init)
    assert len(measured) == len(units) and all(t >= 0 for t in measured)
    seconds = dict.fromkeys(units, 1e-5) | {f"blocks.{i}": 1e-3 for i in range(4)} | {"tok_emb": 1e-4, "head": 5e-3}
    stages = plan_stages(model, 2, "time", lambda names: [seconds[n] for n in names])
    # The head alone (ln_f, near free, may join it): every block on stage 0. auto (parameters) cuts between blocks.
    assert stages[1][-1] == "head" and not any(n.startswith("blocks.") for n in stages[1]), stages
    assert any(n.startswith("blocks.") for n in plan_stages(model, 2)[1])
    assert all(p.is_meta and p.grad is None for p in model.parameters())  # one part at a time, each given back
    assert describe_stages(model, stages, ["cpu", "cpu"], seconds).count("% of the measured time") == 2


@pytest.mark.parametrize(
    ("n_stages", "spec", "message"),
    [
        (6, "auto", "only 5 parts"),  # more stages than blocks
        (2, "tok_emb,pos_emb,blocks.0|blocks.9,ln_f,head", "unknown module 'blocks.9'"),
        (2, "tok_emb,pos_emb,blocks.0|blocks.1,head", "'ln_f' is in no stage"),
        (2, "blocks.1,ln_f,head|tok_emb,pos_emb,blocks.0", "forward order"),
        (2, "tok_emb,blocks.0|pos_emb,blocks.1,ln_f,head", "put them in one stage"),
        (3, "tok_emb,pos_emb,blocks.0|blocks.1,ln_f,head", "names 2 stages"),
    ],
)
def test_bad_split_is_one_line_error(n_stages, spec, message):
    with pytest.raises(UserError, match=message) as e:
        plan_stages(tiny_gpt(2), n_stages, spec)
    assert "\n" not in str(e.value)


def test_bad_layouts_and_devices_are_one_line_errors():
    cfg = Config()
    cfg.parallel.pipeline_stages, cfg.parallel.microbatches, cfg.train.batch_size = 3, 2, 4
    with pytest.raises(UserError, match="does not divide the world size 2"):
        check_layout(cfg, 2)
    cfg.parallel.pipeline_stages = 2
    assert check_layout(cfg, 4) == (1, 2)  # 2 stages x 2 replicas
    cfg.train.batch_size = 3
    with pytest.raises(UserError, match="not divisible by parallel.microbatches"):
        check_layout(cfg, 2)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="cuda:0 does not exist"):
            resolve_devices(["cpu", "cuda:0"], 0)
    with pytest.raises(UserError, match="is not a device"):
        resolve_devices(["cpu", "gpu7"], 0)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_stages_in_sequence_equal_the_whole_model(name):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16) if name == "gpt" else MLPConfig(name="mlp")
    model = build_model(cfg, 65).eval()
    x = torch.randint(0, 65, (2, 16)) if name == "gpt" else torch.randn(2, cfg.in_features)
    stages = plan_stages(model, 2)
    views = [stage_module(model, names) for names in stages]
    h = x
    for view in views:
        h = view(h)
    torch.testing.assert_close(h, model(x))
    names = [n for v in views for n, _ in v.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # canonical names, none twice


def test_bubble_fraction_and_picture(tmp_path):
    # 2 rows, GPipe with M=2 and unit-time ops: each row is busy 4 of 6 time units.
    spans = [
        (0, 0, 0, "F", 0, 1),
        (0, 0, 1, "F", 1, 2),
        (1, 1, 0, "F", 1, 2),
        (1, 1, 1, "F", 2, 3),
        (1, 1, 0, "B", 3, 4),
        (1, 1, 1, "B", 4, 5),
        (0, 0, 0, "B", 4, 5),
        (0, 0, 1, "B", 5, 6),
    ]
    assert bubble_fraction(spans, 2) == pytest.approx(1 - 8 / 12)
    assert ideal_bubble(2, 2) == pytest.approx(1 / 3) and ideal_bubble(2, 2, stages_per_row=2) == pytest.approx(1 / 5)
    draw(spans, ["stage 0", "stage 1"], tmp_path / "t.png", "test")
    assert (tmp_path / "t.png").stat().st_size > 1000


# ---------------------------------------------------------------- real runs against the unsplit model


def weights(run_dir, name="model.safetensors"):
    if name.endswith("/optimizer"):  # a checkpoint's optimizer state, whole, from the shards every rank wrote
        shards = sorted((run_dir / name).parent.glob("shards/*.safetensors"))
        return {k: whole_tensor(e) for k, e in index_files(shards, prefix="optimizer/").items()}
    return load_file(str(run_dir / name))


def assert_same_training(run_dir, ref_dir, steps=range(1, 7), atol=1e-5, file="model.safetensors"):
    got, want = train_losses(run_dir), train_losses(ref_dir)
    for step in steps:
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, got, want)
    if file == "model.safetensors":  # the evaluation (its own schedule / sharding) agrees too
        assert summary(run_dir)["final_val_loss"] == pytest.approx(summary(ref_dir)["final_val_loss"], abs=1e-4)
        got, want = summary(run_dir)["final_val_metrics"], summary(ref_dir)["final_val_metrics"]
        assert got.keys() == want.keys() and got["val_accuracy"] == pytest.approx(want["val_accuracy"], abs=1e-6)
    w, ref = weights(run_dir, file), weights(ref_dir, file)
    assert w.keys() == ref.keys()
    for k in ref:  # Adam amplifies float noise in tiny gradients: a looser atol for it
        torch.testing.assert_close(w[k], ref[k], atol=atol, rtol=1e-4, msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    check(run(warm_cmd(1, *SGD, f"output_dir={tmp / 'ref_sgd'}"), env=launch_env(tmp)))
    check(run(warm_cmd(1, *ADAM, f"output_dir={tmp / 'ref_adam'}"), env=launch_env(tmp)))
    return tmp


def test_in_process_pipeline_matches_unsplit_model(reference):
    """Executor 1 with AdamW; its checkpoint (canonical names) then continues as a plain run."""
    env, ref, out = launch_env(reference), reference / "ref_adam", reference / "inproc"
    result = check(
        run(
            warm_cmd(
                1, *ADAM, "parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]", "parallel.microbatches=2", f"output_dir={out}"
            ),
            env=env,
        )
    )
    assert "engine: pipeline in one process (executor 1)" in result.output
    assert_same_training(out, ref, atol=1e-4)
    s = summary(out)
    assert 0 <= s["pipeline_bubble_measured"] <= 1 and s["pipeline_bubble_ideal"] == pytest.approx(1 / 3)
    assert (out / s["pipeline_timeline"]).stat().st_size > 1000
    assert "pipeline bubble: measured" in result.output
    plain = reference / "plain_from_inproc"
    check(run(warm_cmd(1, *ADAM, f"resume={out / 'checkpoints' / 'step_0000003'}", f"output_dir={plain}"), env=env))
    assert_same_training(plain, ref, steps=range(4, 7), atol=1e-4)


@pytest.mark.multiprocess
def test_data_parallel_x_in_process_pipeline(reference):
    """2 DDP processes, each a 2-stage pipeline on its own devices; batch 4 each, no accumulation = the same 8 samples."""
    out = reference / "dp_pp"
    overrides = [o for o in SGD if not o.startswith("train.gradient_accumulation_steps")]
    result = check(
        run(
            warm_cmd(
                2,
                *overrides,
                "parallel.pipeline_stages=2",
                "parallel.stage_devices=[cpu,cpu]",
                "parallel.microbatches=2",
                f"output_dir={out}",
            ),
            env=launch_env(reference),
        )
    )
    assert "x 2 DDP replicas" in result.output
    assert_same_training(out, reference / "ref_sgd")


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved1f1b"])
def test_multi_process_pipeline_matches_unsplit_model(reference, schedule):
    """1f1b (SGD) trains from scratch and its checkpoint resumes a plain run; gpipe (AdamW) resumes from the
    plain reference's checkpoint and writes the same optimizer state; interleaved puts 4 stages on 2 ranks."""
    env, out = launch_env(reference), reference / f"mp_{schedule}"
    ref = reference / ("ref_adam" if schedule == "gpipe" else "ref_sgd")
    extra = {
        "1f1b": SGD,
        "gpipe": (*ADAM, f"resume={ref / 'checkpoints' / 'step_0000003'}"),
        "interleaved1f1b": (*SGD, "parallel.stages_per_rank=2", "parallel.split=time"),  # both ranks must cut alike
    }[schedule]
    result = check(
        run(
            warm_cmd(
                2, *extra, "parallel.pipeline_stages=2", "parallel.microbatches=2", f"parallel.schedule={schedule}", f"output_dir={out}"
            ),
            env=env,
        )
    )
    assert "executor 2, torch.distributed.pipelining): 2 stage ranks" in result.output
    if schedule == "interleaved1f1b":
        assert result.output.count("% of the measured time") == 4  # 4 stages, cut by measured time
    if schedule == "gpipe":
        assert_same_training(out, ref, steps=range(4, 7), atol=1e-4)
        step6 = "checkpoints/step_0000006/optimizer"
        assert_same_training(out, ref, steps=(), atol=1e-4, file=step6)  # written by both stages, by name
    else:
        assert_same_training(out, ref)
    ideal = 1 / 9 if schedule == "interleaved1f1b" else 1 / 5  # (S-1)/(V*M+S-1), M = 2 x 2 accumulation per schedule step
    assert json.loads((out / "summary.json").read_text())["pipeline_bubble_ideal"] == pytest.approx(ideal)
    if schedule == "1f1b":  # the pipeline's checkpoint (canonical names, gathered on rank 0) continues as a plain run
        plain = reference / "plain_from_pipeline"
        check(run(warm_cmd(1, *SGD, f"resume={out / 'checkpoints' / 'step_0000003'}", f"output_dir={plain}"), env=env))
        assert_same_training(plain, ref, steps=range(4, 7))


def test_bad_pipeline_launch_is_one_line_exit_2(tmp_path):
    """Through train.py: exit 2, one line, nothing written to output_dir."""
    out = tmp_path / "bad"
    result = run(
        warm_cmd(
            1,
            *TINY,
            "parallel.pipeline_stages=2",
            "parallel.stage_devices=[cpu,cpu]",
            "parallel.split=tok_emb,pos_emb,blocks.0|blocks.7,ln_f,head",
            f"output_dir={out}",
        ),
        env=launch_env(tmp_path),
    )
    assert result.returncode == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unknown module 'blocks.7'" in errors[0] and "Traceback" not in result.output
    assert not (out / "config.yaml").exists()


@pytest.mark.multiprocess
def test_world_size_not_divisible_by_stages(tmp_path):
    result = run(warm_cmd(2, *TINY, "parallel.pipeline_stages=3", f"output_dir={tmp_path / 'bad'}"), env=launch_env(tmp_path))
    assert result.returncode != 0
    assert "error: parallel.pipeline_stages=3 does not divide the world size 2" in result.stderr


@pytest.mark.multiprocess
def test_data_parallel_x_multi_process_pipeline(reference):
    """4 processes = 2 stages x 2 data-parallel replicas (mesh dp x pp), batch 4 each: the reference's 8 samples."""
    out = reference / "mp_dp"
    overrides = [o for o in SGD if not o.startswith("train.gradient_accumulation_steps")]
    result = check(
        run(
            warm_cmd(4, *overrides, "parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b", f"output_dir={out}"),
            env=launch_env(reference),
            timeout=600,
        )
    )
    assert "2 data-parallel replicas" in result.output
    assert_same_training(out, reference / "ref_sgd")


@pytest.mark.multiprocess
def test_pipelines_train_in_bf16(reference):
    """bf16 in both executors: close to the fp32 run (not equal: bf16 rounds). One process autocasts; the multi-process
    stages compute in bf16 by FSDP2's policy (parallel/sharding.py fsdp_wraps) and still save fp32 weights under the
    unsplit model's names."""
    env, ref = launch_env(reference), train_losses(reference / "ref_adam")
    runs = {
        "bf16_inproc": warm_cmd(
            1,
            *ADAM,
            "train.mixed_precision=bf16",
            "parallel.pipeline_stages=2",
            "parallel.stage_devices=[cpu,cpu]",
            "parallel.microbatches=2",
            f"output_dir={reference / 'bf16_inproc'}",
        ),
        "bf16_mp": warm_cmd(
            2,
            *ADAM,
            "train.mixed_precision=bf16",
            "parallel.pipeline_stages=2",
            "parallel.microbatches=2",
            f"output_dir={reference / 'bf16_mp'}",
        ),
    }
    for name, cmd in runs.items():
        result = check(run(cmd, env=env))
        assert "precision bf16" in result.output
        losses = train_losses(reference / name)
        assert all(abs(losses[s] - ref[s]) < 0.05 for s in range(1, 7)), (name, losses, ref)
    assert "stages computed in bf16 by FSDP2's policy" in result.output  # the multi-process one, last
    weights, unsplit = (load_file(str(reference / name / "model.safetensors")) for name in ("bf16_mp", "ref_adam"))
    assert weights.keys() == unsplit.keys() and {w.dtype for w in weights.values()} == {torch.float32}


def test_stage_input_gradients_are_made_contiguous_for_sending():
    """A stage whose input gradient comes out transposed (e.g. a batch-first nn.GRU) must still send it."""
    from parallel_train.parallel.pipeline.distributed import _contiguous_input_grads

    class Transposing(torch.nn.Module):
        def forward(self, x):
            return x.transpose(0, 1) * 2

    stage = Transposing()
    stage.register_forward_pre_hook(_contiguous_input_grads)
    x = torch.randn(3, 5, requires_grad=True)
    # The schedules take input gradients with autograd.grad, which (unlike .grad) keeps a transposed layout.
    (grad,) = torch.autograd.grad(stage(x), x, torch.ones(5, 3))
    assert grad.is_contiguous()
    torch.testing.assert_close(grad, torch.full((3, 5), 2.0))
    fresh = torch.randn(3, 5, requires_grad=True)
    (raw,) = torch.autograd.grad(Transposing()(fresh), fresh, torch.ones(5, 3))
    assert not raw.is_contiguous()  # what the hook fixes
