"""The seam between the pipeline and its stages.

Every stage client (one stage process, or a replica set of them) is a
``StageClient``; and the client side imports no engine code. The server, the orchestrator and the wire format run in the client process, which
never runs an engine (in-process stages aside, which import theirs when they start).
Parameter types both sides use live in neutral modules (``omni_engine.params``,
``omni_engine.inputs``), as vLLM keeps ``SamplingParams`` apart from its engine.
"""

from __future__ import annotations

import json
import subprocess
import sys

CLIENT_PACKAGES = ("omni_engine.pipeline", "omni_engine.wire", "omni_engine.entrypoints")
# The process side of a stage: what runs an engine.
ENGINE_MODULES = ("omni_engine.engines", "omni_engine.stage_engine.stage_core", "omni_engine.stage_engine.stage_core_proc",
                  "omni_engine.stage_engine.in_process")

_PROBE = """
import importlib, json, pkgutil, sys
imported = []
for name in sys.argv[1:]:
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
print(json.dumps({"imported": imported, "modules": sorted(sys.modules)}))
"""


def test_the_client_side_imports_no_engine_module():
    result = subprocess.run([sys.executable, "-c", _PROBE, *CLIENT_PACKAGES], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    imported = probe["imported"]
    # The probe really walked the client side (a package that failed to import would show here).
    for module in ("omni_engine.pipeline.orchestrator", "omni_engine.wire.stage_serialization",
                   "omni_engine.entrypoints.multi_stage_engine_client", "omni_engine.entrypoints.openai.app"):
        assert module in imported
    leaked = [m for m in probe["modules"] if any(m == e or m.startswith(e + ".") for e in ENGINE_MODULES)]
    assert leaked == [], f"the client side imported engine code: {leaked}"


def test_one_replica_and_a_replica_set_are_both_stage_clients():
    from omni_engine.pipeline.replica_set import StageReplicaSet
    from omni_engine.stage_engine.stage_client import StageClient
    from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient

    replicas = [StageEngineCoreClient(7), StageEngineCoreClient(7)]
    replica_set = StageReplicaSet(7, replicas)
    for client in (replicas[0], replica_set):
        assert isinstance(client, StageClient)
        assert client.resubmitted == 0 and not client.is_dead and client.ready is None
    # Not started: one status per replica, none with a pid.
    assert [s.pid for s in replicas[0].replica_status()] == [None]
    assert replicas[0].replicas == [replicas[0]] and replica_set.replicas == replicas
    assert [(s.alive, s.in_flight, s.submitted, s.pid) for s in replica_set.replica_status()] == [(True, 0, 0, None)] * 2
    for client in replicas:
        client._release_now()
