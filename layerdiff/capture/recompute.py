"""Activation checkpointing's recomputation, told apart from the forward pass it replays.

A checkpointed region keeps no activations: backward runs its forward again (``torch.utils.checkpoint``, HF's
gradient checkpointing, Megatron's recompute). Recorded as new calls, the replayed modules would read as a second
call of each and every region as a new step, and a run with checkpointing would not align with one without. So the
calls made while recomputing take the numbers of the calls they replay: their forward records are kept apart
(``recompute``), and the backward that runs through them (reentrant checkpointing builds the graph it
differentiates there) is the backward of the original calls.

Which call a recomputation replays: backward meets a step's calls last to first, so a recomputed call whose
caller is not recorded replays the latest call of its module not replayed yet; the calls inside it replay that
call's own calls, in order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Replay:
    """What the calls inside one replayed call replay: each module's calls inside the original, in order."""

    calls: dict[str, deque] = field(default_factory=dict)  # path -> deque of (call, micro)


class StepCalls:
    """The module calls of the step in progress, in the order they began, with how deep each was."""

    def __init__(self):
        self.log: list[tuple[str, int, int, int | None]] = []  # (path, call, depth, micro)
        self.at: dict[tuple[str, int], int] = {}  # (path, call) -> its place in ``log``
        self.of_path: dict[str, list[int]] = {}  # path -> its calls' places in ``log``, in order
        self.replayed: set[tuple[str, int]] = set()

    def clear(self) -> None:
        self.log.clear()
        self.at.clear()
        self.of_path.clear()
        self.replayed.clear()

    def add(self, path: str, call: int, depth: int, micro: int | None) -> None:
        self.at[(path, call)] = len(self.log)
        self.of_path.setdefault(path, []).append(len(self.log))
        self.log.append((path, call, depth, micro))

    def replay_root(self, path: str) -> tuple[int, int | None, Replay] | None:
        """(call, microbatch, what its calls replay) for a recomputed call of ``path`` that no replayed call
        encloses: the latest call of ``path`` in this step not replayed yet; None when there is none."""
        places = self.of_path.get(path) or []
        while places:
            place = places.pop()
            _, call, depth, micro = self.log[place]
            if (path, call) in self.replayed:
                continue
            self.replayed.add((path, call))
            replay = Replay()
            for inner_path, inner_call, inner_depth, inner_micro in self.log[place + 1:]:
                if inner_depth <= depth:
                    break
                replay.calls.setdefault(inner_path, deque()).append((inner_call, inner_micro))
            return call, micro, replay
        return None

    def replay_next(self, replay: Replay, path: str) -> tuple[int, int | None] | None:
        """(call, microbatch) that the next recomputed call of ``path`` inside a replayed call replays."""
        queue = replay.calls.get(path)
        if not queue:
            return None
        call, micro = queue.popleft()
        self.replayed.add((path, call))
        return call, micro
