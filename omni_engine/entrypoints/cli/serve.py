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
from pathlib import Path

from omni_engine.entrypoints.cli.common import say, set_stage_env_defaults

NAME = "serve"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help="serve a pipeline with vLLM's OpenAI-compatible API")
    parser.add_argument("config", type=Path, help="pipeline stage config (YAML)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name in the API (default: the text stage's served_model_name, "
                             "else its model as the config names it)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    set_stage_env_defaults()
    # A dead stage makes /health 503 (for a supervisor to act on); the server itself keeps answering.
    os.environ.setdefault("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1")
    import uvloop

    from omni_engine.config import ConfigError, load_pipeline_config
    from omni_engine.entrypoints.openai.engine_config import text_stage_of

    try:
        config = load_pipeline_config(args.config)
        text_stage_of(config)
    except (ConfigError, ValueError) as exc:
        say(str(exc))
        return 2

    # Until uvicorn's handlers are in place, SIGTERM interrupts start-up (as in
    # vLLM's run_server); stage processes die with us (PDEATHSIG).
    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, _interrupt)
    return uvloop.run(_serve(args, config))


def vllm_server_args(model: str, served_model_name: str, args: argparse.Namespace) -> argparse.Namespace:
    """vLLM's own ``vllm serve`` arguments (all defaults) for this model, host and port."""
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="omni-engine serve"))
    ns = parser.parse_args([
        "--model", model, "--served-model-name", served_model_name,
        "--host", args.host, "--port", str(args.port), "--uvicorn-log-level", args.uvicorn_log_level,
    ])
    validate_parsed_serve_args(ns)
    return ns


async def _serve(args: argparse.Namespace, config) -> int:
    import asyncio

    from vllm.entrypoints.launchers.api_server.entry import build_and_serve
    from vllm.entrypoints.launchers.launcher import setup_server

    from omni_engine.entrypoints.openai.audio import install_audio_routes
    from omni_engine.entrypoints.openai.engine_config import (
        apply_text_stage_config,
        build_text_stage_config,
        default_served_model_name,
        text_stage_of,
    )
    from omni_engine.entrypoints.openai.serving_client import OpenAIServingEngineClient
    from omni_engine.pipeline.stage_specs import prepare_models

    # Our audio routes (/v1/audio/speech, chat with audio) on the app build_and_serve builds.
    install_audio_routes()

    started = time.monotonic()
    served_name = args.served_model_name or default_served_model_name(text_stage_of(config))
    config = prepare_models(config, say)  # the model names as vLLM's server and the stages take them
    text_stage = text_stage_of(config)
    server_args = vllm_server_args(str(text_stage.engine_args["model"]), served_name, args)
    # Bind the port before anything starts: a port in use fails at once.
    try:
        listen_address, sock = setup_server(server_args, reuse_port=False)
    except OSError as exc:
        say(f"cannot listen on {args.host}:{args.port}: {exc}")
        return 1
    try:
        say(f"starting {len(config.stage_args)} stage(s) from {args.config}; "
             f"text stage {text_stage.stage_id} served as {served_name!r}")
        # The text stage's config and tokenizer load while the stages start.
        client_result, text_result = await asyncio.gather(
            OpenAIServingEngineClient.from_config(config, progress=say),
            asyncio.to_thread(build_text_stage_config, text_stage, served_name),
            return_exceptions=True,
        )
        if isinstance(client_result, BaseException):
            raise client_result
        client: OpenAIServingEngineClient = client_result
        try:
            if isinstance(text_result, BaseException):
                raise text_result
            apply_text_stage_config(client, text_result)
            from omni_engine.entrypoints.openai.metrics import register_pipeline_metrics
            register_pipeline_metrics(client)  # omni_engine_* series on vLLM's /metrics
            client.bind_loop()
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
