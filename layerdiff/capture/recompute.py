"""Activation checkpointing's recomputation, told apart from the forward pass it replays.

A checkpointed region keeps no activations: backward runs its forward again (``torch.utils.checkpoint``, HF's
gradient checkpointing, Megatron's recompute). Recorded as new calls, the replayed modules would read as a second
call of each and every region as a new step, and a run with checkpointing would not align with one without. So the
calls made while recomputing take the numbers of the calls they replay: their forward records are kept apart
(``recompute``), and the backward that runs through them (reentrant checkpointing builds the graph it
differentiates there) is the backward of the original calls.

Which call a recomputation replays, for a recomputed call whose caller is not recorded: the call of its module
in this step, not replayed yet, that was given the most of the same input tensors (a checkpoint recomputes on the
tensors it kept; a mask every microbatch shares tells none apart; a tensor given to a call and freed since counts
for none, as a tensor the recomputation makes may take its bytes and its identity); else a call in the same
caller's call as the one the previous such call replayed (a checkpointed ``forward`` whose children are
recomputed one after the other, transformers' way); else the latest (backward meets a step's calls last to
first). The calls inside it replay that call's own calls, in order.
"""
from __future__ import annotations

import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass
class Replay:
    """What the calls inside one replayed call replay: each module's calls inside the original, in order."""

    calls: dict[str, deque] = field(default_factory=dict)  # path -> deque of (call, micro)


class StepCalls:
    """The module calls of the step in progress, in the order they began, with how deep each was."""

    def __init__(self):
        self.log: list[tuple[str, int, int, int | None, tuple | None]] = []  # (path, call, depth, micro, parent)
        self.of_path: dict[str, list[int]] = {}  # path -> its calls' places in ``log``, in order
        # an input tensor's identity -> (the place of a call given it, a weak reference to the tensor given)
        self.given: dict[Any, list[tuple[int, weakref.ref]]] = {}
        self.replayed: set[tuple[str, int]] = set()
        self.last_parent: tuple | None = None  # the caller of the call the previous recomputed root replayed

    def clear(self) -> None:
        self.log.clear()
        self.of_path.clear()
        self.given.clear()
        self.replayed.clear()
        self.last_parent = None

    def add(self, path: str, call: int, depth: int, micro: int | None, parent: tuple | None,
            inputs: Iterable[tuple[Any, Any]]) -> None:
        """A call of the forward pass; ``inputs``: (identity, tensor) of its input tensors (identity None for one
        without)."""
        place = len(self.log)
        self.of_path.setdefault(path, []).append(place)
        for identity, tensor in inputs:
            if identity is not None:
                self.given.setdefault(identity, []).append((place, weakref.ref(tensor)))
        self.log.append((path, call, depth, micro, parent))

    def replay_root(self, path: str, inputs: Iterable[Any], same: Callable[[Any, Any], bool]
                    ) -> tuple[int, int | None, Replay] | None:
        """(call, microbatch, what its calls replay) for a recomputed call of ``path`` that no replayed call
        encloses, given input tensors of identities ``inputs`` (see the module docstring); None when every call of
        ``path`` in this step was replayed. ``same(tensor, identity)``: a tensor given earlier (None once freed)
        is alive and still shows the bytes of that identity."""
        open_places = [place for place in self.of_path.get(path) or ()
                       if (path, self.log[place][1]) not in self.replayed]
        if not open_places:
            return None
        # how many of its input tensors each open call was given (a mask every microbatch shares counts for all)
        is_open = set(open_places)
        shared = Counter(place for identity in set(inputs) if identity is not None
                         for place, given in self.given.get(identity, ())
                         if place in is_open and same(given(), identity))
        siblings = [place for place in open_places if self.last_parent is not None
                    and self.log[place][4] == self.last_parent]
        if shared:
            most = max(shared.values())
            place = max(p for p, n in shared.items() if n == most)
        else:
            place = siblings[0] if siblings else open_places[-1]
        _, call, depth, micro, parent = self.log[place]
        self.replayed.add((path, call))
        self.last_parent = parent
        replay = Replay()
        for inner_path, inner_call, inner_depth, inner_micro, _ in self.log[place + 1:]:
            if inner_depth <= depth:
                break
            replay.calls.setdefault(inner_path, deque()).append((inner_call, inner_micro))
        return call, micro, replay

    def replay_next(self, replay: Replay, path: str) -> tuple[int, int | None] | None:
        """(call, microbatch) that the next recomputed call of ``path`` inside a replayed call replays."""
        queue = replay.calls.get(path)
        if not queue:
            return None
        call, micro = queue.popleft()
        self.replayed.add((path, call))
        return call, micro
