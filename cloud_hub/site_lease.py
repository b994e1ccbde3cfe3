"""How long work leased ahead to a site gateway waits for the gateway's confirmation.

The hub leases a site's tasks to its gateway and re-queues them if the gateway does not confirm
("I stored them") in time, so a batch lost on the way goes out again soon. A fixed ``lease_s``
is wrong for an uplink: over a congested 256 kbit/s link with a 300 ms round trip confirmations
took longer than 8 s, every batch expired and was sent again, and the re-sends congested the
uplink further (village.yaml sent 2-3x the bytes of the same fleet without gateways). So each
gateway's confirmation delay is measured, and the unconfirmed lease lasts a multiple of it,
never less than ``lease_s`` and never more than ``site_hold_s``. Pure logic, no I/O."""

from __future__ import annotations

from typing import Iterable

__all__ = ["ConfirmClock"]


class ConfirmClock:
    """Per-gateway estimate of send-to-confirmation delay (an EWMA), and the lease it implies."""

    def __init__(self, floor_s: float, cap_s: float, *, factor: float = 4.0, alpha: float = 0.3,
                 max_pending: int = 200_000) -> None:
        if not (0 < floor_s <= cap_s):
            raise ValueError(f"need 0 < floor_s <= cap_s, got {floor_s} and {cap_s}")
        self.floor_s, self.cap_s, self.factor, self.alpha = floor_s, cap_s, factor, alpha
        self.max_pending = max_pending
        self.estimate_s: float | None = None
        self._sent: dict[str, float] = {}

    def sent(self, ids: Iterable[str], now: float) -> None:
        """Tasks went to the gateway at ``now``. A re-send keeps the first time: a confirmation
        then over-, never under-states the delay."""
        for tid in ids:
            self._sent.setdefault(tid, now)
        while len(self._sent) > self.max_pending:  # bounded: forget the oldest unconfirmed sends
            self._sent.pop(next(iter(self._sent)))

    def confirmed(self, ids: Iterable[str], now: float) -> None:
        """The gateway confirmed these: one sample per confirming frame (its slowest task)."""
        delays = [now - t for t in (self._sent.pop(tid, None) if isinstance(tid, str) else None for tid in ids) if t is not None]
        if not delays:
            return
        sample = max(0.0, max(delays))
        self.estimate_s = sample if self.estimate_s is None else (1 - self.alpha) * self.estimate_s + self.alpha * sample

    def lease_s(self) -> float:
        """The unconfirmed lease for the next batch."""
        if self.estimate_s is None:
            return self.floor_s
        return min(self.cap_s, max(self.floor_s, self.factor * self.estimate_s))

    @property
    def pending(self) -> int:
        return len(self._sent)
