"""Which of a library's functions is running now, read from the Python frames: how the adapters tell a model's
calls that a training framework's machinery makes (a pipeline schedule's step, a stage's shape inference) without
importing that framework."""
from __future__ import annotations

import sys
from types import FrameType
from typing import Collection


def running_frame(frame: FrameType | None, module: str, names: Collection[str],
                  outermost: bool = False) -> FrameType | None:
    """The frame, from ``frame`` outwards, of a call of one of ``names`` defined in ``module``: the innermost, or
    the ``outermost``; None when none runs, or when ``module`` was never loaded (then nothing is walked)."""
    if module not in sys.modules:
        return None
    found = None
    while frame is not None:
        if frame.f_code.co_name in names and frame.f_globals.get("__name__") == module:
            if not outermost:
                return frame
            found = frame
        frame = frame.f_back
    return found
