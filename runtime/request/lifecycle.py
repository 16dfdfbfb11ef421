"""Where a request stands, one enum for every front end: a request's Slot (runtime/request/slot.py, the server's
too) and its batch decoder's lane (runtime/request/batch.py) move through the same states.

    queued -> prefilling -> decoding -> done
        \\-------------\\----------\\-> failed (its own work raised; in a server: its deadline passed)
         \\-------------\\----------\\-> cancelled (its caller let it go: a closed stream, a later generation
                                      on its cache, a client that went away)
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


ENDED = frozenset((State.DONE, State.FAILED, State.CANCELLED))
