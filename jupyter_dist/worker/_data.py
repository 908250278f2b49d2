"""A sampler that remembers where it is, so a resumed run neither skips nor repeats a sample."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """``DistributedSampler`` semantics (this rank's share of a shuffled index list per epoch) plus a position.

    Put it in the state given to ``jd.save``/``jd.checkpoint`` (``{"model": m, "optimizer": o, "sampler": s}``);
    ``jd.resume`` restores the epoch and how many indices this rank had consumed, and the next iteration continues
    from there. Call :meth:`set_epoch` at the start of each epoch, as with ``DistributedSampler``.

    Parameters
    ----------
    dataset_len
        Number of samples (or the dataset itself: ``len()`` is taken).
    num_replicas, rank
        Default: the data-parallel size and rank (``jd.dp_size``/``jd.dp_rank``), which are the world size and
        rank without model parallelism.
    shuffle, seed, drop_last
        As ``torch.utils.data.DistributedSampler``.
    """

    def __init__(self, dataset_len: Any, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:  # fmt: skip
        n = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        if n < 1:
            raise ValueError(f"ResumableSampler needs at least one sample, got {n}")
        if num_replicas is None or rank is None:
            from ._runtime import get_runtime  # what jd.dp_size / jd.dp_rank read (not the jd facade: no circle)

            rt = get_runtime()
            # data-parallel, not global: the ranks of one tensor-parallel group must see the same samples
            num_replicas = rt.dp_size if num_replicas is None else num_replicas
            rank = rt.dp_rank if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} must be in [0, {num_replicas})")
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.position = 0
        """Indices of the current epoch already handed out by this rank."""
        per = n // num_replicas if drop_last else -(-n // num_replicas)
        self.num_samples = per

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new epoch starts at position 0; the same epoch keeps a restored position)."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def _indices(self) -> list[int]:
        import torch

        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.num_replicas
        if not self.drop_last and total > len(order):
            order += order[: total - len(order)]  # pad by wrapping, as DistributedSampler does
        return order[:total][self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        mine = self._indices()
        while self.position < len(mine):
            index = mine[self.position]
            self.position += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples - self.position

    def state_dict(self) -> dict[str, int]:
        """Epoch and position (what ``jd.save`` keeps for this rank)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved epoch and position (a changed dataset size or seed is an error)."""
        if state.get("n", self.n) != self.n or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"the sampler was saved for {state.get('n')} samples with seed {state.get('seed')}, "
                             f"now {self.n} with seed {self.seed}: the data order would change")  # fmt: skip
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
