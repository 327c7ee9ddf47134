"""rabit2: fault-tolerant allreduce/broadcast for Python.

The API follows rabit (``init``, ``allreduce``, ``broadcast``, ``checkpoint``, ...) and also
answers to the ``xgboost.collective`` spellings.  See ``docs/user-guide.md``.
"""

from rabit2 import aio, errors
from rabit2.api import (
    CommunicatorContext,
    agree,
    allgather,
    allreduce,
    broadcast,
    checkpoint,
    communicator_print,
    finalize,
    get_processor_name,
    get_rank,
    get_world_size,
    init,
    is_distributed,
    lazy_checkpoint,
    load_checkpoint,
    recovery_statistics,
    signal_error,
    tracker_print,
    version_number,
)
from rabit2.core.ops import Op
from rabit2.errors import LiveSetError, RabitError
from rabit2.live import LiveSet, live_set

#: rabit's spelling of :attr:`Op.MAX <rabit2.Op.MAX>`: the element-wise maximum.
MAX = Op.MAX
#: rabit's spelling of :attr:`Op.MIN <rabit2.Op.MIN>`: the element-wise minimum.
MIN = Op.MIN
#: rabit's spelling of :attr:`Op.SUM <rabit2.Op.SUM>`: the element-wise sum.
SUM = Op.SUM
#: rabit's spelling of :attr:`Op.BITOR <rabit2.Op.BITOR>`: the element-wise bitwise OR
#: (integer dtypes only).
BITOR = Op.BITOR

__version__ = "0.1.0"

__all__ = [
    "BITOR",
    "MAX",
    "MIN",
    "SUM",
    "CommunicatorContext",
    "LiveSet",
    "LiveSetError",
    "Op",
    "RabitError",
    "agree",
    "aio",
    "allgather",
    "allreduce",
    "broadcast",
    "checkpoint",
    "communicator_print",
    "errors",
    "finalize",
    "get_processor_name",
    "get_rank",
    "get_world_size",
    "init",
    "is_distributed",
    "lazy_checkpoint",
    "live_set",
    "load_checkpoint",
    "recovery_statistics",
    "signal_error",
    "tracker_print",
    "version_number",
]
