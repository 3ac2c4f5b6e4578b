"""The pipeline core: routing requests through a graph of stages.

``orchestrator`` (``PipelineOrchestrator``), ``stage_graph`` (who feeds whom,
with which input processor), ``request_state`` (one request's bookkeeping and its
one ending: abort, failure, finish), ``replica_set``
(a stage's replicas as one), ``stage_supervisor`` (restarts),
``input_processors`` (edge processors), ``stage_specs`` (a validated config
turned into what each stage process is spawned with) and ``stage_clients``
(which client each replica gets; starting a pipeline). It talks to stages only
through ``StageClient``; how messages travel is the ``stage_engine`` package's
business.
"""
