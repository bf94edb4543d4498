"""What a user runs besides training: --help, the run's log lines, scripts/sample.py, scripts/plot_metrics.py.

Two real 2-process runs (DDP and a 2-stage pipeline) serve every test: sampling must work for both,
since weights are saved with the unsplit model's names whatever the topology.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from helpers import TINY, check, launch_env, run, warm_cmd, warm_script
from parallel_train.config.sections import REPO_ROOT, Config
from parallel_train.core.fields import key_name

pytestmark = pytest.mark.multiprocess

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    env = launch_env(tmp)
    out = {"ddp": tmp / "ddp", "pipeline": tmp / "pipeline"}
    # data.num_workers=3 on a 2-core machine: torch warns at every DataLoader of every rank (4 times here).
    ddp = warm_cmd(2, *TINY, "train.log_interval=2", "data.num_workers=3", f"output_dir={out['ddp']}")
    logs = {"ddp": check(run(ddp, env=env))}
    check(run(warm_cmd(2, *TINY, "parallel.pipeline_stages=2", "parallel.microbatches=2", f"output_dir={out['pipeline']}"), env=env))
    return out, logs, env


def sample(*args: str, env=None):
    return run(warm_script("scripts/sample.py", *args), env=env or launch_env(), timeout=120)


def config_keys(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from config_keys(value, prefix + f.name + ".")
        else:
            yield prefix + key_name(f.name), f, value  # `async_` is the key checkpoint.async


def test_help_lists_every_config_key_with_type_default_and_description():
    result = check(run(warm_cmd(1, "--help"), timeout=60))
    # A key two models share (e.g. model.activation_checkpointing) has one line in each model's group.
    lines: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("  ") and line.split():
            lines.setdefault(line.split()[0], []).append(line)
    keys = list(config_keys(Config()))
    assert len(keys) > 40
    for key, f, default in keys:
        assert key in lines, f"{key} missing from --help"
        kind = "|".join(f.metadata["choices"]) if f.metadata.get("choices") else f.type  # f.type: the annotation, e.g. 'list[str]'
        if isinstance(default, str) and default.startswith(str(REPO_ROOT)):
            default = Path(default).relative_to(REPO_ROOT)  # printed relative to the clone
        shown = str(default) or "''"
        assert f.metadata["help"], key
        matching = [
            line
            for line in lines[key]
            if re.search(rf"\s{re.escape(kind)}\s+default {re.escape(shown)}\s", line) and line.rstrip().endswith(f.metadata["help"])
        ]
        assert matching, (key, lines[key])
    assert "usage: python train.py" in result.stdout and result.stderr == ""


def test_a_run_prints_a_banner_one_line_per_log_interval_and_each_warning_once(runs):
    _out, logs, _env = runs
    stdout = logs["ddp"].stdout
    banners = [line for line in stdout.splitlines() if "world size" in line]
    assert len(banners) == 1, stdout
    for part in ("2 processes (MULTI_CPU", "world size 2", "device cpu", "precision no", "config defaults", "output_dir", "tracker none"):
        assert part in banners[0], part
    # TINY: 6 steps, log_interval=2 here -> steps 2, 4, 6, printed once (main process only).
    steps = re.findall(r"^step (\d+)/6 \| loss [\d.]+ \| lr [\d.e+-]+ \| [\d,]+ tok/s \| [\d.]+ ms/step", stdout, flags=re.M)
    assert steps == ["2", "4", "6"], stdout
    assert "Traceback" not in logs["ddp"].output
    # Library warnings: once per machine, not once per process and DataLoader.
    assert logs["ddp"].stderr.count("UserWarning: This DataLoader will create 3 worker processes") == 1, logs["ddp"].stderr


@pytest.mark.parametrize("topology", ["ddp", "pipeline"])
def test_sample_prints_text_from_a_finished_run(runs, topology):
    out, _logs, env = runs
    first = check(sample("--run", str(out[topology]), "--max_new_tokens", "40", "--prompt", "ROMEO:", "--seed", "3", env=env))
    again = check(sample("--run", str(out[topology]), "--max_new_tokens", "40", "--prompt", "ROMEO:", "--seed", "3", env=env))
    text = first.stdout.rstrip("\n")
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 40, text
    assert first.stdout == again.stdout  # same seed, same text
    assert first.stderr == ""


def test_sample_from_a_checkpoint_with_top_k_and_temperature(runs):
    out, _logs, env = runs
    ckpt = out["ddp"] / "checkpoints" / "step_0000003"
    result = check(sample("--checkpoint", str(ckpt), "--max_new_tokens", "25", "--top_k", "1", "--temperature", "0.5", env=env))
    greedy = result.stdout.rstrip("\n")
    assert len(greedy) == 1 + 25  # the default prompt is one newline
    other_seed = check(sample("--checkpoint", str(ckpt), "--max_new_tokens", "25", "--top_k", "1", "--seed", "9", env=env))
    assert other_seed.stdout == result.stdout  # top_k=1 is greedy: the seed does not matter


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max_new_tokens", "5"], "give --run OUTPUT_DIR"),
        (["--run", "no/such/run", "--max_new_tokens", "5"], "--run no/such/run: no such folder"),
        (["--run", "RUN", "--max_new_tokens", "0"], "--max_new_tokens: must be >= 1"),
        (["--run", "RUN", "--max_new_tokens", "5", "--temperature", "0"], "--temperature: must be > 0"),
        (["--run", "RUN", "--max_new_tokens", "5", "--prompt", "\u20ac"], "not in this run's vocabulary"),
        (["--run", "RUN", "--max_new_tokens", "five"], "invalid int value"),
        (["--checkpoint", "RUN", "--max_new_tokens", "5"], "not a valid checkpoint"),
    ],
)
def test_sample_bad_input_is_one_line_and_exit_2(runs, args, message):
    out, _logs, env = runs
    result = sample(*[str(out["ddp"]) if a == "RUN" else a for a in args], env=env)
    assert result.returncode == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert result.stdout == ""


def test_every_run_draws_its_picture_and_plot_metrics_overlays_runs(runs, tmp_path):
    out, _logs, env = runs
    for run_dir in out.values():
        assert (run_dir / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    target = tmp_path / "both.png"
    result = check(
        run(warm_script("scripts/plot_metrics.py", str(out["ddp"]), str(out["pipeline"]), "--out", str(target)), env=env, timeout=120)
    )
    assert result.stdout.strip() == str(target)
    assert target.read_bytes().startswith(PNG_MAGIC) and target.stat().st_size > 20_000
    bad = run(warm_script("scripts/plot_metrics.py", str(tmp_path)), env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "no metrics.jsonl" in bad.stderr
