"""The CPU priority of provider auto's background work (the Inductor compile process, runtime/background.py, and the
training process's Inductor setup thread, runtime/workers.py): a nice increment over the training process's,
``GRAPHTRAIN_BACKGROUND_NICE`` (default 0: the steps' own priority; what each setting costs is measured in
runtime/background.py). Standard library only: the background child reads it before it imports torch."""

from __future__ import annotations

import os

NICE_ENV = "GRAPHTRAIN_BACKGROUND_NICE"
DEFAULT_NICE = 0  # the steps' own priority; 19 puts the steps first (runtime/background.py's docstring)


def background_nice() -> int:
    """The CPU priority (nice increment over the training process's) of the background compile and of the
    training process's compiler probe."""
    try:
        return int(os.environ.get(NICE_ENV, DEFAULT_NICE))
    except ValueError:
        return DEFAULT_NICE


def lower_priority(who: int, than: int) -> None:
    """Set process or thread `who` (a pid or a Linux thread id) to the background nice increment over `than`'s
    nice value; never raises it. A no-op where the OS has no nice values or `who` has ended."""
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, than) + background_nice())
        if os.getpriority(os.PRIO_PROCESS, who) < target:
            os.setpriority(os.PRIO_PROCESS, who, target)
    except (OSError, AttributeError):
        pass
