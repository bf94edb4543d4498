"""Speed features, MFU, byte/synthetic data, and the benchmark scripts (issue 6).

Speed itself is measured by scripts/bench/benchmark.py and recorded in docs/BENCHMARKS.md, never asserted here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from helpers import PYTHON, REPO, TINY, check, launch_env, read_metrics, run, summary, warm_cmd
from parallel_train.config.load import load_config
from parallel_train.config.sections import Config
from parallel_train.data.sources import check_source
from parallel_train.data.text import build_datasets
from parallel_train.data.tokenizers import ByteVocab, CharVocab, load_vocab
from parallel_train.errors import UserError
from parallel_train.models.gpt import GPT
from parallel_train.observe.perf import host_allocator_thresholds, mfu, peak_flops, process_age_s, set_host_allocator
from parallel_train.parallel.build import shards_parameters
from parallel_train.parallel.launch_env import cpu_threads

IMPORTED = time.monotonic()  # this process has lived at least this long when a test runs


def test_speed_config_keys_parse_and_validate():
    cfg, _ = load_config(
        [
            "train.compile=true",
            "model.activation_checkpointing=true",
            "train.peak_tflops=312",
            "train.tf32=false",
            "data.tokenizer=byte",
            "data.path=synthetic",
            "train.mixed_precision=no",
        ]
    )
    assert cfg.train.compile and cfg.model.activation_checkpointing == "full" and not cfg.train.tf32
    assert (cfg.train.peak_tflops, cfg.data.tokenizer, cfg.data.path) == (312.0, "byte", "synthetic")
    assert cfg.train.mixed_precision == "no"  # YAML reads a bare `no` as False; the str field keeps "no"
    assert not Config().train.compile and Config().model.activation_checkpointing == "none"  # off by default
    for bad, key in (
        ("data.tokenizer=bpe", "data.tokenizer"),
        ("train.peak_tflops=-1", "train.peak_tflops"),
        ("train.compile=maybe", "train.compile"),
    ):
        with pytest.raises(UserError, match=key):
            check_source(load_config([bad])[0])  # what train.py checks before it starts (cli.py)
    for name in ("configs/gpt2_124m.yaml", "configs/shakespeare_char_cpu.yaml"):
        load_config(["--config", str(REPO / name)])  # both shipped configs validate


def test_gpt2_config_has_the_gpt2_small_shape():
    cfg, _ = load_config(["--config", str(REPO / "configs/gpt2_124m.yaml")])
    m = cfg.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size) == (12, 12, 768, 1024, 50304)
    assert cfg.data.path == "synthetic"
    with torch.device("meta"):  # no memory: count the parameters only
        model = GPT(m, m.vocab_size)
    n = sum(p.numel() for p in model.parameters())
    assert 120e6 < n - model.head.weight.numel() < 130e6  # 124M as GPT-2 counts it (head tied to the embedding)


def test_byte_tokenizer_and_synthetic_data(tmp_path):
    text = "héllo wörld, ünïcode ✓\n" * 40
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    cfg, _ = load_config([f"data.path={corpus}", "data.tokenizer=byte", "model.block_size=16", "model.vocab_size=300"])
    data = build_datasets(cfg)
    assert isinstance(data.vocab, ByteVocab) and data.vocab_size == 300  # 256 bytes padded up to model.vocab_size
    ids = data.vocab.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and data.vocab.decode(ids.tolist()) == text
    (tmp_path / "vocab.json").write_text(data.vocab.to_json())
    assert isinstance(load_vocab(tmp_path / "vocab.json"), ByteVocab)
    (tmp_path / "char.json").write_text(CharVocab.from_text("ab").to_json())
    assert load_vocab(tmp_path / "char.json") == CharVocab(["a", "b"])
    with pytest.raises(UserError, match="data.tokenizer"):  # resuming a char run with the byte tokenizer
        build_datasets(cfg, CharVocab.from_text(text))

    cfg, _ = load_config(["data.path=synthetic", "model.block_size=32", "model.vocab_size=1000", "data.num_samples=5000"])
    a, b = build_datasets(cfg), build_datasets(cfg)
    assert a.vocab is None and a.vocab_size == 1000
    assert len(a.train_set) == 5000 - 32 and torch.equal(a.train_set.ids, b.train_set.ids)  # seeded
    x, y = a.train_set.__getitems__([0, 7])
    assert x.shape == (2, 32) and int(x.max()) < 1000 and torch.equal(x[:, 1:], y[:, :-1])


def test_activation_checkpointing_gives_identical_loss_and_gradients():
    cfg, _ = load_config(["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "model.dropout=0.1"])
    grads, losses = [], []
    for ckpt in ("none", "full"):
        cfg.model.activation_checkpointing = ckpt
        torch.manual_seed(0)
        model = GPT(cfg.model, 50)
        x = torch.randint(0, 50, (4, 16))
        torch.manual_seed(1)  # same dropout masks; checkpoint replays them in the recomputation
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[0] == losses[1]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "keys, world, sharded",
    [
        ([], 1, False),  # one process: the setting whose step time was measured
        ([], 2, False),  # DDP
        (["parallel.pipeline_stages=2"], 2, False),  # each stage whole on its rank
        (["parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]"], 1, False),
        (["parallel.dp_shard=2"], 2, True),  # FSDP2
        (["parallel.dp_replicate=2", "parallel.dp_shard=2"], 4, True),  # HSDP
        (["parallel.tp=2"], 2, True),
        (["parallel.dp_shard=2", "parallel.pipeline_stages=2"], 4, True),
    ],
)
def test_the_host_allocator_returns_what_sharding_frees(monkeypatch, keys, world, sharded):
    """observe/perf.py: one process and DDP keep freed blocks up to 32 MiB for the next step (their step time);
    where parameters are sharded, blocks from 1 MiB up are handed back when freed, or rank 0 of 2x / 4x FSDP2 holds
    24% / 44% more than its share at the first step (docs/BENCHMARKS.md "Start memory"). Decided from the config
    and the world size alone: every rank alike, before anything big is allocated."""
    for key in [k for k in os.environ if k.startswith("PARALLELISM_CONFIG_")] + ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"]:
        monkeypatch.delenv(key, raising=False)
    cfg, _ = load_config(keys)
    assert shards_parameters(cfg, world) is sharded
    mmap_threshold, trim_threshold = host_allocator_thresholds(sharded)
    assert mmap_threshold == (1 << 20 if sharded else 32 << 20)
    assert trim_threshold == 1 << 30  # the heap's top is kept on every layout: a step's small blocks never fault again


def test_the_host_allocator_setting_leaves_the_users_own_alone(monkeypatch):
    """observe/perf.py fixes glibc's thresholds unless the user set them (docs/BENCHMARKS.md "Start memory" measures
    live memory that way): a setting of theirs is never silently overridden, on any layout."""
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(key, raising=False)
    try:
        assert set_host_allocator(shards_parameters=True) == (1 << 20, 1 << 30)  # glibc on Linux, as CI and this machine run
        for sharded in (False, True):
            monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
            assert set_host_allocator(sharded) is None
            monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
            monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
            assert set_host_allocator(sharded) is None
            monkeypatch.delenv("GLIBC_TUNABLES")
    finally:
        assert set_host_allocator() == (32 << 20, 1 << 30)  # this test process keeps the one-process setting


def test_threads_share_the_usable_cores_among_the_nodes_processes_unless_the_user_chose():
    assert cpu_threads({}, cores=16) == 16
    assert cpu_threads({"LOCAL_WORLD_SIZE": "4"}, cores=16) == 4
    assert cpu_threads({"LOCAL_WORLD_SIZE": "8"}, cores=2) == 1  # at least one
    assert cpu_threads({"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "3"}, cores=16) == 3  # the user's stands
    assert cpu_threads({"OMP_NUM_THREADS": ""}, cores=6) == 6  # set but empty: not a choice
    assert 1 <= cpu_threads({}) <= (torch.multiprocessing.cpu_count() or 1)


def test_peak_flops_and_mfu(monkeypatch):
    cfg, _ = load_config([])
    cpu = torch.device("cpu")
    monkeypatch.delenv("PEAK_TFLOPS", raising=False)
    assert peak_flops(cpu, "no", cfg.train) is None  # unknown on CPU: MFU stays null
    monkeypatch.setenv("PEAK_TFLOPS", "2")
    assert peak_flops(cpu, "no", cfg.train) == 2e12
    cfg.train.peak_tflops = 3.0  # the config key wins over the environment variable
    assert peak_flops(cpu, "bf16", cfg.train) == 3e12
    assert mfu(1000, 1e9, 4e12, 2) == pytest.approx(0.125)
    assert mfu(None, 1e9, 4e12, 1) is None and mfu(1000, 1e9, None, 1) is None


def test_process_age_counts_from_the_process_start():
    """Bounded by what this process has certainly lived (since this module was imported) and by the machine's
    uptime: no wall-clock figure that a slow machine or a long session could break."""
    age, lived = process_age_s(), time.monotonic() - IMPORTED
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert lived - 0.05 <= age <= uptime + 0.05, (lived, age, uptime)


def test_run_reports_speed_metrics_with_activation_checkpointing(tmp_path):
    """One real launch: synthetic data, activation checkpointing, a peak set by config -> MFU everywhere. No
    OMP_NUM_THREADS: the banner shows the default thread count applied (the warm launcher's own torch has 1)."""
    out = tmp_path / "run"
    started = time.monotonic()
    env = launch_env(tmp_path)
    del env["OMP_NUM_THREADS"]
    result = check(
        run(
            warm_cmd(
                1,
                *TINY,
                "data.path=synthetic",
                "model.vocab_size=128",
                "data.num_samples=4000",
                "model.activation_checkpointing=true",
                "train.peak_tflops=0.05",
                f"output_dir={out}",
            ),
            env=env,
        )
    )
    assert f"| threads {cpu_threads({})} |" in result.output, result.output[:600]
    train = [r for r in read_metrics(out) if r["kind"] == "train"]
    for r in train:
        assert r["tokens_per_sec"] > 0 and r["step_time_s"] > 0 and 0 <= r["data_time_frac"] <= 1 and r["mfu"] > 0
    s = summary(out)
    assert s["mfu"] > 0 and s["tokens_per_sec"] > 0 and s["peak_memory_mb"] > 0
    # From the process's start (imports count: test_process_age_counts_from_the_process_start), so within the launch.
    assert 0 < s["time_to_first_step_s"] < time.monotonic() - started


@pytest.mark.slow
def test_compile_switch_trains_like_eager(tmp_path):
    """torch.compile on CPU: about 30 s of compilation, so not in the default suite."""
    losses = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        check(
            run(warm_cmd(1, *TINY, f"train.compile={flag}", "eval.interval=0", f"output_dir={out}"), env=launch_env(tmp_path), timeout=900)
        )
        losses[flag] = [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-3, abs=1e-4)
    from safetensors.torch import load_file

    assert not any("_orig_mod" in k for k in load_file(str(tmp_path / "true" / "model.safetensors")))  # canonical names


@pytest.mark.slow
def test_benchmark_cli_and_bare_loop_match_train_py(tmp_path):
    """`bench/benchmark.py --help`, then a micro run: the bare loop and train.py see the same batches."""
    r = check(run([PYTHON, "scripts/bench/benchmark.py", "--help"], timeout=60))
    assert "--quick" in r.stdout and "--update-docs" in r.stdout
    bad = run([PYTHON, "scripts/bench/benchmark.py", "--cells", "nope"], timeout=60)
    assert bad.returncode == 2 and "unknown cells" in bad.stderr
    out = tmp_path / "bench"
    check(
        run(
            [PYTHON, "scripts/bench/benchmark.py", "--cells", "bare,template", "--steps", "20", "--repeats", "1", "--out", str(out)],
            env=launch_env(tmp_path),
            timeout=600,
        )
    )
    result = json.loads((out / "benchmark.json").read_text())
    target = result["targets"]["template_vs_bare"]
    assert target["max_loss_gap"] < 1e-4  # same weights, same batches, same optimizer: the same losses
    assert target["median_of_paired_ratios"] > 0
    assert "| bare |" in (out / "benchmark.md").read_text()


@pytest.mark.slow
def test_gpu_memory_dry_run_end_to_end(tmp_path):
    """scripts/bench/gpu_memory.py --dry-run on CPU: a Llama written from its config.json, estimated and trained per
    cell (checkpointing mode x allocator setting), the table and its JSON."""
    out = tmp_path / "gpu_memory"
    cmd = [PYTHON, "scripts/bench/gpu_memory.py", "--dry-run", "--out", str(out), "--cells", "full-expandable,none-expandable"]
    r = check(run(cmd, env=launch_env(tmp_path), timeout=600))
    assert "DRY RUN" in r.stdout
    cells = json.loads((out / "gpu_memory.json").read_text())["cells"]
    assert [(c["checkpointing"], c["status"]) for c in cells] == [("full", "ok"), ("none", "ok")]
    assert all(c["estimated_mb"] > 0 and c["allocated_mb"] > 0 for c in cells)
    assert cells[0]["estimated_mb"] < cells[1]["estimated_mb"]  # full checkpointing keeps less than none
    bad = run([PYTHON, "scripts/bench/gpu_memory.py", "--dry-run", "--cells", "nope"], env=launch_env(tmp_path), timeout=60)
    assert bad.returncode == 2 and "--cells: unknown ['nope']" in bad.output


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_bench_dry_run_end_to_end(tmp_path):
    """scripts/bench/gpu_bench.sh --dry-run on CPU: environment check, 1 and 2 processes, bf16 and fp32, the table."""
    out = tmp_path / "gpu_bench"
    env = launch_env(tmp_path, COMPILE_MODES="false", PYTHON=PYTHON)  # compile rows: see the slow test above
    r = check(run(["bash", "scripts/bench/gpu_bench.sh", "--dry-run", "--out", str(out)], env=env, timeout=600))
    assert "== environment" in r.stdout and "DRY RUN" in r.stdout
    cells = json.loads((out / "gpu_bench.json").read_text())["cells"]
    assert {(c["devices"], c["precision"]) for c in cells} == {(1, "bf16"), (1, "no"), (2, "bf16"), (2, "no")}
    assert all(c["status"] == "ok" and c["tokens_per_sec"] > 0 for c in cells)
    assert (out / "gpu_bench.md").read_text().count("| ok |") == 4
    assert os.access(REPO / "scripts" / "bench/gpu_bench.sh", os.X_OK)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_long_context_dry_run_end_to_end(tmp_path):
    """scripts/bench/gpu_long_context.sh --dry-run on CPU: a Llama built locally, cp=1 and cp=2 at two lengths, the table."""
    out = tmp_path / "long_context"
    r = check(
        run(
            ["bash", "scripts/bench/gpu_long_context.sh", "--dry-run", str(out)],
            env=launch_env(tmp_path, PYTHON=PYTHON),
            timeout=900,
        )
    )
    assert "DRY RUN" in r.stdout
    cells = json.loads((out / "gpu_long_context.json").read_text())["cells"]
    assert {(c["cp"], c["length"]) for c in cells} == {(1, 64), (1, 128), (2, 64), (2, 128)}
    assert all(c["status"] == "ok" and c["tokens_per_sec"] > 0 for c in cells), cells


def test_gpu_moe_dry_run_prints_the_recipes_commands_and_they_load():
    """scripts/bench/gpu_moe.sh --dry-run (GPUS=2): the model build, then per cell (1 GPU; FSDP2 and expert parallel over 2) the estimate
    and the launch of configs/moe_finetune.yaml with its model and data replaced; nothing runs. Each launch's keys load
    (with the recipe's own Hub name for the model folder, which the dry run does not build)."""
    r = check(run(["bash", "scripts/bench/gpu_moe.sh", "--dry-run"], env=launch_env(None, GPUS="2", PYTHON=PYTHON), timeout=60))
    lines = r.stdout.splitlines()
    assert "scripts/make_tiny_chat_model.py runs/gpu_moe/qwen3_moe runs/gpu_moe/chats.jsonl" in lines[0] and "--experts 32" in lines[0]
    launches = [line.split(" scripts/bench/gpu_rank_peak.py ")[1].split() for line in lines if "gpu_rank_peak.py" in line]
    assert len(launches) == 2 and sum("estimate_memory.py --world" in line for line in lines) == 2
    for n, keys in zip((1, 2), launches, strict=True):
        assert keys[:2] == ["--config", "configs/moe_finetune.yaml"] and f"parallel.dp_shard={n}" in keys
        cfg, _ = load_config([k if not k.startswith("model.hf_path=") else "model.hf_path=Qwen/Qwen3-30B-A3B" for k in keys])
        assert not cfg.model.lora_experts and (cfg.parallel.dp_shard, cfg.parallel.ep) == (n, n) and cfg.train.max_steps == 40
    bad = run(["bash", "scripts/bench/gpu_moe.sh", "--nope"], env=launch_env(None), timeout=60)
    assert bad.returncode == 2 and "unknown argument '--nope'" in bad.output
    assert os.access(REPO / "scripts" / "bench" / "gpu_moe.sh", os.X_OK)
