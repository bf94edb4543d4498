"""Context parallelism (parallel.cp): the Ulysses exchange's arithmetic, the refusals, and real runs against one process.

The runs use test_mesh.py's settings (global batch 8, padded samples, SGD): a cp group reads one process's batch, each
rank its half of every row, so losses, evaluation and final weights must equal one process's to float tolerance.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from helpers import check, launch_env, run, summary, warm_cmd
from parallel_train.config.sections import Config
from parallel_train.errors import UserError
from parallel_train.parallel.context_parallel import ContextParallel, refuse_unsupported
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
        (4, {"parallel__cp": 2, "parallel__tp": 2}, r"parallel.cp=2 does not combine with parallel.tp=2"),
        (4, {"parallel__cp": 2, "parallel__pipeline_stages": 2}, r"does not combine with parallel.pipeline_stages"),
        (2, {"parallel__cp": 2, "model__n_experts": 2}, r"does not combine with model.n_experts"),
        (3, {"parallel__cp": 2}, r"parallel.cp=2 does not divide the world size 3"),
    ],
)
def test_what_context_parallelism_does_not_build_is_a_one_line_error(world, keys, message):
    with pytest.raises(UserError, match=message) as e:
        refuse_unsupported(cfg_with(**keys), world)
    assert "\n" not in str(e.value)


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
