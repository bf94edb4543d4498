"""docs/guide.md ("Make it yours"), done exactly as written, in a copy of the repository: the guide cannot rot.

The guide's code blocks say where they go on their first line, which this test follows:
    # new file: PATH                  the block is the whole new file
    # PATH: add to NAME               imports join the file's imports; the other lines go at the end of
    # PATH: add to class NAME         the dict literal NAME = {...} / the body of class NAME
    # PATH: add at the end            imports join the file's imports; the other lines are appended
    # PATH: replace NAME              the block replaces the top-level function NAME
Its ```bash commands run in the copy, in order, after the blocks of their section, their ranks forked warm (the
launchers are tested elsewhere); training commands get tiny sizes (helpers.TINY) before their own keys. Lines marked `# needs the Hub` are skipped.
Section 2's data files are the user's own; the test writes small ones where the guide says they are.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import REPO, TINY, WarmCmd, check, doc_section, launch_env, read_metrics, run
from parallel_train.data.tokenizers import load_saved, load_tokenizer

pytestmark = pytest.mark.multiprocess

FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
SKIPPED = "# needs the Hub"


# ---------------------------------------------------------------- reading the guide


def sections(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(heading, [(language, code), ...]), ...] for every ## / ### / #### heading, in order."""
    parts = re.split(r"^#{2,4} (.+)$", text, flags=re.M)
    return [(heading, FENCE.findall(body)) for heading, body in zip(parts[1::2], parts[2::2], strict=True)]


def is_import(line: str) -> bool:
    return line.startswith(("import ", "from "))


# ---------------------------------------------------------------- applying a block


def split_imports(lines: list[str]) -> tuple[list[str], list[str]]:
    imports = [line for line in lines if is_import(line)]
    rest = [line for line in lines if not is_import(line)]
    while rest and not rest[0].strip():
        rest.pop(0)
    return imports, rest


def add_imports(source: list[str], imports: list[str]) -> list[str]:
    """Insert after the file's last top-level import (before any code that follows it)."""
    last = max(i for i, line in enumerate(source) if is_import(line))
    return source[: last + 1] + imports + source[last + 1 :]


def end_of_block(source: list[str], start: int) -> int:
    """Index just past the last non-blank line of the top-level statement starting at `start`."""
    end = start + 1
    while end < len(source) and (not source[end].strip() or source[end][0] in " \t)]}"):
        end += 1
    while not source[end - 1].strip():
        end -= 1
    return end


def apply_block(root: Path, code: str) -> str:
    """Apply one code block to the copy; returns the path it changed."""
    header, *lines = code.rstrip("\n").split("\n")
    if m := re.fullmatch(r"# new file: (\S+)", header):
        path = root / m.group(1)
        assert not path.exists(), f"the guide creates {m.group(1)}, which already exists"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return m.group(1)
    m = re.fullmatch(r"# (\S+): (add to class|add to|add at the end|replace) ?(\w*)", header)
    assert m, f"a code block of the guide does not say where it goes: {header!r}"
    rel, action, name = m.groups()
    path = root / rel
    source = path.read_text().rstrip("\n").split("\n")
    imports, rest = split_imports(lines)
    if action == "replace":
        start = next(i for i, line in enumerate(source) if line.startswith(f"def {name}("))
        source[start : end_of_block(source, start)] = rest
    elif action == "add at the end":
        source += ["", ""] + rest
    else:
        pattern = rf"class {name}\b.*:$" if action == "add to class" else rf"{name}\b.*= \{{$"
        start = next(i for i, line in enumerate(source) if re.match(pattern, line))
        end = end_of_block(source, start)
        at = end - 1 if source[end - 1] == "}" else end  # inside the braces of a dict literal
        source[at:at] = rest
    if imports:
        source = add_imports(source, imports)
    path.write_text("\n".join(source) + "\n")
    return rel


# ---------------------------------------------------------------- running a command


def command(line: str) -> WarmCmd:
    """The guide's command line, its ranks forked warm from a process that imported torch and the libraries once
    (helpers.WarmCmd, fresh: the template itself is the copy's, as the guide has changed it), with tiny sizes. The
    launchers themselves (python, accelerate launch, torchrun) are the business of tests/test_topologies.py and
    tests/test_reliability.py; here the point is what the guide's changes do."""
    args = shlex.split(line, comments=True)
    if args[0] not in ("python", "accelerate", "torchrun"):
        raise AssertionError(f"the guide runs {args[0]!r}; teach this test how to run it")
    return warm_command(args)


def warm_command(args: list[str]) -> WarmCmd:
    """The ranks `accelerate launch --config_file C`, `torchrun --nproc-per-node N` or `python` would start."""
    script = next(a for a in args if a.endswith(".py"))
    rest = args[args.index(script) + 1 :]
    if args[0] == "accelerate":
        config = yaml.safe_load((REPO / args[args.index("--config_file") + 1]).read_text())
        nproc = int(config.get("num_processes", 1))
    elif args[0] == "torchrun":
        nproc = int(args[args.index("--nproc-per-node") + 1])
    else:
        nproc = 1
    if script == "train.py":
        rest = [*TINY, *rest]  # before the guide's own keys, which win
    return WarmCmd(nproc, script, tuple(rest), fresh=True)


# ---------------------------------------------------------------- the user's own data files


def write_user_data(root: Path) -> None:
    """data/dialogue.tsv (speaker<TAB>text) and data/my_dataset (a Hub-style dataset folder, column `content`)."""
    import datasets

    speaker, rows = "chorus", []
    for line in (REPO / "data" / "tinyshakespeare.txt").read_text().splitlines()[:1500]:
        if re.fullmatch(r"[A-Za-z ]+:", line):
            speaker = line[:-1].lower()
        elif line.strip():
            rows.append(f"{speaker}\t{line}")
    (root / "data" / "dialogue.tsv").write_text("\n".join(rows) + "\n")
    folder = root / "data" / "my_dataset" / "data"
    folder.mkdir(parents=True)
    paragraphs = (REPO / "data" / "tinyshakespeare.txt").read_text()[:40_000].split("\n\n")
    datasets.Dataset.from_dict({"id": list(range(len(paragraphs))), "content": paragraphs}).to_parquet(
        str(folder / "train-00000-of-00001.parquet")
    )
    (root / "data" / "my_dataset" / "README.md").write_text("---\nlicense: mit\n---\n# my dataset\n")


def copy_repo(dest: Path) -> Path:
    """The files a clone has (tracked or not ignored), without .venv, runs, .git: the user's starting point."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (e.g. an unpacked release)
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".venv", "runs", ".git", "__pycache__", ".pytest_cache", ".ruff_cache"))
        return dest
    for rel in filter(None, listed.decode().split("\0")):
        src = REPO / rel
        if src.is_file() and not rel.startswith((".venv/", "runs/", ".git/")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


# ---------------------------------------------------------------- the test


def test_customize_guide_as_written_trains_on_two_processes(tmp_path):
    root = copy_repo(tmp_path / "clone")
    write_user_data(root)
    env = launch_env(tmp_path)
    guide = sections(doc_section("guide", "Make it yours"))
    changed, ran, skipped = [], {}, 0
    for heading, blocks in guide:
        for language, code in blocks:
            if language == "python":
                changed.append(apply_block(root, code))
            elif language == "bash":
                for line in filter(str.strip, code.splitlines()):
                    if SKIPPED in line:
                        skipped += 1
                        continue
                    result = check(run(command(line), env=env, cwd=root, timeout=420))
                    ran[line] = result
                    assert "Traceback" not in result.output, (heading, line, result.output[-3000:])
    # skipped: the Hub dataset of 2b; section 4's install and fine-tunes; section 5's downloads and runs
    assert skipped == 26 and len(ran) == 17, list(ran)
    assert changed.count("src/parallel_train/data/sources.py") == 2 and "src/parallel_train/losses.py" in changed
    assert "src/parallel_train/eval_metrics.py" in changed
    assert not any(path.endswith("config/load.py") for path in changed)  # a model owns its keys: config/load.py never changes

    # What each run shows a user: their model and data trained, on 2 processes, and text came out.
    runs = root / "runs"
    for name in ("char_rnn", "char_rnn_pipeline", "dialogue", "hub_folder", "utterances"):
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["world_size"] == 2 and (runs / name / "metrics.png").is_file(), name
        losses = [r["loss"] for r in read_metrics(runs / name) if r["kind"] == "train"]
        assert losses[-1] < losses[0], (name, losses)
    evals = [r for r in read_metrics(runs / "utterances") if r["kind"] == "eval"]  # the metric of section 3
    assert evals and all(r["val_bits_per_char"] == pytest.approx(r["val_loss"] / math.log(2)) and "val_accuracy" in r for r in evals)
    config = (runs / "char_rnn" / "config.yaml").read_text()
    assert "name: char_rnn" in config and "rnn_residual: true" in config
    pipeline_log = next(r.output for line, r in ran.items() if "pipeline_stages=2" in line)
    assert "emb" in pipeline_log and "layers.0" in pipeline_log and "head" in pipeline_log
    sample = next(r.stdout for line, r in ran.items() if "sample.py" in line)
    assert sample.startswith("ROMEO:") and len(sample.rstrip("\n")) == len("ROMEO:") + 200
    vocab = json.loads((runs / "dialogue" / "vocab.json").read_text())["chars"]
    assert set("ROMEO: ") <= set(vocab)  # upper-cased speakers from the dialogue loader

    # 2d: the tokenizer of your own travels with the run, is reused when it resumes and by sample.py.
    own = load_tokenizer(str(root / "data" / "wordpiece.json"))
    assert own.size == 2000 and own.fingerprint == load_saved(runs / "wordpiece").fingerprint
    assert load_saved(runs / "wordpiece" / "checkpoints" / "step_0000012").fingerprint == own.fingerprint
    resumed = next(r.output for line, r in ran.items() if "train.max_steps=12" in line)
    assert (
        "resumed from" in resumed
        and "at step 6" in resumed
        and json.loads((runs / "wordpiece" / "summary.json").read_text())["steps"] == 12
    )
    sample = next(r.stdout for line, r in ran.items() if "runs/wordpiece" in line and "sample.py" in line)
    assert sample.startswith("romeo :") and len(own.encode(sample)) > 20

    # 4a: LoRA on chat data, under DDP and FSDP2, sampled as a chat, exported merged and as adapters.
    for name, engine in (("chat_lora", "data parallel"), ("chat_lora_fsdp", "device mesh (FSDP2")):
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["world_size"] == 2 and 0 < summary["trainable_params"] < 0.05 * summary["total_params"], summary
        log = next(r.output for line, r in ran.items() if f"output_dir=runs/{name}" in line)
        assert f"engine: {engine}" in log and "packed into" in log and "trainable: 3,584 of" in log
        assert (runs / name / "hf" / "chat_template.jinja").is_file() and (runs / name / "adapter" / "adapter_config.json").is_file()
    answer = next(r.stdout for line, r in ran.items() if "--chat" in line)
    assert answer.strip() and "<|im_start|>" not in answer
    exported = root / "exported"
    assert (exported / "chat_lora" / "model.safetensors").is_file() and (
        exported / "chat_lora-adapter" / "adapter_model.safetensors"
    ).is_file()

    # The new key is typed and documented like the others; the new names are validated like the others.
    help_text = check(run(WarmCmd(1, "train.py", ("--help",), fresh=True), cwd=root, env=env, timeout=60)).stdout
    own_keys = help_text.split("with model.name=char_rnn:")[1].split("with model.name=")[0]
    assert re.search(r"model\.rnn_residual\s+bool\s+default True\s+add each GRU layer", own_keys)
    assert re.search(r"model\.n_layer\s+int\s+default 2\s", own_keys)
    bad = run(WarmCmd(1, "train.py", ("data.source=dialog",), fresh=True), cwd=root, env=env, timeout=60)
    assert bad.returncode == 2 and "known: dialogue, text, utterances" in bad.stderr
