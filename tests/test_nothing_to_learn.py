"""Nothing to learn (issue 26, item 4): data with no token to learn is an error at start, a step with none is skipped
and counted, and no JSON file the template writes holds NaN or Infinity.

A tiny chat Llama (tests/hf_tiny.py) on rows whose answers data.truncate cuts away when a long system prompt comes
first: a step whose samples are all such rows has no target the loss counts. Real runs through the warm launcher:
one process with batch 2 against two processes with batch 1 (the same samples each step), checkpoints every step to
see that a skipped step leaves the weights as they were. The one-line errors through train.py are in
tests/test_bad_inputs.py; here the same checks in process, and prepare_data's.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import hf_tiny
from helpers import REPO, check, launch_env, read_metrics, run, strict_json, summary, warm_cmd
from parallel_train.core.json_text import json_text
from parallel_train.errors import UserError

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LONG_PROMPT = "Speak of kings and queens and all the lords of the realm, " * 4  # ~140 tokens: past block_size 96
BLOCK = 96


def conversation(system: str, answer: str = "A humble servant of the king.") -> dict:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Who art thou?"},
            {"role": "assistant", "content": answer},
        ]
    }


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny chat Llama and 10 rows: train rows 1-3 and 5-7 have their answers cut away at block_size 96; rows 0 and 4
    and the validation rows (8, 9) keep theirs."""
    tmp = tmp_path_factory.mktemp("learn")
    model = hf_tiny.make_chat_model(tmp / "chat_llama")
    rows = [conversation(LONG_PROMPT if i < 8 and i % 4 else "Be brief.") for i in range(10)]
    return {"tmp": tmp, "model": model, "rows": write_rows(tmp / "some_empty.jsonl", rows)}


def keys(chat, *more: str) -> list[str]:
    return [
        "model.name=hf",
        f"model.hf_path={chat['model']}",
        f"model.block_size={BLOCK}",
        "data.format=chat",
        "data.truncate=true",
        f"data.path={chat['rows']}",
        "data.val_fraction=0.2",
        *more,
    ]


# ---------------------------------------------------------------- JSON: null, never NaN


def test_json_text_writes_null_for_nan_and_inf_and_refuses_what_it_cannot_clean():
    value = {"loss": math.nan, "best": [math.inf, -math.inf, 1.5], "deep": {"x": (math.nan, 2)}, "n": 3, "s": "NaN"}
    text = json_text(value)
    assert strict_json(text) == {"loss": None, "best": [None, None, 1.5], "deep": {"x": [None, 2]}, "n": 3, "s": "NaN"}
    with pytest.raises(ValueError):  # allow_nan=False: a non-finite number inside a type it does not walk is never written
        json_text({"a": {1: math.nan}.values()}, default=list)


def test_every_json_file_the_template_writes_goes_through_json_text():
    """json.dumps is left only where its text is no file of a run: a hash's input, a safetensors header, lines printed
    for a parent process. Any new writer must use json_text (core/json_text.py)."""
    allowed = {
        "src/parallel_train/core/json_text.py": 2,  # its docstring, and the one call
        "src/parallel_train/data/prepare.py": 1,  # the inputs' fingerprint (a hash)
        "src/parallel_train/checkpoint/storage.py": 1,  # DCP's safetensors metadata
        "src/parallel_train/checkpoint/export.py": 2,  # the safetensors header and its ties
        "scripts/make_tiny_chat_model.py": 1,  # rows of made-up conversations (data, not a record)
        "scripts/estimate_memory.py": 1,  # printed
        "scripts/check_env.py": 1,  # printed
        "scripts/bench/data.py": 9,  # lines printed to the parent benchmark, and rows of made-up text
        "scripts/bench/checkpoint.py": 3,  # the tiny stand-in checkpoint files it times
        "scripts/bench/bare_loop.py": 1,  # printed
        "scripts/bench/memory_estimate.py": 1,  # printed
        "scripts/bench/memory_matrix.py": 1,  # printed
        "scripts/bench/rank_peak.py": 1,  # a rank's peak (integers) for the parent benchmark
        "scripts/bench/gpu_bench.sh": 2,  # its own python, without the package; its figures come from null-safe summary.json
        "scripts/bench/gpu_long_context.sh": 1,  # the same
        "scripts/bench/gpu_moe.sh": 1,  # the same, for the MoE recipe's table
        "scripts/bench/gpu_rank_peak.py": 1,  # a rank's GPU peaks (finite numbers) for the parent benchmark
    }
    found = {}
    for path in [*REPO.glob("src/**/*.py"), *REPO.glob("scripts/**/*.py"), *REPO.glob("scripts/**/*.sh")]:
        n = len(re.findall(r"\bjson\.dumps\(", path.read_text()))
        if n:
            found[str(path.relative_to(REPO))] = n
    assert found == allowed


def test_metrics_over_nothing_counted_are_none_not_nan():
    from parallel_train.eval_metrics import add_stats, chosen_metrics, metric_stats, metric_values
    from parallel_train.tasks.registry import TASKS

    targets = torch.full((2, 3), -100)  # every target ignored: nothing to measure
    for task in TASKS.values():
        metrics, _ = chosen_metrics(task.metrics, ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"])
        values = metric_values(add_stats(None, metric_stats(torch.zeros(2, 3, 5), targets, metrics)), metrics)
        # entity_f1 reports its precision and recall beside it, from the same statistics
        assert set(task.metrics) <= set(values) and all(v is None for v in values.values()), (task.name, values)


# ---------------------------------------------------------------- steps with nothing to learn


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from parallel_train.checkpoint.export import load_weights

    return load_weights(folder)


def test_steps_with_nothing_to_learn_are_skipped_counted_and_leave_the_weights(chat):
    """1 process x batch 2 and 2 processes x batch 1 read the same samples each step: the same steps are skipped on
    every rank, counted in the log and summary.json, with a null loss; a skipped step's checkpoint holds the weights
    of the step before (AdamW's decay would have moved them); metrics.jsonl and summary.json are strict JSON."""
    tmp, outs = chat["tmp"], {}
    common = ("train.max_steps=6", "train.log_interval=1", "eval.interval=3", "eval.iters=1", "eval.batch_size=2", "tracker=none")
    for name, nproc, batch in (("one", 1, 2), ("two", 2, 1)):
        outs[name] = tmp / f"out_{name}"
        more = (f"train.batch_size={batch}", "checkpoint.interval=1", "checkpoint.keep=6", f"output_dir={outs[name]}")
        r = check(run(warm_cmd(nproc, *keys(chat, *common, *more)), env=launch_env(tmp), timeout=240))
        assert "has no token to learn on any rank: skipped (no update)" in r.output
        assert "Detected call of `lr_scheduler" not in r.output
    records = {name: [r for r in read_metrics(out) if r["kind"] == "train"] for name, out in outs.items()}
    skipped = [r["step"] for r in records["one"] if r["loss"] is None]
    assert 0 < len(skipped) < 6, records["one"]
    for name, out in outs.items():
        assert [r["step"] for r in records[name] if r["loss"] is None] == skipped
        assert records[name][-1]["skipped_empty_steps"] == len(skipped) == summary(out)["skipped_empty_steps"]
        assert summary(out)["final_val_loss"] is not None
        for state in (out / "checkpoints").glob("step_*/trainer_state.json"):
            strict_json(state.read_text())
    for a, b in zip(records["one"], records["two"], strict=True):
        assert (a["loss"] is None and b["loss"] is None) or a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    ckpt = outs["one"] / "checkpoints"
    for step in range(2, 7):
        before, after = weights(ckpt / f"step_{step - 1:07d}"), weights(ckpt / f"step_{step:07d}")
        same = all(torch.equal(before[k], after[k]) for k in before)
        assert same == (step in skipped), step


# ---------------------------------------------------------------- nothing to learn at all: one line at start


def test_nothing_to_learn_is_named_with_its_cause(chat):
    from parallel_train.config.load import load_config
    from parallel_train.data.sources import load_data

    tmp = chat["tmp"]
    no_answer = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]}
    cases = {
        "no assistant turn": ([no_answer] * 6, "no row has an assistant turn"),
        "empty answers": ([conversation("Be brief.", answer="")] * 6, "every answer is empty (5 assistant turns with no text)"),
        "cut away": ([conversation(LONG_PROMPT)] * 6, "data.truncate=true cut every answer away"),
        "validation": ([conversation("Be brief.")] * 5 + [conversation(LONG_PROMPT)], "in its validation split (1 samples)"),
    }
    content_only = tmp / "content_only.jinja"  # {% generation %} around the answer's text alone: an empty one learns nothing
    content_only.write_text(
        hf_tiny.CHAT_TEMPLATE_MARKED.replace("{% generation %}{{ m['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}",
                                             "{% generation %}{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>' + '\n' }}")
    )  # fmt: skip
    assert content_only.read_text() != hf_tiny.CHAT_TEMPLATE_MARKED
    for name, (rows, expected) in cases.items():
        path = write_rows(tmp / f"{name.replace(' ', '_')}.jsonl", rows)
        cfg = load_config([*keys(chat, f"data.path={path}", f"data.chat_template={content_only}")])[0]
        with pytest.raises(UserError, match=re.escape(expected)) as e:
            load_data(cfg)
        assert str(e.value).startswith(f"data.path: '{path}' has nothing to learn in its ") and "\n" not in str(e.value), name


def test_prepare_data_refuses_rows_with_nothing_to_learn_and_training_refuses_answers_cut_away(chat):
    from parallel_train.config.load import load_config
    from parallel_train.data.prepare import Options, prepare
    from parallel_train.data.sources import load_data

    tmp = chat["tmp"]
    no_answers = write_rows(tmp / "prep_no_answers.jsonl", [{"messages": [{"role": "user", "content": "Hail!"}]}] * 6)
    opts = Options([str(no_answers)], tmp / "prep_none", str(chat["model"]), format="chat")
    with pytest.raises(
        UserError, match=r"^--input .*prep_no_answers.jsonl has nothing to learn in its train split .*no row has an assistant turn"
    ):
        prepare(opts, print_fn=lambda m: None)
    assert not (tmp / "prep_none").exists()
    long_rows = write_rows(tmp / "prep_long.jsonl", [conversation(LONG_PROMPT)] * 6)
    prepare(Options([str(long_rows)], tmp / "prep_long", str(chat["model"]), format="chat"), print_fn=lambda m: None)
    meta = json.loads((tmp / "prep_long" / "prepared.json").read_text())
    assert meta["splits"]["train"]["learnable"] > 0 and all(s["learnable"] > 0 for s in meta["splits"]["train"]["shards"])
    with pytest.raises(UserError, match=r"prep_long has nothing to learn in its train split \(5 samples\): data.truncate=true cut every"):
        load_data(load_config(keys(chat, f"data.path={tmp / 'prep_long'}"))[0])
    load_data(load_config(keys(chat, f"data.path={tmp / 'prep_long'}", "model.block_size=256"))[0])  # long enough: it loads


# ---------------------------------------------------------------- LoRA that would train nothing, or not be LoRA


def test_lora_on_embeddings_only_and_lora_keys_without_a_rank_are_refused(chat):
    from parallel_train.config.load import load_config
    from parallel_train.models.hf import HFCausalLM, HFConfig

    lora = {"name": "hf", "hf_path": str(chat["model"]), "block_size": BLOCK, "lora_rank": 8}
    for targets in (["embed_tokens"], ["embed_tokens", "q_proj"]):  # peft wraps the Embedding; its adapters would stay frozen
        with pytest.raises(UserError, match=r"^model.lora_targets=\[.*\] matched model.embed_tokens \(Embedding\); LoRA here adapts Linear"
                           r".*this model's Linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):  # fmt: skip
            HFCausalLM(HFConfig(**lora, lora_targets=targets), 300)
    for key in ("model.lora_alpha=32", "model.lora_dropout=0.1", "model.lora_targets=[q_proj]"):
        with pytest.raises(UserError, match=rf"^{key.split('=')[0]}: set, but model.lora_rank=0, so no adapters are made .*full fine-tune"):
            load_config(["model.name=hf", f"model.hf_path={chat['model']}", key])
    cfg = load_config(["model.name=hf", f"model.hf_path={chat['model']}", "model.lora_rank=4", "model.lora_alpha=32"])[0]
    assert cfg.model.lora_alpha == 32
