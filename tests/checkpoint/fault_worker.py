"""A rank of the fault tests, started as its own process (``python -m tests.checkpoint.fault_worker MODE ...``).

* ``kill``: 3-rank 1F1B on env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the rank ``KILL_RANK`` sends
  itself SIGKILL inside step ``KILL_STEP``, from its first action's handler: a death mid-step. The others
  must fail on their own within the runtime's timeout, naming the dead rank and the action they waited on.
* ``write``: one process, one stage; saves step 1, then starts saving step 2 with a writer that stops
  halfway through its file and prints ``WRITING`` (the test kills it there).
* ``restart``: 2-rank 1F1B under ``torchrun --max-restarts 1``, a checkpoint after every step; on the first
  attempt rank ``KILL_RANK`` dies by SIGKILL inside step ``KILL_STEP``; the restarted attempt resumes from the
  newest complete checkpoint and finishes. Every line it prints names the attempt.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.rendezvous import rendezvous

import splitgrad
from splitgrad.pipeline import build_runtime
from splitgrad.pipeline.ir.actions import ActionKind

KILL_RANK, KILL_STEP, STEPS, TIMEOUT = 1, 3, 6, 20.0


def _model(n_stages: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        torch.nn.Sequential(splitgrad.Linear(8, 8, delay_wgrad_compute=True), torch.nn.Tanh())
        for _ in range(n_stages)
    ]


def kill() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    rt = build_runtime(
        _model(3), "1f1b", n_microbatches=4, loss_fn=F.mse_loss, timeout=TIMEOUT, record_timeline=False
    )
    step_now = {"step": 0}
    forward = rt.handlers[ActionKind.F]

    def dying_forward(ctx, action, received):  # the public per-kind handler table
        if rank == KILL_RANK and step_now["step"] == KILL_STEP:
            print(f"rank {rank}: SIGKILL at action {action} of step {KILL_STEP}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(ctx, action, received)

    rt.handlers[ActionKind.F] = dying_forward
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for step in range(1, STEPS + 1):
        step_now["step"] = step
        rt.step(x, y)
        print(f"rank {rank}: step {step} done", flush=True)
    rt.close()
    dist.destroy_process_group()


def write(root: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from splitgrad.pipeline.checkpoint import PipelineCheckpointer

    stages = _model(1)
    rt = build_runtime(stages, "1f1b", n_microbatches=2, loss_fn=F.mse_loss, record_timeline=False)
    opt = torch.optim.AdamW(rt.parameters())
    ckpt = PipelineCheckpointer(root, rt, stages[0], opt)
    rt.step(torch.randn(4, 8), torch.randn(4, 8))
    opt.step()
    ckpt.save(1)
    original = FileSystemWriter.write_data

    def stalls_halfway(self, plan, planner):  # write half of this rank's file, then hang there
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 64)
            f.flush()
        print("WRITING", flush=True)
        time.sleep(600)
        return original(self, plan, planner)

    FileSystemWriter.write_data = stalls_halfway
    ckpt.save(2)


def restart(root: str) -> None:
    from splitgrad.pipeline.checkpoint import PipelineCheckpointer

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # torchrun's store outlives a restart, and the dead attempt's keys with it (the gloo ranks' addresses):
    # a restarted rank could read its peer's old address before the new one is set, and fail to connect
    # (seen here as "connectFullMesh ... Connection refused" in the second attempt). Keys of an attempt of its own.
    store, rank, world = next(rendezvous("env://"))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    stages = _model(2)
    rt = build_runtime(
        stages, "1f1b", n_microbatches=2, loss_fn=F.mse_loss, timeout=TIMEOUT, record_timeline=False
    )
    opt = torch.optim.AdamW(rt.parameters(), lr=0.01)
    ckpt = PipelineCheckpointer(root, rt, torch.nn.Sequential(*stages), opt, timeout=TIMEOUT)
    done = 0
    if ckpt.latest() is not None:
        restored = ckpt.load()
        done = restored.step
        print(f"attempt {attempt} rank {rank}: resumed from {restored.path} after step {done}", flush=True)
    forward = rt.handlers[ActionKind.F]
    step_now = {"step": 0}

    def dying_forward(ctx, action, received):
        if attempt == 0 and rank == KILL_RANK and step_now["step"] == KILL_STEP:
            print(f"attempt {attempt} rank {rank}: SIGKILL in step {KILL_STEP}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(ctx, action, received)

    rt.handlers[ActionKind.F] = dying_forward
    for step in range(done + 1, STEPS + 1):
        step_now["step"] = step
        data = torch.Generator().manual_seed(step)  # the data position is the step
        x, y = torch.randn(8, 8, generator=data), torch.randn(8, 8, generator=data)
        rt.zero_grad()
        result = rt.step(x, y)
        opt.step()
        ckpt.save(step)  # synchronous: published before the next step starts
        loss = "-" if result.loss is None else repr(float(result.loss))
        print(f"attempt {attempt} rank {rank}: step {step} done, loss {loss}", flush=True)
    ckpt.close()
    rt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"kill": kill, "write": write, "restart": restart}[sys.argv[1]](*sys.argv[2:])
