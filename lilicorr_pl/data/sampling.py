"""Which examples each process reads, in which order, and how a run resumes mid-epoch.

Training: epoch ``e`` visits the global order ``randperm(n, seed + e)``; data-parallel rank ``r`` of ``W``
takes every ``W``-th sample of it from ``r`` (``DistributedSampler``), so a step of ``W`` ranks × ``b``
samples consumes the next ``W·b`` samples of the global order, as one process with batch ``W·b`` would.
The loader is torchdata's ``StatefulDataLoader``: its state (batches yielded this epoch, worker states)
travels in the checkpoint and a resumed run fast-forwards the sampler, without loading the skipped
data, to the batch where it stopped. Exact resume needs the same data, seed, ``W`` and batch size; the
state records them and a mismatched state is refused with a warning (the epoch restarts instead).

Validation: ``ShardedEvalSampler`` gives every example to exactly one rank (no padding), so the
sum-reduced metrics count each example once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class TrainSampler(DistributedSampler):
    """``DistributedSampler`` whose epoch is the data's: Lightning sets a sampler's epoch from its own count at each
    epoch's start, and after a resume that count can run ahead of the data. A fit stopped by ``max_steps`` inside an
    epoch counts that epoch as done, so the fit resumed with more steps went on with the epoch's data under the next
    number, and every later epoch got the order of the one after it (not the uninterrupted run's data). The first
    epoch Lightning sets after a resume (:attr:`resumed_epoch`, the epoch the loaded state goes on with) fixes the
    difference, which applies to every later one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resumed_epoch: int | None = None
        self.offset = 0

    def set_epoch(self, epoch: int) -> None:
        if self.resumed_epoch is not None:
            self.offset, self.resumed_epoch = int(epoch) - self.resumed_epoch, None
        super().set_epoch(int(epoch) - self.offset)


def train_sampler(num_samples: int, seed: int, num_replicas: int = 1, rank: int = 0) -> TrainSampler:
    """The seeded per-epoch shuffle, strided over ranks (explicit replicas/rank: no process group needed,
    and Lightning keeps a ``DistributedSampler`` instead of wrapping it in one)."""
    return TrainSampler(range(int(num_samples)), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The global visiting order of ``epoch`` (all ranks together)."""
    sampler = train_sampler(num_samples, seed)
    sampler.set_epoch(epoch)
    return list(sampler)


class ShardedEvalSampler(DistributedSampler):
    """Rank ``r`` of ``W`` evaluates examples ``r, r+W, r+2W, …``: every example exactly once.

    ``DistributedSampler``, which Lightning would add otherwise, pads the shards with repeated examples,
    which the sum-reduced validation metrics would then count twice. Shards may differ by one example.
    """

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(int(num_samples)), num_replicas=num_replicas, rank=rank, shuffle=False)
        self.dataset_size = int(num_samples)
        self.num_samples = len(range(rank, self.dataset_size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class ResumableLoader(StatefulDataLoader):
    """The training loader: a ``StatefulDataLoader`` whose state also names the data order it belongs to.

    ``order`` (seed, examples, replicas, batch size) and the sampler's epoch are saved with the loader state;
    loading a state of another order warns and starts the epoch from its beginning instead of skipping the
    wrong samples.
    """

    def __init__(self, *args: Any, order: dict[str, int], **kwargs: Any) -> None:
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in recent torch
            warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated", category=UserWarning)
            super().__init__(*args, **kwargs)
        self.order = dict(order)
        # The epoch a loaded state went on with from where it stopped (None: this loader starts its epoch at its first
        # batch): the training metrics of that epoch's earlier steps are the checkpoint's, not this run's.
        self.resumed_at_epoch: int | None = None
        # Whether the running epoch has had its last batch, as the training loop counts it (limit_train_batches
        # included; the loader's own count is not in its state with workers); None where no loop runs.
        self.epoch_finished: Callable[[], bool | None] | None = None

    def state_dict(self) -> dict[str, Any]:
        done = self.epoch_finished() if self.epoch_finished is not None else None
        return {"order": self.order, "epoch": self.sampler.epoch, "epoch_done": done, "loader": super().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if state_dict.get("order") != self.order:
            warnings.warn(
                f"the checkpoint's data order {state_dict.get('order')} does not match this run's {self.order}; "
                "starting the epoch from its beginning (exact resume needs the same data, seed, devices and batch size)",
                stacklevel=2,
            )
            return
        epoch, done = int(state_dict.get("epoch", 0)), state_dict.get("epoch_done")
        if done is None:  # saved without a training loop, or by an earlier version: the loader's own count
            done = state_dict["loader"].get("_num_yielded", 0) >= len(self)
        if done:
            # Saved once its epoch had had its last batch (a checkpoint of an epoch's last step): the run goes on
            # with the next epoch from its first batch. Loaded, this state would fast-forward that epoch past the
            # batches it had (all of them: an empty epoch, then the next one's data), and Lightning makes the
            # resumed run's first iterator before it sets the epoch, so the order is set here.
            self._resume_at(epoch + 1)
            return
        # Before any iterator exists: the fast-forward below replays this epoch's order, not epoch 0's.
        self._resume_at(epoch)
        super().load_state_dict(state_dict["loader"])
        self.resumed_at_epoch = epoch

    def _resume_at(self, epoch: int) -> None:
        """The data go on with ``epoch``, whatever number Lightning gives it next (:class:`TrainSampler`)."""
        self.sampler.set_epoch(epoch)
        if isinstance(self.sampler, TrainSampler):
            self.sampler.resumed_epoch = epoch
