"""``omni-engine transfer-queue serve``: the rollout-to-training data queue (HTTP + RPC)."""

from __future__ import annotations

import argparse
import logging
import sys

NAME = "transfer-queue"

# Flags that set BufferConfig fields; unset ones keep what the data directory recorded.
_CONFIG_FLAGS = ("group_size", "task_type", "max_memory_bytes", "spill_to_disk_threshold", "max_disk_bytes",
                 "group_timeout_seconds", "group_timeout_policy")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="the rollout-to-training trajectory queue (slime-compatible)")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    serve = commands.add_parser("serve", help="run a transfer queue server")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8889, help="HTTP port (default 8889, slime's; 0: any free)")
    serve.add_argument("--rpc-address", default="tcp://127.0.0.1:8890",
                       help="ZMQ RPC bind address (default tcp://127.0.0.1:8890; 'none' to disable)")
    serve.add_argument("--data-dir", default=None,
                       help="write-ahead log directory: writes survive crashes and restarts (default: memory only)")
    serve.add_argument("--durability", choices=["fsync", "write", "off"], default="fsync",
                       help="with --data-dir: ack after fsync (default), after write (survives kill -9, not "
                            "power loss), or no log")
    serve.add_argument("--ack-timeout-seconds", type=float, default=60.0,
                       help="RPC groups a reader has not acknowledged in this time go back to the queue (default 60)")
    serve.add_argument("--group-size", type=int, default=None, help="samples per group (default 16)")
    serve.add_argument("--task-type", default=None)
    serve.add_argument("--max-memory-bytes", type=int, default=None)
    serve.add_argument("--spill-to-disk-threshold", type=float, default=None)
    serve.add_argument("--max-disk-bytes", type=int, default=None)
    serve.add_argument("--no-uid-dedup", dest="uid_dedup", action="store_false", default=None)
    serve.add_argument("--group-timeout-seconds", type=float, default=None)
    serve.add_argument("--group-timeout-policy", choices=["deliver_partial", "drop"], default=None)
    security = serve.add_argument_group(
        "security", "Who may use the queue. Listening on a non-loopback address needs --api-key for HTTP and "
                    "CURVE keys for RPC, or --insecure.")
    security.add_argument("--api-key", default=None,
                          help="bearer key every HTTP route but /health requires (default: "
                               "$OMNI_ENGINE_TRANSFER_QUEUE_API_KEY)")
    security.add_argument("--public-metrics", action="store_true", help="serve /metrics without the key")
    security.add_argument("--curve-server-key", default=None, metavar="FILE",
                          help="the RPC server's CURVE keypair (a zmq.auth .key_secret file): turns CURVE on")
    security.add_argument("--curve-client-key", default=None, metavar="FILE",
                          help="a client keypair the clients share (.key_secret); its public key is admitted")
    security.add_argument("--curve-allowed-key", action="append", default=[], metavar="FILE",
                          help="a client's public key file (.key) to admit; repeatable")
    security.add_argument("--insecure", action="store_true",
                          help="listen on a non-loopback address without protection (warns at start)")
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(handler=run_serve)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def run_serve(args: argparse.Namespace) -> int:
    from omni_engine.stage_engine.security import KeyFileError
    from omni_engine.transfer_queue.data_model import BufferConfig
    from omni_engine.transfer_queue.security import QueueSecurity, api_key_from_env
    from omni_engine.transfer_queue.server import TransferQueueServer, run
    from omni_engine.transfer_queue.service import TransferQueueService

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    updates = {name: getattr(args, name) for name in (*_CONFIG_FLAGS, "uid_dedup") if getattr(args, name) is not None}
    problems = BufferConfig(**{k: v for k, v in updates.items() if k != "group_timeout_policy"}).problems()
    if problems:
        print("transfer-queue serve: " + "; ".join(problems))
        return 2
    try:
        security = QueueSecurity.from_files(args.api_key or api_key_from_env(), args.curve_server_key,
                                            args.curve_client_key, tuple(args.curve_allowed_key),
                                            args.public_metrics, args.insecure)
    except KeyFileError as exc:
        print(f"transfer-queue serve: {exc}", file=sys.stderr)
        return 2
    service = TransferQueueService(updates, args.data_dir, args.durability, ack_timeout_s=args.ack_timeout_seconds)
    rpc = None if args.rpc_address.lower() == "none" else args.rpc_address
    return run(TransferQueueServer(service, args.host, args.port, rpc, security))
