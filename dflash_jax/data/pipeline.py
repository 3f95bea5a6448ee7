"""The grain input pipeline of the trainer: tokenized rows -> shuffled, repeated, fixed-shape batches.

Every process builds the SAME global order (shuffle by seed, a fresh permutation per epoch) and loads only
its own contiguous share of each global batch: global batch ``k`` is records ``[k*G, (k+1)*G)`` of that order
whatever the number of processes, so a run on 2 hosts sees exactly the batches of a run on 1. The iterator's
state (the next batch index) is tiny JSON, saved with every checkpoint and restored by seeking, never by
re-reading.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import grain
import numpy as np

from dflash_jax.errors import UserError


def steps_per_run(num_rows: int, global_batch: int, epochs: int) -> int:
    """Optimizer steps in ``epochs`` passes (the last partial global batch is dropped)."""
    return (num_rows * epochs) // global_batch


def make_dataset(source: Any, global_batch: int, *, seed: int, epochs: int, process_index: int = 0,
                 process_count: int = 1) -> grain.MapDataset:
    """Batches of this process: ``global_batch / process_count`` rows each, one per optimizer step.
    ``source``: random access to the rows (``len`` and ``source[i]``, e.g. a ``TokenizedData``)."""
    num_rows = len(source)
    if global_batch % process_count:
        raise UserError(f"global batch {global_batch} is not divisible by the {process_count} processes")
    steps = steps_per_run(num_rows, global_batch, epochs)
    if steps < 1:
        raise UserError(f"{num_rows} rows x {epochs} epochs do not fill one global batch of {global_batch}")
    local = global_batch // process_count
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(epochs)
    ds = ds.batch(local, drop_remainder=True)[: steps * process_count]
    return ds[process_index::process_count]


class BatchIterator:
    """The dataset's iterator with a JSON-able position: ``state()`` / ``restore(state)`` seek in O(1)."""

    def __init__(self, dataset: grain.MapDataset, prefetch_threads: int = 2):
        self.dataset = dataset
        options = grain.ReadOptions(num_threads=prefetch_threads, prefetch_buffer_size=4)
        self._iter = iter(dataset.to_iter_dataset(options))

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iter)

    def state(self) -> dict[str, Any]:
        return dict(self._iter.get_state())

    def restore(self, state: Mapping[str, Any]) -> None:
        self._iter.set_state(dict(state))
