"""The wire format between the client and a stage process.

``protocol`` (message structs and type enums), ``stage_serialization``
(msgpack with ext types, zero-copy frames and shared-memory handles),
``headers`` (checked tensor/array headers) and ``framing`` (frames <-> one
typed message). Both the ZMQ transport and the tests speak it; nothing here
opens a socket.
"""
