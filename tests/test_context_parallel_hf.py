"""Context parallelism (parallel.cp) for a Hub Llama and for samples: packed documents and padded rows.

test_finetune.py's tiny chat Llama and Shakespeare's lines as conversations serve here. In process: the Llama's
forward on cp parts (the ranks as threads) equals its whole forward, unpacked and packed. Real launches (gloo): the
Llama on packed chat rows at cp=2 equals one process (losses, evaluation, final weights); slow: the Llama on padded
rows, the GPT on packed rows, and a cp=2 checkpoint of the Llama going on on one process.
"""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

import hf_tiny
from helpers import check, launch_env, run, summary, train_losses, warm_cmd
from parallel_train.errors import UserError
from test_context_parallel import ThreadGroup
from test_finetune import LORA

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return hf_tiny.chat_files(tmp_path_factory.mktemp("cp_hf"))


def llama(folder):
    from parallel_train.models.hf import HFConfig, HFModel

    return HFModel(HFConfig(name="hf", hf_path=str(folder), block_size=16), 300)


def on_threads(n: int, work) -> list:
    """work(rank, ThreadGroup) on n threads, one cp group: their results in rank order."""
    box, barrier, got = {}, threading.Barrier(n), [None] * n

    def rank(r: int) -> None:
        got[r] = work(r, ThreadGroup(r, n, box, barrier))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


@pytest.mark.parametrize("packed", [False, True])
def test_a_llama_on_cp_parts_equals_its_whole_forward(chat, packed):
    """Each rank's position_ids are its part's (rotary), attention sees the whole sequence through the exchange, and a
    packed batch's documents stay apart (positions restart per document)."""
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])[None].repeat(2, 1) if packed else None
    with torch.no_grad():
        want = llama(chat["model"])(x, positions)
        models = [llama(chat["model"]) for _ in range(2)]

        def work(r, cp):
            models[r].use_context_parallel(cp)
            return models[r](cp.cut(x), positions)

        got = on_threads(2, work)
    torch.testing.assert_close(torch.cat(got, dim=1), want)


def test_what_the_exchange_cannot_cut_is_a_one_line_error(chat, tmp_path):
    with pytest.raises(UserError, match=r"parallel.cp=4: .* has 4 attention heads and 2 key/value heads; cp must divide both"):
        llama(chat["model"]).use_context_parallel(ThreadGroup(0, 4, {}, None))
    moe = hf_tiny.save_model(hf_tiny.qwen3_moe_config(), tmp_path / "moe")
    with pytest.raises(
        UserError, match=r"parallel.cp=2: .* \(qwen3_moe\): context parallelism runs the dense causal decoders of a known layout"
    ):
        llama(moe).use_context_parallel(ThreadGroup(0, 2, {}, None))
    with pytest.raises(UserError, match=r"parallel.cp=2: the data gives dict batches \(input_ids, labels\)"):
        ThreadGroup(0, 2, {}, None).cut_batch({"input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 4)})


# ---------------------------------------------------------------- real launches

# test_finetune's chat launches, every weight trained (no LoRA), padded unless PACKED
CHAT = (*(k for k in LORA if not k.startswith(("model.lora_rank", "data.packing", "train.learning_rate"))), "train.learning_rate=0.5")
PACKED = ("data.packing=true",)


@pytest.fixture(scope="module")
def launches(chat):
    """launches(name, nproc, *overrides) -> (output_dir, log), each name launched once per module."""
    tmp, done = chat["tmp"], {}

    def launch(name: str, nproc: int, *overrides: str):
        if name not in done:
            args = (*CHAT, f"model.hf_path={chat['model']}", f"data.path={chat['rows']}", *overrides, f"output_dir={tmp / name}")
            done[name] = (tmp / name, check(run(warm_cmd(nproc, *args), env=launch_env(tmp), timeout=600)).output)
        return done[name]

    return launch


def assert_same_training(out, ref, steps=range(1, 7)):
    got, want = train_losses(out), train_losses(ref)
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in steps), (got, want)
    assert summary(out)["final_val_loss"] == pytest.approx(summary(ref)["final_val_loss"], rel=1e-5)
    w, r = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert w.keys() == r.keys()
    for key in r:
        torch.testing.assert_close(w[key], r[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.multiprocess
def test_a_llama_on_packed_chat_rows_at_cp_2_equals_one_process(launches):
    out, log = launches("cp2_packed", 2, *PACKED, "parallel.cp=2")
    assert "context parallel over 2 ranks" in log and "packed into" in log
    assert_same_training(out, launches("ref_packed", 1, *PACKED)[0])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_llama_on_padded_chat_rows_at_cp_2_equals_one_process(launches):
    out, log = launches("cp2_padded", 2, "parallel.cp=2")
    assert "context parallel over 2 ranks" in log and "padded to each batch's longest" in log
    assert_same_training(out, launches("ref_padded", 1)[0])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_cp_2_llama_checkpoint_goes_on_on_one_process(launches):
    source = launches("cp2_packed", 2, *PACKED, "parallel.cp=2")[0]
    out, _ = launches("resumed_on_1", 1, *PACKED, f"resume={source}/checkpoints/step_0000003")
    assert_same_training(out, launches("ref_packed", 1, *PACKED)[0], steps=range(4, 7))


GPT = ("model.name=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.dropout=0.0")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gpt_on_packed_chat_rows_at_cp_2_equals_one_process(launches, chat):
    """The GPT with the chat Llama's tokenizer: packed documents under its own document mask, the whole sequence's."""
    gpt = (*GPT, *PACKED, f"data.tokenizer={chat['model']}")
    out, log = launches("gpt_cp2_packed", 2, *gpt, "parallel.cp=2")
    assert "context parallel over 2 ranks" in log and "packed into" in log
    assert_same_training(out, launches("gpt_ref_packed", 1, *gpt)[0])


def test_the_long_context_recipe_is_laid_out_for_8_gpus():
    """configs/long_context.yaml (its run on a tiny Llama: tests/test_recipes.py): 32k+ tokens, cp=4 x dp_shard=2 on 8
    ranks, which the config's own checks accept, full activation checkpointing, bf16."""
    from parallel_train.config.load import load_config
    from parallel_train.parallel.context_parallel import refuse_unsupported
    from parallel_train.parallel.mesh import MeshLayout, resolve_layout

    cfg, _ = load_config(["--config", "configs/long_context.yaml"])
    assert cfg.model.name == "hf" and cfg.model.block_size >= 32768 and cfg.model.activation_checkpointing == "full"
    assert cfg.train.mixed_precision == "bf16" and resolve_layout(cfg, 8, env={}) == MeshLayout(dp_shard=2, cp=4)
    refuse_unsupported(cfg, 8)
