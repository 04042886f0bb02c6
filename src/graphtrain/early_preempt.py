"""SIGTERM before the first step: exit 75 (preempted) with one line, from the moment `graphtrain train` starts.

Until the training loop's `PreemptionGuard` takes over, SIGTERM's default action ended the process with 143 and
no word: while torch was imported, the data prepared (reading the corpus, training the tokenizer) or the model
built. Nothing had run and nothing was written, so the process ends at once, saying so. `graphtrain train` holds
this from its first line until `fit()` begins; a `Trainer` built from Python holds it while it is built.

Kept free of torch: the command line installs it before importing the trainer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

EXIT_PREEMPTED = 75
MESSAGE = (
    "preempted: SIGTERM before the first step (while the data and model were prepared): nothing was lost, "
    "no step had run and no checkpoint was written or changed; run the same command again (--resume auto "
    "continues a run that has checkpoints)"
)


class PreemptedBeforeStart(SystemExit):
    """Raised by the SIGTERM handler of `before_first_step`: a SystemExit with status 75."""


@contextlib.contextmanager
def before_first_step() -> Iterator[None]:
    """SIGTERM inside the block: print MESSAGE (rank 0) and raise PreemptedBeforeStart(75). Nested blocks are
    fine (each restores the handler it found). Outside the main thread signals cannot be handled: a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        if os.environ.get("RANK", "0") == "0":
            print(MESSAGE, file=sys.stderr, flush=True)
        raise PreemptedBeforeStart(EXIT_PREEMPTED)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
