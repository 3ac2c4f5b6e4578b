"""The seed's import path of ``StageEngineCoreProc`` (it lives in ``stage_core``, beside ``StageEngineCore``)."""

from omni_engine.stage_engine.stage_core import StageEngineCoreProc
from omni_engine.stage_engine.stage_entry import serve_zmq_stage

__all__ = ["StageEngineCoreProc", "serve_zmq_stage"]
