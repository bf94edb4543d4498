"""Context parallelism (`parallel.cp`): every sequence cut into cp parts, one per rank, from the embedding to the loss.

The cp ranks of one group read the same batch (they are one data-parallel rank: parallel/mesh.py) and each keeps its
own contiguous T/cp of every row, inputs and targets alike: rank r holds positions [r*T/cp, (r+1)*T/cp) and the
model's positions (the GPT's position embedding, a Hub model's position_ids and so its rotary tables) are exactly
those. A packed batch's positions (data.packing: each sample's own, restarting at 0) stay whole on every rank: the
model takes its part's for the embedding and draws the whole sequence's document mask from all of them. Everything
but attention works token by token, so only attention talks: the Ulysses exchange (DeepSpeed-Ulysses). Before it
each rank holds its part of the sequence for all heads; one all-to-all gives it the whole sequence for heads/cp of
them, plain causal SDPA runs there (exact: the whole sequence is present), within the whole sequence's document mask
for a packed batch (models/document_mask.py), and a second all-to-all brings the output back to the rank's own part
for all heads. A Hub model (model.name=hf) runs the same exchange as a transformers attention function
(models/hf_context_parallel.py). Padded rows (chat, instruction) need nothing more: their padding comes after each
sample's tokens and its targets are -100, and the padded width is a multiple of cp (data/sft.py).

Why not torch's `context_parallel` (ring attention over DTensor): in torch 2.13 it runs on GPU kernels only. On CPU
SDPA stops with "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered", and under the math backend with "mixed torch.Tensor and DTensor" (platform-facts.md). The all-to-all
here is torch's own differentiable `all_to_all_single_autograd` (functional collectives), which gloo and NCCL both run,
so the same path rehearses CP on a laptop and runs it on GPUs.

The loss stays exact: each rank sums the loss over its own targets, the step divides by the count of valid targets of
the whole batch (step.py counts each cp group's batch once), and the gradients of a sequence's parts are added up
(the mesh engine multiplies the loss by cp, undoing FSDP2's average over the cp ranks).

It composes with tensor parallelism (the exchange runs within each tp rank's n_head/tp heads; sequence parallel cuts
the rank's T/cp further) and with pipeline stages (each stage's ranks hold T/cp): `refuse_compositions`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parallel_train.errors import UserError
from parallel_train.models import document_mask


def refuse_unsupported(cfg, world: int) -> None:
    """One-line errors for what context parallelism does not combine with (decided from the config alone: every rank
    raises alike, before any collective)."""
    p, m, cp = cfg.parallel, cfg.model, cfg.parallel.cp
    if cp == 1:
        return
    rules = [
        (bool(p.stage_devices), "parallel.stage_devices: a pipeline in one process"),
        (m.name not in ("gpt", "hf"), f"model.name={m.name}: models other than the template's GPT and Hub decoders (model.name=hf)"),
        (m.task != "causal-lm", f"model.task={m.task}: tasks other than causal-lm"),
        (getattr(m, "n_experts", 0) > 0, "model.n_experts: a mixture of experts (its balancing loss counts whole batches)"),
    ]
    for bad, what in rules:
        if bad:
            raise UserError(f"parallel.cp={cp} does not combine with {what}; set parallel.cp=1 or leave that out")
    if m.block_size % cp:
        raise UserError(f"parallel.cp={cp} does not divide model.block_size={m.block_size}: each rank holds block_size/cp tokens")
    if getattr(m, "n_head", 0) % cp:  # a Hub model's heads: checked on its config (models/hf_context_parallel.py)
        raise UserError(f"parallel.cp={cp} does not divide model.n_head={m.n_head}: attention gives each rank n_head/cp whole heads")
    if world % cp:
        raise UserError(f"parallel.cp={cp} does not divide the world size {world}; launch a multiple of {cp} processes")


def refuse_compositions(cfg, tp: int, pp: int) -> None:
    """The compositions with tensor parallelism and pipelines, once the mesh's tp is known (a launch config may give it):
    tensor parallelism gives each tp rank n_head/tp heads, and the Ulysses exchange splits those over the cp ranks;
    sequence parallel cuts each rank's block_size/cp tokens into tp shards between the blocks."""
    m, cp = cfg.model, cfg.parallel.cp
    if cp == 1 or (tp == 1 and pp == 1):
        return
    if m.name != "gpt":
        raise UserError(
            f"parallel.cp={cp} with parallel.tp={tp} / pipeline_stages={pp} is built for the template's GPT only "
            f"(model.name={m.name}); set parallel.tp=1 and parallel.pipeline_stages=1, or parallel.cp=1"
        )
    if m.n_head % (tp * cp):
        raise UserError(
            f"parallel.cp={cp} x parallel.tp={tp}: each tp rank holds model.n_head/tp={m.n_head}/{tp} heads and attention "
            f"splits them over the {cp} cp ranks; choose model.n_head a multiple of tp x cp = {tp * cp}, or a smaller tp or cp"
        )
    if m.block_size % (tp * cp):
        raise UserError(
            f"parallel.cp={cp} x parallel.tp={tp}: each rank's model.block_size/cp={m.block_size}/{cp} tokens are cut into {tp} "
            f"sequence-parallel shards; choose model.block_size a multiple of cp x tp = {tp * cp}"
        )


class ContextParallel:
    """This rank's place in its cp group, and the exchange attention runs through."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous part of dim 1 (the sequence) of a (B, T, ...) tensor."""
        part = t.size(1) // self.size
        return t[:, self.rank * part : (self.rank + 1) * part]

    def cut_batch(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """An (inputs, targets[, positions]) batch (refuse_unsupported leaves no other kind): this rank's part of the
        inputs and targets; a packed batch's positions whole (the model cuts them, and masks by all of them)."""
        if isinstance(batch, Mapping):
            raise UserError(
                f"parallel.cp={self.size}: the data gives dict batches ({', '.join(batch)}), which context parallelism does not "
                "cut; give (inputs, targets[, positions]) tuples or set parallel.cp=1"
            )
        return (self.cut(batch[0]), self.cut(batch[1]), *batch[2:])

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The whole sequence (dim 1) from every rank's part (evaluation's logits; no gradient). Loss parallel's logits
        (a DTensor cut by vocabulary over the tp ranks) stay cut so: each tp rank gathers its own slice over cp."""
        if hasattr(part, "to_local"):
            from torch.distributed.tensor import DTensor

            whole = self.gather(part.to_local())
            shape = torch.Size((part.shape[0], whole.size(1), *part.shape[2:]))  # the vocabulary's own size, even if tp cuts it unevenly
            return DTensor.from_local(
                whole, part.device_mesh, part.placements, run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride()
            )
        parts = [torch.empty_like(part) for _ in range(self.size)]
        torch.distributed.all_gather(parts, part.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def positions(self, local: int, device: torch.device, whole: torch.Tensor | None = None) -> torch.Tensor:
        """The positions of this rank's `local` tokens: their place in the whole sequence, or their part of a packed
        batch's `whole` (B, T) positions (each sample's own)."""
        if whole is not None:
            return self.cut(whole)
        return torch.arange(self.rank * local, (self.rank + 1) * local, device=device)

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Chunk i of dim 0 goes to rank i; chunk j of the result came from rank j. Differentiable."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, self.group))

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, T/cp, D) all heads of this rank's part -> (B, H/cp, T, D) the whole sequence of its heads."""
        return heads_to_sequence(t, self.size, self._all_to_all)

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of to_sequence: (B, H/cp, T, D) -> (B, H, T/cp, D)."""
        return sequence_to_heads(t, self.size, self._all_to_all)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, dropout_p: float = 0.0) -> torch.Tensor:
        """Causal attention of (B, heads, T/cp, head_dim) parts of the whole sequence, within `mask`'s documents (the
        whole sequence's: document_mask.for_positions; None: unpacked); returns this rank's part."""
        q, k, v = (self.to_sequence(t) for t in (q, k, v))
        return self.to_heads(document_mask.attend(q, k, v, mask, dropout_p=dropout_p))


def on_mesh(mesh, layout, rank: int, modules) -> ContextParallel | None:
    """parallel.cp > 1: this rank's place in its cp group (the mesh's "cp" axis), handed to each module (the model, or a
    pipeline rank's stages) to take its part of every sequence: positions from that part's place, attention through the
    exchange. None at cp=1."""
    if layout.cp == 1:
        return None
    cp = ContextParallel(mesh["cp"].get_group(), layout.coordinate(rank)["cp"], layout.cp)
    for module in modules:
        module.use_context_parallel(cp)
    return cp


def heads_to_sequence(t: torch.Tensor, n: int, exchange) -> torch.Tensor:
    """(B, H, T/n, D) all heads of this rank's part -> (B, H/n, T, D) the whole sequence of this rank's heads."""
    B, H, L, D = t.shape
    chunks = t.reshape(B, n, H // n, L, D).permute(1, 0, 2, 3, 4)  # chunk i: heads group i, for rank i
    got = exchange(chunks)  # chunk j: this rank's heads, sequence part j
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * L, D)


def sequence_to_heads(t: torch.Tensor, n: int, exchange) -> torch.Tensor:
    """The inverse of heads_to_sequence: (B, H/n, T, D) -> (B, H, T/n, D)."""
    B, h, T, D = t.shape
    chunks = t.reshape(B, h, n, T // n, D).permute(2, 0, 1, 3, 4)  # chunk i: sequence part i, for rank i
    got = exchange(chunks)  # chunk j: heads group j, this rank's sequence part
    return got.permute(1, 0, 2, 3, 4).reshape(B, n * h, T // n, D)
