"""model.name=hf: a transformers causal LM trained like any template model, offline.

Tiny models are made here (tests/hf_tiny.py: a Llama and a GPT-2, 2 layers, 64 wide, a BPE tokenizer trained on
the shipped corpus) and saved with save_pretrained, as a model from the Hub would be. In process: the pipeline
layouts equal each family's own forward, stages in sequence equal the whole model, tied embeddings, export, and
the one-line errors. Real launches: 2-process DDP equal to one process, then its export and sample.py; two
pipeline stages equal to the unsplit model; SIGKILL and a bit-identical resume; FSDP2 and tensor parallel on CPU.
"""

from __future__ import annotations

import signal
import sys

import pytest
import torch
from safetensors.torch import load_file

import hf_tiny
from helpers import WarmCmd, check, launch_env, run, summary, train_losses, warm_cmd, warm_script
from parallel_train import faults
from parallel_train.checkpoint.export import load_weights
from parallel_train.errors import UserError
from parallel_train.models import hf_layouts
from parallel_train.models.hf import HFCausalLM, HFConfig
from parallel_train.models.ties import find_ties
from parallel_train.observe.generation import encode_prompt, generate, load_trained
from parallel_train.parallel.parts import fsdp_units, model_units
from parallel_train.parallel.pipeline.split import plan_stages, stage_module

transformers = pytest.importorskip("transformers")

T = 16
# 6 steps of batch 4 (per process: 2 x 2 under DDP), checkpoints at 3 and 6; data.tokenizer is not given: a
# model.name=hf run reads its data with the model folder's own tokenizer (tests/hf_tiny.py's 300-id BPE).
RUN = (
    "model.name=hf",
    f"model.block_size={T}",
    "train.batch_size=4",
    "train.max_steps=6",
    "train.warmup_steps=2",
    "train.lr_decay_steps=6",
    "train.learning_rate=1e-2",
    "train.log_interval=1",
    "eval.interval=3",
    "eval.iters=4",
    "eval.batch_size=4",
    "checkpoint.interval=3",
    "tracker=none",
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return hf_tiny.make_models(tmp_path_factory.mktemp("hf_models"))


def adapter(folder, **keys) -> HFCausalLM:
    return HFCausalLM(HFConfig(name="hf", hf_path=str(folder), block_size=T, **keys), 256)


def tokens(seed: int = 0, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (batch, T), generator=torch.Generator().manual_seed(seed))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- the adapter, in process


FAMILIES = {
    "llama": lambda: hf_tiny.llama_config(),
    "mistral": lambda: transformers.MistralConfig(**hf_tiny.llama_config().to_dict() | {"sliding_window": 8}),  # slides within T
    "qwen2": lambda: transformers.Qwen2Config(
        **hf_tiny.llama_config().to_dict() | {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None}
    ),
    "qwen3": lambda: transformers.Qwen3Config(**hf_tiny.llama_config().to_dict() | {"head_dim": 16}),
    "gpt2": lambda: hf_tiny.gpt2_config(),
    # mixtures of experts (hf_layouts.MOE_LAYOUTS): the same parts, each layer's MLP routed
    "qwen3_moe": hf_tiny.qwen3_moe_config,
    "mixtral": lambda: hf_tiny.mixtral_config(sliding_window=8),
    "deepseek_v3": hf_tiny.deepseek_v3_config,
    "olmoe": lambda: transformers.OlmoeConfig(**hf_tiny.MOE_SIZES, num_key_value_heads=2, num_experts=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **hf_tiny.MOE_SIZES, num_key_value_heads=2, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **hf_tiny.MOE_SIZES,
        num_key_value_heads=2,
        num_local_experts=4,
        head_dim=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


SLOW_FAMILIES = {"mixtral", "deepseek_v3", "olmoe", "qwen2_moe", "gpt_oss"}  # the MoE layouts but Qwen3-MoE: -m slow


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FAMILIES else f for f in sorted(FAMILIES)])
def test_each_layout_runs_like_the_model_own_forward(family, attn):
    """The part-by-part decoder (what pipeline stages run) equals transformers' forward: logits and gradients."""
    if (family, attn) == ("gpt_oss", "sdpa"):
        pytest.skip("GPT-OSS (attention sinks) runs eager attention only in transformers")
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    layout = hf_layouts.layout_for(model)
    assert layout is hf_layouts.LAYOUTS[family]
    if family == "qwen2":
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
    x = tokens()
    theirs = model(input_ids=x, use_cache=False).logits
    theirs.square().mean().backward()
    their_grads = grads(model)
    model.zero_grad()
    ours = hf_layouts.run_decoder(model, layout, model.config, x)
    ours.square().mean().backward()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # the same operations in the same order
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, their_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("n_stages", [2, 3])
def test_pipeline_stages_in_sequence_equal_the_whole_model(folders, name, n_stages):
    """What a pipeline runs: stage views (other parts None) one after the other, each computing its own positions,
    rotary cos/sin and mask. Equal to transformers' own forward, logits and gradients; the names are the model's."""
    model = adapter(folders[name], untie_embeddings=True)
    stages = plan_stages(model, n_stages)
    assert stages[0][0].endswith(("embed_tokens", "wte")) and stages[-1][-1] == "lm_head"
    x = tokens()
    h = x
    for names in stages:
        h = stage_module(model, names)(h)
    h.square().mean().backward()
    ours = grads(model)
    model.zero_grad()
    whole = model.hf(input_ids=x, use_cache=False).logits
    whole.square().mean().backward()
    torch.testing.assert_close(h, whole, rtol=0, atol=0)
    assert ours.keys() == grads(model).keys() == dict(model.named_parameters()).keys()
    for key, grad in grads(model).items():
        torch.testing.assert_close(ours[key], grad, rtol=0, atol=0, msg=key)
    views = [stage_module(model, names) for names in stages]
    names = [n for v in views for n, _ in v.named_parameters()]
    assert sorted(names) == sorted(model.hf.state_dict())  # the transformers names, each once


def test_tied_embeddings_are_stored_once_and_split_like_untied_ones(folders):
    """The generic tie (models/ties.py): one weight under two names, stored once under the first; the splitter puts the
    embedding in the first stage and lm_head in the last (parallel/pipeline/tied.py keeps their copies equal)."""
    from parallel_train.checkpoint.named_state import RankState, rank_tensors

    gpt2 = adapter(folders["gpt2"])
    assert gpt2.tied == find_ties(gpt2) == {"lm_head.weight": "transformer.wte.weight"}
    tensors, meta = rank_tensors(RankState(gpt2.state_dict(), gpt2, None, gpt2.tied))
    assert "model/lm_head.weight" not in tensors and "model/transformer.wte.weight" in tensors and meta["tied"] == gpt2.tied
    gpt2.load_state_dict(gpt2.state_dict())
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    stages = plan_stages(gpt2, 2)
    assert stages[0][0] == "transformer.wte" and stages[-1][-1] == "lm_head"
    untied = adapter(folders["gpt2"], untie_embeddings=True)
    assert not untied.tied and "lm_head.weight" in untied.state_dict()
    torch.testing.assert_close(untied.lm_head.weight, untied.transformer.wte.weight)  # a copy, trained apart
    assert list(model_units(untied))[:3] == ["transformer.wte", "transformer.wpe", "transformer.drop"]


def test_model_without_a_layout_trains_whole_and_refuses_a_split(tmp_path):
    """An architecture with no pipeline layout (OPT) runs through its own forward; a split is one line."""
    config = transformers.OPTConfig(
        vocab_size=300, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64
    )
    model = adapter(hf_tiny.save_model(config, tmp_path / "opt"))
    assert model.layout is None and model._no_split_modules == ["OPTDecoderLayer"] and len(model.decoder_layers()) == 2
    x = tokens()
    model.eval()  # OPT has dropout
    torch.testing.assert_close(model(x), model.hf(input_ids=x).logits)
    with pytest.raises(UserError, match=r"\(opt\): no pipeline layout .*train it without pipeline stages"):
        plan_stages(model, 2)


def test_sharding_engines_get_the_decoder_layers_and_the_tp_plan(folders):
    """What FSDP wraps (the model's _no_split_modules) and how tensor parallelism cuts it (transformers' own plan,
    as torch styles over the modules a model or a pipeline stage holds); one-line refusals where it cannot."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    llama = adapter(folders["llama"])
    assert llama._no_split_modules == ["LlamaDecoderLayer"]
    assert [type(m).__name__ for m in llama.decoder_layers()] == ["LlamaDecoderLayer"] * 2
    assert fsdp_units(llama) == llama.decoder_layers()  # what the mesh engine's fully_shard wraps, before the root
    plan = llama.tensor_parallel_plan(2)
    # transformers' 2 + 7 per layer, and sequence parallel: the final norm, and per layer its two norms and the inputs of
    # attention and MLP (gathered from sequence shards); the row-wise outputs reduce-scatter into sequence shards
    assert len(plan) == 3 + 2 * 11 and isinstance(plan["model.layers.1.self_attn.k_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.0.mlp.down_proj"], RowwiseParallel) and isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert type(plan["model.norm"]).__name__ == type(plan["model.layers.1.post_attention_layernorm"]).__name__ == "SequenceParallel"
    assert plan["model.layers.0.mlp.down_proj"].output_layouts[0].is_shard(1) and plan["lm_head"].input_layouts[0].is_shard(1)
    # between the regions plain local (B, T/tp, H) tensors (torchtitan's plan): what a pipeline stage can send
    assert plan["model.embed_tokens"].use_local_output and plan["model.layers.0.self_attn.o_proj"].use_local_output
    first, last = (stage_module(llama, names) for names in plan_stages(llama, 2))
    first_plan, stage_plan = first.tensor_parallel_plan(2), last.tensor_parallel_plan(2)  # each stage: the same plan, its parts
    assert sorted({name.split(".")[2] for name in stage_plan if name.startswith("model.layers.")}) == ["1"]
    assert len(stage_plan) == 2 + 11 and type(stage_plan["model.norm"]).__name__ == "SequenceParallel"
    assert stage_plan["lm_head"].input_layouts[0].is_shard(1) and len(first_plan) == 1 + 11
    assert first_plan["model.embed_tokens"].output_layouts[0].is_shard(1)
    with pytest.raises(UserError, match="parallel.tp=3 does not divide the 4 attention heads and 2 key/value heads"):
        llama.tensor_parallel_plan(3)
    with pytest.raises(UserError, match="ties lm_head to its input embedding.*set model.untie_embeddings=true"):
        adapter(folders["gpt2"]).tensor_parallel_plan(2)
    with pytest.raises(UserError, match=r"\(gpt2\) has no tensor-parallel plan in transformers; shard it with FSDP"):
        adapter(folders["gpt2"], untie_embeddings=True).tensor_parallel_plan(2)
    assert llama.flops_per_token() > 6 * sum(p.numel() for p in llama.model.layers.parameters())


def test_activation_checkpointing_recomputes_each_layer_in_backward(folders):
    model = adapter(folders["llama"], activation_checkpointing="full")
    calls = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *args: calls.append(1))
    plain = adapter(folders["llama"])
    model(tokens()).square().mean().backward()
    plain(tokens()).square().mean().backward()
    assert len(calls) == 2  # once forward, once again in backward
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_export_loads_in_transformers_with_equal_logits(folders, tmp_path):
    """The export (what a run writes to output_dir/hf) loads with from_pretrained; the logits equal the trained
    model's; the byte tokenizer loads with AutoTokenizer and gives one id per byte."""
    from parallel_train.data.tokenizers import ByteVocab
    from parallel_train.models.hf_export import export_pretrained

    for name, keys in [("llama", {}), ("gpt2", {}), ("gpt2", {"untie_embeddings": True})]:
        model = adapter(folders[name], **keys)
        with torch.no_grad():  # stands for training: weights unlike the folder's
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        out = tmp_path / f"{name}_{len(keys)}"
        assert str(out) in export_pretrained(
            model.Config(name="hf", hf_path=str(folders[name]), **keys), model.state_dict(), out, ByteVocab()
        )
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        x = tokens()
        torch.testing.assert_close(loaded(x).logits, model(x), rtol=0, atol=0)
        assert loaded.config.tie_word_embeddings == (name == "gpt2" and not keys)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("héllo").input_ids == list("héllo".encode()) and tokenizer.decode(list("héllo".encode())) == "héllo"


# ---------------------------------------------------------------- bad input: one line each


def bad_folders(folders, tmp_path):
    """(folder, keys, expected message) for each kind of bad model folder."""
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"")
    not_causal = tmp_path / "bert"
    transformers.BertConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, architectures=["BertForMaskedLM"]
    ).save_pretrained(not_causal)
    no_weights = tmp_path / "no_weights"
    hf_tiny.llama_config().save_pretrained(no_weights)
    pickled = tmp_path / "pickled"
    hf_tiny.llama_config().save_pretrained(pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04N.")
    small = hf_tiny.save_model(hf_tiny.llama_config(vocab_size=100), tmp_path / "small_vocab")
    return [
        (tmp_path / "missing", {}, "no such folder"),
        (no_config, {}, "holds no config.json"),
        (not_causal / "config.json", {}, "is a file; give the folder"),
        (not_causal, {}, "is a BertForMaskedLM, not a causal language model"),
        (no_weights, {}, "holds no weights (model.safetensors); set model.hf_pretrained=false"),
        (pickled, {}, "holds its weights as pytorch_model.bin (a pickle"),
        (small, {}, "embeds only 100; use the model's own tokenizer"),
        (folders["gpt2"], {"block_size": 1000}, "model.block_size=1000 exceeds the 128 positions"),
        ("no-such-org/no-such-model", {}, "is neither a local folder nor reachable on the Hugging Face Hub"),
    ]


def test_bad_model_folders_are_one_line_errors(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.utils.hub.constants, "HF_HUB_OFFLINE", True)  # as in a launch (launch_env)
    for folder, keys, message in bad_folders(folders, tmp_path):
        keys = {"block_size": T, **keys}
        with pytest.raises(UserError) as e:
            HFCausalLM(HFConfig(name="hf", hf_path=str(folder), **keys), 256)
        assert message in str(e.value) and "\n" not in str(e.value), (folder, str(e.value))
    adapter(tmp_path / "no_weights", hf_pretrained=False)  # random weights need no weights file


def test_without_transformers_the_template_runs_and_hf_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails, as if not installed
    from parallel_train.config.load import load_config

    cfg, _ = load_config(["model.name=hf", "model.hf_path=anything"])
    with pytest.raises(UserError, match=r"^model.name=hf needs the transformers package: pip install -r requirements-hf.txt$"):
        HFCausalLM(cfg.model, 256)


# ---------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def reference(folders, tmp_path_factory):
    """The unsplit Llama, one process, batch 4."""
    tmp = tmp_path_factory.mktemp("hf_runs")
    check(run(warm_cmd(1, *RUN, f"model.hf_path={folders['llama']}", f"output_dir={tmp / 'ref'}"), env=launch_env(tmp)))
    return tmp


def assert_same_training(out, ref, atol=1e-4):
    got, want = train_losses(out), train_losses(ref)
    assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want)
    assert summary(out)["final_val_loss"] == pytest.approx(summary(ref)["final_val_loss"], abs=1e-4)
    w, r = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert w.keys() == r.keys() and "model.layers.1.mlp.down_proj.weight" in w
    for key in r:  # Adam amplifies float noise in tiny gradients: a loose atol
        torch.testing.assert_close(w[key], r[key], atol=atol, rtol=1e-4, msg=key)


@pytest.mark.multiprocess
def test_ddp_two_processes_equal_one_then_export_and_sample(folders, reference):
    """2 processes x batch 2 = the reference's 4 samples per step. The run's hf/ folder loads in transformers with
    the logits of its model.safetensors, the sampler generates from the run, and scripts/export.py --format hf exports a
    checkpoint."""
    out, env = reference / "ddp", launch_env(reference)
    result = check(run(warm_cmd(2, *RUN, "train.batch_size=2", f"model.hf_path={folders['llama']}", f"output_dir={out}"), env=env))
    assert "engine: data parallel" in result.output and f"Hugging Face model folder: {out / 'hf'}" in result.output
    assert_same_training(out, reference / "ref")
    model = adapter(folders["llama"])
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    torch.testing.assert_close(exported(tokens()).logits, model(tokens()), rtol=0, atol=0)
    own = transformers.AutoTokenizer.from_pretrained(folders["llama"])  # the model folder's tokenizer: the run's
    assert own("ROMEO: hi").input_ids == list(load_trained(out).vocab.encode("ROMEO: hi"))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")  # exported whole: ids and special tokens
    assert hf_tokenizer("ROMEO: hi").input_ids == own("ROMEO: hi").input_ids and hf_tokenizer.eos_token == own.eos_token
    trained = load_trained(out)  # what scripts/sample.py --run does (the script itself: tests/test_scripts.py)
    prompt = encode_prompt(trained.vocab, "ROMEO:")
    ids = generate(trained.model, torch.tensor([prompt]), 20, T, generator=torch.Generator().manual_seed(0))
    assert trained.vocab.decode(ids[0].tolist()).startswith("ROMEO:") and ids.shape == (1, len(prompt) + 20)
    step3, folder = out / "checkpoints" / "step_0000003", reference / "step3_hf"  # any checkpoint exports the same way
    assert (step3 / "shards").is_dir() and not (step3 / "model.safetensors").exists()  # each rank's part, by name
    check(run(warm_script("scripts/export.py", str(step3), str(folder), "--format", "hf", "--dtype", "bfloat16"), env=env))
    exported = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert exported.dtype == torch.bfloat16 and exported.config.dtype == torch.bfloat16
    weights = load_weights(step3)  # the checkpoint's model tensors, assembled from the shards
    assert weights.keys() == load_file(str(out / "model.safetensors")).keys()
    for key, value in weights.items():  # the checkpoint's weights, rounded to bf16
        assert torch.equal(exported.get_parameter(key), value.to(torch.bfloat16)), key
    assert transformers.AutoTokenizer.from_pretrained(folder)("ROMEO").input_ids == own("ROMEO").input_ids


@pytest.mark.multiprocess
def test_llama_in_two_pipeline_stages_equals_the_unsplit_model(folders, reference):
    out = reference / "pipeline"
    result = check(
        run(
            warm_cmd(
                2, *RUN, "parallel.pipeline_stages=2", "parallel.microbatches=2", f"model.hf_path={folders['llama']}", f"output_dir={out}"
            ),
            env=launch_env(reference),
        )
    )
    assert "stage 0 on rank 0: model.embed_tokens, model.layers.0" in result.output
    assert_same_training(out, reference / "ref")


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(folders, reference):
    """Killed after step 4 (checkpoint at 3): the resumed run ends with the uninterrupted run's bytes, and so does
    its export."""
    out, ref = reference / "killed", reference / "ref"
    args = (*RUN, f"model.hf_path={folders['llama']}", f"output_dir={out}")
    killed = run(warm_cmd(1, *args), env=launch_env(reference, **{faults.ENV: "kill@4"}))
    assert killed.returncode == -signal.SIGKILL, killed.output[-2000:]
    resumed = check(run(warm_cmd(1, *args), env=launch_env(reference)))
    assert "resumed from" in resumed.output and "step_0000003" in resumed.output
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert (out / "hf" / "model.safetensors").read_bytes() == (ref / "hf" / "model.safetensors").read_bytes()


@pytest.mark.multiprocess
def test_fsdp2_and_tensor_parallel_on_cpu(folders, tmp_path):
    """fully_shard over each decoder layer then the root (Llama, GPT-2), and the Llama cut by its own tensor-parallel
    plan, on gloo: see tests/hf_sharding_worker.py for the checks."""
    cmd = WarmCmd(2, "tests/hf_sharding_worker.py", (str(folders["llama"]), str(folders["gpt2"])))  # 2 ranks forked warm
    result = check(run(cmd, env=launch_env(tmp_path), timeout=300))
    for what in ("fsdp llama", "fsdp gpt2", "tp llama"):
        assert all(f"hf {what} rank {r}/2 ok" in result.stdout for r in (0, 1)), result.output[-2000:]


# The mesh engine (FSDP2, tensor parallel) on the template's own launches, with tests/test_mesh.py's set-up and
# tolerance: global batch 8 (4 x 2 accumulation steps, or 2 x 2 on each of 2 data-parallel ranks), SGD (Adam
# would blow float noise in near-zero gradients up into full steps), losses and weights within 1e-5 relative.
MESH_SGD = ("train.gradient_accumulation_steps=2", "train.optimizer=sgd", "train.learning_rate=0.5")
MESH_LAUNCHES = {"ref": (1, ()), "fsdp2": (2, ("train.batch_size=2", "parallel.dp_shard=2")), "tp2": (2, ("parallel.tp=2",))}
MESH_LAUNCHES["tp2_pp2"] = (4, ("parallel.tp=2", "parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b"))


@pytest.fixture(scope="module")
def mesh_runs(folders, tmp_path_factory):
    """mesh_runs(name) -> (output_dir, log) of the Llama launched as MESH_LAUNCHES[name], once per module."""
    tmp, done = tmp_path_factory.mktemp("hf_mesh"), {}

    def launch(name: str):
        if name not in done:
            nproc, overrides = MESH_LAUNCHES[name]
            args = (*RUN, *MESH_SGD, f"model.hf_path={folders['llama']}", *overrides, f"output_dir={tmp / name}")
            cmd = warm_cmd(1, *args) if nproc == 1 else warm_cmd(nproc, *args)
            done[name] = (tmp / name, check(run(cmd, env=launch_env(tmp), timeout=600)).output)
        return done[name]

    return launch


def assert_same_as_mesh_reference(out, ref):
    got, want = train_losses(out), train_losses(ref)
    assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (got, want)
    assert summary(out)["final_val_loss"] == pytest.approx(summary(ref)["final_val_loss"], rel=1e-5)
    w, r = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert w.keys() == r.keys() and "model.layers.1.self_attn.q_proj.weight" in w
    for key in r:
        torch.testing.assert_close(w[key], r[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.multiprocess
def test_llama_fsdp2_on_2_ranks_shards_each_decoder_layer_and_equals_one_process(mesh_runs):
    out, log = mesh_runs("fsdp2")
    assert "device mesh (FSDP2" in log and (out / "hf" / "config.json").exists()
    assert_same_as_mesh_reference(out, mesh_runs("ref")[0])


@pytest.mark.multiprocess
def test_llama_tensor_parallel_on_2_ranks_by_its_own_plan_equals_one_process(mesh_runs):
    out, log = mesh_runs("tp2")
    assert "device mesh (tensor parallel" in log and "sequence parallel and loss parallel" in log
    assert_same_as_mesh_reference(out, mesh_runs("ref")[0])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_llama_in_pipeline_stages_under_tensor_parallel_runs_sequence_and_loss_parallel_and_equals_one_process(mesh_runs):
    """2 stages x tp 2 (4 processes): each stage cut like the whole model, sequence parallel between its regions (a
    stage sends 1/tp of the sequence) and the last stage's loss on vocabulary shards; the same training as one process."""
    out, log = mesh_runs("tp2_pp2")
    assert "schedule 1f1b, 2 micro-batches x 2 accumulation = 4 per step" in log, log[-3000:]
    assert "mesh pp 2 x tp 2" in log and "; sequence parallel and loss parallel" in log, log[-3000:]
    assert_same_as_mesh_reference(out, mesh_runs("ref")[0])


@pytest.mark.slow
def test_bad_model_through_train_py_is_one_line_exit_2(tmp_path):
    out = tmp_path / "out"
    result = run(warm_cmd(1, *RUN, f"model.hf_path={tmp_path}", f"output_dir={out}"), env=launch_env(tmp_path))
    assert result.returncode == 2, result.output[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: model.hf_path {str(tmp_path)!r} holds no config.json; give a folder written by save_pretrained (or a Hub name)"
    ]
    assert "Traceback" not in result.output and not (out / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gpt2_untied_in_two_stages_of_one_process_equals_the_unsplit_model(folders, reference):
    """GPT-2 ties its embeddings: untied, its two in-process pipeline stages train like the unsplit (untied) model."""
    gpt2 = (*RUN, f"model.hf_path={folders['gpt2']}", "model.untie_embeddings=true")
    env, ref, out = launch_env(reference), reference / "gpt2_ref", reference / "gpt2_pipeline"
    check(run(warm_cmd(1, *gpt2, f"output_dir={ref}"), env=env))
    stages = ("parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]", "parallel.microbatches=2")
    check(run(warm_cmd(1, *gpt2, *stages, f"output_dir={out}"), env=env))
    got, want = train_losses(out), train_losses(ref)
    assert all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want)
    w, r = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert "lm_head.weight" in w and all(torch.allclose(w[k], r[k], atol=1e-4, rtol=1e-4) for k in r)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gpt2_tied_trains_under_ddp_and_as_a_two_stage_pipeline_alike(folders, tmp_path):
    """Tied GPT-2 under DDP (one tensor) and in 2 pipeline stages on 2 processes (a copy each, gradients summed:
    parallel/pipeline/tied.py): the same 4 samples per step, the same losses; both exports tied."""
    gpt2 = (*RUN, f"model.hf_path={folders['gpt2']}")
    out, pp = tmp_path / "ddp", tmp_path / "pp"
    check(run(warm_cmd(2, *gpt2, "train.batch_size=2", f"output_dir={out}"), env=launch_env(tmp_path)))
    stages = ("parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b")
    check(run(warm_cmd(2, *gpt2, *stages, f"output_dir={pp}"), env=launch_env(tmp_path)))
    got, want = train_losses(pp), train_losses(out)
    assert all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want)
    for run_dir in (out, pp):
        assert "lm_head.weight" not in load_file(str(run_dir / "model.safetensors"))  # stored once, as transformers does
        exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf")
        assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()
    w, r = load_weights(pp), load_weights(out)
    assert torch.equal(w["lm_head.weight"], w["transformer.wte.weight"])
    assert all(torch.allclose(w[k], r[k], atol=1e-4, rtol=1e-4) for k in r)


def test_the_guide_commands_are_valid_configs():
    """docs/guide.md section 4's commands need the Hub and GPUs: their keys and values are checked here instead."""
    import shlex

    from helpers import doc_section
    from parallel_train.config.load import load_config

    section = doc_section("guide", "4. Fine-tune a model from the Hub").splitlines()
    commands = [line for line in section if "model.name=hf model.hf_path=" in line and "# needs the Hub" in line]  # 4a's run offline
    assert len(commands) == 3
    for line in commands:
        overrides = [a for a in shlex.split(line, comments=True) if "=" in a and a.split("=")[0].islower() and not a.startswith("-")]
        cfg, _ = load_config(overrides)
        assert cfg.model.name == "hf" and cfg.model.hf_path and cfg.model.block_size >= 1024
