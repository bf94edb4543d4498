"""Dict batches on every layout (issue 27 item 1): a causal LM trained from {"input_ids", "labels"} batches, from a
data source of the user's own (tests/dict_train.py registers it as docs/guide.md says), gives the losses of the same
windows given as (inputs, targets) tuples, on every engine. And what a batch's keys ask of the model, checked at
the start: a forward that does not take a key, an output without logits, a pipeline that cannot pass a key.

Global batch 8 everywhere: the reference is one process x 8 tuples; every other launch cuts the same 8 dicts its
own way (data-parallel ranks, micro-steps, pipeline micro-batches), several layouts in one launch where the engines
compose (FSDP2 x TP on 4 ranks, DDP x the one-process pipeline), and the rest, one layout each, in the slow suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_tiny
from helpers import WarmCmd, check, launch_env, run
from test_bad_inputs import assert_one_line_error
from test_mesh import assert_same_training

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/dict_train.py"
RUN = (  # global batch 8, 3 steps, one evaluation of 2 batches of 8 at the end
    "model.block_size=16",
    "train.max_steps=3",
    "train.warmup_steps=1",
    "train.lr_decay_steps=3",
    "train.log_interval=1",
    "eval.interval=3",
    "eval.iters=2",
    "eval.batch_size=8",
    "checkpoint.interval=3",
    "tracker=none",
    "train.optimizer=sgd",  # SGD: the weights of every layout within float noise of one process's (Adam amplifies it)
    "train.learning_rate=1.0",
)
GPT = ("model.n_layer=2", "model.n_head=2", "model.n_embd=32")
HF = ("model.name=hf", "model.hf_path={llama}", "data.tokenizer=byte")  # tests/hf_tiny.py's Llama
ACCUM = ("train.batch_size=4", "train.gradient_accumulation_steps=2")
DDP = ("train.batch_size=4",)
FSDP2_TP2 = ("train.batch_size=4", "parallel.dp_shard=2", "parallel.tp=2")
INPROC = ("parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]")
PP2 = ("parallel.pipeline_stages=2", "parallel.microbatches=2")
ONE = ("train.batch_size=8",)
LAUNCHES = {  # name -> (processes, model, data source, overrides)
    "ref": (1, GPT, "windows_tuples", ONE),
    "accum": (1, GPT, "windows_dicts", ACCUM),
    "fsdp2_tp2": (4, GPT, "windows_dicts", FSDP2_TP2),
    "ddp_x_inproc_pp": (2, GPT, "windows_dicts", (*DDP, *INPROC)),
    "pp2_accum": (2, GPT, "windows_dicts", (*ACCUM, *PP2)),
    "label_key": (1, GPT, "label_dicts", ONE),  # HF datasets' `label`, taken as `labels` (as transformers' collators do)
    # slow: each layout alone (the default ones above compose them)
    "one": (1, GPT, "windows_dicts", ONE),
    "ddp2": (2, GPT, "windows_dicts", DDP),
    "fsdp2": (2, GPT, "windows_dicts", (*DDP, "parallel.dp_shard=2")),
    "tp2": (2, GPT, "windows_dicts", (*ONE, "parallel.tp=2")),
    "pp2": (2, GPT, "windows_dicts", (*ONE, *PP2)),
    "inproc_pp": (1, GPT, "windows_dicts", (*ONE, *INPROC)),
    # a Hub decoder on padded dicts (attention_mask): every layout against one process
    "hf_ref": (1, HF, "padded_dicts", ONE),
    "hf_ddp2": (2, HF, "padded_dicts", DDP),
    "hf_pp2_accum": (2, HF, "padded_dicts", (*ACCUM, *PP2)),
    "hf_fsdp2_tp2": (4, HF, "padded_dicts", FSDP2_TP2),
    "hf_ddp_x_inproc_pp": (2, HF, "padded_dicts", (*DDP, *INPROC)),
    "hf_fsdp2": (2, HF, "padded_dicts", (*DDP, "parallel.dp_shard=2")),
    "hf_tp2": (2, HF, "padded_dicts", (*ONE, "parallel.tp=2")),
}
SLOW = (
    "label_key",
    "one",
    "ddp2",
    "fsdp2",
    "tp2",
    "pp2",
    "inproc_pp",
    "hf_ddp2",
    "hf_fsdp2_tp2",
    "hf_ddp_x_inproc_pp",
    "hf_fsdp2",
    "hf_tp2",
)
ENGINES = {  # the layout each launch asked for, as its banner says it
    "fsdp2_tp2": "mesh dp_shard 2 x tp 2",
    "ddp_x_inproc_pp": "x 2 DDP replicas",
    "pp2_accum": "2 micro-batches x 2 accumulation",
    "inproc_pp": "pipeline in one process (executor 1)",
    "pp2": "executor 2, torch.distributed.pipelining): 2 stage ranks",
}


def dict_cmd(nproc: int, *overrides: str) -> WarmCmd:
    """tests/dict_train.py (train.py with the user's sources and models registered) on `nproc` warm ranks."""
    return WarmCmd(nproc, SCRIPT, overrides)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """tests/hf_tiny.py's Llama (untied: tensor parallel cuts it; 300 ids: data.tokenizer=byte fits), saved as a Hub
    folder is."""
    return hf_tiny.save_model(hf_tiny.llama_config(), tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def launched(tmp_path_factory, request):
    """launched(name) -> (output_dir, log); each launch runs once per module, when first asked for."""
    tmp = tmp_path_factory.mktemp("dicts")
    done: dict[str, tuple[Path, str]] = {}

    def launch(name: str) -> tuple[Path, str]:
        if name not in done:
            nproc, model, source, overrides = LAUNCHES[name]
            if model is HF:
                model = tuple(o.format(llama=request.getfixturevalue("llama")) for o in model)
            out = tmp / name
            cmd = dict_cmd(nproc, *RUN, *model, f"data.source={source}", *overrides, f"output_dir={out}")
            done[name] = (out, check(run(cmd, env=launch_env(tmp), timeout=300)).output)
        return done[name]

    return launch


def cases(hf: bool) -> list:
    names = [n for n in LAUNCHES if n.startswith("hf_") == hf and not n.endswith("ref")]
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.mark.parametrize("name", cases(hf=False))
def test_dict_batches_train_like_tuples(launched, name):
    out, log = launched(name)
    assert ENGINES.get(name, "engine: ") in log  # the layout the launch asked for
    assert_same_training(out, launched("ref")[0], steps=range(1, 4))


@pytest.mark.parametrize("name", cases(hf=True))
def test_a_padded_dict_batch_trains_a_hub_decoder_alike_on_every_layout(launched, name):
    """attention_mask reaches transformers' masks on every layout: in each pipeline stage too (models/hf_layouts.py)."""
    out, log = launched(name)
    assert ENGINES.get(name[3:], "engine: ") in log
    assert_same_training(out, launched("hf_ref")[0], steps=range(1, 4))


REFUSED = {  # name -> (processes, overrides, the one error line's start)
    "a_key_the_one_process_pipeline_cannot_pass": (
        1,
        ("data.source=typed_dicts", "model.name=takes_any", *INPROC),
        "error: the batch's 'token_type_ids' input cannot travel through the one-process pipeline (parallel.stage_devices), ",
    ),
    "a_key_the_multi_process_pipeline_cannot_pass": (
        2,
        ("data.source=typed_dicts", "model.name=takes_any", *PP2),
        "error: the batch's 'token_type_ids' input cannot travel through the multi-process pipeline (parallel.pipeline_stages=2), ",
    ),
    "a_key_the_forward_lacks": (
        1,
        ("data.source=padded_dicts",),
        "error: data gives 'attention_mask', which model.name=gpt's forward does not take (data.source=padded_dicts); ",
    ),
    "a_token_id_beyond_the_embedding": (
        1,
        ("data.source=beyond_dicts",),
        "error: data.source=beyond_dicts: the batch's 'input_ids' hold 65, beyond the 65 ids the model embeds (the data's vocab_size 65); ",
    ),
    "an_output_without_logits": (
        1,
        ("data.source=windows_dicts", "model.name=no_logits"),
        "error: the model's forward returned keys hidden without 'logits': the loss and the metrics need the logits; ",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_a_dict_batch_asks_of_the_model_is_one_line(tmp_path, name):
    nproc, overrides, expected = REFUSED[name]
    result = run(dict_cmd(nproc, *RUN, *GPT, *ONE, *overrides, f"output_dir={tmp_path / 'out'}"), env=launch_env(tmp_path), timeout=120)
    # Several ranks: the launcher's exit code is 1 (torchrun's when a worker failed); each worker's is 2.
    assert_one_line_error(2 if nproc > 1 and result.returncode == 1 else result.returncode, result.output, expected)
    assert not (tmp_path / "out" / "checkpoints").exists() or not any((tmp_path / "out" / "checkpoints").iterdir())


def test_the_hub_decoder_masks_padding_as_transformers_does(llama):
    """models/hf.py hands a dict batch's attention_mask to its layers' masks (hf_layouts.py runs the decoder part by
    part): the logits are transformers' own with that mask, and left padding left unmasked would change them."""
    from parallel_train.models.hf import HFCausalLM, HFConfig

    model = HFCausalLM(HFConfig(name="hf", hf_path=str(llama), block_size=16), 300)
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (3, 8))
    mask = (torch.arange(8) >= torch.tensor([[0], [3], [1]])).long()  # sample i: its first 0, 3, 1 tokens are padding
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        got, unmasked = model(ids, attention_mask=mask), model(ids)
        want = model.hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got[1:], unmasked[1:], atol=1e-3)  # the padded samples: the mask matters
    torch.testing.assert_close(got[0], unmasked[0])  # the unpadded one: it does not


@pytest.mark.parametrize("batch", ["dict", "packed tuple"])
def test_every_tensor_of_a_batch_moves_to_the_device(batch):
    """batch.parts moves every tensor a batch holds, not only the main input and the labels: on the CPU the device is
    the host, so no run shows a mask left behind; the meta device does."""
    from parallel_train.data.batch import parts

    ids = torch.ones(2, 4, dtype=torch.long)
    if batch == "dict":
        given = {"input_ids": ids, "attention_mask": ids, "token_type_ids": ids * 0, "labels": ids}
    else:
        given = (ids, ids, torch.arange(4).expand(2, 4))
    x, y, others = parts(given, torch.device("meta"))
    assert others and all(t.device.type == "meta" for t in (x, y, *others.values()))
