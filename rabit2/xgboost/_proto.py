"""The messages of XGBoost's federated communicator, built from their descriptor at import.

XGBoost (2.1 and later, with ``USE_FEDERATED``) sends every collective it needs as one
unary gRPC call of the service ``xgboost.collective.federated.Federated``.  The contract is
``federated.proto`` beside this module; the same descriptor is compiled into
``libxgboost.so``; ``tests/integration/test_xgboost.py`` checks the two are equal.  Building
the classes from the descriptor at run time (instead of committing ``protoc`` output) keeps
them working on every protobuf runtime from 4.22 on, which generated code does not.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "xgboost.collective.federated"
SERVICE = f"{PACKAGE}.Federated"

# XGBoost casts its ArrayInterfaceHandler::Type straight into DataType: the order matters
DATA_TYPES = ("HALF", "FLOAT", "DOUBLE", "LONG_DOUBLE", "INT8", "INT16", "INT32", "INT64",
              "UINT8", "UINT16", "UINT32", "UINT64")
REDUCE_OPS = ("MAX", "MIN", "SUM", "BITWISE_AND", "BITWISE_OR", "BITWISE_XOR")

_T = descriptor_pb2.FieldDescriptorProto
_SEQ = ("sequence_number", 1, _T.TYPE_UINT64, "")
_RANK = ("rank", 2, _T.TYPE_INT32, "")
_SEND = ("send_buffer", 3, _T.TYPE_BYTES, "")
_RECV = ("receive_buffer", 1, _T.TYPE_BYTES, "")

_MESSAGES: dict[str, tuple[tuple[str, int, int, str], ...]] = {
    "AllgatherRequest": (_SEQ, _RANK, _SEND),
    "AllgatherReply": (_RECV,),
    "AllgatherVRequest": (_SEQ, _RANK, _SEND),
    "AllgatherVReply": (_RECV,),
    "AllreduceRequest": (_SEQ, _RANK, _SEND,
                         ("data_type", 4, _T.TYPE_ENUM, f".{PACKAGE}.DataType"),
                         ("reduce_operation", 5, _T.TYPE_ENUM, f".{PACKAGE}.ReduceOperation")),
    "AllreduceReply": (_RECV,),
    "BroadcastRequest": (_SEQ, _RANK, _SEND, ("root", 4, _T.TYPE_INT32, "")),
    "BroadcastReply": (_RECV,),
}
METHODS = ("Allgather", "AllgatherV", "Allreduce", "Broadcast")


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """``federated.proto`` as a FileDescriptorProto (what ``protoc`` would make of it)."""
    fd = descriptor_pb2.FileDescriptorProto(name="federated.proto", package=PACKAGE,
                                            syntax="proto3")
    for name, fields in _MESSAGES.items():
        msg = fd.message_type.add(name=name)
        for fname, number, ftype, type_name in fields:
            field = msg.field.add(name=fname, number=number, type=ftype,
                                  label=_T.LABEL_OPTIONAL)
            if type_name:
                field.type_name = type_name
    for ename, values in (("DataType", DATA_TYPES), ("ReduceOperation", REDUCE_OPS)):
        enum = fd.enum_type.add(name=ename)
        for number, vname in enumerate(values):
            enum.value.add(name=vname, number=number)
    service = fd.service.add(name="Federated")
    for method in METHODS:
        m = service.method.add(name=method, input_type=f".{PACKAGE}.{method}Request",
                               output_type=f".{PACKAGE}.{method}Reply")
        m.options.SetInParent()
    return fd


def _classes() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor())
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
            for name in _MESSAGES}


MESSAGES = _classes()
