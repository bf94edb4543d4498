"""The GPT's llama flavor (`model.flavor=llama`: rotary positions, RMSNorm, SwiGLU, no biases; models/gpt.py) and its
export to transformers (models/gpt_export.py): Llama dense, Mixtral with experts, reloaded by from_pretrained with the
GPT's logits; the rotary positions under context parallelism and in pipeline stages, in process. Under -m slow, real
runs of the llama flavor on every layout against one process (test_mesh.py's settings), and the MoE under ep=2."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from safetensors.torch import load_file

from helpers import check, launch_env, run, warm_cmd, warm_script
from parallel_train.errors import UserError
from parallel_train.models.gpt import GPT, GPTConfig
from parallel_train.models.gpt_export import export_gpt
from test_context_parallel import ThreadGroup
from test_mesh import HALF, SGD, assert_same_training
from test_moe import RUN, assert_same

LLAMA = ("model.flavor=llama",)


def llama(n_experts: int = 0, tie: bool = False, **keys) -> GPTConfig:
    keys = {"flavor": "llama", **keys}
    return GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, n_experts=n_experts, tie_embeddings=tie, **keys)


def tiny(n_experts: int = 0, tie: bool = False, **keys) -> GPT:
    torch.manual_seed(0)
    return GPT(llama(n_experts, tie, **keys), 50).eval()


def reloaded_logits(folder, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(x).logits


@pytest.mark.parametrize(
    ("n_experts", "tie", "keys", "kind"),
    [
        (0, False, {"rope_theta": 500.0}, "LlamaForCausalLM"),
        (0, True, {"rope_theta": 500.0}, "LlamaForCausalLM"),
        (4, False, {"rope_theta": 500.0}, "MixtralForCausalLM"),
        (4, True, {"rope_theta": 500.0}, "MixtralForCausalLM"),
        (0, False, {"flavor": "gpt2"}, "GPT2LMHeadModel"),
        (0, True, {"flavor": "gpt2", "bias": False}, "GPT2LMHeadModel"),  # the absent biases written as zeros
    ],
)
def test_the_gpt_exports_to_transformers_with_equal_logits(tmp_path, n_experts, tie, keys, kind):
    model = tiny(n_experts, tie, **keys)
    for p in model.parameters():  # biases and norms away from their start, so that a misplaced one shows
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.3)
    line = export_gpt(llama(n_experts, tie, **keys), model.state_dict(), tmp_path, None, "the test's GPT")
    assert kind in line
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(reloaded_logits(tmp_path, x), want, rtol=0, atol=1e-5)


def test_a_gpt2_flavor_moe_hf_export_is_refused_in_one_line(tmp_path):
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, n_experts=4)
    with pytest.raises(UserError, match="model.flavor=gpt2 with model.n_experts=4 .* train with model.flavor=llama") as e:
        export_gpt(cfg, GPT(cfg, 50).state_dict(), tmp_path, None, "runs/x")
    assert "\n" not in str(e.value) and not any(tmp_path.iterdir())


def test_the_llama_flavor_has_no_position_table_nor_biases_and_tp_cuts_swiglu():
    model = tiny()
    names = dict(model.named_parameters())
    assert model.pos_emb is None and not [n for n in names if n.endswith("bias")]
    assert {"blocks.0.mlp.gate.weight", "blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight"} <= set(names)
    plan = model.tensor_parallel_plan(2)
    assert "pos_emb" not in plan and type(plan["blocks.1.mlp.gate"]) is type(plan["blocks.1.mlp.fc"])
    assert type(plan["blocks.1.mlp.gate"]).__name__ == "ColwiseParallel" and type(plan["blocks.1.mlp.proj"]).__name__ == "RowwiseParallel"
    moe = tiny(4).blocks["0"].mlp
    assert moe.gate.shape == moe.fc.shape == (4, 32, 128) and moe.fc_bias is None


def test_rotary_positions_in_pipeline_stages_packed_rows_and_under_context_parallelism_equal_the_whole_model():
    model = tiny()
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        want = model(x)
        # two pipeline stages: the second gets the first's activations, no embeddings
        first, second = copy.deepcopy(model), copy.deepcopy(model)
        first.ln_f = first.head = None
        del first.blocks["1"]
        second.tok_emb = None
        del second.blocks["0"]
        torch.testing.assert_close(second(first(x)), want)
        # a packed row of two samples equals each alone (the document mask; rotary scores depend on relative places only)
        packed = model(x, positions=torch.arange(8).repeat(2).expand(2, 16))
        torch.testing.assert_close(packed, torch.cat([model(x[:, :8]), model(x[:, 8:])], dim=1))
        # cp=2: each rank its half of the sequence, rotated by its place in the whole
        box, barrier, got = {}, threading.Barrier(2), [None, None]

        def rank(r: int) -> None:
            cp, part = ThreadGroup(r, 2, box, barrier), copy.deepcopy(model)
            part.use_context_parallel(cp)
            got[r] = part(cp.cut(x))

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    torch.testing.assert_close(torch.cat(got, dim=1), want)


def test_a_llama_moe_run_exports_with_scripts_export_and_reloads_with_its_logits(tmp_path):
    out = tmp_path / "run"
    check(run(warm_cmd(1, *RUN, *LLAMA, "train.max_steps=3", "checkpoint.interval=3", f"output_dir={out}"), env=launch_env(tmp_path)))
    result = check(run(warm_script("scripts/export.py", str(out), "--format", "hf"), env=launch_env(tmp_path), timeout=180))
    assert "MixtralForCausalLM" in result.output and (out / "hf" / "config.json").is_file()
    from parallel_train.config.load import load_config

    cfg, _ = load_config([*RUN, *LLAMA])
    model = GPT(cfg.model, 65).eval()
    model.load_state_dict(load_file(out / "model.safetensors"))
    x = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(reloaded_logits(out / "hf", x), want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- real runs against one process (-m slow)

DENSE = {
    "ref": (1, ()),
    "ddp": (2, HALF),
    "fsdp2": (2, (*HALF, "parallel.dp_shard=2")),
    "tp2": (2, ("parallel.tp=2",)),
    "pp2": (2, ("parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b")),
    "cp2": (2, ("parallel.cp=2",)),
}
EXPERTS = {"moe_ref": (1, ()), "moe_ddp": (2, ("train.batch_size=2",)), "moe_ep2": (2, ("train.batch_size=2", "parallel.ep=2"))}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flavor")
    done = {}

    def launch(name: str):
        if name not in done:
            n, extra = DENSE.get(name) or EXPERTS[name]
            base = RUN if name in EXPERTS else SGD
            out = tmp / name
            check(run(warm_cmd(n, *base, *LLAMA, *extra, f"output_dir={out}"), env=launch_env(tmp), timeout=600))
            done[name] = out
        return done[name]

    return launch


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "tp2", "pp2", "cp2"])
def test_the_llama_flavor_on_each_layout_equals_one_process(launched, name):
    assert "blocks.0.mlp.gate.weight" in load_file(launched("ref") / "model.safetensors")  # the llama flavor ran
    assert_same_training(launched(name), launched("ref"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["moe_ddp", "moe_ep2"])
def test_the_llama_flavors_experts_under_ddp_and_ep2_equal_one_process(launched, name):
    from test_expert_parallel import train_records

    ref, got = launched("moe_ref"), launched(name)
    assert_same(train_records(got), train_records(ref))
    want, have = load_file(ref / "model.safetensors"), load_file(got / "model.safetensors")
    assert sorted(have) == sorted(want) and "blocks.0.mlp.gate" in want
    for key in want:
        torch.testing.assert_close(have[key], want[key], rtol=1e-5, atol=1e-5)
