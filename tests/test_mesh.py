"""N-D parallelism on a device mesh: FSDP2, HSDP, tensor parallel and pipelines, on gloo, against one process.

Every run sees the same global batch of 8 as the reference (one process, batch 4 x 2 accumulation steps), so
its per-step losses, its evaluation and its final weights must equal the reference's to float tolerance.
Measured on this machine (fp32, SGD, 6 steps): losses within 2e-7 relative, weights within 1.2e-7 absolute
on tensors of size about 1 (the sums of tensor-parallel and sharded reductions run in another order);
asserted at 1e-5 relative. SGD, as in the pipeline tests: Adam would blow float noise in the attention key
bias (whose gradient is zero in exact arithmetic) up into full-size steps. Checkpoints cross topologies on the
way (tensor parallel -> FSDP x TP); the estimator's parameter count per rank equals what each run reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import PYTHON, TINY, accelerate_cmd, accelerate_warm, check, launch_env, run, summary, train_losses, warm_cmd
from parallel_train.config.load import load_config
from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.models import build_model
from parallel_train.models.gpt import GPT, GPTConfig
from parallel_train.models.mlp import MLPConfig
from parallel_train.parallel.mesh import MeshLayout, resolve_layout
from parallel_train.parallel.sharding import tensor_parallel_plan

# Global batch 8: batch 4 x 2 micro-steps per data-parallel rank, or batch 2 x 2 micro-steps on 2 of them.
# Padded samples (each keeps a different number of targets, the rest -100): the loss is per valid token of the whole
# step, so the per-rank and per-micro-step shares of valid tokens differ and only a correct global count matches.
PADDED = ("data.path=synthetic", "data.synthetic_padding=true", "data.num_samples=4000", "model.vocab_size=65")
SGD = (*TINY, *PADDED, "train.gradient_accumulation_steps=2", "train.optimizer=sgd", "train.learning_rate=1.0", "eval.batch_size=8")
HALF = ("train.batch_size=2",)  # two data-parallel ranks
LAUNCHES = {  # name -> (processes or accelerate config, overrides)
    "ref": (1, ()),
    "tp2": (2, ("parallel.tp=2",)),
    "fsdp2": (2, (*HALF, "parallel.dp_shard=2")),
    "fsdp2_tp2": (4, (*HALF, "parallel.dp_shard=2", "parallel.tp=2", "resume={tp2}/checkpoints/step_0000003")),
    "fsdp_yaml": ("fsdp", (*HALF, "train.mixed_precision=no")),
    "tp2_pp2": (4, ("parallel.tp=2", "parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b")),
    "zbv": (2, ("parallel.pipeline_stages=2", "parallel.microbatches=4", "parallel.schedule=zbv")),
    # train.compile: each block compiled on its own (TP plan first, FSDP2 after), 20 steps against eager
    "ref20": (1, ("train.max_steps=20",)),
    "compile_fsdp2": (2, (*HALF, "parallel.dp_shard=2", "train.compile=true", "train.max_steps=20")),
    # slow ones
    "compile_tp2": (2, ("parallel.tp=2", "train.compile=true", "train.max_steps=20")),
    "hsdp": (4, ("train.batch_size=1", "parallel.dp_replicate=2", "parallel.dp_shard=2")),
    "interleavedzb": (2, ("parallel.pipeline_stages=2", "parallel.microbatches=4", "parallel.schedule=interleavedzb")),
    "dualpipev": (2, ("parallel.pipeline_stages=2", "parallel.microbatches=4", "parallel.schedule=dualpipev")),
    # FSDP2 over 2 replicas of a 2-stage zero-bubble pipeline: a stage's weights' gradients come after its inputs', with
    # other micro-batches' forwards between (FSDP2 must keep the stage unsharded from forward to weight gradient)
    "fsdp2_pp2_zbv": (
        4,
        ("train.batch_size=4", "train.gradient_accumulation_steps=1", "parallel.dp_shard=2", "parallel.pipeline_stages=2")
        + ("parallel.microbatches=4", "parallel.schedule=zbv"),
    ),
    "fsdp_tp_yaml": ("fsdp_tp", (*HALF, "train.mixed_precision=no")),
    # all three at once, as the 405B layout runs (docs/performance.md): FSDP2 over 2 replicas of a 2-stage 1F1B pipeline
    # whose stages run tensor parallel 2 (sequence and loss parallel inside them): 8 processes
    "fsdp2_tp2_pp2": (
        8,
        (*HALF, "parallel.dp_shard=2", "parallel.tp=2", "parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b"),
    ),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(name) -> the run's output_dir and log; each launch runs once per module, when first asked for."""
    tmp = tmp_path_factory.mktemp("mesh")
    done: dict[str, tuple[Path, str]] = {}

    def launch(name: str) -> tuple[Path, str]:
        if name not in done:
            how, overrides = LAUNCHES[name]
            for other in LAUNCHES:  # a launch that resumes another's checkpoint needs that one first
                if any(f"{{{other}}}" in o for o in overrides):
                    launch(other)
            out = tmp / name
            args = (*SGD, *(o.format(**{k: v[0] for k, v in done.items()}) for o in overrides), f"output_dir={out}")
            extra: dict[str, str] = {}
            if isinstance(how, int):
                cmd = warm_cmd(how, *args)
            elif how == "fsdp":  # the environment accelerate's launcher gives fsdp.yaml's 2 workers, forked warm
                cmd, extra = accelerate_warm(how, *args, launch_args=("--num_processes", "2"))
            else:  # a real `accelerate launch` (slow): 4 processes, its parallelism_config cut to fit (4 x 2 would need 8)
                flags = ("--num_processes", "4", "--parallelism_config_dp_shard_size", "2")
                cmd = accelerate_cmd(how, *args, launch_args=flags)
            done[name] = (out, check(run(cmd, env=launch_env(tmp, **extra), timeout=600)).output)
        return done[name]

    return launch


def assert_same_training(run_dir: Path, ref_dir: Path, steps=range(1, 7)) -> None:
    got, want = train_losses(run_dir), train_losses(ref_dir)
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    s, r = summary(run_dir), summary(ref_dir)
    assert s["final_val_loss"] == pytest.approx(r["final_val_loss"], rel=1e-5)
    assert s["final_val_metrics"]["val_accuracy"] == pytest.approx(r["final_val_metrics"]["val_accuracy"], abs=1e-9)
    w, ref = load_file(str(run_dir / "model.safetensors")), load_file(str(ref_dir / "model.safetensors"))
    assert w.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(w[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def total_params() -> int:
    return sum(q.numel() for q in build_model(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16), 65).parameters())


# ---------------------------------------------------------------- real runs against one process


@pytest.mark.multiprocess
def test_tensor_parallel_on_2_ranks_equals_one_process(launched):
    out, log = launched("tp2")
    assert "engine: device mesh (tensor parallel, plain torch): mesh tp 2; rank 0 holds" in log
    assert "; sequence parallel and loss parallel" in log  # the norms on sequence shards, the loss on vocabulary shards
    assert_same_training(out, launched("ref")[0])
    s = summary(out)
    assert s["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "pp": 1, "tp": 2}
    assert total_params() / 2 < s["local_param_numel"] < 0.52 * total_params()  # the vocabulary (65) splits 33 + 32


@pytest.mark.multiprocess
def test_fsdp2_on_2_ranks_with_accumulation_equals_one_process(launched):
    out, log = launched("fsdp2")
    assert "engine: device mesh (FSDP2, plain torch): mesh dp_shard 2" in log and "global batch 2 x 2 data-parallel ranks x 2" in log
    assert_same_training(out, launched("ref")[0])
    assert summary(out)["mesh"]["dp_shard"] == 2 and summary(out)["local_param_numel"] < 0.51 * total_params()
    assert shard_writers(out / "checkpoints" / "step_0000003") == {0, 1}  # each rank wrote its own shards


def shard_writers(folder: Path) -> set[int]:
    """The ranks that wrote a checkpoint's tensor files (its manifest records the writer of each)."""
    files = json.loads((folder / "manifest.json").read_text())["files"]
    return {meta["rank"] for name, meta in files.items() if name.startswith("shards/")}


@pytest.mark.multiprocess
def test_fsdp_x_tp_on_4_ranks_continues_a_tensor_parallel_checkpoint(launched):
    """2-D DTensors (FSDP over TP), loaded from the tp=2 run's checkpoint (each tp rank's shards, canonical names)."""
    out, log = launched("fsdp2_tp2")
    assert shard_writers(launched("tp2")[0] / "checkpoints" / "step_0000003") == {0, 1}
    assert "mesh dp_shard 2 x tp 2; rank 0 holds" in log and "resumed from" in log
    assert_same_training(out, launched("ref")[0], steps=range(4, 7))
    assert summary(out)["local_param_numel"] < 0.26 * total_params()


@pytest.mark.multiprocess
def test_fsdp_yaml_shards_on_cpu(launched):
    """accelerate never shards on CPU; the template does (FSDP2 with plain torch), and says so in the banner."""
    out, log = launched("fsdp_yaml")
    assert "engine: device mesh (FSDP2, plain torch): mesh dp_shard 2" in log and "falls back to plain DDP" not in log
    assert summary(out)["distributed_type"] == "MULTI_CPU" and summary(out)["mesh"]["dp_shard"] == 2
    assert_same_training(out, launched("ref")[0])


@pytest.mark.multiprocess
def test_tensor_parallel_x_pipeline_on_4_ranks(launched):
    """GPT's plan hands on local (B, T/tp, H) tensors, so its stages ran sequence parallel before; the last stage's loss
    now runs on vocabulary shards too (loss parallel inside the schedule's step)."""
    out, log = launched("tp2_pp2")
    assert "schedule 1f1b, 2 micro-batches x 2 accumulation = 4 per step, 1 data-parallel replica; mesh pp 2 x tp 2" in log
    assert "; sequence parallel and loss parallel" in log
    assert_same_training(out, launched("ref")[0])
    assert summary(out)["pipeline_bubble_ideal"] == pytest.approx(1 / 5)  # (S-1)/(M+S-1), M = 4 per schedule step


@pytest.mark.multiprocess
def test_zero_bubble_zbv_equals_one_process(launched):
    """ZB-V: 4 stages V-placed on 2 ranks (rank 0 holds the first and the last), backward split into B and W."""
    out, log = launched("zbv")
    assert "2 stage ranks x 2 V-shaped stages each, schedule zbv" in log and "stage 3 on rank 0" in log
    assert_same_training(out, launched("ref")[0])
    assert summary(out)["pipeline_bubble_ideal"] == 0.0 and (out / "pipeline_timeline.png").stat().st_size > 1000


@pytest.mark.multiprocess
def test_estimator_counts_what_each_run_holds(launched):
    """scripts/estimate_memory.py's parameters per rank (meta model, fake process group, the same parallelize())
    equal local_param_numel of the real runs, for every layout launched above."""
    from parallel_train.data.sources import load_data
    from parallel_train.parallel.memory_estimate import estimate

    for name in ("tp2", "fsdp2", "fsdp2_tp2", "tp2_pp2", "zbv"):
        out, _ = launched(name)
        world = summary(out)["world_size"]
        cfg, _ = load_config(["--config", str(out / "config.yaml")])
        data = load_data(cfg)
        _, ranks = estimate(cfg, world, data.vocab_size, data.train_set[0])
        assert ranks[0].param_numel == summary(out)["local_param_numel"], name


@pytest.mark.multiprocess
@pytest.mark.slow  # torch.compile on CPU: inductor builds C++ kernels per rank, 15-20 s (listed in docs/contributing.md)
@pytest.mark.parametrize("name", ["compile_fsdp2", "compile_tp2"])
def test_compiled_blocks_train_like_eager(launched, name):
    """train.compile=true on the mesh compiles each block on its own (after the TP plan, before FSDP2): after
    20 steps the losses equal the eager one-process run's within 1e-4 relative, and the banner says so."""
    out, log = launched(name)
    assert "[parallel_train] compiled: 2 blocks, each on its own (torch.compile)" in log
    got, want = train_losses(out), train_losses(launched("ref20")[0])
    for step in (1, 10, 20):
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)


@pytest.mark.multiprocess
def test_fsdp2_in_fp16_scales_the_loss_and_skips_an_overflow_on_every_rank(launched, tmp_path):
    """fp16 under FSDP2: the MixedPrecisionPolicy (fp16 parameters, fp32 gradient reduction) and ShardedGradScaler.
    Inf gradients forced into step 2 on rank 1 only: both ranks skip that update (the scaler all-reduces its
    finding), the guard does not stop the run, and the two shards stay one model."""
    out = tmp_path / "fp16"
    env = launch_env(tmp_path, PARALLEL_TRAIN_FAULT="overflow@2:rank=1")
    cmd = warm_cmd(2, *SGD, *HALF, "parallel.dp_shard=2", "train.mixed_precision=fp16", f"output_dir={out}")
    log = check(run(cmd, env=env, timeout=600)).output
    assert "FSDP2 mixed precision: parameters gathered and computed in fp16, gradients reduced in fp32" in log
    assert summary(out)["skipped_by_scaler_steps"] == 1 and summary(out)["steps"] == 6
    ref = train_losses(launched("ref")[0])
    assert train_losses(out)[1] == pytest.approx(ref[1], rel=2e-3)  # fp16 compute, the same model and data


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name",
    ["hsdp", "interleavedzb", "dualpipev", "fsdp2_pp2_zbv"]
    + [pytest.param(n, marks=pytest.mark.slow) for n in ("fsdp_tp_yaml", "fsdp2_tp2_pp2")],
)
def test_more_meshes_equal_one_process(launched, name):
    out, log = launched(name)
    assert_same_training(out, launched("ref")[0])
    if name == "hsdp":
        assert "engine: device mesh (HSDP, plain torch): mesh dp_replicate 2 x dp_shard 2" in log
    if name == "fsdp2_tp2_pp2":
        assert summary(out)["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "pp": 2, "tp": 2}
    if name == "fsdp_tp_yaml":  # the parallelism_config block of the launch config, read with accelerate's ParallelismConfig
        assert summary(out)["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "pp": 1, "tp": 2}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tp_x_pipeline_checkpoint_continues_as_one_process(launched, tmp_path):
    ref = launched("ref")[0]
    out = tmp_path / "plain"
    check(
        run(
            warm_cmd(1, *SGD, f"resume={launched('tp2_pp2')[0] / 'checkpoints' / 'step_0000003'}", f"output_dir={out}"),
            env=launch_env(tmp_path),
        )
    )
    assert_same_training(out, ref, steps=range(4, 7))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("nproc", "overrides", "message"),
    [
        (3, (*TINY, "parallel.tp=3"), "error: parallel.tp=3 does not divide model.n_head=2: each rank holds whole heads"),
        (
            2,
            ("--config", "configs/seed_mlp.yaml", "train.max_steps=2", "parallel.tp=2"),
            "error: parallel.tp=2: SeedMLP has no tensor-parallel plan",
        ),
        (
            2,
            (*TINY, "parallel.tp=2", "parallel.stage_devices=[cpu,cpu]", "parallel.pipeline_stages=2"),
            "error: parallel.stage_devices (all stages",
        ),
    ],
)
def test_bad_mesh_launches_are_one_line_errors(tmp_path, nproc, overrides, message):
    r = run(warm_cmd(nproc, *overrides, f"output_dir={tmp_path / 'bad'}"), env=launch_env(tmp_path), timeout=300)
    assert r.returncode != 0 and message in r.stderr, r.output[-3000:]
    assert len([line for line in r.stderr.splitlines() if line.startswith("error:")]) == 1
    assert not (tmp_path / "bad" / "config.yaml").exists()


def test_first_weights_are_keyed_by_module_name_whatever_holds_them():
    """parallel/model_init.py: built on the meta device, each module is initialised under a seed keyed by its name, so
    the whole model and its pipeline stages filled one by one get the same numbers, no rank ever needing the whole
    model; the run's own random stream is untouched. Old fused-qkv checkpoints still convert."""
    from parallel_train.parallel.model_init import start_model
    from parallel_train.parallel.pipeline.split import stage_module

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=24, block_size=16)
    whole, init = start_model(GPT, cfg, 65, seed=1337)
    assert all(p.is_meta for p in whole.parameters())
    torch.manual_seed(0)
    init.fill(whole, torch.device("cpu"))
    assert torch.rand(1).item() == pytest.approx(0.49625658, abs=1e-8)  # torch.manual_seed(0)'s first draw: untouched
    split, init = start_model(GPT, cfg, 65, seed=1337)
    for names in (["tok_emb", "pos_emb", "drop", "blocks.0"], ["blocks.1", "ln_f", "head"]):
        init.fill(stage_module(split, names), torch.device("cpu"))
    expected = whole.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in split.state_dict().items())
    assert expected["blocks.0.attn.proj.weight"].std() < 0.6 * expected["blocks.0.attn.q.weight"].std()  # scaled by depth


def test_tensor_parallel_plan_errors_are_one_line():
    model = build_model(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=8), 11)
    with pytest.raises(UserError, match=r"parallel.tp=3 does not divide model.n_head=4") as e:
        tensor_parallel_plan(model, 3)
    assert "\n" not in str(e.value)
    assert set(tensor_parallel_plan(model, 2)) >= {"blocks.0.attn.q", "blocks.0.mlp.proj", "head", "tok_emb"}
    with pytest.raises(UserError, match=r"SeedMLP has no tensor-parallel plan; give its class a method `tensor_parallel_plan") as e:
        tensor_parallel_plan(build_model(MLPConfig(name="mlp"), 0), 2)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the mesh from keys, launch config and world size


def layout_of(world: int, *overrides: str, **env: str) -> MeshLayout:
    cfg = Config()
    for o in overrides:
        key, value = o.split("=")
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, int(value))
    return resolve_layout(cfg, world, env=env)


def test_mesh_layout_from_keys_launch_config_and_world():
    assert layout_of(4) == MeshLayout(dp_replicate=4)  # every key 1: DDP replicas fill the world
    assert layout_of(4, "parallel.pipeline_stages=2") == MeshLayout(dp_replicate=2, pp=2)
    assert layout_of(8, "parallel.dp_shard=2", "parallel.tp=2", "parallel.dp_replicate=2").dp == 4
    assert layout_of(4, ACCELERATE_USE_FSDP="true") == MeshLayout(dp_shard=4)  # fsdp.yaml shards over everything
    assert layout_of(4, "parallel.tp=2", ACCELERATE_USE_FSDP="true") == MeshLayout(dp_shard=2, tp=2)
    launch = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}
    assert layout_of(4, **launch) == MeshLayout(dp_shard=2, tp=2)  # fsdp_tp.yaml's parallelism_config block
    # rank = ((replicate * shard + shard_index) * pp + pp_index) * tp + tp_index: tensor-parallel ranks are neighbours
    mesh = MeshLayout(dp_replicate=2, dp_shard=2, pp=2, tp=2)
    assert mesh.coordinate(13) == {"dp_replicate": 1, "dp_shard": 1, "cp": 0, "pp": 0, "tp": 1} and mesh.dp_rank(13) == 3


@pytest.mark.parametrize(
    ("world", "overrides", "env", "message"),
    [
        (4, ("parallel.tp=2",), {}, r"= 1 x 1 x 1 x 1 x 2 = 2 \(parallel.\* keys and the launch config\), but 4 processes were launched"),
        (1, ("parallel.dp_shard=2",), {}, "= 1 x 2 x 1 x 1 x 1 = 2 .*, but 1 process was launched"),
        (2, ("parallel.dp_shard=2",), {"ACCELERATE_USE_DEEPSPEED": "true"}, "under DeepSpeed: ZeRO shards the model its own way"),
        (
            4,
            ("parallel.tp=4",),
            {"PARALLELISM_CONFIG_TP_SIZE": "2"},
            "parallel.tp=4 but the launch config's parallelism_config says tp_size=2",
        ),
        (
            4,
            (),
            {"PARALLELISM_CONFIG_CP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"},
            "context and sequence parallelism are not read from a launch config; set parallel.cp",
        ),
        (3, ("parallel.pipeline_stages=2",), {}, "parallel.pipeline_stages=2 does not divide the world size 3"),
    ],
)
def test_bad_meshes_are_one_line_errors(world, overrides, env, message):
    with pytest.raises(UserError, match=message) as e:
        layout_of(world, *overrides, **env)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_estimate_memory_script(tmp_path):
    """The estimator's table and verdict, and its one-line errors."""
    script = [PYTHON, "scripts/estimate_memory.py"]
    r = check(run([*script, "--world", "2", "--device", "h100", *TINY[:4], "parallel.tp=2"], env=launch_env(tmp_path), timeout=120))
    assert "mesh tp 2 (2 processes)" in r.stdout and "h100 (80 GiB, 64.0 usable at 80%): fits" in r.stdout
    assert "| 0 | 0 | 15,328 (50.8%) |" in r.stdout  # what test_tensor_parallel_on_2_ranks reports for this model
    bad = run([*script, "--world", "3", *TINY[:4], "parallel.tp=2"], env=launch_env(tmp_path), timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: the mesh") and bad.stderr.count("\n") == 1
    import importlib.util

    spec = importlib.util.spec_from_file_location("estimate_memory", "scripts/estimate_memory.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(UserError, match="--device tpu9: unknown; known: h100"):
        cli.parse(["--world", "2", "--device", "tpu9"])
