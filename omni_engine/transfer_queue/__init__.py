"""TransferQueue: the rollout-to-training trajectory queue (slime-compatible HTTP, ZMQ RPC,
exact uid dedup, blocking and streaming reads, spill to disk, a write-ahead log).

It uses a few engine parts (LoopSocket); the engine imports nothing of it.
"""

from omni_engine.transfer_queue.client import (
    AckUncertainError,
    AsyncTransferQueueClient,
    BufferFullError,
    TransferQueueClient,
    TransferQueueError,
)
from omni_engine.transfer_queue.data_model import (
    BatchReadResult,
    BufferConfig,
    BufferStatus,
    MetaInfo,
    TimeoutPolicy,
    Trajectory,
    TrajectoryGroup,
)
from omni_engine.transfer_queue.service import Durability, TransferQueueService, WriteResult

__all__ = [
    "AckUncertainError",
    "AsyncTransferQueueClient",
    "BatchReadResult",
    "BufferConfig",
    "BufferFullError",
    "BufferStatus",
    "Durability",
    "MetaInfo",
    "TimeoutPolicy",
    "Trajectory",
    "TrajectoryGroup",
    "TransferQueueClient",
    "TransferQueueError",
    "TransferQueueService",
    "WriteResult",
]
