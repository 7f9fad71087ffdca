"""Evening out a data-parallel step within the step (``batch_split: by_speed`` with
``batch_split_steal``): members that finish their own slice take chunks of the slices still
being worked on.

Slices sized by speed (:mod:`shoal.coordinator.slices`) give each member a share of the
global batch in proportion to its measured rate, but a member's work on the same slice swings
from one step to the next (another process's burst, a CFS period, a page fault), and a
synchronous step waits for whoever was slow this time. So each member's slice - its *block* -
is cut into chunks of one size (the engine's micro-batches: the prefetcher already fetches
them one by one), and every chunk is *claimed* before it is trained: a member takes its own
block's chunks from the front; once its block is done, it takes the last untaken chunk of the
block with the largest share of its chunks left (the member furthest from done), until no
chunk is left anywhere. Then it launches its part of the all-reduce as ever.

Claims are atomic in the generation's rendezvous store (:meth:`RedisStore.claim
<shoal.worker.store.RedisStore.claim>`, one Lua call per chunk, under the group's store
prefix and this step's key): no chunk is trained twice, every chunk is trained by someone,
and the step's all-reduced sample count (the engine's tail) still checks that the ranks
covered exactly the global batch. The update does not depend on who trained which sample
(shoal sums the losses and divides by the global count), so the replicas stay bit-identical
and the weights equal those of equal slices up to the order of float additions. Each member
commits the samples it trained (``StepResult.trained``), so the ledger stays exactly once.
A failed step aborts as any step does (nothing applied, its claims forgotten: the next try
runs in another generation, under another key).

Opt-in (``batch_split_steal: true``): measured, samples/s +3-7 % where a waiting member's CPU
stays idle (CFS quotas that bind), nil on an oversubscribed box, where the claims, the stolen
chunks read in their thieves' training threads and the finer loader items cost the CPU the
waiting freed (``docs/training.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

#: Chunks per member at the job's largest world size, by default (the chunk is the job's
#: ``micro_batch`` when the setup gives one): a chunk is about 1/16 of a member's step, so a
#: step's members finish within about a chunk of each other.
PARTS_PER_MEMBER = 16
#: The default chunk is never smaller than this many samples (a forward and backward pass
#: per sample or two would cost more than the waiting it saves).
MIN_CHUNK = 8

#: ``claim(key, block, chunks)`` -> (block, chunk index) or None: :meth:`RedisStore.claim`
Claim = Callable[[str, int, Sequence[int]], "tuple[int, int] | None"]


def default_chunk(global_batch: int, max_workers: int) -> int:
    """The chunk of a job that balances within the step and gives no ``micro_batch``."""
    return max(MIN_CHUNK, -(-global_batch // (max(1, max_workers) * PARTS_PER_MEMBER)))


@dataclass(frozen=True)
class StepShares:
    """One step's work by rank: ``blocks[r]`` is rank r's slice (dataset indices, in the order
    its engine trains them), cut in chunks of ``chunk`` samples from the front; ``rank`` is
    this member's; ``key`` names the step in the group's store (its table's generation and
    its step: never reused by another try of the step)."""

    blocks: tuple[np.ndarray, ...]
    rank: int
    chunk: int
    key: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(np.asarray(b, dtype=np.int64).reshape(-1) for b in self.blocks))
        if self.chunk <= 0:
            raise ValueError(f"chunk must be positive, got {self.chunk}")
        if not 0 <= self.rank < len(self.blocks):
            raise ValueError(f"rank {self.rank} has no block (of {len(self.blocks)})")

    @property
    def chunks(self) -> list[int]:
        """Each block's number of chunks (its last one may be short)."""
        return [-(-len(b) // self.chunk) for b in self.blocks]

    def part(self, block: int, index: int) -> list[int]:
        """The dataset indices of chunk ``index`` of ``block``."""
        start = index * self.chunk
        return self.blocks[block][start : start + self.chunk].tolist()


def parts(shares: StepShares, claim: Claim) -> Iterator[tuple[int, list[int]]]:
    """The chunks this member trains in the step, as it claims them: (block, indices) - its
    own block's from the front first, then others'. Ends when every chunk is taken."""
    chunks = shares.chunks
    while (got := claim(shares.key, shares.rank, chunks)) is not None:
        block, index = got
        yield block, shares.part(block, index)
