"""``PrefetchWorker``: one rank's channel B, producing ready packs in the background.

    own sample stream -> rollout (through the RequestGate) -> preprocess (the user's function)
    -> teacher-forced encode -> packing -> VersionedReadyQueue

It runs in a thread beside the training loop: the rollout waits on the network (no
GIL held), preprocessing and tokenizing are short. The same steps run inline in the
synchronous loop (``produce_batch``), which is the baseline the benchmark compares against.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from omni_engine.rl.data import Sample
from omni_engine.rl.fence import GateStopped, RequestGate
from omni_engine.rl.packing import EncodedSample, Pack, Packer
from omni_engine.rl.ready_queue import VersionedReadyQueue
from omni_engine.rl.rollout_client import Rollout, RolloutClient, RolloutError

logger = logging.getLogger(__name__)

# (sample, rollout) -> the training target (parsed, matched, rebuilt), or None to skip the sample.
Preprocess = Callable[[Sample, Rollout], "str | None"]
# (sample, target, version) -> the teacher-forced encoding with its loss mask.
Encode = Callable[[Sample, str, int], EncodedSample]
# sample -> the prompt text sent to the server (the chat template applied).
RenderPrompt = Callable[[Sample], str]


@dataclass
class PrefetchCounters:
    batches: int = 0
    rollouts: int = 0
    rejected: int = 0  # preprocess returned None
    preprocess_errors: int = 0
    rollout_errors: int = 0
    packs: int = 0


class PrefetchWorker:
    def __init__(self, samples: Iterator[Sample], client: RolloutClient, gate: RequestGate, render: RenderPrompt,
                 preprocess: Preprocess, encode: Encode, packer: Packer, queue: VersionedReadyQueue[Pack],
                 batch_size: int) -> None:
        self.samples = samples
        self.client = client
        self.gate = gate
        self.render = render
        self.preprocess = preprocess
        self.encode = encode
        self.packer = packer
        self.queue = queue
        self.batch_size = batch_size
        self.counters = PrefetchCounters()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- one batch
    def produce_batch(self) -> list[Pack]:
        """One rollout batch through every step; the packs it completed. Raises GateStopped when
        the learner stopped."""
        batch = [next(self.samples) for _ in range(self.batch_size)]
        with self.gate.request() as version:
            rollouts = self.client.generate([self.render(s) for s in batch], version)
        self.counters.batches += 1
        packs = []
        for sample, rollout in zip(batch, rollouts):
            self.counters.rollouts += 1
            try:
                target = self.preprocess(sample, rollout)
                if target is None:
                    self.counters.rejected += 1
                    continue
                encoded = self.encode(sample, target, rollout.version)
            except Exception:  # noqa: BLE001 - one bad sample must not stop the stream
                self.counters.preprocess_errors += 1
                logger.exception("preprocess failed for a rollout (version %d); sample skipped", rollout.version)
                continue
            packs.extend(self.packer.add(encoded))
        self.counters.packs += len(packs)
        return packs

    # ------------------------------------------------------------- background
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="omni-rl-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Room for what a batch yields (as many packs as the batches so far gave on average).
                if not self.queue.wait_for_room(self.packs_per_batch()):
                    break
                try:
                    packs = self.produce_batch()
                except RolloutError as exc:
                    self.counters.rollout_errors += 1
                    logger.warning("rollout batch failed, going on with the next: %s", exc)
                    continue
                for pack in packs:
                    self.queue.put(pack, pack.ver)
        except GateStopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training loop by check()
            self.error = exc
            logger.exception("prefetch worker stopped")

    def packs_per_batch(self) -> int:
        c = self.counters
        return max(1, round(c.packs / c.batches)) if c.batches else 1

    def check(self) -> None:
        """Raise in the training loop what stopped the worker, so a broken channel B is not silent."""
        if self.error is not None:
            raise RuntimeError(f"channel B's prefetch worker failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self._stop.set()
        self.gate.stop()
        self.queue.close()
        if self._thread is not None:
            # At most one request holds the thread, bounded by the client's timeout.
            self._thread.join(timeout=self.client.timeout_s + 5.0)
        self.client.close()
