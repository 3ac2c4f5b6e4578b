"""The seed's import path of the wire format (it lives in ``omni_engine.wire``)."""

from omni_engine.wire.headers import WireFormatError  # noqa: F401
from omni_engine.wire.stage_serialization import (  # noqa: F401
    CustomType,
    DataLocation,
    StageMsgpackDecoder,
    StageMsgpackEncoder,
    register_wire_struct,
)

__all__ = ["CustomType", "DataLocation", "StageMsgpackDecoder", "StageMsgpackEncoder", "WireFormatError",
           "register_wire_struct"]
