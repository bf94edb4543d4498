"""configs/moe_finetune.yaml, a Hub MoE (Qwen3-MoE) fine-tuned with LoRA on attention (and, with model.lora_experts,
on the routed experts: peft's target_parameters on the fused experts), run as written with only its paths and sizes
overridden, on a tiny Qwen3-MoE with a chat tokenizer (tests/hf_tiny.py) and short conversations.

In process: the meta-device start with the experts' adapters gives from_pretrained's logits (the wrapped experts'
weights are read under their files' names); a few steps train the adapters only, the experts' too; the export's hf/
(merged) and adapter/ (peft) reload with the trained model's logits; the refusals. Launched (-m slow): FSDP2 on 2
processes with the experts' adapters (parallel.ep=1), whose hf/ differs from the base in the adapted weights only,
equal to 1 process; the recipe as written (LoRA on attention) under parallel.ep=2 equal to 1 process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_tiny
from helpers import check, launch_env, run, train_losses, warm_cmd
from parallel_train.errors import UserError
from parallel_train.models.hf import HFConfig, HFModel
from parallel_train.parallel.model_init import start_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

T = 64
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
WORDS = "the king is dead long live the queen of rome and all her men".split()


def chats(n: int, seed: int) -> list[dict]:
    """Short conversations (a turn of a few words), so a sample fits model.block_size=64 whole."""
    import random

    rng = random.Random(seed)
    say = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))  # noqa: E731
    return [{"messages": [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]} for _ in range(n)]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_recipe")
    model = hf_tiny.save_model(hf_tiny.qwen3_moe_config(), root / "qwen3_moe", hf_tiny.chat_tokenizer())
    for split, n, seed in (("train", 64, 0), ("validation", 8, 1)):
        (root / "chats").mkdir(exist_ok=True)
        (root / "chats" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(n, seed)))
    return {"model": model, "data": root / "chats", "root": root}


def lora(folder: Path, **keys) -> HFConfig:
    settings = dict(lora_rank=4, lora_targets=ATTENTION, lora_experts=True)
    return HFConfig(name="hf", hf_path=str(folder), block_size=T, **{**settings, **keys})


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, hf_tiny.VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


def test_lora_on_attention_and_experts_starts_as_the_base_trains_only_adapters_and_exports_what_it_trained(made, tmp_path):
    """Meta-device start: the experts' wrapped weights (experts.base_layer.base_layer.gate_up_proj) are read from the
    per-expert files, so the logits are from_pretrained's. Three AdamW steps change the adapters only, the experts'
    among them; a model started again and given the adapters (a resume), hf/ (merged) and adapter/ (peft) give the
    trained model's logits."""
    from parallel_train.data.tokenizers import ByteVocab

    base = transformers.AutoModelForCausalLM.from_pretrained(made["model"])
    x = tokens()
    model, init = start_model(HFModel, lora(made["model"]), hf_tiny.VOCAB, seed=0)
    init.fill(model, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(model(x), base(x).logits, rtol=0, atol=1e-5)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert {n.split(".")[-4] for n in trained} == {*ATTENTION, "experts", "base_layer"}, trained
    assert "model.layers.0.mlp.experts.base_layer.lora_A.default.weight" in trained  # the second wrapper's (gate_up_proj)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trained)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert set(state) == set(trained)  # checkpoints hold the adapters only
    again, init = start_model(HFModel, lora(made["model"]), hf_tiny.VOCAB, seed=0)
    init.fill(again, torch.device("cpu"))
    again.load_state_dict(state)  # a resume: the base from the files, the adapters from the checkpoint
    HFModel.export(lora(made["model"]), state, tmp_path / "hf", ByteVocab())
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(again(x), want, rtol=0, atol=0)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(x).logits
        torch.testing.assert_close(merged, want, rtol=0, atol=1e-5)
        assert (merged - base(x).logits).abs().max() > 1e-3  # it trained
        peft = pytest.importorskip("peft")
        fresh = transformers.AutoModelForCausalLM.from_pretrained(made["model"])
        adapted = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")(x).logits
        torch.testing.assert_close(adapted, want, rtol=0, atol=1e-5)


def test_lora_experts_is_refused_where_peft_cannot_adapt_the_experts(made, tmp_path):
    """A dense model has no fused experts; peft's parameter LoRA has no dropout: each one line naming the key."""
    dense = hf_tiny.save_model(hf_tiny.llama_config(), tmp_path / "llama")
    with pytest.raises(UserError, match="model.lora_experts: .* has no fused expert weights"):
        HFModel(lora(dense, lora_targets=[]), hf_tiny.VOCAB)
    with pytest.raises(UserError, match="model.lora_dropout=0.1: .* set model.lora_dropout=0"):
        HFModel(lora(made["model"], lora_dropout=0.1), hf_tiny.VOCAB)


def test_lora_experts_without_a_rank_is_refused():
    from parallel_train.config.load import load_config

    with pytest.raises(UserError, match="model.lora_experts.*model.lora_rank=0"):
        load_config(["model.name=hf", "model.hf_path=Qwen/Qwen3-30B-A3B", "model.lora_experts=true"])


# ---------------------------------------------------------------- the recipe as written, tiny, launched


def recipe(made, out: Path, *layout: str) -> tuple[str, ...]:
    """configs/moe_finetune.yaml with its paths and sizes overridden (and the precision: fp32 on CPU), nothing else."""
    return (
        "--config", "configs/moe_finetune.yaml", f"model.hf_path={made['model']}", f"data.path={made['data']}",
        f"model.block_size={T}", "train.mixed_precision=no", "train.max_steps=3", "train.warmup_steps=1",
        "train.lr_decay_steps=3", "train.learning_rate=1e-2", "train.log_interval=1", "eval.interval=3", "eval.iters=1",
        "checkpoint.interval=3", f"output_dir={out}", *layout,
    )  # fmt: skip


LAYOUTS = {  # the same global batch of 4 on each
    # model.lora_experts=true: the experts' adapters, with FSDP2 sharding the experts (parallel.ep=1)
    "one": (1, ("parallel.dp_shard=1", "parallel.ep=1", "train.batch_size=4", "model.lora_experts=true")),
    "fsdp2": (2, ("parallel.dp_shard=2", "parallel.ep=1", "train.batch_size=2", "model.lora_experts=true")),
    # the recipe's own layout: LoRA on attention, the experts frozen and split by expert parallelism
    "one_attention": (1, ("parallel.dp_shard=1", "parallel.ep=1", "train.batch_size=4")),
    "ep2": (2, ("parallel.dp_shard=2", "parallel.ep=2", "train.batch_size=2")),
}


class Runs(dict):
    """{layout: its output_dir}, each launched when a test first asks for it."""

    def __init__(self, made):
        super().__init__()
        self.made = made

    def __missing__(self, layout: str) -> Path:
        nproc, keys = LAYOUTS[layout]
        out = self.made["root"] / layout
        check(run(warm_cmd(nproc, *recipe(self.made, out, *keys)), env=launch_env(self.made["root"]), timeout=300))
        self[layout] = out
        return out


@pytest.fixture(scope="module")
def runs(made):
    return Runs(made)


def assert_same_losses(runs, layout: str, reference: str = "one") -> None:
    want, got = train_losses(runs[reference]), train_losses(runs[layout])
    assert len(want) == 3 and got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want)


# Slow: the default suite runs the recipe under FSDP2 on 2 processes as docs/guide.md section 4b shows it
# (tests/test_guide.py), and the adapters' export in process (above).
@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_recipe_under_fsdp2_exports_attention_and_experts_adapted_and_nothing_else(made, runs):
    """2 processes, FSDP2 (parallel.ep=1): hf/ holds the per-expert layout from_pretrained reads, and differs from the
    base in attention and the experts only (no norm, router or embedding moved)."""
    from safetensors.torch import load_file

    out = runs["fsdp2"]
    assert len(train_losses(out)) == 3
    base, merged = load_file(str(made["model"] / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
    assert merged.keys() == base.keys()
    moved = {k.split(".")[-2] for k in base if not torch.equal(base[k], merged[k])}
    assert moved == {*ATTENTION, "gate_proj", "up_proj", "down_proj"}, moved  # mlp.experts.E.gate_proj, ...
    assert transformers.AutoModelForCausalLM.from_pretrained(out / "hf") is not None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_recipe_is_the_same_on_one_process_and_fsdp2(runs):
    """The same global batch of 4 on each: the logged losses within 1e-5."""
    assert_same_losses(runs, "fsdp2")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_recipe_under_ep2_is_the_same_as_one_process(runs):
    """The recipe's own kind of layout, parallel.ep=2 x dp_shard=2 on 2 processes, equal to one process (the default
    suite runs it as docs/guide.md section 4b shows it: tests/test_guide.py)."""
    assert_same_losses(runs, "ep2", reference="one_attention")


def test_lora_on_the_experts_under_expert_parallel_is_one_line():
    from parallel_train.config.load import load_config

    with pytest.raises(UserError, match="model.lora_experts with parallel.ep=2: the experts' adapters cover every expert"):
        load_config(["--config", "configs/moe_finetune.yaml", "model.lora_experts=true", "parallel.ep=2", "parallel.dp_shard=2"])
