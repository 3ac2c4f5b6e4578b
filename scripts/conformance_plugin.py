"""pytest plugin for scripts/conformance.sh: vLLM's own entrypoint tests against a running server.

Loaded with ``-p conformance_plugin`` (``scripts/`` on ``PYTHONPATH``) in a pytest run whose rootdir is
vLLM's release source (only its ``tests/`` extracted; ``vllm`` itself is the installed package). It

* replaces ``tests.utils.RemoteOpenAIServer`` (what ``from tests.utils import`` and ``from ...utils
  import`` bind) by :class:`RunningServer`, which starts nothing and points every test at the server in
  ``CONFORMANCE_URL``. The arguments a test's fixture would have launched its server with are compared
  with the flags the running server got (``CONFORMANCE_SERVER_FLAGS``): capacity and precision flags are
  ignored (both servers run SmolLM2-135M with smollm2_text.yaml's engine arguments), a model name the
  server does not serve (``CONFORMANCE_SERVED_NAMES``) or a behaviour flag it lacks skips the test as
  "not runnable", naming what is missing;
* loads the served model's tokenizer for every served name (``CONFORMANCE_MODEL_DIR``), since the model
  answering under ``Qwen/Qwen3-0.6B`` there is SmolLM2 (other names still go to the HF hub, offline);
* lets a file whose server fixture also loads a LoRA adapter from the HF hub run its base-model tests:
  the adapter's download is answered with a path that is never read, the LoRA flags are not asked of
  the running server, and each test that sends the adapter's name is not runnable (omni-engine serve
  refuses ``--lora-modules``; the adapters cannot be fetched offline);
* puts a wall-clock limit on each test (``CONFORMANCE_TIMEOUT`` seconds, SIGALRM);
* writes one JSON line per test to ``CONFORMANCE_RESULTS``: nodeid, outcome (passed, failed, error,
  skipped, xfailed, xpassed), reason.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import types
from urllib.parse import urlparse

import pytest

SRC = os.environ.get("CONFORMANCE_SRC", os.getcwd())
URL = os.environ.get("CONFORMANCE_URL", "http://127.0.0.1:8000")
API_KEY = os.environ.get("CONFORMANCE_API_KEY", "")
SERVED = [n for n in os.environ.get("CONFORMANCE_SERVED_NAMES", "").split(",") if n]
SERVER_FLAGS = json.loads(os.environ.get("CONFORMANCE_SERVER_FLAGS", "[]"))
MODEL_DIR = os.environ.get("CONFORMANCE_MODEL_DIR", "")
TIMEOUT = float(os.environ.get("CONFORMANCE_TIMEOUT", "180"))
RESULTS = os.environ.get("CONFORMANCE_RESULTS", "")

# Flags that size or place the engine, or launch the process: both servers run smollm2_text.yaml's
# engine arguments whatever a test asked (float32, eager, 16 sequences), so these do not decide whether
# a test can run. "--seed" and "--port" are what RemoteOpenAIServer itself adds. --max-model-len is
# compared (conformance.py groups the files by it).
IGNORED = {
    "--dtype", "--max-num-seqs", "--enforce-eager", "--gpu-memory-utilization",
    "--seed", "--port", "--host", "--no-enable-prefix-caching", "--enable-prefix-caching",
    "--enable-chunked-prefill", "--max-cpu-loras", "--max-lora-rank", "--enable-lora",
}
# A fixture's ``--lora-modules name=path``: the names are recorded (tests sending one are not runnable),
# the flag itself is not asked of the running server.
LORA_FLAG = "--lora-modules"
LORA_ADAPTERS: set[str] = set()
# Flags that take no value (the others take the next token unless written --flag=value).
SWITCHES = {
    "--enforce-eager", "--no-enable-prefix-caching", "--enable-prefix-caching", "--enable-chunked-prefill",
    "--enable-lora", "--enable-auto-tool-choice", "--enable-prompt-tokens-details",
    "--enable-tokenizer-info-endpoint", "--enable-force-include-usage", "--return-tokens-as-token-ids",
    "--enable-server-load-tracking", "--trust-remote-code", "--enable-log-outputs", "--enable-log-requests",
    "--disable-log-stats", "--enable-request-id-headers", "--enable-prompt-embeds", "--enable-sleep-mode",
    "--disable-frontend-multiprocessing", "--enable-mfu-metrics", "--enable-log-deltas",
}


def parse_flags(args: list[str]) -> dict[str, list[str]]:
    """{flag: [values]}; a switch has the value ""; --served-model-name keeps all its names."""
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        tok = str(args[i])
        i += 1
        if not tok.startswith("--"):
            continue
        if "=" in tok:
            flag, value = tok.split("=", 1)
            out.setdefault(flag, []).append(value)
            continue
        if tok in SWITCHES:
            out.setdefault(tok, []).append("")
            continue
        values = []
        while i < len(args) and not str(args[i]).startswith("--"):
            values.append(str(args[i]))
            i += 1
            if tok != "--served-model-name":
                break
        out.setdefault(tok, []).extend(values or [""])
    return out


HAVE = parse_flags(SERVER_FLAGS)


def missing_for(model: str, wanted: list[str], env_dict: dict | None) -> list[str]:
    """What the running server lacks for a test that would launch ``vllm serve model *wanted``."""
    lacks = []
    want = parse_flags(list(wanted))
    names = want.pop("--served-model-name", None) or [model]
    for name in names:
        if name not in SERVED:
            lacks.append(f"model {name!r} (served: a small text model)")
    LORA_ADAPTERS.update(v.split("=", 1)[0] for v in want.pop(LORA_FLAG, []) if v)
    for flag, values in want.items():
        if flag in IGNORED:
            continue
        have = HAVE.get(flag)
        if have is None or sorted(have) != sorted(values):
            shown = " ".join(v for v in values if v)
            lacks.append(f"{flag} {shown}".strip())
    if env_dict:
        lacks.append("server environment " + " ".join(f"{k}={v}" for k, v in env_dict.items()))
    return lacks


def _stub_tblib() -> None:
    """vLLM's tests/conftest.py installs tblib's exception pickling; not needed against a server."""
    try:
        import tblib  # noqa: F401
    except ImportError:
        mod = types.ModuleType("tblib")
        sub = types.ModuleType("tblib.pickling_support")
        sub.install = lambda *a, **k: None
        mod.pickling_support = sub
        sys.modules["tblib"] = mod
        sys.modules["tblib.pickling_support"] = sub


def _map_tokenizers() -> None:
    """The tokenizer of every served name is the served model's."""
    if not MODEL_DIR:
        return
    import transformers
    import vllm.tokenizers as vt
    import vllm.tokenizers.registry as vr

    def local(name):
        return MODEL_DIR if isinstance(name, str) and name in SERVED else name

    orig_get = vr.get_tokenizer

    def get_tokenizer(tokenizer_name, *args, **kwargs):
        return orig_get(local(tokenizer_name), *args, **kwargs)

    vr.get_tokenizer = vt.get_tokenizer = get_tokenizer
    orig_auto = transformers.AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, name, *args, **kwargs):
        return orig_auto(cls, local(name), *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = classmethod(from_pretrained)


def _stub_lora_downloads() -> None:
    """A fixture's ``snapshot_download`` of a LoRA adapter returns a path nothing reads.

    Only the tests that name the adapter would use it, and those are not runnable (see
    :func:`pytest_runtest_call`); any other download still goes to the (offline) hub.
    """
    from vllm.transformers_utils import repo_utils

    orig = repo_utils.hf_api

    class Api:
        def __init__(self, api):
            self._api = api

        def snapshot_download(self, repo_id, *args, **kwargs):
            if "lora" in repo_id.lower():
                return f"/nonexistent/conformance-lora/{repo_id}"
            return self._api.snapshot_download(repo_id, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._api, name)

    repo_utils.hf_api = lambda *a, **k: Api(orig(*a, **k))


def _install_server() -> None:
    import tests.utils as tu

    base = tu.RemoteOpenAIServer
    parsed = urlparse(URL)

    class RunningServer(base):
        """RemoteOpenAIServer's interface on a server that is already running."""

        if API_KEY:
            DUMMY_API_KEY = API_KEY

        def __init__(self, model, vllm_serve_args, *, env_dict=None, seed=0, auto_port=True,
                     max_wait_seconds=None, override_hf_configs=None, **_):
            lacks = missing_for(model, list(vllm_serve_args), env_dict)
            if override_hf_configs:
                lacks.append(f"--hf-overrides {json.dumps(override_hf_configs)}")
            if lacks:
                pytest.skip("not runnable: the shared server lacks " + "; ".join(lacks))
            self.model = model
            self.uds = None
            self.host = parsed.hostname
            self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
            self.show_hidden_metrics = False
            self._shutdown_complete = True
            self.proc = None

        @property
        def url_root(self) -> str:
            return URL.rstrip("/")

        def _shutdown(self) -> None:
            pass

        def _poll(self):
            return None

    tu.RemoteVLLMServer._active_servers = set()
    tu.RemoteOpenAIServer = RunningServer


# Before pytest loads vLLM's conftest.py files (they run ahead of pytest_configure).
_stub_tblib()
if SRC not in sys.path:
    sys.path.insert(0, SRC)


def pytest_configure(config):
    _map_tokenizers()
    _stub_lora_downloads()
    _install_server()
    config.addinivalue_line("markers", "conformance_not_runnable: set by conformance_plugin")


LORA_REASON = ("not runnable: {name!r} is a LoRA adapter from the HF hub (offline here; omni-engine serve "
               "refuses --lora-modules)")
# Fixtures that need the adapter's files themselves (not only a server that has it).
LORA_FILE_FIXTURES = ("lora_files", "lora_adapter")


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = getattr(item, "fixturenames", ())
        if any(n.endswith(LORA_FILE_FIXTURES) for n in names) and "server" not in names:
            item.add_marker(pytest.mark.skip(reason=LORA_REASON.format(name="its fixture")))


def _sends_lora_adapter(item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, str) and v in LORA_ADAPTERS:
                return v
    return None


class TestTimeout(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    def expired(signum, frame):
        raise TestTimeout(f"test ran past {TIMEOUT:.0f} s (conformance_plugin's limit)")

    # The module's server fixture has run by now, so its --lora-modules names are known.
    adapter = _sends_lora_adapter(item)
    if adapter is not None:
        pytest.skip(LORA_REASON.format(name=adapter))
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_outcomes: dict[str, dict] = {}


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0][:300] if crash.message else ""
    return str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else ""


def pytest_runtest_logreport(report):
    rec = _outcomes.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": None, "reason": ""})
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when == "call":
        outcome = report.outcome
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        return
    if rec["outcome"] in (None, "passed") or outcome == "error" and rec["outcome"] != "error":
        if rec["outcome"] == "failed" and outcome == "error":
            return
        rec["outcome"] = outcome
        rec["reason"] = _reason(report) if outcome != "passed" else ""
        rec["duration_s"] = round(getattr(report, "duration", 0.0), 2)


def pytest_sessionfinish(session, exitstatus):
    if RESULTS:
        with open(RESULTS, "w") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in _outcomes.values())


if __name__ == "__main__":  # a quick self-check of the flag comparison
    print(parse_flags(shlex.split("--dtype bfloat16 --served-model-name a b --enable-lora --x=1")))
