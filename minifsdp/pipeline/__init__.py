"""minifsdp.pipeline: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero bubble) with
``torch.distributed.pipelining``'s API.

Split a model into stages by layers; each rank runs its stage(s) on a stream of
micro-batches, passing activations forward and gradients back with send/recv.
Code written for ``torch.distributed.pipelining`` with hand-built stages runs
by changing the import::

    from minifsdp.pipeline import PipelineStage, ScheduleGPipe    # was: torch.distributed.pipelining
    stage = PipelineStage(stage_module, rank, world_size, device)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(x)
    elif rank == world_size - 1:
        out = schedule.step(target=y, losses=losses)
    else:
        schedule.step()

Read in this order: ``plan.py`` (a plan as data and on paper: messages,
timeline, bubble, peak activations), ``schedules.py`` (the plans of GPipe,
1F1B, interleaved and zero bubble, printable before anything runs),
``validator.py`` (what makes a plan runnable), ``stage.py`` (one stage: forward, B / I / W backward, messages),
``executor.py`` (the loop that runs any plan; torch's schedule classes),
``partition.py`` (cutting a GPT by balance or parameter count) and
``parallel.py`` (pipeline x data parallel, for the trainer).
"""

from .executor import (PipelineSchedule, Schedule1F1B, ScheduleFromPlan, ScheduleGPipe, ScheduleInterleaved1F1B,
                       ScheduleInterleavedZeroBubble, measured_bubble, measured_spans, split_microbatches)
from .parallel import SCHEDULE_CLASSES, PipelineParallel, pipeline_groups
from .partition import GPTStage, balance_by_params, gpt_layers, split_gpt
from .plan import Action, Plan, ScheduleError, Timeline, lower, simulate
from .schedules import SCHEDULES, gpipe, interleaved_1f1b, make_plan, one_f_one_b, zero_bubble
from .stage import CHECKPOINT_MODES, PipelineStage
from .validator import validate

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "ScheduleFromPlan", "PipelineSchedule", "split_microbatches",
           "Action", "Plan", "SCHEDULES", "make_plan", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble",
           "lower", "validate", "simulate", "Timeline", "ScheduleError", "GPTStage", "gpt_layers",
           "balance_by_params", "split_gpt", "CHECKPOINT_MODES", "PipelineParallel", "SCHEDULE_CLASSES",
           "pipeline_groups", "measured_bubble", "measured_spans"]
