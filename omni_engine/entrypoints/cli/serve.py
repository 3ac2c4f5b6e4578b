"""``omni-engine serve``: a pipeline behind vLLM's own OpenAI-compatible server.

The stages start as their own processes (as for ``generate``); the server
process builds only the text stage's config, tokenizer and chat template
(``omni_engine.entrypoints.openai.engine_config``), never a second engine.
Every endpoint -- ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, ``/tokenize``, ... -- is vLLM's code, with the pipeline's
``MultiStageEngineClient`` underneath. Start-up progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_engine.entrypoints.cli.common import say, set_stage_env_defaults

if TYPE_CHECKING:
    from omni_engine.config import PipelineConfig

NAME = "serve"
# main() hands this subcommand its raw arguments: vLLM's parser reads them.
PARSES_OWN_ARGS = True


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Listed in ``omni-engine --help``; its arguments are parsed by ``main`` (vLLM's parser)."""
    parser = subparsers.add_parser(
        NAME, add_help=False,
        help="serve a pipeline with vLLM's OpenAI-compatible API (takes `vllm serve` flags; see serve --help)")
    parser.set_defaults(handler=lambda _args: main([]))
    return parser


def main(argv: Sequence[str]) -> int:
    """``omni-engine serve PIPELINE_CONFIG|MODEL [vllm serve flags] [omni-engine flags]``."""
    from omni_engine.config import ConfigError
    from omni_engine.entrypoints.cli.serve_args import ServeArgsError, parse_serve_args
    from omni_engine.pipeline.early_launch import discard_launched

    launched: dict[int, Any] = {}
    try:
        # The config and its models first: vLLM's parser imports vLLM (seconds), and a
        # wrong model must not wait for that. Then the stages start, so that their own
        # imports run while this process imports vLLM.
        early = _early_flags(argv)
        config = _load_checked(argv[0], early.deploy_config) if argv and not argv[0].startswith("-") else None
        if config is not None and not _asks_for_help(argv):
            config = _with_served_names(config, early.served_model_name).with_traces_endpoint(
                early.otlp_traces_endpoint)
            launched = _launch_early(config)
        args = parse_serve_args(argv)
        if config is not None and argv[0] == args.model_tag:
            config, launched = _with_engine_flags(config, args, launched)
    except (ConfigError, ServeArgsError) as exc:
        discard_launched(launched)
        say(str(exc))
        return 2
    except BaseException:
        discard_launched(launched)
        raise
    if config is None or argv[0] != args.model_tag:
        discard_launched(launched)
        return run(args, None)
    return run(args, config, launched)


def _with_engine_flags(config: PipelineConfig, args: argparse.Namespace,
                       launched: dict[int, Any]) -> tuple[PipelineConfig, dict[int, Any]]:
    """``config`` with the command line's vLLM engine flags on its llm stage, and the stages
    started early that it still runs as they were started (the others are stopped: the client
    starts them again with the flags). Raises ``ServeArgsError`` where the flags cannot apply."""
    from omni_engine.entrypoints.cli.serve_args import ServeArgsError
    from omni_engine.entrypoints.openai.engine_config import with_engine_flags
    from omni_engine.pipeline.early_launch import discard_launched

    try:
        flagged = with_engine_flags(config, getattr(args, "engine_flags", {}), str(args.pipeline_config))
    except ValueError as exc:
        raise ServeArgsError(f"omni-engine serve: {exc}") from None
    kept = {sid: stage for sid, stage in launched.items() if flagged.stage(sid) == config.stage(sid)}
    discard_launched({sid: stage for sid, stage in launched.items() if sid not in kept})
    return flagged, kept


def _asks_for_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def _early_flags(argv: Sequence[str]) -> argparse.Namespace:
    """``--served-model-name`` and ``--otlp-traces-endpoint`` from the command line (what the
    stages are started with), read before vLLM's parser (which imports vLLM) can. vLLM's parser
    has the last word: ``_serve`` restarts the stages if it reads otherwise (from a ``--config``
    file of serve flags)."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--served-model-name", "--served_model_name", nargs="+")
    early.add_argument("--otlp-traces-endpoint", "--otlp_traces_endpoint")
    early.add_argument("--deploy-config", "--deploy_config")
    known, _rest = early.parse_known_args(list(argv[1:]))
    return known


def _with_served_names(config: PipelineConfig, names: list[str] | None) -> PipelineConfig:
    """The config as ``_serve`` runs it: the text stage's vLLM labels its metrics with the served names."""
    from omni_engine.entrypoints.openai.engine_config import (
        default_served_model_name,
        text_stage_of,
        with_served_model_name,
    )

    return with_served_model_name(config, list(names or [default_served_model_name(text_stage_of(config))]))


def _launch_early(config: PipelineConfig) -> dict[int, Any]:
    """Start the stages that can start before vLLM is imported here (``pipeline.early_launch``)."""
    import sys

    from omni_engine.pipeline.early_launch import launch_stages_early

    set_stage_env_defaults()
    launched = launch_stages_early(config, say)
    if launched and "vllm" in sys.modules:
        # Checked, not assumed: an import of vLLM on this path undoes what starting early buys.
        say(f"{len(launched)} stage(s) started, but after this process imported vLLM (a slow start)")
    elif launched:
        say(f"{len(launched)} stage(s) started; this process imports vLLM meanwhile")
    return launched


def _load_checked(target: str | Path, deploy_config: str | None = None) -> PipelineConfig:
    """What ``target`` serves, validated, with its models checked and prepared: the pipeline config
    file it names, or the pipeline of the model it names (its family's, by architecture, or one
    vLLM stage: ``omni_engine.config.for_model``).

    The text stage keeps the name its YAML gives its model (a recipe name such as
    ``smollm2``, not the prepared directory) as the name the API serves by default.
    """
    from omni_engine.config import ConfigError
    from omni_engine.config.for_model import load_config_or_model
    from omni_engine.entrypoints.openai.engine_config import (
        default_served_model_name,
        text_stage_of,
        with_served_model_name,
    )
    from omni_engine.pipeline.stage_specs import prepare_models

    notes: list[str] = []
    config = load_config_or_model(target, deploy_config, notes)
    for note in notes:
        say(f"deploy config: {note}")
    try:
        text_stage = text_stage_of(config)
    except ValueError as exc:
        raise ConfigError([f"{target}: {exc}"], str(target)) from None
    if "served_model_name" not in text_stage.engine_args:
        config = with_served_model_name(config, [default_served_model_name(text_stage)])
    return prepare_models(config, say)


def run(args: argparse.Namespace, config: PipelineConfig | None = None,
        launched: dict[int, Any] | None = None) -> int:
    """Serve ``args.pipeline_config`` (``config``: that file already loaded by ``_load_checked``;
    ``launched``: its stages already started by ``_launch_early``)."""
    set_stage_env_defaults()
    # A dead stage makes /health 503 (for a supervisor to act on); the server itself keeps answering.
    os.environ.setdefault("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1")
    import uvloop

    from omni_engine.config import ConfigError

    if config is None:
        from omni_engine.entrypoints.cli.serve_args import ServeArgsError

        try:
            config, _ = _with_engine_flags(_load_checked(args.model_tag, args.deploy_config), args, {})
        except (ConfigError, ServeArgsError) as exc:
            say(str(exc))
            return 2

    # Until uvicorn's handlers are in place, SIGTERM interrupts start-up (as in
    # vLLM's run_server); stage processes die with us (PDEATHSIG).
    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, _interrupt)
    from omni_engine.pipeline.early_launch import discard_launched

    try:
        return uvloop.run(_serve(args, config, dict(launched or {})))
    finally:
        discard_launched(launched or {})  # those no client adopted (a start that failed first)


async def _serve(args: argparse.Namespace, config, launched: dict[int, Any]) -> int:
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve
    from vllm.entrypoints.launchers.launcher import setup_server

    from omni_engine.entrypoints.cli.serve_args import server_args_for
    from omni_engine.entrypoints.openai.app import install_app_extensions
    from omni_engine.entrypoints.openai.engine_config import (
        default_served_model_name,
        text_stage_of,
        with_served_model_name,
    )
    from omni_engine.entrypoints.openai.metrics import register_pipeline_metrics
    from omni_engine.pipeline.early_launch import discard_launched

    # Our audio routes (/v1/audio/speech, chat with audio) and the API key on every route,
    # on the app build_and_serve builds.
    install_app_extensions()

    started = time.monotonic()
    served_names = list(args.served_model_name or [default_served_model_name(text_stage_of(config))])
    # The text stage's vLLM labels its vllm:* metrics with the name the API serves, as under `vllm serve`.
    named = with_served_model_name(config, served_names).with_traces_endpoint(args.otlp_traces_endpoint)
    if launched and named != config:
        # vLLM's parser read other names (or an endpoint) than the early look did (a --config file).
        say("the served model name or traces endpoint differs from the command line's: starting the stages again")
        discard_launched(launched)
    config = named
    text_stage = text_stage_of(config)
    server_args = server_args_for(args, str(text_stage.engine_args["model"]), served_names)
    # Bind the port before anything starts: a port in use fails at once.
    try:
        listen_address, sock = setup_server(server_args, reuse_port=False)
    except OSError as exc:
        say(f"cannot listen on {args.host}:{args.port}: {exc}")
        return 1
    try:
        say(f"starting {len(config.stage_args)} stage(s) from {args.pipeline_config}; "
             f"text stage {text_stage.stage_id} served as {served_names[0]!r}")
        from omni_engine.entrypoints.multi_stage_engine_client import (
            MultiStageEngineClient,
        )

        client = await MultiStageEngineClient.from_config(config, progress=say, text_stage=True, launched=launched)
        try:
            # omni_engine_* series and the LLM stages' vllm:* series on vLLM's /metrics
            register_pipeline_metrics(client, engine_metrics_timeout=args.engine_metrics_timeout)
            say(f"pipeline ready in {time.monotonic() - started:.1f} s ({config.runtime.execution_mode}); "
                 f"serving on {listen_address}")
            shutdown_task = await build_and_serve(client, listen_address, sock, server_args)
            await shutdown_task
        finally:
            await client.shutdown_async()
            say("stopped")
    finally:
        sock.close()
    return 0
