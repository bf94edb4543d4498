"""The metrics each task is judged by (eval_metrics.py), on hand-made logits and labels with hand-worked answers:
F1 of two classes and macro F1 of more, entity F1 over BIO spans (seqeval's reading), perplexity; every one the same
from summed statistics whatever way the samples are split over ranks, and None when nothing was counted. A metric of
the user's own file (eval.metric=FILE.py:FUNCTION), in process and on a tiny run."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from helpers import TINY, check, launch_env, read_metrics, run, summary, warm_cmd
from parallel_train.errors import UserError
from parallel_train.eval_metrics import (
    TASK_METRICS,
    add_stats,
    add_totals,
    bio_tags,
    chosen_metrics,
    entity_spans,
    metric_stats,
    metric_values,
    user_metric,
)
from parallel_train.tasks.registry import TASKS

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def logits_for(predicted: list, classes: int) -> torch.Tensor:
    """Logits whose argmax is `predicted` (any shape of class ids)."""
    return torch.nn.functional.one_hot(torch.tensor(predicted), classes).float() * 5


def values(task: str, logits: torch.Tensor, labels: torch.Tensor, names=TAGS) -> dict:
    metrics, _ = chosen_metrics(TASKS[task].metrics, names)
    return metric_values(add_stats(None, metric_stats(logits, labels, metrics)), metrics)


# ---------------------------------------------------------------- F1 of classes


def test_binary_f1_is_the_f1_of_class_1():
    gold, predicted = [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 1, 0]  # class 1: tp 2, fp 1, fn 1
    v = values("sequence-classification", logits_for(predicted, 2), torch.tensor(gold))
    assert v["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1)) and v["accuracy"] == pytest.approx(4 / 6)
    # Class 1 neither a label nor a prediction: not measured (scikit-learn would warn and say 0).
    assert values("sequence-classification", logits_for([0, 0], 2), torch.tensor([0, 0]))["f1"] is None


def test_macro_f1_averages_the_classes_that_occur():
    gold, predicted = [0, 1, 2, 2], [0, 2, 2, 1]  # F1: class 0 1.0, class 1 0.0, class 2 2/4; class 3 occurs nowhere
    v = values("image-classification", logits_for(predicted, 4), torch.tensor(gold))
    assert v["f1"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    # A label that counts nowhere (-100) is neither a true nor a false anything.
    v = values("image-classification", logits_for([*predicted, 3], 4), torch.tensor([*gold, -100]))
    assert v["f1"] == pytest.approx(0.5) and v["accuracy"] == pytest.approx(2 / 4)


# ---------------------------------------------------------------- entity F1


@pytest.mark.parametrize(
    "tags, spans",
    [
        ("B-PER I-PER O B-LOC", {("PER", 0, 2), ("LOC", 3, 4)}),
        ("I-PER I-PER O", {("PER", 0, 2)}),  # I after O starts an entity (seqeval's default mode, conlleval)
        ("B-PER B-PER", {("PER", 0, 1), ("PER", 1, 2)}),  # B always starts a new one
        ("B-PER I-LOC I-LOC", {("PER", 0, 1), ("LOC", 1, 3)}),  # I of another type too
        ("O I-LOC B-LOC I-LOC O", {("LOC", 1, 2), ("LOC", 2, 4)}),
        ("B-MISC", {("MISC", 0, 1)}),  # an entity at the end is closed
        ("O O", set()),
        ("", set()),
    ],
)
def test_entity_spans_read_bio_as_seqeval_does(tags, spans):
    assert entity_spans([("O", "") if t == "O" else (t[0], t[2:]) for t in tags.split()]) == spans


def test_entity_f1_is_seqevals_on_its_readme_example_and_skips_unlabelled_tokens():
    # seqeval's README: f1_score(y_true, y_pred) == 0.50 (MISC found at the wrong start, PER found).
    y_true = ["O O O B-MISC I-MISC I-MISC O".split(), "B-PER I-PER O".split()]
    y_pred = ["O O B-MISC I-MISC I-MISC I-MISC O".split(), "B-PER I-PER O".split()]
    ids = {name: i for i, name in enumerate(TAGS)}
    # Each word followed by a sub-word labelled -100 and predicted as B-LOC: it must change nothing.
    gold = [sum(([ids[t], -100] for t in row), []) + [-100] * (2 * (7 - len(row))) for row in y_true]
    pred = [sum(([ids[t], ids["B-LOC"]] for t in row), []) + [0] * (2 * (7 - len(row))) for row in y_pred]
    v = values("token-classification", logits_for(pred, len(TAGS)), torch.tensor(gold))
    assert v["entity_f1"] == pytest.approx(0.5) and v["accuracy"] == pytest.approx(8 / 10)  # words 3 and 4 of the first row
    # No entity in the labels nor in the predictions: not measured.
    assert values("token-classification", logits_for([[0, 0]], len(TAGS)), torch.tensor([[0, -100]]))["entity_f1"] is None


def test_entity_precision_and_recall_are_seqevals_beside_f1():
    """seqeval's precision_score and recall_score (micro, every type; zero_division 0), worked by hand: 2 entities
    predicted, both right; 3 gold, the MISC missed. Nothing gold but something predicted: 0 and 0, as seqeval says;
    nothing either side: not measured."""
    ids = {name: i for i, name in enumerate(TAGS)}
    gold = [[ids[t] for t in "B-PER I-PER B-LOC O B-MISC I-MISC".split()]]
    pred = [[ids[t] for t in "B-PER I-PER B-LOC O O O".split()]]
    v = values("token-classification", logits_for(pred, len(TAGS)), torch.tensor(gold))
    assert list(v) == ["loss", "accuracy", "entity_precision", "entity_recall", "entity_f1"]  # seqeval's report's order
    assert (v["entity_precision"], v["entity_recall"]) == (1.0, pytest.approx(2 / 3)) and v["entity_f1"] == pytest.approx(0.8)
    v = values("token-classification", logits_for([[1, 0]], len(TAGS)), torch.tensor([[0, 0]]))
    assert (v["entity_precision"], v["entity_recall"], v["entity_f1"]) == (0.0, 0.0, 0.0)
    v = values("token-classification", logits_for([[0, 0]], len(TAGS)), torch.tensor([[0, 0]]))
    assert (v["entity_precision"], v["entity_recall"], v["entity_f1"]) == (None, None, None)


def test_tag_names_that_are_not_bio_give_token_accuracy_and_one_notice():
    assert bio_tags(TAGS) is not None and bio_tags(["O", "PER", "LOC"]) is None and bio_tags(None) is None
    metrics, notice = chosen_metrics(TASKS["token-classification"].metrics, ["O", "PER", "LOC"])
    assert list(metrics) == ["loss", "accuracy"] and "not BIO" in notice and "O, PER, LOC" in notice
    assert chosen_metrics(TASKS["token-classification"].metrics, TAGS)[1] is None


# ---------------------------------------------------------------- every task: exact on any split, None over nothing


def test_each_task_reports_loss_first_then_what_it_is_judged_by():
    judged_by = {"causal-lm": "perplexity", "masked-lm": "perplexity", "seq2seq": "perplexity"}
    judged_by |= {"sequence-classification": "f1", "image-classification": "f1", "token-classification": "entity_f1"}
    for task in TASKS.values():
        assert task.metrics[0] == "loss" and "accuracy" in task.metrics and judged_by[task.name] in task.metrics
        assert set(task.metrics) <= {*TASK_METRICS, "entity_f1"}


@pytest.mark.parametrize("task", list(TASKS))
def test_one_rank_equals_two_ranks_splitting_the_samples(task):
    """The statistics of every sample summed once: any split of the samples gives the same metrics (evaluation.py
    sums each rank's totals), even with uneven slices and samples holding different numbers of labels."""
    torch.manual_seed(0)
    tokens = task not in ("sequence-classification", "image-classification")
    shape = (9, 6) if tokens else (40,)
    logits = torch.randn(*shape, len(TAGS))
    labels = torch.randint(0, len(TAGS), shape)
    labels[torch.rand(shape) < 0.3] = -100
    metrics, _ = chosen_metrics(TASKS[task].metrics, TAGS)
    whole = metric_values(add_stats(None, metric_stats(logits, labels, metrics)), metrics)
    rank0 = add_stats(None, metric_stats(logits[:3], labels[:3], metrics))  # 3 samples, then the rest in 2 batches
    rank1 = add_stats(add_stats(None, metric_stats(logits[3:5], labels[3:5], metrics)), metric_stats(logits[5:], labels[5:], metrics))
    split = metric_values(add_totals(rank0, rank1), metrics)
    assert all(v is not None for v in whole.values()) and split == pytest.approx(whole)
    if "perplexity" in whole:
        assert whole["perplexity"] == pytest.approx(math.exp(whole["loss"]))


# ---------------------------------------------------------------- the user's own metric

EXACT_MATCH = """
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Unused:  # a dataclass needs its module in sys.modules while the file is imported
    n: int = 0

def exact_match(logits, labels):
    # (all of a sample's real labels predicted, 1): the share of samples predicted whole
    real = labels != -100
    right = ((logits.argmax(-1) == labels) | ~real).flatten(1).all(1)
    return torch.stack([right.double(), torch.ones_like(right, dtype=torch.float64)], dim=1)

def labels_seen(logits, labels):
    return (labels != -100).flatten(1).sum(1, keepdim=True)

def labels_seen_value(totals):
    return totals[0]
"""


def test_a_user_metric_is_a_function_of_their_file(tmp_path):
    (tmp_path / "mine.py").write_text(EXACT_MATCH)
    logits, labels = logits_for([[1, 2], [1, 1]], 3), torch.tensor([[1, 2], [1, 2]])
    name, metric = user_metric(f"{tmp_path}/mine.py:exact_match")
    metrics, _ = chosen_metrics(TASKS["causal-lm"].metrics, None, (name, metric))
    assert list(metrics) == ["loss", "perplexity", "accuracy", "exact_match"]
    assert metric_values(add_stats(None, metric_stats(logits, labels, metrics)), metrics)["exact_match"] == 0.5
    name, metric = user_metric(f"{tmp_path}/mine.py:labels_seen")  # its value made by labels_seen_value from the sums
    assert metric_values(add_stats(None, metric_stats(logits, labels, {name: metric})), {name: metric}) == {"labels_seen": 4.0}


@pytest.mark.parametrize(
    "spec, says",
    [
        ("mine.py", "'mine.py' is not FILE.py:FUNCTION"),
        ("mine.txt:exact_match", "is not FILE.py:FUNCTION"),
        ("nope.py:exact_match", "nope.py: no such file"),
        ("mine.py:exact", "mine.py has no function exact (its functions: Unused, exact_match, labels_seen, labels_seen_value)"),
        ("broken.py:f", "broken.py (line 3) failed to import: SyntaxError"),
        ("raises.py:f", "raises.py (line 2) failed to import: KeyError: 'x'"),
    ],
)
def test_a_bad_metric_spec_is_one_line(tmp_path, monkeypatch, spec, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(EXACT_MATCH)
    (tmp_path / "broken.py").write_text("def f(logits, labels):\n    pass\ndef g(:\n")
    (tmp_path / "raises.py").write_text("import os\n{}['x']\n")
    with pytest.raises(UserError, match="^eval.metric: ") as e:
        user_metric(spec)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_user_metric_named_as_a_reported_one_or_of_the_wrong_shape_is_one_line(tmp_path):
    (tmp_path / "m.py").write_text("import torch\ndef accuracy(l, y):\n    return y\ndef flat(l, y):\n    return torch.ones(len(y))\n")
    with pytest.raises(UserError, match="val_accuracy is reported already"):
        chosen_metrics(TASKS["causal-lm"].metrics, None, user_metric(f"{tmp_path}/m.py:accuracy"))
    name, metric = user_metric(f"{tmp_path}/m.py:flat")
    with pytest.raises(UserError, match=r"flat\(logits, labels\) returned a tensor of shape \(2,\) for 2 samples"):
        metric_stats(torch.zeros(2, 3), torch.tensor([0, 1]), {name: metric})


def test_a_user_metric_on_a_tiny_run_reaches_metrics_jsonl_and_summary(tmp_path):
    (tmp_path / "my_metrics.py").write_text(EXACT_MATCH)
    out = tmp_path / "run"
    keys = (*TINY, "train.max_steps=2", "train.lr_decay_steps=2", "eval.iters=2", f"output_dir={out}")
    result = check(run(warm_cmd(1, *keys, f"eval.metric={tmp_path}/my_metrics.py:exact_match"), env=launch_env(tmp_path)))
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert evals and all(set(r) >= {"val_loss", "val_perplexity", "val_accuracy", "val_exact_match"} for r in evals)
    assert evals[-1]["val_perplexity"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    assert 0 <= evals[-1]["val_exact_match"] <= 1
    final = summary(out)["final_val_metrics"]
    assert final == {k: v for k, v in evals[-1].items() if k.startswith("val_")}
    assert f"val exact_match {final['val_exact_match']:.4f}" in result.output
    assert json.loads((out / "summary.json").read_text())["final_val_loss"] == final["val_loss"]  # val loss read as before


def test_a_metric_that_raises_on_the_last_stage_alone_stops_every_rank_at_once(tmp_path):
    """In a 2-stage pipeline only the last stage's rank holds logits, so only it runs the metric; its error travels in the
    evaluation's gather and both ranks stop with the one line, printed once (before, rank 1 died alone and rank 0
    reported a failed collective beside it; where the peer's socket stays open, it would wait out parallel.timeout_s)."""
    (tmp_path / "bad.py").write_text("def bad(logits, labels):\n    raise ValueError('no labels like these')\n")
    keys = (*TINY, "parallel.pipeline_stages=2", "parallel.timeout_s=120", "train.max_steps=2", "eval.interval=1", "eval.iters=1")
    started = time.monotonic()
    result = run(warm_cmd(2, *keys, f"eval.metric={tmp_path}/bad.py:bad", f"output_dir={tmp_path / 'run'}"), env=launch_env(tmp_path))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and time.monotonic() - started < 60, result.output[-3000:]
    assert errors == [
        "error: eval.metric: bad(logits, labels) raised ValueError: no labels like these (bad.py line 2); fix the function "
        f"(step 1's checkpoint is written first: {tmp_path / 'run' / 'checkpoints' / 'step_0000001'}; a rerun resumes from it)"
    ], errors


VALUES = """
import torch


def counted(logits, labels):
    return torch.ones(len(labels), 2)


def raises_value(totals):
    return totals[0] / 0


def text_value(totals):
    return "high"


def many_value(totals):
    return torch.tensor(totals)


def one_value(totals):
    return torch.tensor(totals[0])
"""


@pytest.mark.parametrize(
    "function, says",
    [
        (
            "raises",
            "eval.metric: raises_value(totals) raised ZeroDivisionError: float division by zero (mine.py line 10); fix the function",
        ),
        ("text", "eval.metric: text_value(totals) returned 'high' (str); return a number (or None: not measured)"),
        ("many", "eval.metric: many_value(totals) returned a tensor of shape (2,); return a number (or None: not measured)"),
    ],
)
def test_a_user_value_that_raises_or_is_no_number_is_one_line(tmp_path, function, says):
    """FUNCTION_value(totals) makes the reported number (issue 34, kind 8): before, what it raised, or a string or a tensor
    it returned (math.isfinite refusing it), was a traceback after training."""
    (tmp_path / "mine.py").write_text(VALUES.replace("def counted", f"def {function}"))
    name, metric = user_metric(f"{tmp_path}/mine.py:{function}")
    stats = add_stats(None, metric_stats(torch.zeros(2, 3), torch.tensor([0, 1]), {name: metric}))
    with pytest.raises(UserError) as e:
        metric_values(stats, {name: metric})
    assert str(e.value) == says


def test_a_user_value_of_one_element_is_its_number(tmp_path):
    (tmp_path / "mine.py").write_text(VALUES.replace("def counted", "def one"))
    name, metric = user_metric(f"{tmp_path}/mine.py:one")
    stats = add_stats(None, metric_stats(torch.zeros(2, 3), torch.tensor([0, 1]), {name: metric}))
    assert metric_values(stats, {name: metric}) == {"one": 2.0}


def test_a_metric_that_fails_at_the_final_evaluation_keeps_the_training(tmp_path):
    """The last step's evaluation comes before its checkpoint: a metric failing there stopped the run with nothing of
    its training kept (and a traceback for a value that was no number). Now the checkpoint is written first, then the one
    line, which says where it is: a rerun with the function fixed resumes from it."""
    (tmp_path / "mine.py").write_text(VALUES.replace("def counted", "def text"))
    out = tmp_path / "run"
    keys = (*TINY, "train.max_steps=2", "train.lr_decay_steps=2", "eval.iters=1", "checkpoint.interval=0", f"output_dir={out}")
    result = run(warm_cmd(1, *keys, f"eval.metric={tmp_path}/mine.py:text"), env=launch_env(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: eval.metric: text_value(totals) returned 'high' (str); return a number (or None: not measured) "
        f"(step 2's checkpoint is written first: {out / 'checkpoints' / 'step_0000002'}; a rerun resumes from it)"
    ], result.output[-3000:]
    assert (out / "checkpoints" / "step_0000002" / "manifest.json").is_file()
