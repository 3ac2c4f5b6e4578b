"""How tensors travel between the client and a stage process: one typed record.

Built once on the client (``envs.connector_settings``: the pipeline's
``runtime.connectors`` over the documented environment overrides over these
defaults) and handed to every stage inside its process spec, so both ends of
a pipeline use the same values and nothing reads the environment in a stage.
Imports nothing but msgspec: the spec that carries it is unpickled in a fresh
stage process before vLLM is imported there.
"""

from __future__ import annotations

import msgspec

DEFAULT_INLINE_THRESHOLD = 256
DEFAULT_SHM_THRESHOLD = 1 << 20
DEFAULT_SHM_POOL_BYTES = 2 << 30


class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Thresholds and switches of the tensor connectors (README "Wire format and shared memory")."""

    # False: every tensor travels as a ZMQ frame, none through shared memory.
    use_shm: bool = True
    # Tensors of at least this many bytes go through the stage's shared-memory pool.
    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    # Tensors smaller than this travel inside the msgpack body.
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD
    # Most shared memory one stage's pool holds; beyond it, ZMQ frames.
    shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES
    # Pickled objects on the wire (unsafe with untrusted peers; both ends must agree).
    allow_pickle: bool = False


DEFAULT_CONNECTORS = ConnectorSettings()
