"""``omni-engine transfer-queue serve``: the rollout-to-training data queue (HTTP + RPC)."""

from __future__ import annotations

import argparse
import logging

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
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(handler=run_serve)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def run_serve(args: argparse.Namespace) -> int:
    from omni_engine.transfer_queue.data_model import BufferConfig
    from omni_engine.transfer_queue.server import TransferQueueServer, run
    from omni_engine.transfer_queue.service import TransferQueueService

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    updates = {name: getattr(args, name) for name in (*_CONFIG_FLAGS, "uid_dedup") if getattr(args, name) is not None}
    problems = BufferConfig(**{k: v for k, v in updates.items() if k != "group_timeout_policy"}).problems()
    if problems:
        print("transfer-queue serve: " + "; ".join(problems))
        return 2
    service = TransferQueueService(updates, args.data_dir, args.durability, ack_timeout_s=args.ack_timeout_seconds)
    rpc = None if args.rpc_address.lower() == "none" else args.rpc_address
    return run(TransferQueueServer(service, args.host, args.port, rpc))
