"""Data-parallel attention + expert parallelism (DEP) at run time: process groups from torchrun's
environment, launching N ranks, one rank's engine with the step discipline that keeps every rank
in every collective, and EPLB. Design and commands: docs/parallelism.md.

    ctx = init_from_env()                               # RANK, WORLD_SIZE, MASTER_ADDR, ...
    eng = rank_engine_from_artifacts("artifacts/", ctx)  # this rank's requests + expert slots
    eng.generate(my_prompts)                            # then joins idle steps until all finish
"""

from .group import DistContext, free_port, init_from_env, shutdown
from .launch import is_rank_process, launch, relaunch_under_torchrun, torchrun_argv
from .runner import RankEngine, RankStats, StepError, rank_engine_from_artifacts

__all__ = [
           "DistContext",
           "RankEngine",
           "RankStats",
           "StepError",
           "free_port",
           "init_from_env",
           "is_rank_process",
           "launch",
           "rank_engine_from_artifacts",
           "relaunch_under_torchrun",
           "shutdown",
           "torchrun_argv",
]
