"""The wire format between the client and a stage process.

``protocol`` (message type enums, structs, and frames <-> one typed message),
``stage_serialization`` (msgpack with ext types, zero-copy frames and
shared-memory handles) and ``headers`` (checked tensor/array headers). Both the
ZMQ transport and the tests speak it; nothing here opens a socket.
"""
