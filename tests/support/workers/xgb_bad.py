"""Bad requests at a rank's federated endpoint, inside a real job; every rank reports how it
failed.  Modes: ``wrong-rank`` (a real XGBoost told the wrong federated_rank on rank 1),
``mismatch`` (ranks send Allreduce requests of different sizes), ``sequence`` (rank 1 skips a
sequence number), ``dtype`` (rank 1 asks for LONG_DOUBLE)."""

from __future__ import annotations

import contextlib
import sys
import time

import grpc
import numpy as np
import xgboost

import rabit2
from rabit2.xgboost import service
from rabit2.xgboost._proto import DATA_TYPES, MESSAGES, SERVICE
from rabit2.xgboost.service import Endpoint


def call(port: int, method: str, **fields: object) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = channel.unary_unary(f"/{SERVICE}/{method}",
                                   request_serializer=MESSAGES[f"{method}Request"].SerializeToString,
                                   response_deserializer=MESSAGES[f"{method}Reply"].FromString)
        stub(MESSAGES[f"{method}Request"](**fields), timeout=60)


def main() -> None:
    mode = sys.argv[1]
    # (how long an early sequence number waits for the calls before it: the refusal after
    # the wait is what is tested, not its length)
    service.SEQUENCE_WAIT_SEC = 1.0
    rabit2.init()
    rank, world = rabit2.get_rank(), rabit2.get_world_size()
    endpoint = Endpoint(rank, world)
    port = endpoint.start()
    started = time.monotonic()
    try:
        if mode == "wrong-rank":
            told = (rank + 1) % world if rank == 1 else rank
            xgboost.collective.init(dmlc_communicator="federated",
                                    federated_server_address=f"127.0.0.1:{port}",
                                    federated_world_size=world, federated_rank=told)
            xgboost.DMatrix(np.ones((10, 3)), np.ones(10))
        else:
            dtype = DATA_TYPES.index("DOUBLE")
            size = 8 * (3 if mode == "mismatch" and rank == 1 else 2)
            seq = 1 if mode == "sequence" and rank == 1 else 0
            if mode == "dtype" and rank == 1:
                dtype = DATA_TYPES.index("LONG_DOUBLE")
            call(port, "Allreduce", sequence_number=seq, rank=rank, send_buffer=b"\0" * size,
                 data_type=dtype, reduce_operation=2)
        print(f"bad rank={rank} outcome=ok", flush=True)
    except (grpc.RpcError, xgboost.core.XGBoostError) as exc:
        text = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        line = " ".join(text.split())[:400]
        print(f"bad rank={rank} outcome=error after={time.monotonic() - started:.1f}s "
              f"error={type(exc).__name__}: {line}", flush=True)
    finally:
        endpoint.stop()
        with contextlib.suppress(rabit2.RabitError):
            rabit2.finalize()


if __name__ == "__main__":
    main()
