"""The command line's exit statuses (cli/main.py's docstring has the rule): 0 done, 1 a run failed, 2 a usage
error (one line naming the problem and the fix), 75 preempted (early_preempt.py), 130 interrupted."""

from __future__ import annotations

from graphtrain.early_preempt import EXIT_PREEMPTED

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PREEMPTED", "EXIT_USAGE"]
