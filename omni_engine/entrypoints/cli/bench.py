"""``omni-engine bench serve``: benchmark a running OpenAI-compatible server (``omni_engine.bench``)."""

from __future__ import annotations

import argparse

NAME = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help="benchmark a running server (text and audio)")
    kinds = parser.add_subparsers(title="benchmarks", metavar="KIND")
    serve = kinds.add_parser("serve", help="requests against an OpenAI-compatible server, as `vllm bench serve`",
                             description="Time to first token and audio, throughput, real-time factor and the "
                                         "underruns of a listener at 1x, against any OpenAI-compatible server.")
    from omni_engine.bench.serve_bench import add_arguments

    add_arguments(serve)
    serve.set_defaults(handler=handle)
    return parser


def handle(args: argparse.Namespace) -> int:
    from omni_engine.bench.serve_bench import main

    return main(args)
