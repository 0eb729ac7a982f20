"""Pipeline schedules as plain data: IR, generators, lowering passes, validator, simulator.

Pure Python: nothing here imports torch.
"""
from schedule.generate import SCHEDULE_NAMES, generate, generate_forward, list_schedule
from schedule.ir import (Action, Op, Schedule, channel, format_schedule, offloaded_stages, peer_recv, round_robin,
                         stages_of, tie_actions, tied_stages)
from schedule.lower import (add_load_offload, add_optimizer, add_send_recv, add_tie, build, build_forward, resident_stages,
                            stage_intervals)
from schedule.grid import ScheduleError, format_grid
from schedule.simulate import SimResult, simulate
from schedule.validate import validate

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "add_load_offload",
    "add_optimizer",
    "add_send_recv",
    "add_tie",
    "build",
    "build_forward",
    "channel",
    "format_grid",
    "format_schedule",
    "generate",
    "generate_forward",
    "list_schedule",
    "offloaded_stages",
    "peer_recv",
    "resident_stages",
    "round_robin",
    "simulate",
    "stage_intervals",
    "stages_of",
    "tie_actions",
    "tied_stages",
    "validate",
]
