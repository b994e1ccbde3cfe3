"""How long work leased ahead to a site gateway waits for the gateway's confirmation.

The hub leases a site's tasks to its gateway and re-queues them if the gateway does not confirm
("I stored them") in time, so a batch lost on the way goes out again soon. A fixed ``lease_s``
is wrong for an uplink: over a congested 256 kbit/s link with a 300 ms round trip confirmations
took longer than 8 s, every batch expired and was sent again, and the re-sends congested the
uplink further (village.yaml sent 2-3x the bytes of the same fleet without gateways). So each
gateway's confirmation delay is measured, and the unconfirmed lease lasts a multiple of it,
never less than ``lease_s`` and never more than ``site_hold_s``.

With site frames (docs/sites.md, "Leases confirmed cumulatively") nothing leased to a connected
gateway expires on that timer at all: :class:`PendingBatches` knows which numbered ``site_down``
carried which tasks, the gateway's "stored up to n" and its id confirmations settle them, and a
batch is given up (its tasks re-queued) only on evidence: its send failed, the gateway stored a
later batch but not this one, or the gateway's hello says it stored nothing past n. The clock then
still serves two things: the unconfirmed lease once a gateway's session ends, and the uplink's
measured throughput, which paces how many bytes of work may be in flight (:meth:`ConfirmClock.window_bytes`, fed by :meth:`ConfirmClock.batch_confirmed`).
Pure logic, no I/O."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["ConfirmClock", "PendingBatches", "MIN_WINDOW_BYTES"]

#: The pacing window never shrinks below this: a gateway whose throughput is not known yet, or a
#: very slow one, still gets a batch of work at a time.
MIN_WINDOW_BYTES = 16 * 1024


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
        #: the uplink's measured throughput towards the gateway, bytes/s (EWMA), None until measured
        self.rate_bps: float | None = None

    def sent(self, ids: Iterable[str], now: float) -> None:
        """Tasks went to the gateway at ``now``. A re-send keeps the first time: a confirmation
        then over-, never under-states the delay."""
        for tid in ids:
            self._sent.setdefault(tid, now)
        while len(self._sent) > self.max_pending:  # bounded: forget the oldest unconfirmed sends
            self._sent.pop(next(iter(self._sent)))

    def confirmed(self, ids: Iterable[str], now: float) -> None:
        """The gateway confirmed these by id: one sample per confirming frame (its slowest task)."""
        delays = [now - t for t in (self._sent.pop(tid, None) if isinstance(tid, str) else None for tid in ids) if t is not None]
        if delays:
            self.estimate_s = self._ewma(self.estimate_s, max(0.0, max(delays)))

    def batch_confirmed(self, inflight_bytes: int, seconds: float) -> None:
        """A numbered site_down, sent with ``inflight_bytes`` unconfirmed (itself included), was
        confirmed after ``seconds`` (PendingBatches' samples): a delay sample, and the link carried
        at least that many bytes in that time. With site frames this replaces :meth:`sent` and
        :meth:`confirmed`: the batches already know when they went."""
        if seconds < 0:
            return
        self.estimate_s = self._ewma(self.estimate_s, seconds)
        if inflight_bytes > 0 and seconds > 0:
            self.rate_bps = self._ewma(self.rate_bps, inflight_bytes / max(seconds, 0.05))

    def _ewma(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample

    def lease_s(self) -> float:
        """The unconfirmed lease for the next batch."""
        if self.estimate_s is None:
            return self.floor_s
        return min(self.cap_s, max(self.floor_s, self.factor * self.estimate_s))

    def window_bytes(self, target_s: float = 4.0) -> int:
        """How many bytes of leased-ahead work may be in flight unconfirmed: what the uplink carries
        in ``target_s`` at its measured throughput. Bytes, not task counts: a task of 4 KB and one
        of 40 bytes cost the uplink differently, and sending more than the link carries only
        queues it, which delays every confirmation (and with it every device's next work)."""
        if self.rate_bps is None:
            return 4 * MIN_WINDOW_BYTES
        return max(MIN_WINDOW_BYTES, int(self.rate_bps * target_s))

    @property
    def pending(self) -> int:
        return len(self._sent)


@dataclass
class _Batch:
    sent_at: float
    nbytes: int
    inflight: int  # bytes in flight when it was sent, itself included (a throughput sample)
    ids: set[str] = field(default_factory=set)


class PendingBatches:
    """Numbered site_down batches whose leased-ahead tasks the gateway has not confirmed.

    ``upto(n)``: the gateway stored every batch up to n. ``confirmed(ids)``: it stored these tasks
    (its id confirmation, for a batch out of order). ``holes(now, grace)``: batches older than
    ``grace`` below the newest one the gateway confirmed anything of: lost on the way (the link
    keeps order), given up. ``floor(next_seq)``: every batch below it is settled, which the hub
    tells the gateway so its "stored up to" can step over a hole."""

    def __init__(self, max_batches: int = 10_000) -> None:
        self.max_batches = max_batches
        self._batches: OrderedDict[int, _Batch] = OrderedDict()
        self._seq_of: dict[str, int] = {}
        self._newest_confirmed = 0
        self.inflight_bytes = 0

    def sent(self, seq: int, ids: Iterable[str], nbytes: int, now: float) -> None:
        """Batch ``seq`` (``nbytes`` on the wire) leased these tasks ahead."""
        b = _Batch(now, nbytes, self.inflight_bytes + nbytes, set(ids))
        if not b.ids:
            return
        for tid in b.ids:
            self._seq_of[tid] = seq
        self._batches[seq] = b
        self.inflight_bytes += nbytes
        while len(self._batches) > self.max_batches:  # bounded: the oldest is forgotten (its lease still runs out)
            self._drop(next(iter(self._batches)))

    def floor(self, next_seq: int) -> int:
        return next(iter(self._batches), next_seq)

    def upto(self, seq: int, now: float) -> tuple[list[str], list[tuple[int, float]]]:
        """The gateway stored every batch up to ``seq``: their task ids, and (bytes in flight,
        seconds) throughput samples."""
        ids: list[str] = []
        samples: list[tuple[int, float]] = []
        while self._batches and next(iter(self._batches)) <= seq:
            n = next(iter(self._batches))
            b = self._batches[n]
            samples.append((b.inflight, now - b.sent_at))
            ids.extend(b.ids)
            self._drop(n)
        self._newest_confirmed = max(self._newest_confirmed, seq)
        return ids, samples

    def confirmed(self, ids: Iterable[str], now: float) -> list[tuple[int, float]]:
        """The gateway confirmed these tasks by id: throughput samples of the batches it settles."""
        samples: list[tuple[int, float]] = []
        for tid in ids:
            n = self._seq_of.pop(tid, None) if isinstance(tid, str) else None
            if n is None:
                continue
            self._newest_confirmed = max(self._newest_confirmed, n)
            b = self._batches.get(n)
            if b is None:
                continue
            b.ids.discard(tid)
            if not b.ids:
                samples.append((b.inflight, now - b.sent_at))
                self._drop(n)
        return samples

    def holes(self, now: float, grace_s: float) -> list[str]:
        """Give up batches the gateway stepped over: below the newest it confirmed anything of and
        sent more than ``grace_s`` ago (a confirmation of theirs could still be on its way). Their
        unconfirmed task ids, to re-queue."""
        out: list[str] = []
        for n in [n for n, b in self._batches.items() if n < self._newest_confirmed and now - b.sent_at > grace_s]:
            out.extend(self._drop(n))
        return out

    def not_stored(self, stored_upto: int, now: float, grace_s: float) -> list[str]:
        """The gateway's summary says it stored up to ``stored_upto`` and not further (it says so in
        every full summary, at least once a minute): a batch after that, sent more than
        ``grace_s`` ago and not confirmed by id either, did not arrive. Given up; its task ids, to
        re-queue. This is what frees work whose batch was lost when no later batch shows the hole."""
        out: list[str] = []
        for n in [n for n, b in self._batches.items() if n > stored_upto and now - b.sent_at > grace_s]:
            out.extend(self._drop(n))
        return out

    def past(self, seq: int) -> list[str]:
        """Give up every batch after ``seq`` (the gateway's hello says it stored up to seq and no
        further): their unconfirmed task ids, to re-queue."""
        out: list[str] = []
        for n in [n for n in self._batches if n > seq]:
            out.extend(self._drop(n))
        return out

    def give_up(self, seq: int) -> list[str]:
        """Batch ``seq`` is lost (it could not be sent): its task ids, to re-queue."""
        return self._drop(seq) if seq in self._batches else []

    def forget(self) -> list[str]:
        """Stop waiting for any confirmation by number (the gateway restarted and lost its count):
        every pending task id, which the caller puts back on the unconfirmed-lease timer."""
        out = self.ids()
        self._batches.clear()
        self._seq_of.clear()
        self.inflight_bytes = 0
        return out

    def ids(self) -> list[str]:
        """Every task id still waiting for confirmation."""
        return list(self._seq_of)

    def _drop(self, seq: int) -> list[str]:
        b = self._batches.pop(seq)
        self.inflight_bytes -= b.nbytes
        for tid in b.ids:
            self._seq_of.pop(tid, None)
        return list(b.ids)

    def __len__(self) -> int:
        return len(self._batches)
