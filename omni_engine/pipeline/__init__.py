"""The pipeline core: routing requests through a graph of stages.

``orchestrator`` (``PipelineOrchestrator``), ``stage_graph`` (who feeds whom,
with which input processor), ``request_state`` and ``request_events`` (one
request's bookkeeping and what it means for metrics), ``stage_supervisor``
(restarts), ``input_processors`` (edge processors), ``stage_specs`` (a
validated config turned into what each stage process is spawned with) and
``stage_clients`` (which client each replica gets; starting them all). It
talks to stages only through ``StageClient`` (one replica or a ``StageReplicaSet``); how messages travel is the
``stage_engine`` package's business.
"""
