"""Can each stage's model be loaded? Answered before any stage process starts.

A stage's ``engine_args.model`` is the field a user most often gets wrong, and
the engine finds out late: vLLM (or the tokenizer the CLI loads for the chat
template) takes its import time to try, retries a hub for a minute when there
is no network, and ends in a traceback that names neither the config file nor
the stage. So every model (and ``engine_args.tokenizer``) is classified here
from the file system and, for hub ids only, one quick look at the network:

* a ``prepare-model`` recipe name (``smollm2``): fine, it is prepared next;
* an existing directory: it must hold what the engine reads (a config, weights
  unless ``load_format: dummy``, a tokenizer unless one is given apart or
  ``skip_tokenizer_init``); an existing ``.gguf`` file is loadable as is;
* a Hugging Face hub id: fine when the hub can be reached or the model is in the
  local hub cache; refused at once when offline (``HF_HUB_OFFLINE=1``) or when
  the hub's host cannot be reached in a few seconds;
* anything else is a path that does not exist.

Every problem names the file, the stage and the field, and all of them are
raised together as one :class:`ModelError` (a ``ConfigError``), like the rest
of the config's checks. Nothing heavy is imported here (the hub library only
for a hub id), so that the check costs milliseconds, not vLLM's import.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from omni_engine.config import ConfigError, PipelineConfig, StageConfig
from omni_engine.config.convert import ErrorCollector

__all__ = ["ModelError", "check_models", "hub_unreachable", "model_problem", "safetensors_problem",
           "stage_model_error"]

# How long the one look at the hub's host may take before it counts as unreachable.
HUB_PROBE_TIMEOUT_S = 3.0
# A hub id: "name" or "namespace/name" (huggingface_hub's rule, without its length limits).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json")
_TRUE = ("1", "true", "yes", "on")
# safetensors refuses headers above 100 MB; a larger "length" is not a safetensors file.
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


class ModelError(ConfigError):
    """A stage's model (or tokenizer) cannot be loaded; one line per such stage field."""


def check_models(config: PipelineConfig, recipes: frozenset[str] | None = None) -> None:
    """Raise one :class:`ModelError` naming every stage whose model cannot be loaded."""
    if recipes is None:
        from omni_engine.models.prepare import llm_recipe_names

        recipes = llm_recipe_names()
    source = config.source_path or "<dict>"
    errors = ErrorCollector(source)
    for index, stage in enumerate(config.stage_args):
        report = errors.for_stage(f"stage {stage.stage_id} ({stage.stage_type})")
        for field, problem in _stage_problems(stage, recipes):
            report(f"stage_args[{index}].engine_args.{field}", problem)
    if errors.errors:
        raise ModelError(errors.errors, source)


def stage_model_error(config: PipelineConfig, index: int, field: str, problem: str) -> ModelError:
    """The error for one stage's model field, in the form ``check_models`` reports (file, stage, field)."""
    source = config.source_path or "<dict>"
    stage = config.stage_args[index]
    errors = ErrorCollector(source)
    errors.for_stage(f"stage {stage.stage_id} ({stage.stage_type})")(f"stage_args[{index}].engine_args.{field}",
                                                                      problem)
    return ModelError(errors.errors, source)


def _stage_problems(stage: StageConfig, recipes: frozenset[str]) -> list[tuple[str, str]]:
    args = stage.engine_args
    problems = []
    if stage.stage_type == "llm":
        for field in ("model", "tokenizer"):
            value = args.get(field)
            if isinstance(value, str) and value:
                problem = model_problem(value, recipes, field=field, engine_args=args)
                if problem is not None:
                    problems.append((field, problem))
    elif isinstance(args.get("model"), str) and _looks_like_path(args["model"]):
        # A generation stage's factory reads its model itself; only a path that is not there is certain.
        if not Path(args["model"]).expanduser().exists():
            problems.append(("model", f"no such file or directory: {args['model']}{_relative_note(args['model'])}"))
    return problems


def model_problem(value: str, recipes: frozenset[str], *, field: str = "model",
                  engine_args: dict[str, Any] | None = None) -> str | None:
    """Why ``value`` cannot be loaded as an llm stage's ``field`` (None: it can, as far as is known)."""
    engine_args = engine_args or {}
    path = Path(value).expanduser()
    if path.is_dir():
        return _directory_problem(path, field, engine_args)
    if path.is_file():
        if path.suffix == ".gguf":
            return None
        return f"{value} is a file; expected a model directory (with config.json and weights) or a .gguf file"
    if value in recipes:
        return None
    if _looks_like_path(value) or not _HUB_ID.match(value):
        return f"no such directory: {value}{_relative_note(value)}; {_what_it_can_be(recipes)}"
    return _hub_problem(value, recipes, field)


def _directory_problem(path: Path, field: str, engine_args: dict[str, Any]) -> str | None:
    try:
        names = {p.name for p in path.iterdir()}
    except OSError as exc:
        return f"cannot read directory {path}: {exc.strerror or exc}"
    missing = []
    if field == "model":
        configs = ("params.json",) if engine_args.get("config_format") == "mistral" else ("config.json", "params.json")
        if not names.intersection(configs):
            missing.append(configs[0])
        if engine_args.get("load_format") != "dummy":
            if not any(any(path.glob(p)) for p in _WEIGHT_PATTERNS):
                missing.append("weights (*.safetensors, *.bin, *.pt, *.gguf)")
            for weights in sorted(path.glob("*.safetensors")):
                if (problem := safetensors_problem(weights)) is not None:
                    return f"directory {path}: {problem}"
        needs_tokenizer = not engine_args.get("skip_tokenizer_init") and not engine_args.get("tokenizer")
    else:
        needs_tokenizer = True
    if needs_tokenizer and not names.intersection(_TOKENIZER_FILES):
        missing.append("tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model)")
    if not missing:
        return None
    return f"directory {path} has no {', no '.join(missing)}: not a model directory vLLM can load"


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (None: its header is sound and its data all there).

    Reads only the header (8 bytes of length, then JSON), so a truncated download or a
    file of something else is found in microseconds instead of by the engine's loader.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if size < 8 or not 2 <= length <= min(size - 8, _MAX_SAFETENSORS_HEADER):
                return f"{path.name} is not a safetensors file (no header: {size} bytes)"
            header = json.loads(file.read(length))
    except OSError as exc:
        return f"cannot read {path.name}: {exc.strerror or exc}"
    except ValueError:
        return f"{path.name} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{path.name} is not a safetensors file (its header is not a JSON object)"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"
            and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2 and isinstance(entry["data_offsets"][1], int)]
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        return f"{path.name} is truncated: its header describes {needed} bytes, the file has {size}"
    return None


def _hub_problem(repo_id: str, recipes: frozenset[str], field: str) -> str | None:
    """A hub id: loadable if cached, or if the hub can be reached."""
    if _env_true("VLLM_USE_MODELSCOPE"):
        return None  # another hub, reached by vLLM its own way
    if _in_hub_cache(repo_id, "config.json" if field == "model" else "tokenizer_config.json"):
        return None
    reason = hub_unreachable()
    if reason is None:
        return None
    not_recipe = "" if "/" in repo_id else f"not a prepare-model recipe ({', '.join(sorted(recipes))}), "
    return (f"{repo_id!r} is {not_recipe}not a directory{_relative_note(repo_id)}, and the Hugging Face hub "
            f"cannot provide it: {reason} and it is not in the local hub cache; prepare a model "
            f"(`omni-engine prepare-model NAME`, NAME one of: {', '.join(sorted(recipes))}) or point "
            f"engine_args.{field} at a model directory")


@functools.cache
def hub_unreachable() -> str | None:
    """Why models cannot be downloaded from the hub now (None: its host answered), asked once per process."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _env_true(name):
            return f"{name}={os.environ[name]} is set"
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port, what = via.hostname or host, via.port or 80, f"the proxy {proxy}"
    else:
        what = f"{host}:{port}"
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{what} cannot be reached ({exc.strerror or exc})"
    return None


def _in_hub_cache(repo_id: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except Exception:  # noqa: BLE001 - an id the hub library refuses is simply not cached
        return False


def _what_it_can_be(recipes: frozenset[str]) -> str:
    return (f"give a prepare-model recipe name ({', '.join(sorted(recipes))}), a model directory, "
            "or a Hugging Face hub id")


def _looks_like_path(value: str) -> bool:
    return (value.startswith(("/", "./", "../", "~", ".\\")) or value.count("/") > 1 or "\\" in value
            or value in (".", ".."))


def _relative_note(value: str) -> str:
    path = Path(value).expanduser()
    return "" if path.is_absolute() else f" (looked for in {Path.cwd()})"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE
