"""A small, clean GPT (decoder-only transformer) for character- or byte-level language modelling.

Layout (the names matter: the pipeline splitter cuts the model by these module names, and
checkpoints use them as parameter names whatever the topology):

    tok_emb, pos_emb      token and position embeddings (no pos_emb in the llama flavor: rotary positions)
    blocks.0 .. blocks.N  transformer blocks (a ModuleDict, so names survive when a stage keeps a few)
    ln_f, head            final norm and the output projection to the vocabulary (model.tie_embeddings=true:
                          its weight is tok_emb's, one weight on every layout: models/ties.py)

Two flavors (`model.flavor`): gpt2 (learned positions, LayerNorm, a GELU MLP, biases as model.bias says) and llama
(rotary positions of `model.rope_theta`, models/rotary.py; RMSNorm; a SwiGLU MLP, `gate` beside `fc` (up) and `proj`
(down); no biases), which is transformers' Llama, or Mixtral with model.n_experts, and exports to them
(models/gpt_export.py). Both keep the same module names, so every layout cuts them alike.

`forward` tolerates missing parts (set to None by a pipeline stage): a stage without the embeddings
takes the previous stage's activations as input, a stage without the head returns activations.

Tensor parallelism (`parallel.tp`): `tensor_parallel_plan` says how torch's `parallelize_module` cuts each
part (attention by heads, the MLP by columns (SwiGLU: gate and fc alike), sequence parallel on the norms). Attention has separate q, k, v
projections so that a column cut gives each rank whole heads of all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parallel_train.core.fields import check, opt
from parallel_train.core.model_config import ModelConfig
from parallel_train.errors import UserError
from parallel_train.models import document_mask, rotary
from parallel_train.models.activation_checkpoint import Checkpointing, check_option, mode_field, option_field
from parallel_train.models.moe import MoE

RMS_EPS = 1e-5  # the llama flavor's RMSNorm epsilon (written to the export's rms_norm_eps)


@dataclass
class GPTConfig(ModelConfig):
    """The GPT's own keys (model.<key>=value), beside the keys every model has."""

    n_layer: int = opt(4, "transformer blocks", min=1)
    n_head: int = opt(4, "attention heads per block", min=1)
    n_embd: int = opt(128, "embedding width (divisible by n_head)", min=1)
    dropout: float = opt(0.0, "dropout probability", min=0.0, below=1.0)
    bias: bool = opt(True, "bias in Linear and LayerNorm layers (model.flavor=gpt2; the llama flavor has none)")
    flavor: str = opt(
        "gpt2",
        "gpt2: learned positions, LayerNorm, GELU MLP; llama: rotary positions, RMSNorm, SwiGLU MLP, no biases "
        "(exports to transformers' Llama, or Mixtral with model.n_experts: scripts/export.py --format hf)",
        choices=("gpt2", "llama"),
    )
    rope_theta: float = opt(10000.0, "model.flavor=llama: the rotary positions' base (transformers' rope_theta)", above=0.0)
    activation_checkpointing: str = mode_field()  # none | full | selective (models/activation_checkpoint.py)
    selective_ac: str = option_field()
    tie_embeddings: bool = opt(False, "the output layer uses the token embedding's weight (GPT-2 ties them): fewer parameters")
    n_experts: int = opt(0, "0: a dense MLP in each block; N: a mixture of N expert MLPs, routed per token (models/moe.py)", min=0)
    experts_per_token: int = opt(2, "model.n_experts > 0: the experts each token is routed to (top k)", min=1)
    moe_aux_loss_coef: float = opt(0.01, "model.n_experts > 0: weight of the router's balancing loss (0: off)", min=0.0)

    def check(self) -> None:
        check(self.n_embd % self.n_head == 0, f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        check_option(self.selective_ac)
        check(
            not self.n_experts or self.experts_per_token <= self.n_experts,
            f"model.experts_per_token ({self.experts_per_token}) must not exceed model.n_experts ({self.n_experts})",
        )

    def biased(self) -> bool:
        """Whether the Linear and norm layers have biases: model.bias in the gpt2 flavor, never in the llama flavor."""
        return self.bias and self.flavor == "gpt2"


def norm(cfg: GPTConfig) -> nn.Module:
    """The flavor's norm: LayerNorm (gpt2) or RMSNorm (llama; transformers' Llama and Mixtral eps, 1e-5 in the export)."""
    return nn.LayerNorm(cfg.n_embd, bias=cfg.biased()) if cfg.flavor == "gpt2" else nn.RMSNorm(cfg.n_embd, eps=RMS_EPS)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        # Separate projections (not one fused qkv): a column cut for tensor parallelism then gives each rank
        # whole heads of q, k and v.
        bias = cfg.biased()
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.rope_theta = cfg.rope_theta if cfg.flavor == "llama" else None  # rotary positions (llama flavor)
        self.context_parallel = None  # parallel.cp > 1: the exchange that gives attention the whole sequence (GPT.use_context_parallel)

    def forward(self, x: torch.Tensor, mask=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: packed documents kept apart (document_mask.py); None: plain causal attention. `positions`: a packed
        batch's positions (the llama flavor's rotary angles), else 0..T-1 of the sequence this attention sees whole
        (tensor parallelism gathers it), or this rank's part of it under context parallelism."""
        B, T, _ = x.shape
        # (B, T, heads x head_dim) -> (B, heads, T, head_dim); under tensor parallelism this rank's heads only
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if self.rope_theta is not None:
            cp = self.context_parallel  # under cp: this rank's part of the positions (a packed batch's are whole here)
            if cp is not None:
                positions = cp.positions(T, x.device, positions)
            elif positions is None:
                positions = torch.arange(T, device=x.device)
            cos, sin = rotary.angles(positions, self.head_dim, self.rope_theta, q.dtype)
            q, k = rotary.rotate(q, cos, sin), rotary.rotate(k, cos, sin)
        # Fused attention: flash / memory-efficient kernels on GPU, a fused kernel on CPU.
        dropout_p = self.dropout if self.training else 0.0
        if self.context_parallel is not None:  # x is this rank's part of the sequence (parallel/context_parallel.py)
            y = self.context_parallel.attend(q, k, v, mask, dropout_p=dropout_p)
        else:
            y = document_mask.attend(q, k, v, mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """gpt2: proj(gelu(fc(x))); llama: SwiGLU, proj(silu(gate(x)) * fc(x)) (Llama's gate, up and down projections).
    Hidden width 4 x n_embd in both."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        bias = cfg.biased()
        self.gate = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False) if cfg.flavor == "llama" else None
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x)) if self.gate is None else F.silu(self.gate(x)) * self.fc(x)
        return self.drop(self.proj(h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg)
        if cfg.n_experts:  # a routed mixture of MLPs of the dense one's shape
            gated = cfg.flavor == "llama"
            self.mlp = MoE(cfg.n_embd, 4 * cfg.n_embd, cfg.n_experts, cfg.experts_per_token, cfg.biased(), cfg.dropout, gated)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        # The mask (and a packed batch's positions) only when there is one: tensor parallelism prepares exactly one
        # input of attn.
        x = x + (self.attn(self.ln_1(x)) if mask is None else self.attn(self.ln_1(x), mask, positions))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    Config = GPTConfig  # its keys: what model.name=gpt accepts
    # forward uses these together: the pipeline splitter keeps them in one stage.
    pipeline_groups = (("tok_emb", "pos_emb", "drop"),)
    _no_split_modules = ["Block"]  # FSDP's unit (accelerate reads this name, as for transformers models)

    def __init__(self, cfg: GPTConfig, vocab_size: int):
        super().__init__()
        self.block_size, self.n_head, self.dropout_p = cfg.block_size, cfg.n_head, cfg.dropout
        self.activation_checkpointing = Checkpointing(cfg.activation_checkpointing, cfg.selective_ac)
        self.n_embd, self.flavor = cfg.n_embd, cfg.flavor
        self.tok_emb = nn.Embedding(vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.flavor == "gpt2" else None  # llama: rotary
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = norm(cfg)
        self.head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        if cfg.tie_embeddings:  # one weight, two names; every layout keeps it one weight (models/ties.py)
            self.head.weight = self.tok_emb.weight

        self.n_layer = cfg.n_layer
        self.context_parallel = None  # parallel.cp > 1: which part of each sequence this rank holds (use_context_parallel)
        # Every module initialised by init_weights, drawing from torch's generator: built whole (tests, scripts),
        # this is the model's start; the trainer builds it on the meta device instead and parallel/model_init.py calls
        # init_weights one module at a time, under a seed keyed by the module's name.
        for name, module in self.named_modules():
            self.init_weights(name, module)

    def init_weights(self, name: str, module: nn.Module) -> None:
        """GPT-2's initialisation of one module's own parameters: normal(0, 0.02) for Linear and Embedding weights,
        residual projections (`attn.proj`, `mlp.proj`) scaled down by depth, zero biases, norms at 1 (and 0)."""
        proj_std = 0.02 / math.sqrt(2 * self.n_layer)
        if isinstance(module, MoE):  # the experts' stacked weights (the router is a Linear of its own)
            module.init_weights(0.02, proj_std)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            std = proj_std if name.endswith("proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            module.reset_parameters()

    def use_context_parallel(self, cp) -> None:
        """parallel.cp > 1: the inputs are this rank's part of each sequence (parallel/context_parallel.py's
        ContextParallel): positions from that part's place, attention through its exchange."""
        self.context_parallel = cp
        for module in self.modules():
            if isinstance(module, CausalSelfAttention):
                module.context_parallel = cp

    def get_output_embeddings(self) -> nn.Module | None:
        """The layer that makes the logits (transformers' name for it): tensor parallelism keeps its output cut by
        vocabulary for the loss (loss parallel, parallel/sharding.py)."""
        return self.head

    def tensor_parallel_plan(self, tp: int) -> dict:
        """How `parallel.tp` ranks cut this model: {module name: torch ParallelStyle}, for `parallelize_module`.

        Megatron-style: q, k, v and the MLP's first layer by columns (each rank whole heads / a slice of the
        hidden units), the attention and MLP output projections by rows (one all-reduce each, done as a
        reduce-scatter: sequence parallel); between them the residual stream, the LayerNorms and dropout work on
        1/tp of the sequence each. The embeddings are cut by rows of the vocabulary / positions, the output layer
        by columns (the vocabulary), the logits gathered whole; the mesh engine keeps them cut by vocabulary instead and
        computes the loss on the shards (loss parallel, parallel/sharding.py). A mixture of experts runs whole on every
        tensor-parallel rank (`moe_plan`).
        Parts a pipeline stage does not hold are skipped by the caller.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

        if self.n_head % tp:
            raise UserError(
                f"parallel.tp={tp} does not divide model.n_head={self.n_head}: each rank holds whole heads; "
                f"choose a tp that divides {self.n_head}"
            )
        plan = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        if self.flavor == "gpt2":  # learned positions; the llama flavor's rotary ones have no weights
            plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        for name in self.blocks:
            b = f"blocks.{name}."
            dense = {b + "mlp.fc": ColwiseParallel(input_layouts=Shard(1)), b + "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}
            plan.update(
                {
                    b + "ln_1": SequenceParallel(),
                    b + "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    b + "attn.q": ColwiseParallel(),
                    b + "attn.k": ColwiseParallel(),
                    b + "attn.v": ColwiseParallel(),
                    b + "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                    b + "ln_2": SequenceParallel(),
                }
            )
            if self.flavor == "llama":  # SwiGLU: the gate cut as fc (up), so each rank multiplies its own hidden units
                dense[b + "mlp.gate"] = ColwiseParallel(input_layouts=Shard(1))
            plan.update(moe_plan(b + "mlp") if isinstance(getattr(self.blocks[name], "mlp", None), MoE) else dense)
        return plan

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab). A pipeline stage may lack some parts. `positions` (B, T): a
        packed batch's positions within each sample (data/batch.py); each sample then attends only to itself."""
        if self.tok_emb is not None:
            # the ids' length (tensor parallelism returns the embedding cut by sequence)
            pos = torch.arange(x.size(1), device=x.device) if positions is None else positions
            if self.context_parallel is not None:  # this rank's part of the sequence: its place in the whole (or its
                pos = self.context_parallel.positions(x.size(1), x.device, positions)  # part of a packed batch's)
            # gpt2 flavor: learned positions (llama: rotary, in each attention)
            x = self.drop(self.tok_emb(x) if self.pos_emb is None else self.tok_emb(x) + self.pos_emb(pos))
        # Once per forward (every stage of a pipeline builds its own); flex attention has no dropout. Under context
        # parallelism `positions` are the whole sequence's, as attention sees it after its exchange.
        mask = document_mask.for_positions(positions, flex=False if self.training and self.dropout_p else None)
        for name, block in self.blocks.items():
            # model.activation_checkpointing: keep less for backward and rerun the block's forward there (same dropout
            # masks: the RNG state is saved). Blocks are counted by their name: a pipeline stage's blocks.5 is layer 5.
            x = self.activation_checkpointing.run(int(name), block, *((x,) if mask is None else (x, mask, positions)))
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per parameter plus attention (PaLM appendix B, as in nanoGPT). A mixture of
        experts counts the experts a token uses: experts_per_token of n_experts."""
        n_params = sum(p.numel() for p in self.parameters()) - (self.pos_emb.weight.numel() if self.pos_emb is not None else 0)
        for m in self.modules():
            if isinstance(m, MoE):
                experts = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("router"))
                n_params -= experts * (m.n_experts - m.top_k) // m.n_experts
        return 6 * n_params + 12 * len(self.blocks) * self.n_embd * self.block_size


def moe_plan(name: str) -> dict:
    """A MoE layer under tensor parallelism: its input gathered whole from the sequence shards, the router and the experts
    run on every tensor-parallel rank alike (replicated, or split by expert parallelism over the dp_shard ranks), and its
    output cut back to this rank's shard of the sequence. Its gradients are then the same on every tensor-parallel rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    style = PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
    )
    return {name: style}
