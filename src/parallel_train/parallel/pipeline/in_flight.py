"""The activations a pipeline rank holds at once under a schedule: torch's own order of actions, walked.

A stage keeps a micro-batch's activations from its forward (F) until its backward frees them (B; under the
zero-bubble schedules the input's gradient I and then the weights' W, which still needs the layer inputs). How many
are alive at once is the schedule's business: GPipe runs every forward first (M in flight), 1F1B at most S - rank,
the interleaved schedules a warm-up of several chunks of each local stage (more micro-batches, each over fewer
layers). Rather than a formula per schedule, the order is torch's: `Schedule*._get_pipeline_order` (one stage per
rank) or `_calculate_single_rank_operations` (several), the functions each schedule runs to decide what to do, called
here without stages or a process group (they read only the sizes). The memory estimator weighs each (stage,
micro-batch) by that stage's activation bytes and takes the largest sum along the way.
"""

from __future__ import annotations

from types import SimpleNamespace

from parallel_train.parallel.pipeline.distributed import SCHEDULES

RELEASES = ("FULL_BACKWARD", "BACKWARD_WEIGHT", "BACKWARD_INPUT")


def rank_actions(schedule: str, n_ranks: int, per_rank: int, microbatches: int, rank: int) -> list:
    """torch's list of actions for pipeline rank `rank` (None: idle), as the schedule computes it."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, SCHEDULES[schedule])
    rounds = max(1, microbatches // n_ranks)
    sizes = SimpleNamespace(
        _num_stages=n_ranks * per_rank,
        num_stages=n_ranks * per_rank,
        _n_microbatches=microbatches,
        pp_group_size=n_ranks,
        n_local_stages=per_rank,
        number_of_rounds=rounds,
        microbatches_per_round=microbatches // rounds,
    )
    if issubclass(cls, schedules.PipelineScheduleSingle):
        return cls._get_pipeline_order(sizes)[rank]
    return cls._calculate_single_rank_operations(sizes, rank)


def peak_in_flight(actions: list, stage_bytes: dict[int, int], grads: int = 0) -> int:
    """The largest sum of the activation bytes of the (stage, micro-batch) pairs forwarded and not yet freed, with
    `grads` (the rank's gradients) from the end of its first backward on: before it they do not exist yet (each step
    sets them to None), so GPipe's peak is the larger of all M micro-batches alone and M - 1 beside the gradients.
    A pair is freed by its last backward action (W after I when the backward is split)."""
    flat = [sub for a in actions if a is not None for sub in (getattr(a, "sub_actions", None) or (a,))]
    last_release = {}
    for i, a in enumerate(flat):
        if a.computation_type.name in RELEASES:
            last_release[(a.stage_index, a.microbatch_index)] = i
    alive, peak, held = 0, 0, 0
    for i, a in enumerate(flat):
        key = (a.stage_index, a.microbatch_index)
        if a.computation_type.name == "FORWARD":
            alive += stage_bytes.get(a.stage_index, 0)
        elif last_release.get(key) == i:
            alive -= stage_bytes.get(a.stage_index, 0)
            held = grads
        peak = max(peak, alive + held)
    return peak


def in_flight_bytes(
    schedule: str, n_ranks: int, per_rank: int, microbatches: int, rank: int, stage_bytes: dict[int, int], grads: int = 0
) -> int:
    """Activation bytes pipeline rank `rank` holds at its peak under `schedule` (`stage_bytes`: one micro-batch's, per
    stage index this rank holds), with `grads` bytes of gradients from its first backward on."""
    return peak_in_flight(rank_actions(schedule, n_ranks, per_rank, microbatches, rank), stage_bytes, grads)
