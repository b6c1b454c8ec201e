"""Fair queues: the order in which the queue pass tries queued items when demand exceeds free GPUs.

Pure (no database, no clock): ``rental_queue.process_queue`` reads what it needs and walks a ``FairQueue``.
docs/placement.md ("Fair queues") states the policy; in short:

1. **Priority first.** Every ``on_demand`` item comes before every ``interruptible`` one (``PRIORITY``).
2. **Within a priority, the account using least per weight.** An account's *usage* is the GPU milli its
   active placed rentals hold now (a 1-GPU rental: 1000; half a GPU: 500), plus what this pass has placed
   for it so far; its *deficit key* is ``usage / weight`` (weights are positive, set by an admin, default 1).
   The account with the lowest key goes next; ties go to the account whose next item is older
   (``(created_at, id)``), so with equal weights and nothing held the first choice is the oldest item.
3. **Within an account, oldest first.**

The caller reports each placement (``placed``), which raises that account's usage before the next choice;
an item that does not fit is simply not reported and the walk goes on (no head-of-line blocking). Nothing is
preempted for fairness and nothing is reserved: fairness only decides who is tried first for GPUs that are free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction

# Lower is tried first. A kind not listed (none today) is tried last.
PRIORITY = {"on_demand": 0, "interruptible": 1}
DEFAULT_WEIGHT = 1


@dataclass(frozen=True)
class QueuedItem:
    """One thing the queue pass tries as a unit: a queued rental, or a queued cluster (its first member's age)."""

    key: str  # the rental's id, or the cluster's
    account_id: str
    kind: str  # on_demand | interruptible
    created_at: datetime
    tie: str  # the (first) rental's id: breaks ties of created_at as the old FIFO order did
    milli: int  # GPU milli it holds once placed (gpu_count × gpu_milli, summed over a cluster's members)

    @property
    def age_key(self) -> tuple[datetime, str]:
        return self.created_at, self.tie


class FairQueue:
    """Queued items in fair-share order, adapting as the caller reports placements.

    ``held``: GPU milli each account holds now (missing: 0); ``weights``: each account's weight (missing:
    ``DEFAULT_WEIGHT``; must be > 0). Iterating yields each item once; call ``placed(item)`` after placing one.
    """

    def __init__(self, items: Iterable[QueuedItem], *, held: Mapping[str, int], weights: Mapping[str, int | Fraction]) -> None:
        self._usage: dict[str, int] = {}
        self._weight: dict[str, Fraction] = {}
        # priority → account → its items, oldest last (popped from the end)
        self._waiting: dict[int, dict[str, list[QueuedItem]]] = {}
        for item in items:
            level = PRIORITY.get(item.kind, len(PRIORITY))
            self._waiting.setdefault(level, {}).setdefault(item.account_id, []).append(item)
            if item.account_id not in self._weight:
                weight = Fraction(weights.get(item.account_id, DEFAULT_WEIGHT))
                if weight <= 0:
                    raise ValueError(f"account {item.account_id!r}: fair-share weight must be > 0, got {weight}")
                self._weight[item.account_id] = weight
                self._usage[item.account_id] = max(0, held.get(item.account_id, 0))
        for accounts in self._waiting.values():
            for queue in accounts.values():
                queue.sort(key=lambda i: i.age_key, reverse=True)

    def deficit(self, account_id: str) -> Fraction:
        """The account's usage per unit of weight: lower is served first."""
        return self._usage[account_id] / self._weight[account_id]

    def placed(self, item: QueuedItem) -> None:
        """The item was placed: its account now holds its GPUs too."""
        self._usage[item.account_id] += item.milli

    def __iter__(self) -> Iterator[QueuedItem]:
        for level in sorted(self._waiting):
            accounts = self._waiting[level]
            while accounts:
                account_id = min(accounts, key=lambda a: (self.deficit(a), accounts[a][-1].age_key))
                queue = accounts[account_id]
                item = queue.pop()
                if not queue:
                    del accounts[account_id]
                yield item


def fair_order(items: Iterable[QueuedItem], *, held: Mapping[str, int], weights: Mapping[str, int | Fraction]) -> list[QueuedItem]:
    """The order ``FairQueue`` tries the items in when none of them is placed (what a full fleet sees)."""
    return list(FairQueue(items, held=held, weights=weights))
