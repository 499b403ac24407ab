"""Per-rank body of the CSV run test: torch's schedules, dumped as CSV, loaded and run by splitgrad's runtime.

Each rank generates the CSV itself with torch's schedule class (every rank gets the same file), loads it with
``Schedule.from_csv``, validates and simulates it, and runs one step of the float64 GPT from the runtime tests
with it; the loss and every local gradient are compared with the single-process reference.
"""

from __future__ import annotations

import os
import tempfile

from torch.distributed.pipelining import schedules as S

from splitgrad.models import lm_loss
from splitgrad.pipeline import Schedule, simulate, validate
from splitgrad.pipeline.runtime import build_runtime
from tests.pipeline.torch_grid import torch_schedule
from tests.pipeline_runtime.workers import MB, compare, gpt_model, gpt_reference, token_batch

CLASSES = (S.ScheduleInterleavedZeroBubble, S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV)
N_MICROBATCHES = 4


def run_csv_schedules(rank: int, world: int) -> dict[str, dict]:
    """``{class name: compare() result + losses}`` for each of ``CLASSES``, and a negative check."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cls in CLASSES:
            path = os.path.join(tmp, f"{cls.__name__}.csv")
            torch_schedule(cls, 2, N_MICROBATCHES, world)._dump_csv(path, format="compute_only")
            with open(path) as f:
                schedule = Schedule.from_csv(f.read(), name=cls.__name__)
            validate(schedule)
            simulate(schedule)
            model, stages = gpt_model(schedule.n_stages, seed=5)
            ids, tgt = token_batch(N_MICROBATCHES, seed=11)
            ref_loss, ref = gpt_reference(model, ids.split(MB), tgt.split(MB))
            runtime = build_runtime(stages, schedule, loss_fn=lm_loss, timeout=60)
            result = runtime.step(ids, tgt)
            res = compare(model, runtime, ref)
            res.update(loss=result.loss.item(), ref_loss=ref_loss, w_tasks=result.w_tasks)
            if cls is S.ScheduleDualPipeV:
                # Negative check: a reference on other data is rejected by the same comparison.
                other = gpt_reference(model, *(t.split(MB) for t in token_batch(N_MICROBATCHES, seed=12)))[1]
                res["other_data_bad"] = len(compare(model, runtime, other)["bad"])
            out[cls.__name__] = res
    return out
