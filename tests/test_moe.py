"""The GPT's mixture of experts (models/moe.py) and the router's balancing loss over the data-parallel batch
(parallel/router_balance.py): routing and grouped compute against a naive per-token loop, the loss on a hand example,
and one process against DDP and FSDP2 with the loss on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY, check, launch_env, read_metrics, run, warm_cmd
from parallel_train.config.load import load_config
from parallel_train.errors import UserError
from parallel_train.models.gpt import GPT, GPTConfig
from parallel_train.models.moe import MoE
from parallel_train.parallel.router_balance import RouterBalance

MOE = ("model.n_experts=4", "model.experts_per_token=2", "model.moe_aux_loss_coef=0.1")


def moe(bias: bool = True) -> MoE:
    torch.manual_seed(0)
    m = MoE(8, 12, n_experts=4, top_k=2, bias=bias, dropout=0.0)
    m.init_weights(0.3, 0.3)
    if bias:
        torch.nn.init.normal_(m.fc_bias), torch.nn.init.normal_(m.proj_bias)
    return m


def naive(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: softmax over all experts, its top k, their weights renormalised, the weighted sum of
    those experts' MLPs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.softmax(m.router(x[t]).float(), dim=-1)
        weights, experts = torch.topk(probs, m.top_k)
        for w, e in zip(weights / weights.sum(), experts.tolist(), strict=True):
            out[t] += w * expert(m, e, x[t])
    return out


def expert(m: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ m.fc[e] + (0 if m.fc_bias is None else m.fc_bias[e]))
    return h @ m.proj[e] + (0 if m.proj_bias is None else m.proj_bias[e])


@pytest.mark.parametrize("bias", [True, False])
def test_routing_and_grouped_compute_equal_a_per_token_loop(bias):
    m = moe(bias)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(m(x), naive(m, x.reshape(10, 8)).reshape(2, 5, 8), rtol=1e-5, atol=1e-6)
    counts, sums = m.last
    _, experts = torch.topk(F.softmax(m.router(x.reshape(10, 8)), -1), 2)
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=4).tolist() and counts.sum() == 20
    torch.testing.assert_close(sums, F.softmax(m.router(x.reshape(10, 8)), -1).sum(0))


def test_grouped_compute_equals_each_row_through_its_expert():
    """Groups of every size, an empty one among them: each sorted row goes through its own expert only."""
    m = moe()
    rows, counts = torch.randn(7, 8), torch.tensor([3, 0, 1, 3])
    owner = [0, 0, 0, 2, 3, 3, 3]
    torch.testing.assert_close(m.compute(rows, counts), torch.stack([expert(m, e, r) for e, r in zip(owner, rows, strict=True)]))


def stats(counts: list[int], sums: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(counts), torch.tensor(sums, requires_grad=True)


def test_balancing_loss_of_a_hand_example():
    """N=2, k=1, 4 tokens: counts (3, 1), probability sums (2.4, 1.6): f = (.75, .25), P = (.6, .4), loss
    2 * (.75 * .6 + .25 * .4) = 1.1; a second layer perfectly even: 1.0. The term is coef x the mean over layers."""
    layers = [MoE(4, 4, 2, 1, False, 0.0), MoE(4, 4, 2, 1, False, 0.0)]
    balance = RouterBalance(layers, coef=0.5, dp_size=1, device=torch.device("cpu"))
    layers[0].last, layers[1].last = stats([3, 1], [2.4, 1.6]), stats([2, 2], [2.0, 2.0])
    term = balance.term(micro_batches=2)  # averaged over the step's 2 micro-batches
    assert math.isclose(term.item(), 0.5 * (1.1 + 1.0) / 2 / 2, rel_tol=1e-6)
    assert layers[0].last is None  # consumed
    layers[0].last, layers[1].last = stats([4, 0], [3.0, 1.0]), stats([2, 2], [2.0, 2.0])
    balance.term(micro_batches=2)
    report = balance.report()
    assert math.isclose(report["aux_loss"], ((1.1 + 1.0) / 2 + (2 * 0.75 + 1.0) / 2) / 2, rel_tol=1e-6)
    assert report["expert_load"] == [7 / 4, 1.0]  # max / mean of the counts (7, 1) and (4, 4) since the last report
    assert balance.report() == {}  # nothing since


def test_the_balancing_loss_reaches_the_router_and_coef_0_turns_it_off():
    layers = [moe()]
    layers[0](torch.randn(6, 8))
    RouterBalance(layers, coef=0.01, dp_size=1, device=torch.device("cpu")).term(1).backward()
    assert layers[0].router.weight.grad.abs().sum() > 0 and layers[0].fc.grad is None
    layers[0](torch.randn(6, 8))
    assert RouterBalance(layers, coef=0.0, dp_size=1, device=torch.device("cpu")).term(1) is None


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_keeps_the_balancing_losss_gradient(ac):
    """The block's forward runs again in backward (its routing statistics with it): the gradients stay those of one
    forward."""
    grads = []
    for mode in ("none", ac):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, n_experts=4, activation_checkpointing=mode), vocab_size=11)
        balance = RouterBalance([m for m in model.modules() if isinstance(m, MoE)], 0.5, 1, torch.device("cpu"))
        loss = model(torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))).square().mean()
        (loss + balance.term(1)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_gpt_with_experts_builds_counts_active_flops_and_refuses_bad_keys():
    dense = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8), vocab_size=11)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, n_experts=4, experts_per_token=1)
    sparse = GPT(cfg, vocab_size=11)
    assert isinstance(sparse.blocks["0"].mlp, MoE) and sparse(torch.randint(0, 11, (2, 8))).shape == (2, 8, 11)
    router = sum(b.mlp.router.weight.numel() for b in sparse.blocks.values())
    assert sparse.flops_per_token() == dense.flops_per_token() + 6 * router  # one expert of the dense MLP's size per token
    with pytest.raises(UserError, match="model.experts_per_token"):
        load_config(["model.n_experts=2", "model.experts_per_token=3"])
    with pytest.raises(UserError, match="the in-process pipeline does not carry the router's balancing loss"):
        load_config(["model.n_experts=2", "parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]"])


# Global batch 8: 4 x 2 micro-batches on one process, 2 x 2 on each of two ranks.
RUN = (*TINY, *MOE, "train.gradient_accumulation_steps=2", "train.optimizer=sgd", "train.learning_rate=1.0", "eval.interval=0")


# A tiny Qwen3-MoE from its config (random weights), its coefficient its own router_aux_loss_coef (raised to matter).
HUB = ("model.name=hf", "model.hf_path={hub}", "model.hf_pretrained=false", "data.tokenizer=byte", "model.moe_aux_loss_coef=-1")
LAUNCHES = {
    "ref": (1, ()),
    "ddp": (2, ("train.batch_size=2",)),
    "fsdp2": (2, ("train.batch_size=2", "parallel.dp_shard=2")),
    "hub_ref": (1, HUB),
    "hub_fsdp2": (2, (*HUB, "train.batch_size=2", "parallel.dp_shard=2")),
    # one process continues the FSDP2 run's step-3 checkpoint (the experts' stacked weights saved as 2 shards)
    "resumed": (1, ("resume={fsdp2}/checkpoints/step_0000003",)),
}


def save_tiny_qwen3_moe(folder) -> str:
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, max_position_embeddings=64,
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """name -> its metrics, each launch run once per module."""
    done: dict[str, list[dict]] = {}
    outs: dict[str, object] = {}

    def get(name: str) -> list[dict]:
        if name not in done:
            n, extra = LAUNCHES[name]
            out = tmp_path_factory.mktemp(name)
            if any("{fsdp2}" in k for k in extra):
                get("fsdp2")
            keys = [
                k.format(hub=save_tiny_qwen3_moe(out / "qwen3_moe")) if "{hub}" in k else k.format(fsdp2=outs.get("fsdp2"))
                for k in (*RUN, *extra)
            ]
            check(run(warm_cmd(n, *keys, f"output_dir={out / 'out'}"), env=launch_env(out)))
            outs[name] = out / "out"
            done[name] = [r for r in read_metrics(out / "out") if r["kind"] == "train"]
        return done[name]

    return get


def assert_same(got: list[dict], ref: list[dict]) -> None:
    """The loss, the aux loss and the expert load of every step, within 1e-5."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4, 5, 6]
    for g, r in zip(got, ref, strict=True):
        assert math.isclose(g["loss"], r["loss"], rel_tol=1e-5), (g, r)
        assert math.isclose(g["aux_loss"], r["aux_loss"], rel_tol=1e-5), (g, r)
        assert g["expert_load"] == pytest.approx(r["expert_load"], rel=1e-5)


@pytest.mark.multiprocess
def test_moe_with_the_balancing_loss_under_ddp_equals_one_process(launched):
    """The balancing loss counts the experts' tokens over both ranks: loss, aux loss and load agree step by step."""
    ref = launched("ref")
    assert all(0.9 < r["aux_loss"] < 4 and len(r["expert_load"]) == 2 for r in ref)
    assert ref[-1]["loss"] != ref[0]["loss"]  # it trained
    assert_same(launched("ddp"), ref)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_moe_with_the_balancing_loss_under_fsdp2_equals_one_process(launched):
    assert_same(launched("fsdp2"), launched("ref"))
    resumed = launched("resumed")  # its log holds steps 4-6 (a resume keeps the earlier records of its own folder only)
    assert_same([r for r in launched("ref") if r["step"] <= 3] + resumed, launched("ref"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_transformers_moe_with_the_balancing_loss_under_fsdp2_equals_one_process(launched):
    ref = launched("hub_ref")
    assert ref[-1]["loss"] != ref[0]["loss"] and all(len(r["expert_load"]) == 2 for r in ref)
    assert_same(launched("hub_fsdp2"), ref)


def test_a_transformers_moe_gets_the_same_loss_from_its_routers():
    """A tiny Qwen3-MoE (one layer: transformers' loss concatenates the layers' logits, ours averages per layer): the
    routers' hooks give transformers' own load_balancing_loss_func over the forward, whose f_i sum to k (ours to 1),
    and the coefficient defaults to its router_aux_loss_coef."""
    from types import SimpleNamespace

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from parallel_train.parallel.router_balance import router_balance

    config = Qwen3MoeConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(config)
    cfg = SimpleNamespace(model=SimpleNamespace(moe_aux_loss_coef=-1.0))
    balance = router_balance(SimpleNamespace(hf=hf, modules=lambda: iter(())), cfg, 1, torch.device("cpu"))
    assert balance.coef == 0.02 and len(balance.layers) == 1
    out = hf(torch.randint(0, 50, (2, 7)))
    term = balance.term(micro_batches=1)
    torch.testing.assert_close(term / 0.02, out.aux_loss / 2, rtol=1e-5, atol=0)
    cfg.model.moe_aux_loss_coef = 0.0
    off = router_balance(SimpleNamespace(hf=hf, modules=lambda: iter(())), cfg, 1, torch.device("cpu"))
    hf(torch.randint(0, 50, (2, 7)))
    assert off.term(1) is None and off.report()["aux_loss"] > 0.9


def test_the_tracker_gets_each_layers_expert_load(tmp_path):
    """metrics.jsonl keeps the list; a tracker (scalars only) gets train/expert_load/0, /1, ..."""
    from types import SimpleNamespace

    from parallel_train.observe.tracking import MetricsLog

    logged = []
    accelerator = SimpleNamespace(is_main_process=True, log=lambda values, step: logged.append((values, step)))
    MetricsLog(tmp_path / "metrics.jsonl", accelerator, "tensorboard").log(
        {"kind": "train", "step": 5, "loss": 2.0, "aux_loss": 1.1, "expert_load": [1.5, 2.25]}
    )
    assert logged == [({"train/loss": 2.0, "train/aux_loss": 1.1, "train/expert_load/0": 1.5, "train/expert_load/1": 2.25}, 5)]
    assert read_metrics(tmp_path)[0]["expert_load"] == [1.5, 2.25]


def test_the_engines_backpropagate_the_balancing_term_after_each_forward_but_log_the_loss_alone():
    """parallel/engine.py `accumulate`: `extra()` runs after each micro-batch's forward; its term joins what goes
    backward (in the loss sum's units: RouterBalance.extra divides by the engine's scale), not the returned loss."""
    from contextlib import nullcontext

    from parallel_train.parallel.engine import accumulate

    m = moe()
    balance = RouterBalance([m], coef=0.5, dp_size=1, device=torch.device("cpu"))
    scale = torch.tensor(4.0)
    backward, micro = [], [(torch.randn(3, 8), torch.zeros(3)), (torch.randn(2, 8), torch.zeros(2))]
    total = accumulate(
        micro, lambda x: m(x), lambda y_hat, y: y_hat.sum(), backward.append, lambda last: nullcontext(), torch.device("cpu"),
        extra=balance.extra(len(micro), scale),
    )  # fmt: skip
    sums = [m_out.sum() for m_out in (m(x) for x, _ in micro)]  # the same forward again: the loss alone
    torch.testing.assert_close(total, sum(sums).detach())
    for sent, s in zip(backward, sums, strict=True):
        term = (sent - s) * scale  # what the term adds after the engine's scale: coef x loss (1 to N) / micro-batches
        assert 0.5 * 1 / 2 <= term.item() < 0.5 * 4 / 2


def test_the_memory_estimator_runs_the_experts_on_fake_tensors():
    """parallel/activation_memory.py measures a forward on fake tensors (shapes, no values): the groups are taken even."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        m = MoE(8, 12, n_experts=4, top_k=2, bias=True, dropout=0.0)
        y = m(torch.randn(2, 5, 8))
    assert y.shape == (2, 5, 8)
