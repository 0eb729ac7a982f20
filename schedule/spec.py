"""What defines a pipeline's programs, as one value.

Every rank's program is a pure function of the stage -> rank mapping and of a ``ProgramSpec``;
the run, the memory plan and the mapping planner build from the same spec, so they cannot
disagree about what the program is.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from schedule.ir import Schedule
from schedule.lower import build, build_forward, device_stepped_stages, resident_stages


@dataclass(frozen=True)
class ProgramSpec:
    """The settings a program is built from (``schedule.lower.build``).

    Attributes:
        schedule: schedule name (``schedule.generate.SCHEDULE_NAMES``).
        num_stages: pipeline stages, virtual stages included.
        num_microbatches: micro-batches per iteration (of one replica's pipeline).
        offload: parameters live on the host and are loaded per residency interval.
        prefetch: each LOAD is issued one interval early (only with ``offload``).
        clip: the global gradient norm is needed (a NORM before the steps).
        resident: with ``offload``, stages per rank that stay on the device.
        tied: the first and last stage hold copies of one tied matrix (a TIE before the steps).
        num_segments: sequence segments per micro-batch's rows (1: whole sequences).
        receive_ahead: computes by which a receive is posted before the compute that takes it.
        device_steps: with ``offload``, offloaded stages per rank whose AdamW step runs on the
            device (``device_stepped``); the program is the same, only where its STEP runs differs.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    offload: bool = False
    prefetch: bool = False
    clip: bool = False
    resident: int = 0
    tied: bool = False
    num_segments: int = 1
    receive_ahead: int = 0
    device_steps: int = 0

    def device_stepped(self, mapping: list[int]) -> frozenset[int]:
        """The offloaded stages whose STEP runs on their GPU (``schedule.lower.device_stepped_stages``)."""
        if not self.offload or not self.device_steps:
            return frozenset()
        return device_stepped_stages(mapping, resident_stages(mapping, self.resident), self.device_steps)

    def build(self, mapping: list[int]) -> Schedule:
        """Every rank's training program, validated: built once per spec and mapping (the memory
        plan asks again for every candidate it weighs), each caller given its own lists."""
        return {rank: list(actions) for rank, actions in _built(self, tuple(mapping)).items()}

    def build_forward(self, mapping: list[int]) -> Schedule:
        """Every rank's forward-only program (evaluation), validated."""
        return build_forward(self.num_stages, self.num_microbatches, mapping, offload=self.offload,
                             prefetch=self.prefetch, resident=self.resident, num_segments=self.num_segments,
                             receive_ahead=self.receive_ahead)


@functools.lru_cache(maxsize=256)
def _built(spec: ProgramSpec, mapping: tuple[int, ...]) -> Schedule:
    return build(spec.schedule, spec.num_stages, spec.num_microbatches, list(mapping), offload=spec.offload,
                 prefetch=spec.prefetch, clip=spec.clip, resident=spec.resident, tied=spec.tied,
                 num_segments=spec.num_segments, receive_ahead=spec.receive_ahead)


__all__ = ["ProgramSpec"]
