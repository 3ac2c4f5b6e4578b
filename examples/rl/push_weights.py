"""Push a model's weights into a running ``omni-engine serve`` (``VLLM_SERVER_DEV_MODE=1``), as a trainer does.

    python examples/rl/push_weights.py --url http://127.0.0.1:8000 --api-key KEY \\
        --weights step-12.safetensors --version 12 --mode wait

The weights go over shared memory (``--backend shm``, the trainer on the server's host) or
ZMQ frames with CURVE (``--backend zmq``, any host: the server's stages fetch them from a
socket this process binds, ``--bind``). ``--vllm-client`` drives the push with vLLM's own
``HTTPVLLMWeightSyncClient`` instead of ours (no API key, no fence): a trainer written for
vLLM works unchanged. Prints one JSON line: version, chunks, seconds.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="the server's --api-key")
    parser.add_argument("--weights", required=True, nargs="+", help="safetensors file(s) with the model's tensors")
    parser.add_argument("--version", required=True, help="the weight version the pushed weights get")
    parser.add_argument("--mode", default="wait", choices=("wait", "abort", "keep"),
                        help="what the fence does with requests in flight")
    parser.add_argument("--backend", default="shm", choices=("shm", "zmq"))
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="zmq: where this process serves the chunks")
    parser.add_argument("--dtype", default="float32", help="cast floating tensors to this dtype before sending")
    parser.add_argument("--vllm-client", action="store_true", help="push with vLLM's HTTPVLLMWeightSyncClient")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from omni_engine.weights import OmniHTTPWeightSyncClient, WeightSender

    dtype = getattr(torch, args.dtype)
    state = {name: (t.to(dtype) if t.is_floating_point() else t)
             for path in args.weights for name, t in load_file(path).items()}
    if args.vllm_client:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        client, mode = HTTPVLLMWeightSyncClient(args.url), None
    else:
        client, mode = OmniHTTPWeightSyncClient(args.url, api_key=args.api_key), args.mode
    t0 = time.perf_counter()
    with WeightSender(args.backend, bind=args.bind) as sender:
        client.init_weight_transfer_engine(sender.init_info())
        chunks = sender.push(client, state, version=args.version, mode=mode)
    print(json.dumps({"version": args.version, "chunks": chunks, "seconds": round(time.perf_counter() - t0, 3)}))


if __name__ == "__main__":
    main()
