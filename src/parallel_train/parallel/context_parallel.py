"""Context parallelism (`parallel.cp`): every sequence cut into cp parts, one per rank, from the embedding to the loss.

The cp ranks of one group read the same batch (they are one data-parallel rank: parallel/mesh.py) and each keeps its
own contiguous T/cp of every row, inputs and targets alike: rank r holds positions [r*T/cp, (r+1)*T/cp) and the
GPT's position embedding takes exactly those. Everything but attention works token by token, so only attention
talks: the Ulysses exchange (DeepSpeed-Ulysses). Before it each rank holds its part of the sequence for all heads;
one all-to-all gives it the whole sequence for heads/cp of them, plain causal SDPA runs there (exact: the whole
sequence is present), and a second all-to-all brings the output back to the rank's own part for all heads.

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

import torch
import torch.nn.functional as F

from parallel_train.errors import UserError


def refuse_unsupported(cfg, world: int) -> None:
    """One-line errors for what context parallelism does not combine with (decided from the config alone: every rank
    raises alike, before any collective)."""
    p, m, cp = cfg.parallel, cfg.model, cfg.parallel.cp
    if cp == 1:
        return
    rules = [
        (bool(p.stage_devices), "parallel.stage_devices: a pipeline in one process"),
        (m.name != "gpt", f"model.name={m.name}: models other than the template's GPT"),
        (m.task != "causal-lm", f"model.task={m.task}: tasks other than causal-lm"),
        (getattr(m, "n_experts", 0) > 0, "model.n_experts: a mixture of experts (its balancing loss counts whole batches)"),
        (cfg.data.format != "text" or cfg.data.packing, "data.format chat/instruction and data.packing: padded or packed rows"),
    ]
    for bad, what in rules:
        if bad:
            raise UserError(f"parallel.cp={cp} does not combine with {what}; set parallel.cp=1 or leave that out")
    if m.block_size % cp:
        raise UserError(f"parallel.cp={cp} does not divide model.block_size={m.block_size}: each rank holds block_size/cp tokens")
    if m.n_head % cp:
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
        """A (inputs, targets) text batch: this rank's part of both (refuse_unsupported leaves no other kind)."""
        return tuple(self.cut(t) for t in batch)

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

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        """The positions this rank's `local` tokens hold in the whole sequence."""
        return torch.arange(self.rank * local, (self.rank + 1) * local, device=device)

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Chunk i of dim 0 goes to rank i; chunk j of the result came from rank j. Differentiable."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, self.group))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        """Causal attention of (B, heads, T/cp, head_dim) parts of the whole sequence; returns this rank's part."""
        q, k, v = (heads_to_sequence(t, self.size, self._all_to_all) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return sequence_to_heads(y, self.size, self._all_to_all)


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
