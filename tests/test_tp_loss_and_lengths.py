"""Tensor parallelism with any loss and any length (issue 34, items 5 and 6).

- A `token_losses` other than plain cross-entropy (the guide's label smoothing) trains under `parallel.tp` on logits
  gathered whole, with one notice of what that costs, and evaluation reports it too: the run equals one process.
  Plain cross-entropy, however written, keeps loss parallel (losses.plain_cross_entropy decides by values).
- A model.block_size that sequence parallel cannot cut into tp equal shards is one line on every rank before any
  collective, and the memory estimator says the same line; padded batches are as long as tp can cut.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, TINY, WarmCmd, check, launch_env, run, summary, train_losses, warm_cmd
from parallel_train import losses
from parallel_train.config.load import load_config
from parallel_train.data.packing import PaddedSamples, SamplesInMemory
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX
from parallel_train.models.gpt import GPT, GPTConfig
from parallel_train.parallel.sharding import tensor_parallel_cuts


def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """docs/guide.md's token_losses with label smoothing 0.1."""
    out = F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX, label_smoothing=0.1
    )
    return out.view(targets.shape)


def rewritten(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy written another way: log-softmax and the target's entry."""
    logp = logits.float().log_softmax(-1)
    picked = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return torch.where(targets == IGNORE_INDEX, 0.0, picked)


def gpt(block_size: int = 16) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=block_size), 65)


# ---------------------------------------------------------------- in process


def test_loss_parallel_serves_plain_cross_entropy_only(monkeypatch):
    from parallel_train.parallel.sharding import gathered_logits_notice

    assert losses.plain_cross_entropy() and tensor_parallel_cuts(gpt(), 2, 16, None) == (True, True)
    monkeypatch.setattr(losses, "token_losses", rewritten)
    assert losses.plain_cross_entropy()  # by its values, not its name: loss parallel computes the same numbers
    for other in (smoothed, lambda logits, targets: 1 / 0, lambda logits, targets: smoothed(logits, targets).flatten()):
        monkeypatch.setattr(losses, "token_losses", other)
        assert not losses.plain_cross_entropy()
    monkeypatch.setattr(losses, "token_losses", smoothed)
    assert tensor_parallel_cuts(gpt(), 2, 16, None) == (True, False)  # the plan's gathered logits, for the user's loss
    notice = gathered_logits_notice(gpt(), 2, False, 4, 16)
    assert notice.startswith("notice: token_losses") and "4 x 16 x 65 x 4 bytes = 0.0 MiB per micro-batch" in notice
    assert "\n" not in notice and gathered_logits_notice(gpt(), 2, True, 4, 16) is None
    monkeypatch.setattr(losses, "token_losses", losses.cross_entropy)
    assert not losses.plain_cross_entropy(lambda logits, targets: smoothed(logits, targets).sum())  # a task's own loss_sum


def test_the_estimator_counts_the_gathered_logits_of_a_loss_loss_parallel_cannot_serve(monkeypatch):
    from parallel_train.parallel.memory_estimate import estimate

    cfg = load_config([*TINY[:4], "parallel.tp=2", "train.batch_size=4"])[0]
    sample = (torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long))
    whole = 4 * 16 * 65 * 4  # a micro-batch's logits in fp32
    assert estimate(cfg, 2, 65, sample)[1][0].breakdown["loss"] < 0.6 * whole  # loss parallel: 33 of 65 columns
    monkeypatch.setattr(losses, "token_losses", smoothed)
    assert estimate(cfg, 2, 65, sample)[1][0].breakdown["loss"] >= whole


def test_a_length_sequence_parallel_cannot_cut_is_one_line_and_the_estimator_says_it_too():
    message = r"^model.block_size=15: sequence parallel cuts every sequence into parallel.tp=2 equal shards, .* \(14 or 16\)$"
    with pytest.raises(UserError, match=message):
        tensor_parallel_cuts(gpt(15), 2, 15, None)
    from parallel_train.parallel.memory_estimate import estimate

    cfg = load_config([*TINY[:3], "model.block_size=15", "parallel.tp=2"])[0]
    with pytest.raises(UserError, match=message):
        estimate(cfg, 2, 65, (torch.zeros(15, dtype=torch.long), torch.zeros(15, dtype=torch.long)))


def test_padded_batches_are_as_long_as_tp_can_cut():
    samples = SamplesInMemory([torch.arange(n).numpy() for n in (5, 12)], [torch.ones(n).numpy() for n in (5, 12)])
    x, y = PaddedSamples(samples, 48, 0, fixed=False, align=24).__getitems__([0, 1])  # lcm(8, tp=3)
    assert x.shape == y.shape == (2, 24) and (y[:, 11:] == IGNORE_INDEX).all()


# ---------------------------------------------------------------- real runs

# train.py with losses.py's token_losses edited as docs/guide.md says (label smoothing 0.1)
SMOOTHED_TRAIN = f"""
import runpy

import torch.nn.functional as F
from parallel_train import eval_metrics, losses


def smoothed(logits, targets):
    out = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none", ignore_index=-100, label_smoothing=0.1)
    return out.view(targets.shape)


losses.token_losses = eval_metrics.token_losses = smoothed
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
# Padded samples, SGD, global batch 8 (tests/test_mesh.py's reference): steps equal one process's to float tolerance
RUN = (*TINY, "data.path=synthetic", "data.synthetic_padding=true", "data.num_samples=4000", "model.vocab_size=65")
RUN += ("train.gradient_accumulation_steps=2", "train.optimizer=sgd", "train.learning_rate=1.0", "eval.batch_size=8", "train.max_steps=3")


@pytest.mark.multiprocess
def test_label_smoothing_under_tensor_parallel_equals_one_process(tmp_path):
    script = tmp_path / "smoothed_train.py"
    script.write_text(SMOOTHED_TRAIN)
    env = launch_env(tmp_path)
    ref, tp = tmp_path / "ref", tmp_path / "tp2"
    one = check(run(WarmCmd(1, str(script), (*RUN, f"output_dir={ref}")), env=env))
    two = check(run(WarmCmd(2, str(script), (*RUN, "parallel.tp=2", f"output_dir={tp}")), env=env))
    assert "notice" not in one.output and "; sequence parallel\n" in two.output.replace(" |", "\n")  # no loss parallel
    assert "notice: token_losses (src/parallel_train/losses.py) is not plain cross-entropy" in two.output
    got, want = train_losses(tp), train_losses(ref)
    assert got == pytest.approx(want, rel=1e-5) and len(got) == 3
    assert summary(tp)["final_val_loss"] == pytest.approx(summary(ref)["final_val_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_a_block_size_tp_cannot_cut_stops_every_rank_in_one_line(tmp_path):
    r = run(warm_cmd(2, *TINY, "model.block_size=15", "parallel.tp=2", f"output_dir={tmp_path / 'bad'}"), env=launch_env(tmp_path))
    assert r.returncode != 0 and "Traceback" not in r.output and "collective" not in r.output, r.output[-3000:]
    # said once, without "rank N": every rank failed with this same line (errors.report_user_error)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: model.block_size=15: sequence parallel cuts every sequence into parallel.tp=2 equal shards, and 2 "
        "does not divide 15; choose a model.block_size that is a multiple of 2 (14 or 16)"
    ]
    assert not (tmp_path / "bad" / "config.yaml").exists()
