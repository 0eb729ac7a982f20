"""What the schedule tests share (tests/pure/test_schedule.py, test_validate.py,
test_schedule_segments.py): the sweep axes, golden lists parsed from their printout, and two
peaks read off an action list."""
from __future__ import annotations

from schedule import Action, Op

NAMES = ["gpipe", "1f1b", "interleaved"]
MICROBATCHES = [1, 2, 3, 4, 5, 8]
# (offload, prefetch, clip)
LOWERINGS = [(False, False, False), (True, False, False), (True, True, False), (False, False, True), (True, True, True)]


def parse_schedule(text: str) -> dict[int, list[Action]]:
    """Inverse of ``format_schedule``, so golden lists read like the printout."""
    out = {}
    for line in text.strip().splitlines():
        head, body = line.split(":")
        out[int(head.split()[1])] = [Action.parse(t) for t in body.split()]
    return out


def peak_in_flight(actions: list[Action]) -> int:
    """Most forwards whose backward has not run yet, i.e. activations held at once."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD:
            live -= 1
    return peak


def peak_resident(actions: list[Action]) -> int:
    resident, peak = set(), 0
    for a in actions:
        if a.op is Op.LOAD:
            resident.add(a.stage)
        elif a.op in (Op.DROP, Op.OFFLOAD_GRADS):
            resident.discard(a.stage)
        peak = max(peak, len(resident))
    return peak
