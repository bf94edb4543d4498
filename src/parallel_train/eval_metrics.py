"""Validation metrics: what evaluation reports, each logged as `val_<name>`. A task names the ones it is judged by
(Task.metrics, tasks/*.py: "loss" first); METRICS below are yours, reported on every run; and a run may name one
function of the user's own file (eval.metric=FILE.py:FUNCTION, `user_metric`).

A metric comes in two parts, so that it is exact on any number of processes and pipeline stages:
- `stats(logits, targets)`: a (batch, K) tensor of K numbers per sample that add up over the validation set
  (correct tokens and tokens; true/false positives; entity spans found, predicted and gold);
- `value(totals)`: the metric from those K numbers summed over the whole validation set.
Evaluation (evaluation.py) sums the statistics of every sample exactly once, across ranks (each rank takes its
slice of every global validation batch), so a ratio of sums (a micro-average over tokens), an F1 or a corpus-level
score comes out the same on 1 process as on 64.

`loss` must stay: the trainer reads it (val_loss, best checkpoint). Like training, it is per token: the summed
`token_losses` over the summed count of valid targets (IGNORE_INDEX, padding, counts nowhere).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX, token_losses


@dataclass(frozen=True)
class Metric:
    stats: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> (batch, K)
    value: Callable[[list[float]], float | None]  # the K totals -> the reported number (None: not measured)


def ratio(totals: list[float]) -> float | None:
    """None when nothing was counted (validation batches with no token to learn): not measured, written as null."""
    return totals[0] / totals[1] if totals[1] else None


def f1(found: float, predicted: float, gold: float) -> float | None:
    """2 tp / (predicted + gold) = the harmonic mean of precision and recall; None when neither holds anything."""
    return 2 * found / (predicted + gold) if predicted + gold else None


# ---------------------------------------------------------------- loss, perplexity, accuracy


def loss_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(sample's summed token loss, its valid targets): their ratio of sums is the loss per token."""
    return per_sample_losses(token_losses(logits, targets), targets)


def per_sample_losses(losses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """loss_stats from the token losses (shaped like `targets`), however they were computed."""
    losses, real = losses.reshape(targets.shape[0], -1), (targets != IGNORE_INDEX).reshape(targets.shape[0], -1)
    return torch.stack([losses.sum(dim=1), real.sum(dim=1).to(losses.dtype)], dim=1)


def perplexity(totals: list[float]) -> float | None:
    """exp of the loss per token (not a mean of per-sample perplexities); beyond float range: not a number, null."""
    loss = ratio(totals)
    return None if loss is None or loss > math.log(torch.finfo(torch.float64).max) else math.exp(loss)


def accuracy_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(correct predictions, real targets) per sample: their ratio of sums is the accuracy over all targets."""
    return per_sample_correct(logits.argmax(dim=-1), targets)


def per_sample_correct(predicted: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """accuracy_stats from the predicted classes (shaped like `targets`), however they were found."""
    real = (targets != IGNORE_INDEX).reshape(targets.shape[0], -1)
    correct = (predicted == targets).reshape(targets.shape[0], -1) & real
    return torch.stack([correct.sum(dim=1), real.sum(dim=1)], dim=1)


# ---------------------------------------------------------------- F1 of classes


def class_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, per class (C = the logits' last dimension): true positives, false positives, false negatives,
    as (batch, 3C): [tp of each class, fp of each class, fn of each class]. Targets that are IGNORE_INDEX count nowhere."""
    classes, real = logits.shape[-1], (targets != IGNORE_INDEX)[..., None]
    predicted = F.one_hot(logits.argmax(dim=-1), classes).bool() & real
    gold = F.one_hot(targets.clamp(min=0), classes).bool() & real
    per_sample = [m.reshape(targets.shape[0], -1, classes).sum(dim=1) for m in (predicted & gold, predicted & ~gold, gold & ~predicted)]
    return torch.cat(per_sample, dim=1)


def class_f1(totals: list[float]) -> float | None:
    """Two classes: the F1 of class 1 (the positive class: what GLUE reports for MRPC and QQP). More: the macro F1,
    the mean over the classes that occur as a label or a prediction (scikit-learn's f1_score(average="macro"))."""
    classes = len(totals) // 3
    tp, fp, fn = totals[:classes], totals[classes : 2 * classes], totals[2 * classes :]
    if classes == 2:
        return f1(tp[1], tp[1] + fp[1], tp[1] + fn[1])
    scores = [f1(tp[c], tp[c] + fp[c], tp[c] + fn[c]) for c in range(classes)]
    seen = [s for s in scores if s is not None]
    return sum(seen) / len(seen) if seen else None


# ---------------------------------------------------------------- entity F1 (BIO tags)


def bio_tags(label_names: list[str] | None) -> list[tuple[str, str]] | None:
    """(kind, entity type) of each class name: "B-PER" -> ("B", "PER"), "O" -> ("O", ""). None unless every name is
    O, B-TYPE or I-TYPE (BIO, also called IOB2: run_ner's CoNLL tags)."""
    if not label_names:
        return None
    tags = [("O", "") if n == "O" else (n[0], n[2:]) for n in label_names]
    ok = all(n == "O" or (n[:2] in ("B-", "I-") and len(n) > 2) for n in label_names)
    return tags if ok else None


def entity_spans(tags: list[tuple[str, str]]) -> set[tuple[str, int, int]]:
    """The entities of one tag sequence as (type, start, end) with end exclusive, read as seqeval's default mode and
    conlleval read them: B starts an entity; I continues the entity before it when that one has the same type and
    starts a new entity otherwise (after O, or after another type)."""
    spans, start, previous = set(), None, ("O", "")
    for i, (kind, kind_type) in enumerate([*tags, ("O", "")]):
        continues = kind == "I" and kind_type == previous[1]  # O's type is "": an I after O starts an entity
        if start is not None and not continues:
            spans.add((previous[1], start, i))
            start = None
        if kind != "O" and not continues:
            start = i
        previous = (kind, kind_type)
    return spans


def entity_stats(logits: torch.Tensor, targets: torch.Tensor, tags: list[tuple[str, str]]) -> torch.Tensor:
    """(entities predicted exactly, predicted, gold) per sample, over its labelled tokens only (a word's first
    sub-word; -100 elsewhere), as run_ner hands seqeval its tags. An entity counts when type, start and end match."""
    if logits.shape[-1] != len(tags):
        raise UserError(
            f"the model gives {logits.shape[-1]} classes per token, but the data names {len(tags)} tags; "
            "build the model with as many labels as the data has"
        )
    rows = []
    for predicted_ids, gold_ids in zip(logits.argmax(dim=-1).tolist(), targets.tolist(), strict=True):
        kept = [(p, g) for p, g in zip(predicted_ids, gold_ids, strict=True) if g != IGNORE_INDEX]
        predicted = entity_spans([tags[p] for p, _ in kept])
        gold = entity_spans([tags[g] for _, g in kept])
        rows.append([len(predicted & gold), len(predicted), len(gold)])
    return torch.tensor(rows, dtype=torch.float64, device=logits.device).reshape(-1, 3)


def entity_f1(totals: list[float]) -> float | None:
    """Micro F1 over every entity of every type (seqeval's f1_score)."""
    return f1(*totals)


def entity_share(of: int, totals: list[float]) -> float | None:
    """Entities found exactly over those predicted (of=1: seqeval's precision_score) or gold (of=2: its recall_score),
    micro over every type; 0 when that count is 0 but the other is not (seqeval's zero_division), None when neither
    holds anything (not measured, as entity_f1)."""
    found, predicted, gold = totals
    return found / totals[of] if totals[of] else (0.0 if predicted + gold else None)


# ---------------------------------------------------------------- the metrics a run reports

# Every metric a task may name (Task.metrics). entity_f1 is built from the data's tag names (chosen_metrics).
TASK_METRICS: dict[str, Metric] = {
    "loss": Metric(loss_stats, ratio),
    "perplexity": Metric(loss_stats, perplexity),  # the same statistics as loss, computed once (metric_stats)
    "accuracy": Metric(accuracy_stats, ratio),  # of next-token, masked-token, tag or class predictions
    "f1": Metric(class_stats, class_f1),
}
ENTITY_F1 = "entity_f1"  # a task that names it reports entity precision and recall before it
ENTITY_PRECISION, ENTITY_RECALL = "entity_precision", "entity_recall"

# Yours: reported on every run, after the task's own. name -> Metric(stats, value), logged as val_<name>.
METRICS: dict[str, Metric] = {
    # "name": Metric(stats, value), e.g. bits per character from loss_stats (docs/guide.md, section 3)
}


def chosen_metrics(
    names: tuple[str, ...], label_names: list[str] | None, user: tuple[str, Metric] | None = None
) -> tuple[dict[str, Metric], str | None]:
    """What a run reports, in order: its task's metrics (`names`), METRICS, then the user's (eval.metric). With a
    notice when one of the task's cannot be measured (entity F1 without BIO tag names). entity_f1 comes with
    entity_precision and entity_recall before it, as seqeval reports them."""
    chosen, notice = {}, None
    for name in names:
        if name != ENTITY_F1:
            chosen[name] = TASK_METRICS[name]
        elif (tags := bio_tags(label_names)) is not None:  # seqeval's three, from one set of statistics (stats_by)
            stats = partial(entity_stats, tags=tags)
            chosen |= {ENTITY_PRECISION: Metric(stats, partial(entity_share, 1)), ENTITY_RECALL: Metric(stats, partial(entity_share, 2))}
            chosen[name] = Metric(stats, entity_f1)
        else:
            shown = ", ".join((label_names or ["none"])[:4]) + (", ..." if len(label_names or []) > 4 else "")
            notice = (
                f"notice: the tag names ({shown}) are not BIO (O, B-TYPE, I-TYPE), so validation reports token accuracy and no entity F1"
            )
    chosen.update(METRICS)
    if user is not None:
        name, metric = user
        if name in chosen:
            raise UserError(f"eval.metric: val_{name} is reported already; give your function another name")
        chosen[name] = metric
    return chosen, notice


# ---------------------------------------------------------------- the user's own (eval.metric=FILE.py:FUNCTION)


def user_metric(spec: str) -> tuple[str, Metric]:
    """FUNCTION of the user's FILE.py, read from that file (never from a checkpoint) as a metric logged as
    val_FUNCTION. FUNCTION(logits, labels) returns a (batch, K) tensor of per-sample statistics; the value is the
    sum of the first column over the sum of the second (None when that is 0), unless the file also defines
    FUNCTION_value(totals), which makes it from the K sums (a list of floats)."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise UserError(f"eval.metric: {spec!r} is not FILE.py:FUNCTION; e.g. eval.metric=my_metrics.py:exact_match")
    if not Path(path).is_file():
        raise UserError(f"eval.metric: {path}: no such file (from {Path.cwd()}); give the path of your metric file")
    module = load_file(Path(path))
    stats, value = getattr(module, name, None), getattr(module, f"{name}_value", ratio)
    if not callable(stats) or not callable(value):
        functions = ", ".join(n for n, v in vars(module).items() if callable(v) and getattr(v, "__module__", "") == module.__name__)
        raise UserError(
            f"eval.metric: {path} has no function {name if not callable(stats) else name + '_value'}"
            f" (its functions: {functions or 'none'}); name one of them"
        )
    return name, Metric(partial(checked_stats, stats, name, value is ratio), value if value is ratio else partial(checked_value, value))


def load_file(path: Path):
    """The user's file as a module; an error while importing it is one line that names the file and the line."""
    spec = importlib.util.spec_from_file_location(f"parallel_train_user_metric_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: a dataclass or a pickle in the file looks its module up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: whatever it raises, said in one line with where
        del sys.modules[spec.name]
        lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if Path(frame.filename).resolve() == path.resolve()]
        line = e.lineno if isinstance(e, SyntaxError) else (lines[-1] if lines else None)
        where = f" (line {line})" if line else ""
        raise UserError(f"eval.metric: {path}{where} failed to import: {type(e).__name__}: {e}; fix the file") from None
    return module


def checked_stats(stats: Callable, name: str, needs_ratio: bool, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The user's statistics, checked for the shape every metric's stats have; whatever the function raises is one line
    that names it and its line (evaluation.py has every rank stop with it)."""
    try:
        out = stats(logits, targets)
    except Exception as e:  # the user's code: any exception
        raise UserError(f"eval.metric: {name}(logits, labels) raised {raised(stats, e)}; fix the function") from None
    columns = 2 if needs_ratio else 1
    if not (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == targets.shape[0] and out.shape[1] >= columns):
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(
            f"eval.metric: {name}(logits, labels) returned {got} for {targets.shape[0]} samples; return a (batch, K) tensor of "
            f"per-sample statistics, K >= {columns}"
            + ("" if not needs_ratio else f" (the value is the first column's sum over the second's, or define {name}_value(totals))")
        )
    return out


def checked_value(value: Callable, totals: list[float]) -> float | None:
    """The user's FUNCTION_value(totals): a number, or None (not measured). What it raises, or anything else it returns
    (a string, a tensor of several numbers), is one line that names it, said alike on every rank (every rank holds the
    same totals), so the trainer keeps the training before it stops (trainer.py's evaluate)."""
    try:
        out = value(totals)
    except Exception as e:  # the user's code: any exception
        raise UserError(f"eval.metric: {value.__name__}(totals) raised {raised(value, e)}; fix the function") from None
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if out is None or (isinstance(out, numbers.Real) and not isinstance(out, bool)):
        return out
    got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"{str(out)[:60]!r} ({type(out).__name__})"
    raise UserError(f"eval.metric: {value.__name__}(totals) returned {got}; return a number (or None: not measured)")


def raised(function: Callable, e: Exception) -> str:
    """What the user's `function` raised and where: "ValueError: ... (FILE line N)", the line of its file the error left."""
    code = function.__code__
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == code.co_filename]
    return f"{type(e).__name__}: {e} ({Path(code.co_filename).name} line {lines[-1] if lines else code.co_firstlineno})"


# ---------------------------------------------------------------- sums


def metric_stats(logits: torch.Tensor, targets: torch.Tensor, metrics: dict[str, Metric]) -> dict[str, torch.Tensor]:
    """Every metric's per-sample statistics: {name: (batch, K)}, float64 so that sums stay exact. Statistics two
    metrics share (loss and perplexity) are computed once."""
    return stats_by(lambda stats: stats(logits, targets.to(logits.device)), metrics)


def stats_by(compute: Callable[[Callable], torch.Tensor], metrics: dict[str, Metric]) -> dict[str, torch.Tensor]:
    """{name: compute(metric.stats) in float64}, each distinct stats function computed once."""
    computed = {}
    for metric in metrics.values():
        if metric.stats not in computed:
            computed[metric.stats] = compute(metric.stats).to(torch.float64)
    return {name: computed[metric.stats] for name, metric in metrics.items()}


def add_totals(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two sets of summed statistics added up (`a` None: nothing summed yet)."""
    return b if a is None else {name: a[name] + b[name] for name in b}


def add_stats(totals: dict[str, torch.Tensor] | None, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Running sums over samples: totals + the column sums of one batch's statistics."""
    return add_totals(totals, {name: s.sum(dim=0) for name, s in stats.items()})


def metric_values(totals: dict[str, torch.Tensor], metrics: dict[str, Metric]) -> dict[str, float | None]:
    """The metrics from their statistics summed over the validation set. None where a metric was not measured: its
    value is None or not finite (a ratio over nothing; JSON has no NaN, so metrics.jsonl says null)."""
    values = {name: metrics[name].value(totals[name].tolist()) for name in metrics}
    return {name: float(v) if v is not None and math.isfinite(v) else None for name, v in values.items()}
