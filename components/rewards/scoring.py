"""Score batches with several rewards, combine them, and overlap scoring with sampling.

``RewardSet`` scores in this process; ``components.rewards.client.RemoteRewardSet`` scores on a
reward server. Both return ``{reward key: RewardOutput}`` and are driven by ``BackgroundScoring``,
which scores each sampled batch while the next one is sampled.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from components.errors import RewardError
from components.rewards.base import Inputs, Reward, RewardOutput, describe
from components.rewards.registry import FrameAggregation, RewardCache, RewardSpec

WORKERS_PER_REWARD = 4


class Scorer(Protocol):
    weights: dict[str, float]
    required: set[str]
    groupwise: set[str]

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
              group_ids: Sequence[int], keys: Sequence[str], inputs: Inputs | None = None) -> dict[str, RewardOutput]:
        ...

    def close(self) -> None: ...


def call_reward(reward: Reward, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                group_ids: Sequence[int], frames: FrameAggregation = "mean",
                inputs: Inputs | None = None) -> RewardOutput:
    """One reward on one batch; a groupwise reward is called once per group; an image reward on videos
    (B, F, H, W, 3) scores their frames, aggregated by ``frames``; the input images reach a reward that takes
    them (``Reward.inputs``). Never raises."""
    n = len(images)
    if images.ndim == 5 and not reward.video:
        return score_frames(reward, images, prompts, metadata, group_ids, frames, inputs)
    given = {"inputs": inputs} if reward.inputs else {}
    try:
        if reward.kind == "groupwise":
            out = RewardOutput(scores=np.full(n, np.nan), errors=[None] * n)
            ids = np.asarray(group_ids)
            for g in dict.fromkeys(ids.tolist()):
                idx = np.flatnonzero(ids == g)
                if reward.inputs:
                    given = {"inputs": None if inputs is None else [inputs[i] for i in idx]}
                part = reward(images[idx], [prompts[i] for i in idx], [metadata[i] for i in idx], **given)
                _check_length(part, len(idx))
                out.scores[idx] = part.scores
                for j, i in enumerate(idx):
                    out.errors[i] = part.errors[j]
            return out
        out = reward(images, prompts, metadata, **given)
        _check_length(out, n)
        return out
    except Exception as exc:  # recorded as a failure of every sample of the batch
        return RewardOutput.all_failed(n, describe(exc))


def score_frames(reward: Reward, videos: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                 group_ids: Sequence[int], frames: FrameAggregation, inputs: Inputs | None = None) -> RewardOutput:
    """An image reward on videos (B, F, H, W, 3): every frame scored as an image of its video's prompt (and
    group), a video's score the mean or the min of its frames'; a failed frame fails its video."""
    b, f = videos.shape[:2]
    out = call_reward(reward, videos.reshape(b * f, *videos.shape[2:]), [p for p in prompts for _ in range(f)],
                      [m for m in metadata for _ in range(f)], [g for g in group_ids for _ in range(f)],
                      inputs=None if inputs is None else [x for x in inputs for _ in range(f)])
    per_frame = out.scores.reshape(b, f)
    scores = per_frame.mean(axis=1) if frames == "mean" else per_frame.min(axis=1)  # NaN where a frame failed
    errors: list[str | None] = []
    for i in range(b):
        failed = [(j, e) for j, e in enumerate(out.errors[i * f:(i + 1) * f]) if e is not None]
        errors.append(f"frame {failed[0][0]} of {f}: {failed[0][1]}" if failed else None)
    extra = {k: [v[i * f:(i + 1) * f] for i in range(b)] for k, v in out.extra.items()}  # per video, frame lists
    return RewardOutput(scores=scores, errors=errors, extra=extra)


def _check_length(out: RewardOutput, n: int) -> None:
    if len(out.scores) != n or len(out.errors) != n:
        raise ValueError(f"returned {len(out.scores)} scores for {n} samples")


class DaemonPool:
    """``submit`` like a ThreadPoolExecutor, on daemon threads started as needed: a reward call that never
    returns must not keep the process from exiting (executor threads are joined at exit)."""

    def __init__(self, max_workers: int, name: str) -> None:
        self.max_workers = max_workers
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, fn, *args) -> cf.Future:
        future: cf.Future = cf.Future()
        self._queue.put((future, fn, args))
        with self._lock:
            if self._idle == 0 and self._threads < self.max_workers:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Stop each worker after the calls already queued."""
        with self._lock:
            workers = self._threads
        for _ in range(workers):
            self._queue.put(None)


class RewardSet:
    """The configured rewards in this process, keyed by ``spec.key``, each call bounded by its timeout."""

    def __init__(self, specs: list[RewardSpec], cache: RewardCache | None = None, where: str = "rewards") -> None:
        cache = cache or RewardCache()
        self.specs = {s.key: s for s in specs}
        self.rewards = {s.key: cache.get(s, f"{where}.{i}") for i, s in enumerate(specs)}
        self.weights = {s.key: s.weight for s in specs}
        self.required = {s.key for s in specs if s.required}
        self.groupwise = {k for k, r in self.rewards.items() if r.kind == "groupwise"}
        # Each reward has its own workers, so one that hangs past its timeout (keeping its thread until it
        # returns) delays no other reward; its calls still queued when their time is up are cancelled.
        # Fanning out over several rewards only waits, with timeouts, on those workers.
        self._workers = {k: DaemonPool(WORKERS_PER_REWARD, f"reward-{k}") for k in self.rewards}
        self._fanout = DaemonPool(WORKERS_PER_REWARD * len(specs), "reward-fanout")

    def call(self, key: str, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
             group_ids: Sequence[int], inputs: Inputs | None = None) -> RewardOutput:
        timeout = self.specs[key].timeout_s
        future = self._workers[key].submit(call_reward, self.rewards[key], images, prompts, metadata, group_ids,
                                           self.specs[key].frames, inputs)
        try:
            return future.result(timeout=timeout)
        except cf.TimeoutError:
            future.cancel()
            return RewardOutput.all_failed(len(images), f"timed out after {timeout:g}s")

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
              group_ids: Sequence[int], keys: Sequence[str], inputs: Inputs | None = None) -> dict[str, RewardOutput]:
        if len(keys) == 1:
            return {keys[0]: self.call(keys[0], images, prompts, metadata, group_ids, inputs)}
        futures = {k: self._fanout.submit(self.call, k, images, prompts, metadata, group_ids, inputs) for k in keys}
        return {k: f.result() for k, f in futures.items()}

    def close(self) -> None:
        for pool in (*self._workers.values(), self._fanout):
            pool.shutdown()


def combine(outputs: dict[str, RewardOutput], weights: dict[str, float]) -> np.ndarray:
    """Weighted sum per sample; NaN where any reward failed."""
    return sum(weights[k] * out.scores for k, out in outputs.items())


def check_required(outputs: dict[str, RewardOutput], required: set[str]) -> None:
    """Abort the step when a reward marked ``required`` failed on any sample."""
    for key in sorted(required & outputs.keys()):
        out = outputs[key]
        if out.failed:
            first = next(e for e in out.errors if e is not None)
            raise RewardError(f"required reward {key!r} failed on {out.failed} of {len(out.errors)} samples: {first}")


def concat_outputs(parts: list[RewardOutput]) -> RewardOutput:
    extra: dict[str, list[Any]] = {}
    for part in parts:
        for k, v in part.extra.items():
            extra.setdefault(k, []).extend(v)
    return RewardOutput(scores=np.concatenate([p.scores for p in parts]),
                        errors=[e for p in parts for e in p.errors], extra=extra)


class BackgroundScoring:
    """Scores each submitted batch in the background; ``finish`` returns outputs for all samples in order.

    Pointwise rewards run as soon as a batch is submitted (overlapping the sampling of the next batch);
    groupwise rewards run in ``finish``, when every group is complete.
    """

    def __init__(self, scorer: Scorer, max_in_flight: int) -> None:
        self.scorer = scorer
        self._pool = cf.ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="scoring")
        self._pending: list[cf.Future] = []
        self._batches: list[tuple[np.ndarray, list[str], list[dict[str, Any]], list[int], Inputs | None]] = []
        self._lock = threading.Lock()
        self.pointwise = [k for k in scorer.weights if k not in scorer.groupwise]

    def submit(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
               group_ids: list[int], inputs: Inputs | None = None) -> None:
        with self._lock:
            self._batches.append((images, prompts, metadata, group_ids, inputs))
            if self.pointwise:
                self._pending.append(self._pool.submit(self.scorer.score, images, prompts, metadata, group_ids,
                                                       self.pointwise, inputs))

    def check(self) -> None:
        """Raise the failure of a batch already scored, as ``finish`` would, without waiting for the others: the
        sampler calls it between steps, so a reward server gone past its retry window stops sampling at once."""
        for future in self._pending:
            error = future.exception() if future.done() and not future.cancelled() else None
            if error is not None:
                self._abandon()
                raise error

    def finish(self) -> dict[str, RewardOutput]:
        """Every sample's outputs, in order. On a failure the batches not yet started are dropped and the pool
        is let go at once; the requests in flight end when the scorer is closed (the trainer always closes it)."""
        try:
            return self._collect()
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _collect(self) -> dict[str, RewardOutput]:
        results = [f.result() for f in self._pending]
        outputs = {k: concat_outputs([r[k] for r in results]) for k in self.pointwise}
        groupwise = [k for k in self.scorer.weights if k in self.scorer.groupwise]
        if groupwise:
            images = np.concatenate([b[0] for b in self._batches])
            prompts = [p for b in self._batches for p in b[1]]
            metadata = [m for b in self._batches for m in b[2]]
            group_ids = [g for b in self._batches for g in b[3]]
            inputs = None if self._batches[0][4] is None else [x for b in self._batches for x in b[4]]
            outputs.update(self.scorer.score(images, prompts, metadata, group_ids, groupwise, inputs))
        self._pool.shutdown(wait=True)
        return {k: outputs[k] for k in self.scorer.weights}
