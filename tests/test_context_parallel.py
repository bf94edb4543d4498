"""Context parallelism (parallel.cp): the Ulysses exchange's arithmetic, the refusals, and real runs against one process.

The runs use test_mesh.py's settings (global batch 8, padded samples, SGD): a cp group reads one process's batch, each
rank its half of every row, so losses, evaluation and final weights must equal one process's to float tolerance.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from helpers import check, launch_env, run, summary, train_losses, warm_cmd
from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.parallel.context_parallel import ContextParallel, refuse_compositions, refuse_unsupported
from parallel_train.parallel.mesh import MeshLayout, resolve_layout
from test_mesh import SGD, assert_same_training


class ThreadGroup(ContextParallel):
    """A cp group of threads in one process: the all-to-all done through shared memory (chunk i to rank i)."""

    def __init__(self, rank: int, size: int, box: dict, barrier: threading.Barrier):
        super().__init__(None, rank, size)
        self.box, self.barrier = box, barrier

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait()
        self.box[self.rank] = x
        self.barrier.wait()
        out = torch.stack([self.box[j][self.rank] for j in range(self.size)])
        self.barrier.wait()
        return out


@pytest.mark.parametrize("n", [2, 4])
def test_ulysses_attention_on_parts_equals_causal_attention_on_the_whole(n):
    B, H, T, D = 2, 4, 8, 3
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    box, barrier, got = {}, threading.Barrier(n), [None] * n

    def rank(r: int) -> None:
        cp = ThreadGroup(r, n, box, barrier)
        got[r] = cp.attend(*(cp.cut(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(got, dim=2), want)
    assert ContextParallel(None, 1, n).positions(T // n, torch.device("cpu")).tolist() == list(range(T // n, 2 * T // n))


def cfg_with(**keys) -> Config:
    cfg = Config()
    for key, value in keys.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize(
    ("world", "keys", "message"),
    [
        (2, {"parallel__cp": 2, "model__block_size": 15}, r"parallel.cp=2 does not divide model.block_size=15"),
        (2, {"parallel__cp": 2, "model__n_head": 3, "model__n_embd": 48}, r"parallel.cp=2 does not divide model.n_head=3"),
        (2, {"parallel__cp": 2, "parallel__stage_devices": ["cpu", "cpu"]}, r"does not combine with parallel.stage_devices"),
        (2, {"parallel__cp": 2, "model__n_experts": 2}, r"does not combine with model.n_experts"),
        (3, {"parallel__cp": 2}, r"parallel.cp=2 does not divide the world size 3"),
    ],
)
def test_what_context_parallelism_does_not_build_is_a_one_line_error(world, keys, message):
    with pytest.raises(UserError, match=message) as e:
        refuse_unsupported(cfg_with(**keys), world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"parallel__tp": 4}, r"parallel.cp=2 x parallel.tp=4: each tp rank holds model.n_head/tp=4/4 heads .* a multiple of tp x cp = 8"),
        ({"parallel__tp": 2, "model__block_size": 18}, r"model.block_size/cp=18/2 tokens are cut into 2 .* a multiple of cp x tp = 4"),
    ],
)
def test_context_parallel_with_tensor_parallel_needs_whole_heads_per_rank(keys, message):
    """cp x tp: tp gives each rank n_head/tp heads and Ulysses splits those over cp (decided with the mesh's tp, which a
    launch config may give, before any collective)."""
    with pytest.raises(UserError, match=message) as e:
        resolve_layout(cfg_with(parallel__cp=2, model__n_head=4, **keys), 8, env={})
    assert "\n" not in str(e.value)
    assert resolve_layout(cfg_with(parallel__cp=2, parallel__tp=2, model__n_head=4), 4, env={}) == MeshLayout(cp=2, tp=2)
    with pytest.raises(UserError, match=r"is built for the template's GPT only \(model.name=hf\)"):  # what is checked
        refuse_compositions(cfg_with(parallel__cp=2, model__name="hf"), 1, 2)


def test_context_parallel_ranks_are_one_data_parallel_rank():
    layout = resolve_layout(cfg_with(parallel__cp=2), 4, env={})
    assert layout == MeshLayout(dp_replicate=2, cp=2) and layout.dp == 2 and layout.sharded
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # the two cp ranks of a group read one batch
    assert resolve_layout(cfg_with(parallel__cp=2, parallel__dp_shard=2), 4, env={}).dp_rank(3) == 1


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    done = {}

    def launch(name: str, nproc: int, *overrides: str):
        if name not in done:
            out = tmp / name
            done[name] = (out, check(run(warm_cmd(nproc, *SGD, *overrides, f"output_dir={out}"), env=launch_env(tmp), timeout=600)).output)
        return done[name]

    return launch


@pytest.mark.multiprocess
def test_context_parallel_on_2_ranks_equals_one_process(launched):
    out, log = launched("cp2", 2, "parallel.cp=2")
    assert "context parallel over 2 ranks (Ulysses all-to-all attention)" in log and "global batch 4 x 1 data-parallel ranks" in log
    assert_same_training(out, launched("ref", 1)[0])
    assert summary(out)["mesh"]["cp"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fsdp"), [("cp2_fsdp2", ("parallel.dp_shard=2",)), ("cp2_hsdp", ())])
def test_context_parallel_x_data_parallel_on_4_ranks_equals_one_process(launched, name, fsdp):
    """cp=2 x dp_shard=2 (FSDP2 over 4), and cp=2 with the replicas filling the world (HSDP: 2 replicas x 2 cp shards)."""
    out, log = launched(name, 4, "train.batch_size=2", "parallel.cp=2", *fsdp)
    assert "global batch 2 x 2 data-parallel ranks" in log
    assert_same_training(out, launched("ref", 1)[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "nproc", "layout"),
    [("on_1", 1, ()), ("on_fsdp2", 2, ("train.batch_size=2", "parallel.dp_shard=2")), ("cp_back_on", 2, ("parallel.cp=2",))],
)
def test_a_checkpoint_crosses_between_cp_and_other_layouts(launched, name, nproc, layout):
    """cp=2's step-3 checkpoint goes on on 1 process and on dp_shard=2; one process's goes on at cp=2: the same steps 4-6."""
    source = launched("ref", 1)[0] if name == "cp_back_on" else launched("cp2", 2, "parallel.cp=2")[0]
    out, _ = launched(f"resumed_{name}", nproc, *layout, f"resume={source}/checkpoints/step_0000003")
    assert_same_training(out, launched("ref", 1)[0], steps=range(4, 7))


H4 = ("model.n_head=4",)  # cp=2 x tp=2: each tp rank's 2 heads, split over the 2 cp ranks


@pytest.mark.slow
def test_context_parallel_x_tensor_parallel_on_4_ranks_equals_one_process(launched):
    """cp=2 x tp=2: Ulysses within each tp rank's heads, sequence parallel over each rank's T/cp part between the blocks,
    the loss on vocabulary shards of each rank's part (loss parallel), evaluation's logits gathered over cp per slice."""
    out, log = launched("cp2_tp2", 4, *H4, "parallel.cp=2", "parallel.tp=2")
    assert "tensor parallel + context parallel over 2 ranks" in log and "; sequence parallel and loss parallel" in log
    assert_same_training(out, launched("ref_h4", 1, *H4)[0])


PP2 = ("parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("tied", [(), ("model.tie_embeddings=true",)], ids=["untied", "tied"])
def test_context_parallel_x_pipeline_on_4_ranks_equals_one_process(launched, tied):
    """cp=2 x 2 pipeline stages (1F1B): each stage's ranks hold T/cp of every micro-batch, the stages send (B, T/cp, C),
    the first stage's positions are its part's, the last stage's loss is its part's; one process runs the same
    micro-batches as gradient accumulation. Tied: the embedding's copies on the first and last stage sum their gradients
    per cp rank (each holds its own FSDP2 shard of the weight: parallel/pipeline/tied.py)."""
    out, log = launched(f"cp2_pp2{'_tied' * bool(tied)}", 4, *tied, "parallel.cp=2", *PP2)
    assert "schedule 1f1b, 2 micro-batches x 2 accumulation = 4 per step" in log and "mesh cp 2 x pp 2" in log
    assert_same_training(out, launched(f"ref{'_tied' * bool(tied)}", 1, *tied)[0])


@pytest.mark.slow
def test_context_parallel_x_zero_bubble_pipeline_equals_one_process(launched):
    """cp=2 x ZB-V (4 stages V-placed on 2 ranks): the backward split into input and weight gradients, the attention's
    all-to-all in the input's."""
    out, _ = launched("cp2_zbv", 4, "parallel.cp=2", "parallel.pipeline_stages=2", "parallel.microbatches=4", "parallel.schedule=zbv")
    assert_same_training(out, launched("ref", 1)[0])


@pytest.mark.slow
def test_context_parallel_x_tensor_parallel_x_pipeline_on_8_ranks_equals_one_process(launched):
    """All three: each stage cut by tp (sequence and loss parallel) and by cp, sending (B, T/(cp x tp), C)."""
    out, log = launched("cp2_tp2_pp2", 8, *H4, "parallel.cp=2", "parallel.tp=2", *PP2)
    assert "mesh cp 2 x pp 2 x tp 2" in log and "; sequence parallel and loss parallel" in log
    assert_same_training(out, launched("ref_h4", 1, *H4)[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp2_tp2", "cp2_pp2"])
def test_a_cp_x_tp_or_pipeline_checkpoint_resumes_on_one_process(launched, name):
    """The step-3 checkpoint of cp=2 x tp=2 (each rank a shard cut by heads and by dp_shard x cp) and of cp=2 x 2 stages
    goes on on one process: the same steps 4-6."""
    heads = H4 if name == "cp2_tp2" else ()
    layout = ("parallel.tp=2",) if name == "cp2_tp2" else PP2
    source = launched(name, 4, *heads, "parallel.cp=2", *layout)[0]
    out, _ = launched(f"{name}_on_1", 1, *heads, f"resume={source}/checkpoints/step_0000003")
    assert min(train_losses(out)) == 4  # resumed, not started over
    assert_same_training(out, launched("ref_h4" if heads else "ref", 1, *heads)[0], steps=range(4, 7))


@pytest.mark.slow
def test_a_loss_loss_parallel_cannot_serve_under_cp_x_tp_equals_one_process(tmp_path):
    """Label smoothing (docs/guide.md) under cp=2 x tp=2: the logits of each rank's T/cp part gathered whole over tp for
    it (the notice counts that part), evaluation's gathered over cp as plain tensors."""
    from helpers import WarmCmd
    from test_tp_loss_and_lengths import RUN, SMOOTHED_TRAIN

    script = tmp_path / "smoothed_train.py"
    script.write_text(SMOOTHED_TRAIN)
    env, ref, cp_tp = launch_env(tmp_path), tmp_path / "ref", tmp_path / "cp2_tp2"
    check(run(WarmCmd(1, str(script), (*RUN, *H4, f"output_dir={ref}")), env=env))
    four = check(run(WarmCmd(4, str(script), (*RUN, *H4, "parallel.cp=2", "parallel.tp=2", f"output_dir={cp_tp}")), env=env))
    assert "4 x 8 x 65 x 4 bytes" in four.output  # a rank's micro-batch: batch 4, its 16/2 tokens, the whole vocabulary
    assert train_losses(cp_tp) == pytest.approx(train_losses(ref), rel=1e-5) and len(train_losses(ref)) == 3
    assert summary(cp_tp)["final_val_loss"] == pytest.approx(summary(ref)["final_val_loss"], rel=1e-5)
