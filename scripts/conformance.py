"""vLLM's own OpenAI entrypoint tests as a conformance suite (scripts/conformance.sh; issue 66).

Fetches the release source of the installed vLLM (the sdist's ``tests/`` only, from pip's index,
sha256-checked, cached outside the repository), serves SmolLM2-135M-Instruct twice -- with
``omni-engine serve stage_configs/smollm2_text.yaml`` and with vLLM's own
``vllm.entrypoints.openai.api_server`` on smollm2_text.yaml's engine arguments -- under every model
name the chosen test files ask for, runs those files against each server (``conformance_plugin.py``
points their ``RemoteOpenAIServer`` at it) and prints, per test, the outcome on each side, then every
test whose outcome differs and the counts. ``--out`` gets the same as JSON and markdown.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
ENTRY = "tests/entrypoints/"

# Every model name the chosen files send; both servers serve SmolLM2 under all of them (the first is
# the real one). Tests then decide by what the server does, not by the name they picked.
SERVED_NAMES = [
    "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2-1.5B-Instruct",
    "Qwen/Qwen3-0.6B", "facebook/opt-125m", "openai-community/gpt2", "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "claude-3-7-sonnet-latest", "HuggingFaceH4/zephyr-7b-beta",
]
# smollm2_text.yaml's engine arguments, for vLLM's own server (omni-engine serve reads them from the
# yaml); the context length is the group's (below), given to both servers.
VLLM_ENGINE_ARGS = ["--max-num-seqs", "16", "--enforce-eager", "--dtype", "float32",
                    "--gpu-memory-utilization", "0.3"]
# smollm2_text.yaml's default_sampling_params (temperature 0.0, max_tokens 128), as vLLM takes defaults
# (--vllm-defaults stage, the default). vLLM also caps a request's own max_tokens at max_new_tokens (a
# request for 200 gets 128; ours gives 200): "temperature" gives vLLM's server only the temperature (a
# request without max_tokens then runs to the context's end, as under plain `vllm serve`), "none" neither.
VLLM_DEFAULTS = {
    "stage": ["--override-generation-config", json.dumps({"temperature": 0.0, "max_new_tokens": 128})],
    "temperature": ["--override-generation-config", json.dumps({"temperature": 0.0})],
    "none": [],
}

# The union of the behaviour flags the chosen files' server fixtures pass, given to both servers.
COMMON_FLAGS = ["--max-logprobs", "151936",                 # test_chat_echo: prompt_logprobs=-1
                "--enable-prompt-tokens-details",           # test_completion, anthropic/test_messages
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",  # test_return_token_ids, anthropic
                "--enable-tokenizer-info-endpoint"]         # serve/tokenize/test_tokenization

# Groups: each starts both servers once, with COMMON_FLAGS plus its own flags, for its files. The files'
# fixtures differ in --max-model-len, which tests read back (/tokenize's max_model_len, context-length
# errors): a group per length, as the files ask.
GROUPS = {
    "ctx2048": (["--max-model-len", "2048"], [
        "openai/chat_completion/test_chat_completion.py",
        "openai/chat_completion/test_batched_chat_completions.py",
        "openai/completion/test_completion.py",
        "openai/completion/test_prompt_validation.py",
        "openai/test_return_token_ids.py",
        "anthropic/test_messages.py",
    ]),
    "ctx1024": (["--max-model-len", "1024"], [
        "openai/chat_completion/test_logprob_token_ids.py",
        "openai/chat_completion/test_chat_logit_bias_validation.py",
        "serve/instrumentator/test_metrics.py",
    ]),
    "ctx4080": (["--max-model-len", "4080"], [
        "openai/chat_completion/test_chat_echo.py",
    ]),
    "ctx8192": (["--max-model-len", "8192"], [
        "serve/tokenize/test_tokenization.py",
        "serve/instrumentator/test_basic.py",
        "openai/chat_completion/test_chat.py",
    ]),
    # Forces usage into every stream, which other files' streaming tests would see: its own servers.
    "force-usage": (["--max-model-len", "128", "--enable-force-include-usage"], [
        "openai/chat_completion/test_enable_force_include_usage.py",
    ]),
}

# Files of the list (and their neighbours) that are not run, with the reason.
NOT_RUN = {
    "openai/models/test_models.py": "its one test lists a LoRA adapter served with --lora-modules (refused by "
                                    "omni-engine serve; the adapter comes from the HF hub)",
    "openai/test_return_tokens_as_ids.py": "its server fixture loads a Qwen3 LoRA adapter from the HF hub",
    "openai/chat_completion/test_chat_error.py": "in-process unit tests of vLLM's handler with mocks: start no server",
    "openai/completion/test_completion_error.py": "in-process unit tests of vLLM's handler with mocks: start no server",
    "openai/chat_completion/test_root_path.py": "needs a server started with --root-path and its own environment",
    "openai/chat_completion/test_extra_content_fields.py": "google/translategemma-4b-it's chat template (4B model)",
    "openai/chat_completion/test_thinking_token_budget.py": "a reasoning model on several GPUs (fp8)",
    "openai/chat_completion/test_include_reasoning.py": "a reasoning parser on a reasoning model",
    "openai/chat_completion/test_completion_with_function_calling.py": "tool calling by a model trained for it",
    "openai/chat_completion/test_chat_completion_with_prompt_embeds.py": "--enable-prompt-embeds on a model "
                                                                         "downloaded by the test",
    "openai/completion/test_completion_with_prompt_embeds.py": "--enable-prompt-embeds with the HF model's "
                                                               "embeddings computed in the test",
    "openai/completion/test_token_in_token_out.py": "snapshot_download of Qwen3-0.6B to serve from its path",
    "openai/completion/test_lora_resolvers.py": "LoRA resolvers",
    "openai/completion/test_tensorizer_entrypoint.py": "tensorizer-serialized weights",
    "openai/test_openai_schema.py": "a multimodal model (SmolVLM) and schemathesis",
    "openai/test_chunked_prompt.py": "--max-num-batched-tokens smaller than a prompt (a different engine)",
    "multimodal/, pooling/, speech_to_text/": "multimodal, pooling and speech models",
    "tool_parsers/, openai/responses/": "model-specific tool and reasoning parsers; the Responses API on gpt-oss",
    "serve/lora/, serve/sagemaker/": "LoRA adapters",
}

# Tests that pass on vLLM's server and fail on ours, with the reason (README, "Conformance").
KNOWN_DIFFERENCES: dict[str, str] = {}

_children: list[subprocess.Popen] = []


def log(msg: str) -> None:
    print(f"[conformance {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- vLLM's release source
def pip_indexes() -> list[str]:
    found: list[str] = []
    env = os.environ.get("PIP_INDEX_URL")
    try:
        conf = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        conf = ""
    index = extra = ""
    for line in conf.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".index-url"):
            index = value
        elif key.endswith(".extra-index-url"):
            extra = value
    found.append(env or index or "https://pypi.org/simple")
    found += (os.environ.get("PIP_EXTRA_INDEX_URL") or extra).split()
    return found


def find_sdist(version: str) -> tuple[str, str]:
    """(url, sha256) of vllm-<version>.tar.gz on pip's indexes (PEP 503 simple pages)."""
    want = f"vllm-{version}.tar.gz"
    for index in pip_indexes():
        page_url = index.rstrip("/") + "/vllm/"
        try:
            with urllib.request.urlopen(page_url if not page_url.startswith("file:") else page_url + "index.html",
                                        timeout=60) as r:
                page = r.read().decode("utf-8", "replace")
        except Exception as e:  # noqa: BLE001 - try the next index
            log(f"index {page_url}: {e}")
            continue
        for href in re.findall(r'href="([^"]+)"', page):
            link, _, frag = href.partition("#")
            if urllib.parse.unquote(link.rsplit("/", 1)[-1]) == want:
                sha = frag.removeprefix("sha256=") if frag.startswith("sha256=") else ""
                return urllib.parse.urljoin(page_url, link), sha
    raise SystemExit(f"conformance: {want} is on none of pip's indexes {pip_indexes()}")


def fetch_source(version: str, cache: Path) -> Path:
    root = cache / f"vllm-src-{version}"
    src = root / f"vllm-{version}"
    if (root / ".complete").exists():
        return src
    url, sha = find_sdist(version)
    log(f"downloading {url}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / "sdist.tar.gz.part"
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if sha and digest.hexdigest() != sha:
        tmp.unlink()
        raise SystemExit(f"conformance: sha256 of {url} is {digest.hexdigest()}, the index says {sha}")
    prefix = f"vllm-{version}/"
    with tarfile.open(tmp) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"]
        tar.extractall(root, members=members, filter="data")
    tmp.unlink()
    (root / ".complete").write_text(f"{url}\nsha256={digest.hexdigest()}\n")
    log(f"vLLM {version}'s tests/ in {src} ({len(members)} files)")
    return src


# ---------------------------------------------------------------- servers
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], logfile: Path, pidfile: Path) -> subprocess.Popen:
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _children.append(proc)
    with open(pidfile, "a") as f:
        f.write(f"{proc.pid}\n")
    return proc


def wait_healthy(proc: subprocess.Popen, port: int, logfile: Path, timeout: float = 600) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            tail = logfile.read_text(errors="replace").splitlines()[-30:]
            raise SystemExit(f"conformance: server exited ({proc.returncode}); {logfile}:\n" + "\n".join(tail))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        time.sleep(1)
    raise SystemExit(f"conformance: server on port {port} not healthy after {timeout:.0f} s ({logfile})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    # the process group may keep an engine child after the leader is gone
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return


def server_cmd(side: str, model_dir: str, port: int, flags: list[str], defaults: str = "stage") -> list[str]:
    if side == "ours":
        return [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve", "stage_configs/smollm2_text.yaml",
                "--port", str(port), "--served-model-name", *SERVED_NAMES, *flags]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
            "--served-model-name", *SERVED_NAMES, *VLLM_ENGINE_ARGS, *VLLM_DEFAULTS[defaults], *flags]


def run_tests(side: str, src: Path, port: int, flags: list[str], files: list[str], model_dir: str,
              out_dir: Path, timeout: float, group: str) -> dict[str, dict]:
    results = out_dir / f"{group}-{side}.jsonl"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(src)]),
           "CONFORMANCE_SRC": str(src), "CONFORMANCE_URL": f"http://127.0.0.1:{port}",
           "CONFORMANCE_SERVED_NAMES": ",".join(SERVED_NAMES), "CONFORMANCE_MODEL_DIR": model_dir,
           "CONFORMANCE_SERVER_FLAGS": json.dumps(["--served-model-name", *SERVED_NAMES, *flags]),
           "CONFORMANCE_TIMEOUT": str(timeout), "CONFORMANCE_RESULTS": str(results),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "conformance_plugin", "-p", "no:cacheprovider", "-q",
           "-rN", "--tb=line", "--rootdir", str(src), "-o", "addopts=", "-W", "ignore",
           *[ENTRY + f for f in files]]
    log(f"{group}: vLLM's tests against {side} (port {port}): {len(files)} files")
    t0 = time.time()
    with open(out_dir / f"{group}-{side}-pytest.log", "wb") as out:
        rc = subprocess.run(cmd, cwd=src, env=env, stdout=out, stderr=subprocess.STDOUT,
                            check=False).returncode
    log(f"{group}: {side} done in {time.time() - t0:.0f} s (pytest rc {rc})")
    found = {}
    if results.exists():
        for line in results.read_text().splitlines():
            rec = json.loads(line)
            found[rec["nodeid"].removeprefix(ENTRY)] = rec
    if not found:
        tail = (out_dir / f"{group}-{side}-pytest.log").read_text(errors="replace").splitlines()[-20:]
        log("no results; pytest said:\n" + "\n".join(tail))
    return found


# ---------------------------------------------------------------- report
SHORT = {"passed": "passed", "failed": "FAILED", "error": "ERROR", "skipped": "skipped", "xfailed": "xfailed",
         "xpassed": "XPASS", None: "-"}


def report(rows: dict[str, dict[str, dict]], sides: list[str], meta: dict, out: Path) -> int:
    width = min(max((len(k) for k in rows), default=10), 110)
    lines = [f"{'test (tests/entrypoints/...)':<{width}}  {'vLLM':<8}  {'ours':<8}", "-" * (width + 20)]
    differ, regressions, counts = [], [], {s: {} for s in sides}
    for nodeid in sorted(rows):
        r = rows[nodeid]
        outs = {s: (r.get(s) or {}).get("outcome") for s in sides}
        for s in sides:
            counts[s][SHORT[outs[s]]] = counts[s].get(SHORT[outs[s]], 0) + 1
        mark = ""
        if len(sides) == 2 and outs["vllm"] != outs["ours"]:
            mark = "  <- differs"
            differ.append(nodeid)
            if outs["vllm"] == "passed":
                regressions.append(nodeid)
        name = nodeid if len(nodeid) <= width else nodeid[: width - 3] + "..."
        lines.append(f"{name:<{width}}  {SHORT[outs.get('vllm')]:<8}  {SHORT[outs.get('ours')]:<8}{mark}")
    lines.append("")
    lines.append(f"Tests whose outcome differs ({len(differ)}):")
    for nodeid in differ:
        for s in sides:
            rec = rows[nodeid].get(s) or {}
            lines.append(f"  {nodeid}\n      {s}: {SHORT[rec.get('outcome')]} {rec.get('reason', '')[:240]}")
    if not differ:
        lines.append("  none")
    reasons: dict[str, int] = {}
    for nodeid, r in rows.items():
        for s in sides:
            rec = r.get(s) or {}
            if rec.get("outcome") == "skipped":
                reasons[rec.get("reason", "")] = reasons.get(rec.get("reason", ""), 0) + 1
    lines.append("")
    lines.append("Skipped tests (counted over both sides), by reason:")
    for reason, n in sorted(reasons.items(), key=lambda x: -x[1]):
        lines.append(f"  {n:4d}  {reason[:200]}")
    lines.append("")
    lines.append("Files not run, with the reason:")
    for f, why in NOT_RUN.items():
        lines.append(f"  {f}: {why}")
    lines.append("")
    for s in sides:
        total = sum(counts[s].values())
        lines.append(f"{'vLLM api_server' if s == 'vllm' else 'omni-engine serve'}: {total} tests: "
                     + ", ".join(f"{k} {v}" for k, v in sorted(counts[s].items())))
    unexplained = [n for n in regressions if n not in KNOWN_DIFFERENCES]
    if len(sides) == 2:
        lines.append(f"differ: {len(differ)}; pass on vLLM's server and not on ours: {len(regressions)} "
                     f"({len(unexplained)} not named in KNOWN_DIFFERENCES / the README)")
    lines.append(f"wall time: {meta['wall_s']:.0f} s")
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {**meta, "sides": sides, "counts": counts, "differ": differ, "regressions": regressions,
            "not_run": NOT_RUN, "tests": rows}
    out.write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text("```\n" + text + "\n```\n")
    log(f"report: {out} and {out.with_suffix('.md')}")
    return 1 if unexplained else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="+", help="test files under tests/entrypoints/ (default: every group's)")
    ap.add_argument("--only", choices=["ours", "vllm"], help="run against one server only")
    ap.add_argument("--out", type=Path, help="JSON report (a .md beside it); default under a temp dir")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per test (default 180)")
    ap.add_argument("--vllm-defaults", choices=list(VLLM_DEFAULTS), default="stage",
                    help="sampling defaults of vLLM's server (default: smollm2_text.yaml's, see VLLM_DEFAULTS)")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "omni_engine")
    args = ap.parse_args()
    t0 = time.time()
    out_dir = Path(tempfile.mkdtemp(prefix="omni-conformance-"))
    out = args.out or out_dir / "conformance.json"
    pidfile = Path(os.environ.get("CONFORMANCE_PIDFILE", out_dir / "servers.pids"))
    import vllm

    version = vllm.__version__.split("+")[0]
    src = fetch_source(version, args.cache_dir)
    model_dir = subprocess.run([sys.executable, "-m", "omni_engine.entrypoints.cli.main", "prepare-model", "smollm2"],
                               capture_output=True, text=True, check=True, cwd=REPO).stdout.strip().splitlines()[-1]
    sides = [args.only] if args.only else ["vllm", "ours"]
    groups = {}
    for name, (flags, files) in GROUPS.items():
        chosen = [f for f in files if not args.files or f in args.files or ENTRY + f in args.files]
        if chosen:
            groups[name] = (flags, chosen)
    if args.files:
        known = {f for _, fs in GROUPS.values() for f in fs}
        extra = [f.removeprefix(ENTRY) for f in args.files if f.removeprefix(ENTRY) not in known]
        if extra:
            groups.setdefault("main", ([], []))[1].extend(extra)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows: dict[str, dict[str, dict]] = {}
    started = {}
    try:
        for group, (extra_flags, files) in groups.items():
            flags = [*COMMON_FLAGS, *extra_flags]
            procs = {}
            for side in sides:
                port = free_port()
                logfile = out_dir / f"{group}-{side}-server.log"
                cmd = server_cmd(side, model_dir, port, flags, args.vllm_defaults)
                procs[side] = (start(cmd, logfile, pidfile), port, logfile)
                started[f"{group}-{side}"] = " ".join(cmd)
            for side, (proc, port, logfile) in procs.items():
                ready = wait_healthy(proc, port, logfile)
                log(f"{group}: {side} server healthy on port {port} after {ready:.0f} s")
            for side, (proc, port, logfile) in procs.items():
                for nodeid, rec in run_tests(side, src, port, flags, files, model_dir, out_dir, args.timeout,
                                             group).items():
                    rows.setdefault(nodeid, {})[side] = rec
            for proc, _, _ in procs.values():
                stop(proc)
    finally:
        for proc in _children:
            stop(proc)
    meta = {"vllm_version": version, "source": str(src), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "servers": started, "vllm_defaults": args.vllm_defaults, "wall_s": time.time() - t0, "logs": str(out_dir), "timeout_s": args.timeout}
    return report(rows, sides, meta, out)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
