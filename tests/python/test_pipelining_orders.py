"""The pipeline schedules' per-rank orders equal PyTorch's (issue 34).

For many (schedule, pp ranks p, stages per rank v, microbatches m), libfsdp's order of compute actions on each
rank (src/pipelining/schedule_orders.cpp, printed by tests/pipelining/print_pipeline_orders.cpp, idle slots
left out) must be the order in which PyTorch's own schedule (the wheel's torch.distributed.pipelining) runs them.

PyTorch's side needs no real processes: each rank's schedule is built on the "fake" process group (its sends and
receives do nothing) over PipelineStages of a tiny Linear with static shapes, and one step() runs while
forward_one_chunk / backward_one_chunk / backward_weight_one_chunk are traced. So the reference is what PyTorch
executes, also for GPipe and 1F1B, whose step is a hand-written loop. For the multi-stage schedules the trace is
also checked against `schedule.pipeline_order[rank]` (which their step runs). Schedule1F1B's _get_pipeline_order
(used only to print the schedule) does not match what its step runs in 2.13 (the last rank shows 3F1..3F8 and no
3F0), so it is not used. A configuration PyTorch rejects (e.g. 1F1B with m < p) is skipped.
"""

import json
import subprocess
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_testing import BUILD, show

PRINT_ORDERS = BUILD / "bin" / "print_pipeline_orders"
BINARIES = [PRINT_ORDERS]

# Our schedule names -> PyTorch's classes.
CLASSES = {
    "gpipe": S.ScheduleGPipe,
    "1f1b": S.Schedule1F1B,
    "interleaved-1f1b": S.ScheduleInterleaved1F1B,
    "interleaved-zero-bubble": S.ScheduleInterleavedZeroBubble,
    "zbv-zero-bubble": S.ScheduleZBVZeroBubble,
}
SINGLE = ("gpipe", "1f1b")
MS = range(1, 17)


def configs(schedule):
    """(p, v, m) to compare for a schedule."""
    if schedule in SINGLE:
        return [(p, 1, m) for p in (1, 2, 3, 4, 8) for m in MS]
    if schedule == "zbv-zero-bubble":
        return [(p, 2, m) for p in (1, 2, 3, 4, 8) for m in MS]
    out = [(p, v, m) for v in (2, 3) for p in (1, 2, 3, 4) for m in MS]
    return out + [(8, 2, m) for m in (1, 4, 8, 9, 16)]


def stage_ids(schedule, p, v, rank):
    if schedule == "zbv-zero-bubble":
        return [rank, 2 * p - 1 - rank]
    return [rank + i * p for i in range(v)]


def pytorch_order(schedule, p, v, m, rank):
    """The compute actions PyTorch's schedule runs on `rank` in one step ("1F3", ...), and its pipeline_order
    (compute actions only; None for the single-stage schedules). Raises ValueError where PyTorch rejects (p, v, m)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p)
    n = p * v
    x = torch.zeros(1, 2)
    stages = [PipelineStage(nn.Linear(2, 2), i, n, torch.device("cpu"), input_args=(x,), output_args=(x,),
                            input_grads=(x,), output_grads=(x,)) for i in stage_ids(schedule, p, v, rank)]
    log = []
    for st in stages:
        # The fake group's receives leave their buffers as they are: vote "static shapes" without them.
        st._warmup_forward_vote = lambda has_backward, received_acc=None: torch.ones(1, dtype=torch.int32)
        st._warmup_backward_result = lambda received_result=None: torch.ones(1, dtype=torch.int32)
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", None),
                             ("backward_weight_one_chunk", "W")):
            def traced(*args, _orig=getattr(st, method), _kind=kind, _stage=st, **kwargs):
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
                k = _kind or ("B" if kwargs.get("full_backward", True) else "I")
                log.append(f"{_stage.stage_index}{k}{mb}")
                return _orig(*args, **kwargs)
            setattr(st, method, traced)
    cls = CLASSES[schedule]
    sched = cls(stages[0] if schedule in SINGLE else stages, m, loss_fn=lambda out, target: out.sum())
    ids = stage_ids(schedule, p, v, rank)
    sched.step(torch.zeros(m, 2) if 0 in ids else None, target=torch.zeros(m, 2) if n - 1 in ids else None)
    listed = None
    if schedule not in SINGLE:
        listed = [str(a) for a in sched.pipeline_order[rank]
                  if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
    return log, listed


def ours(specs):
    p = subprocess.run([str(PRINT_ORDERS), *specs], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, show(p)
    return json.loads(p.stdout)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", list(CLASSES))
def test_orders_equal_pytorch(schedule):
    theirs, rejected = {}, []
    for p, v, m in configs(schedule):
        spec = f"{schedule}:{p}:{v}:{m}"
        try:
            per_rank = {r: pytorch_order(schedule, p, v, m, r) for r in range(p)}
        except ValueError:  # PyTorch's own rule (1F1B: m >= p; interleaved: m divisible by rounds, ...)
            rejected.append(spec)
            continue
        theirs[spec] = per_rank
    assert len(theirs) >= 10, f"PyTorch accepted only {sorted(theirs)}; rejected {rejected}"
    mine = ours(list(theirs))
    diffs = []
    for spec, per_rank in theirs.items():
        for r, (traced, listed) in per_rank.items():
            # The trace is what PyTorch's step ran; for the multi-stage schedules it is their pipeline_order.
            assert listed is None or traced == listed, f"{spec} rank {r}: PyTorch ran {traced}, lists {listed}"
            got = mine[spec][str(r)]
            if got != traced:
                first = next((i for i, (a, b) in enumerate(zip(got, traced)) if a != b), min(len(got), len(traced)))
                diffs.append(f"{spec} rank {r}: first difference at action {first}:\n  libfsdp {got}\n  PyTorch {traced}")
    assert not diffs, f"{len(diffs)} rank orders differ from PyTorch's:\n" + "\n".join(diffs[:10])
