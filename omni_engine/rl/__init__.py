"""The learner's side of the async actor-learner loop (extra ``rl``); the engine imports nothing of it.

``ActorLearnerRun`` (``omni_engine.rl.runner``) builds a rank's loop from the YAML; the parts are
usable alone: the schedule and feasibility gate, versioned ready queues, the request gate and sync
fence, rollout clients, packing and the prefetch worker.
"""

from omni_engine.rl.fence import RequestGate, WeightSyncFence
from omni_engine.rl.learner import ActorLearner, merge_summaries
from omni_engine.rl.packing import EncodedSample, Pack, Packer, encode_chat
from omni_engine.rl.prefetch import PrefetchWorker
from omni_engine.rl.ready_queue import VersionedReadyQueue
from omni_engine.rl.rollout_client import HTTPRolloutClient, Rollout, RolloutClient, RolloutError
from omni_engine.rl.schedule import BresenhamSchedule, Channel, FeasibilityGate

__all__ = [
    "ActorLearner", "BresenhamSchedule", "Channel", "EncodedSample", "FeasibilityGate", "HTTPRolloutClient",
    "Pack", "Packer", "PrefetchWorker", "RequestGate", "Rollout", "RolloutClient", "RolloutError",
    "VersionedReadyQueue", "WeightSyncFence", "encode_chat", "merge_summaries",
]
