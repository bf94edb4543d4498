"""model.name=hf with a Hub mixture of experts: Qwen3-MoE, Mixtral and DeepSeek-V3, tiny (tests/hf_tiny.py: 2 layers,
4 experts, top-2, 32 wide), saved by save_pretrained, which writes each expert's tensors apart.

In process: the weights load as from_pretrained loads them (its converters fuse the experts), on the meta-device
start the trainer uses and built whole, with equal logits and first-batch loss; a rank that holds some experts reads
only theirs; the export writes the per-expert layout back, which from_pretrained reloads with equal logits; MFU counts
the active parameters. One real run (Qwen3-MoE, 1 process) with no update: its hf/ equals the original. With -m slow:
Mixtral and DeepSeek-V3 in process, Mixtral under FSDP2 on 2 ranks (each reads its experts) equal to one process, and
a Mixtral fine-tune whose export holds what it trained.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hf_tiny
from helpers import check, launch_env, run, train_losses, warm_cmd
from parallel_train.models.hf import HFConfig, HFModel
from parallel_train.parallel.model_init import start_model

transformers = pytest.importorskip("transformers")

T = 16


def save(family: str, folder, tokenizer=None):
    return hf_tiny.save_model(hf_tiny.MOE_CONFIGS[family](), folder, tokenizer)


class Folders(dict):
    """{family: its folder}, each saved when a test first asks for it."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        self[family] = save(family, self.root / family)
        return self[family]


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    return Folders(tmp_path_factory.mktemp("hf_moe"))


# Qwen3-MoE in the default suite; Mixtral (renamed keys: block_sparse_moe) and DeepSeek-V3 (latent attention, a shared
# expert, a dense first layer) with -m slow, but for the reading of a shard (Mixtral: its renaming and fusing together).
FAMILIES = [pytest.param(f, marks=() if f == "qwen3_moe" else pytest.mark.slow) for f in sorted(hf_tiny.MOE_CONFIGS)]


def config(folder, **keys) -> HFConfig:
    return HFConfig(name="hf", hf_path=str(folder), block_size=T, **keys)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, hf_tiny.VOCAB, (3, T), generator=torch.Generator().manual_seed(seed))


def loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def started(folder) -> HFModel:
    """The model as the trainer starts it: built on the meta device, then filled tensor by tensor from the files."""
    model, init = start_model(HFModel, config(folder), hf_tiny.VOCAB, seed=0)
    assert next(model.parameters()).is_meta
    init.fill(model, torch.device("cpu"))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_weights_load_as_from_pretrained_loads_them(moe_folders, family):
    """Per-expert files, fused by transformers' own converters: the logits and the first batch's loss equal
    from_pretrained's within 1e-5, whether the model starts on the meta device (the trainer) or whole (scripts)."""
    folder = moe_folders[family]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert any(".experts.0." in k for k in handle.keys())  # noqa: SIM118 (the layout save_pretrained writes)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    x = tokens()
    want = reference(x).logits
    for model in (started(folder), HFModel(config(folder), hf_tiny.VOCAB)):
        assert model.weight_conversions and all(".experts." in name for name in model.weight_conversions.conversions)
        with torch.no_grad():
            got = model(x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(loss(got, x), loss(want, x), rtol=0, atol=1e-5)


def test_a_rank_that_holds_some_experts_reads_only_theirs(moe_folders, monkeypatch):
    """An FSDP2 shard of a fused expert tensor (rows 2..3 of 4, some columns) reads experts 2 and 3 only."""
    import safetensors

    model = HFModel(config(moe_folders["mixtral"], hf_pretrained=True), hf_tiny.VOCAB)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    whole = model.get_parameter(name).detach()
    read, real = [], safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    region = (slice(2, 4), slice(None), slice(5, 20))
    torch.testing.assert_close(model.weight_conversions.read(name, region), whole[region], rtol=0, atol=0)
    assert sorted(read) == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in (2, 3) for w in ("w1", "w3")]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.values[0] != "deepseek_v3"])
def test_export_writes_the_per_expert_layout_that_from_pretrained_reloads(moe_folders, family, tmp_path):
    """The run's fused weights, exported: the same tensor names as the folder save_pretrained wrote, and the logits of
    the trained model when from_pretrained loads them."""
    from parallel_train.data.tokenizers import ByteVocab
    from parallel_train.models.hf_export import export_pretrained

    model = HFModel(config(moe_folders[family]), hf_tiny.VOCAB)
    with torch.no_grad():  # stands for training: weights unlike the folder's
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    export_pretrained(config(moe_folders[family]), model.state_dict(), tmp_path / "hf", ByteVocab())
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written.keys() == load_file(str(moe_folders[family] / "model.safetensors")).keys()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, model(tokens()), rtol=0, atol=1e-5)


def test_mfu_and_the_banner_count_the_active_parameters(moe_folders):
    """Each token runs 2 of a layer's 4 routed experts: half of the routed experts' parameters are not active."""
    model = HFModel(config(moe_folders["qwen3_moe"]), hf_tiny.VOCAB)
    total = sum(p.numel() for p in model.parameters())
    layers = model.hf.model.layers
    routed = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel() for layer in layers)
    assert routed == 2 * 4 * (2 * 16 * 32 + 32 * 16)
    assert model.active_params() == total - routed // 2
    embedding = model.hf.model.embed_tokens.weight.numel()
    attention = 12 * 2 * 32 * T
    assert model.flops_per_token() == 6 * (total - routed // 2 - embedding) + attention
    dense = HFModel(HFConfig(name="hf", hf_path=str(moe_folders["qwen3_moe"]), block_size=T, hf_pretrained=False), hf_tiny.VOCAB)
    dense.hf.config.num_experts_per_tok = 4  # every expert for every token: all active
    assert dense.active_params() == total


def launch(folder, out, nproc: int = 1, *extra: str):
    """A run of `folder` from its weights, data.tokenizer=byte; `extra` overrides."""
    overrides = (
        "model.name=hf",
        f"model.hf_path={folder}",
        "data.tokenizer=byte",
        f"model.block_size={T}",
        "train.batch_size=2",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.learning_rate=1e-30",  # too small to move a float32 weight: a run with no update
        "train.min_lr=0",
        "train.weight_decay=0",
        "train.log_interval=1",
        "eval.interval=2",
        "eval.iters=1",
        "eval.batch_size=2",
        "checkpoint.interval=2",
        "tracker=none",
        f"output_dir={out}",
        *extra,
    )
    return check(run(warm_cmd(nproc, *overrides), env=launch_env(out.parent), timeout=600))


def assert_logits_equal(a, b) -> None:
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            transformers.AutoModelForCausalLM.from_pretrained(a)(x).logits,
            transformers.AutoModelForCausalLM.from_pretrained(b)(x).logits,
            rtol=0,
            atol=1e-5,
        )


@pytest.mark.multiprocess
def test_a_run_without_update_exports_the_original_logits(tmp_path):
    """1 process, Qwen3-MoE from its per-expert files: the run trains, names its active parameters, and its hf/ loads
    in transformers with the original's logits."""
    folder = save("qwen3_moe", tmp_path / "qwen3_moe")
    result = launch(folder, tmp_path / "run")
    assert "active per token" in result.output and f"Hugging Face model folder: {tmp_path / 'run' / 'hf'}" in result.output
    assert_logits_equal(tmp_path / "run" / "hf", folder)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_ranks_read_their_experts_and_equal_one_process(tmp_path):
    """FSDP2 over 2 ranks shards each fused expert tensor by rows (experts 0-1, 2-3), which each rank reads from the
    per-expert files alone: the same losses as one process, and an export with the original's logits."""
    folder = save("mixtral", tmp_path / "mixtral")
    one = launch(folder, tmp_path / "one", 1, "train.batch_size=4")
    two = launch(folder, tmp_path / "two", 2, "parallel.dp_shard=2")
    assert "device mesh (FSDP2" in two.output
    got, want = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want, one.output[-500:])
    assert_logits_equal(tmp_path / "two" / "hf", folder)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mixtral_fine_tunes_from_its_weights_and_exports_what_it_trained(tmp_path):
    """A learning rate that moves the weights: the loss falls, and the exported folder holds the run's weights."""
    folder = save("mixtral", tmp_path / "mixtral")
    out = tmp_path / "run"
    launch(folder, out, 1, "train.learning_rate=1e-2", "train.max_steps=6", "eval.interval=6", "checkpoint.interval=6")
    losses = train_losses(out)
    assert losses[6] < losses[1], losses
    model = HFModel(config(folder), hf_tiny.VOCAB)
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, model(tokens()), rtol=0, atol=1e-5)
