"""``omni-engine serve``'s arguments: vLLM's own ``vllm serve`` parser plus ours.

The parser is vLLM's ``make_arg_parser``, so every flag an operator passes to
``vllm serve`` (``--api-key``, ``--ssl-*``, ``--root-path``,
``--allowed-origins``, ``--middleware``, logging flags, tool and chat-template
flags, ``--config`` with a YAML of serve options ...) is parsed and validated
by vLLM and then read by vLLM's server code exactly as under ``vllm serve``.
vLLM's positional ``model_tag`` becomes the pipeline config; our flags sit in
their own group beside vLLM's.

A pipeline's engines are configured per stage in its YAML; vLLM's *engine* flags
(``--max-model-len``, ``--max-logprobs``, ``--model`` ...) given on the command
line set the engine of its one llm stage (``args.engine_flags``, applied by
``engine_config.with_engine_flags``), so a ``vllm serve`` command line works as
it is, and are refused, naming the stage field, where a pipeline has several. So
are the few server flags that cannot work in front of a pipeline (several API
server processes, gRPC, LoRA modules ...). Nothing given is silently ignored.
vLLM is imported only here, i.e. only for ``serve``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Our one default that differs from ``vllm serve`` (all interfaces): a server
# that answers unauthenticated prompts is reachable from elsewhere only on request.
DEFAULT_HOST = "127.0.0.1"
# Seconds a /metrics scrape waits for the stages' vLLM metrics before showing the last ones.
DEFAULT_ENGINE_METRICS_TIMEOUT_S = 2.0

# vLLM engine flags whose meaning in ``vllm serve`` is the server's own.
# (--otlp-traces-endpoint traces the whole pipeline: runtime.otlp_traces_endpoint, which llm stages share.)
SERVER_SIDE_ENGINE_FLAGS = frozenset({"served_model_name", "disable_log_stats", "enable_log_requests",
                                      "otlp_traces_endpoint"})
# Server flags that need one engine per API server, or that serve something a pipeline does not have.
UNSUPPORTED_SERVER_FLAGS: dict[str, str] = {
    "headless": "a pipeline's stages run under the server that starts them",
    "api_server_count": "the stages are shared by one API server process",
    "grpc": "omni-engine serves HTTP only",
    "grpc_port": "omni-engine serves HTTP only",
    "data_parallel_supervisor_port": "stages are not vLLM data-parallel engines",
    "dp_supervisor_probe_interval_s": "stages are not vLLM data-parallel engines",
    "dp_supervisor_probe_timeout_s": "stages are not vLLM data-parallel engines",
    "dp_supervisor_probe_failure_threshold": "stages are not vLLM data-parallel engines",
    "tokens_only": "a pipeline serves the OpenAI API, not the tokens-only endpoints",
    "enable_scale_out": "a pipeline serves the OpenAI API, not the scale-out endpoints",
    "model": "the positional argument names what is served; a pipeline's models are set in its config "
             "(engine_args.model of a stage)",
}


class ServeArgsError(ValueError):
    """A command line ``omni-engine serve`` refuses; the message names the flag."""


def build_serve_parser() -> Any:
    """vLLM's ``vllm serve`` parser with the pipeline config as its positional and our group."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from omni_engine.entrypoints.openai import tool_parsers

    tool_parsers.register()  # before vLLM lists the parsers in --tool-call-parser's help
    parser = FlexibleArgumentParser(
        prog="omni-engine serve",
        description="Serve a pipeline with vLLM's OpenAI-compatible server. Takes the flags of "
                    "`vllm serve` (see --help=all, --help=Frontend, --help=<flag>); engine flags set the "
                    "engine of the pipeline's one llm stage (with several, set them per stage in the "
                    "pipeline config).",
    )
    make_arg_parser(parser)
    config = _action(parser, "model_tag")
    config.metavar = "PIPELINE_CONFIG|MODEL"
    config.help = ("pipeline stage config (YAML) to serve, or a model: a checkpoint directory or "
                   "prepare-model recipe, served as its family's pipeline (by its architectures) or as "
                   "one vLLM stage (required)")
    parser.set_defaults(host=DEFAULT_HOST)
    _action(parser, "host").help = f"Host name (default: {DEFAULT_HOST}; `vllm serve` listens on all)."

    ours = parser.add_argument_group("omni-engine", "Options of the pipeline server itself.")
    ours.add_argument("--deploy-config", default=None, metavar="FILE",
                      help="vLLM-Omni's deploy YAML (stages: max_num_seqs, devices, gpu_memory_utilization, "
                           "default_sampling_params, ...; platforms:) over the pipeline: every field honoured or "
                           "refused by name (omni_engine.config.deploy)")
    ours.add_argument("--engine-metrics-timeout", type=float, default=DEFAULT_ENGINE_METRICS_TIMEOUT_S,
                      help="Seconds a /metrics scrape waits for the LLM stages' vllm:* metrics before it "
                           "shows the last ones they sent (default: %(default)s).")
    return parser


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check ``argv``; ``--help`` exits as argparse does. Raises ``ServeArgsError``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = build_serve_parser()
    args = parser.parse_args(list(argv))
    if not args.model_tag:
        raise ServeArgsError("omni-engine serve: the pipeline config or model is required: "
                             "omni-engine serve PIPELINE_CONFIG.yaml|MODEL_DIR [vllm serve flags]")
    # vLLM's own --config (a YAML of serve flags) keeps its dest; ours is pipeline_config.
    args.pipeline_config = Path(args.model_tag)
    engine_dests = {a.dest for a in AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())._actions}
    defaults = vars(parser.parse_args([]))
    # Engine flags given (a value other than vLLM's default): engine_args of the one llm stage.
    args.engine_flags = {}
    for dest, value in vars(args).items():
        if dest not in defaults or value == defaults[dest] or dest in SERVER_SIDE_ENGINE_FLAGS:
            continue
        if dest in UNSUPPORTED_SERVER_FLAGS:
            raise ServeArgsError(f"omni-engine serve: {_flag(parser, dest)} is not supported: "
                                 f"{UNSUPPORTED_SERVER_FLAGS[dest]}")
        if dest in engine_dests:
            args.engine_flags[dest] = value
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as exc:
        raise ServeArgsError(f"omni-engine serve: {exc}") from exc
    return args


def server_args_for(args: argparse.Namespace, model: str, served_model_names: list[str]) -> argparse.Namespace:
    """The namespace vLLM's server reads: ours, with the text stage's model and served names."""
    server_args = argparse.Namespace(**vars(args))
    server_args.model = model
    server_args.model_tag = model
    server_args.served_model_name = served_model_names
    return server_args


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    for action in parser._actions:
        if action.dest == dest:
            return action
    raise RuntimeError(f"vLLM's serve parser has no {dest!r} argument any more")


def _flag(parser: argparse.ArgumentParser, dest: str) -> str:
    strings = _action(parser, dest).option_strings
    long = [s for s in strings if s.startswith("--") and not s.startswith("--no-")]
    return (long or strings or [dest])[0]
