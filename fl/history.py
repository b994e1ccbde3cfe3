"""Per-round history of a federated run: JSON/CSV export and a PNG plot.

One ``RoundRecord`` per round: round number, global loss/accuracy (evaluated after
aggregation), participants (clients whose updates were used), stragglers (asked but not back
before the deadline), dropped (client -> reason the update was rejected), round time (s), and
free-form ``extra`` metrics (among them the bytes of model data up and down per client:
``RoundRecord.bytes_up`` / ``bytes_down`` and ``History.traffic()`` sum them). Pure Python; matplotlib is imported only by ``plot_png``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

__all__ = ["RoundRecord", "History"]

PathLike = Union[str, "os.PathLike[str]"]


def _num(v: Any) -> Optional[float]:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


@dataclass
class RoundRecord:
    round: int
    loss: Optional[float] = None
    accuracy: Optional[float] = None
    participants: List[str] = field(default_factory=list)
    stragglers: List[str] = field(default_factory=list)
    dropped: Dict[str, str] = field(default_factory=dict)
    round_time_s: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def epsilon(self) -> Optional[float]:
        """Client-level DP budget spent up to this round (``extra["dp"]["epsilon"]``, from the
        RDP accountant), or None for a run without DP."""
        dp = self.extra.get("dp")
        return _num(dp.get("epsilon")) if isinstance(dp, dict) else None

    @property
    def fed_accuracy(self) -> Optional[float]:
        """Federated evaluation: accuracy on the clients' own test parts, weighted by examples
        (``extra["fed_accuracy"]``); None in rounds without it."""
        return _num(self.extra.get("fed_accuracy"))

    @property
    def fed_loss(self) -> Optional[float]:
        """Federated evaluation's loss, weighted by examples (``extra["fed_loss"]``)."""
        return _num(self.extra.get("fed_loss"))

    @property
    def fed_examples(self) -> Optional[int]:
        """Test examples on the devices behind ``fed_loss``/``fed_accuracy``."""
        v = self.extra.get("fed_examples")
        return int(v) if isinstance(v, (int, float)) else None

    @property
    def bytes_up(self) -> Optional[int]:
        """Bytes of model data the clients sent up this round (``extra["bytes_up_total"]``)."""
        v = self.extra.get("bytes_up_total")
        return int(v) if isinstance(v, (int, float)) else None

    @property
    def bytes_down(self) -> Optional[int]:
        """Bytes of model data sent down to the clients this round (``extra["bytes_down_total"]``)."""
        v = self.extra.get("bytes_down_total")
        return int(v) if isinstance(v, (int, float)) else None

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RoundRecord":
        return cls(
            round=int(d["round"]),
            loss=_num(d.get("loss")),
            accuracy=_num(d.get("accuracy")),
            participants=[str(x) for x in d.get("participants") or []],
            stragglers=[str(x) for x in d.get("stragglers") or []],
            dropped={str(k): str(v) for k, v in (d.get("dropped") or {}).items()},
            round_time_s=_num(d.get("round_time_s")),
            extra=dict(d.get("extra") or {}),
        )


class History:
    """Ordered list of ``RoundRecord`` plus run ``metadata`` (strategy name, seed, ...)."""

    CSV_FIELDS = ["round", "loss", "accuracy", "num_participants", "participants",
                  "num_stragglers", "stragglers", "num_dropped", "dropped", "round_time_s", "epsilon"]

    def __init__(self, rounds: Optional[List[RoundRecord]] = None, metadata: Optional[Dict[str, Any]] = None):
        self.rounds: List[RoundRecord] = list(rounds or [])
        self.metadata: Dict[str, Any] = dict(metadata or {})

    def add_round(self, round: int, loss: Optional[float] = None, accuracy: Optional[float] = None, *,
                  participants=(), stragglers=(), dropped=None, round_time_s: Optional[float] = None,
                  **extra: Any) -> RoundRecord:
        rec = RoundRecord(int(round), _num(loss), _num(accuracy), [str(p) for p in participants],
                          [str(s) for s in stragglers], {str(k): str(v) for k, v in (dropped or {}).items()},
                          _num(round_time_s), dict(extra))
        self.rounds.append(rec)
        return rec

    def append(self, rec: RoundRecord) -> None:
        self.rounds.append(rec)

    def __len__(self) -> int:
        return len(self.rounds)

    def __iter__(self) -> Iterator[RoundRecord]:
        return iter(self.rounds)

    def __getitem__(self, i: int) -> RoundRecord:
        return self.rounds[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and self.rounds == other.rounds and self.metadata == other.metadata

    @property
    def last(self) -> Optional[RoundRecord]:
        return self.rounds[-1] if self.rounds else None

    def traffic(self) -> Dict[str, Any]:
        """Model data moved over the run: per round ``(round, up, down, clients up)`` and the
        totals and per-update means (up: bytes per update received; down: per client sent)."""
        rows = []
        n_up = n_down = 0
        for r in self.rounds:
            up, down = r.bytes_up, r.bytes_down
            if up is None and down is None:
                continue
            k_up = len(r.extra.get("bytes_up") or {})
            n_up += k_up
            n_down += len(r.extra.get("bytes_down") or {})
            rows.append({"round": r.round, "up": up or 0, "down": down or 0, "updates": k_up})
        tot_up = sum(x["up"] for x in rows)
        tot_down = sum(x["down"] for x in rows)
        return {"rounds": rows, "up": tot_up, "down": tot_down,
                "up_per_update": tot_up / n_up if n_up else None, "down_per_client": tot_down / n_down if n_down else None,
                "compression": self.metadata.get("compression")}

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {"metadata": self.metadata, "rounds": [asdict(r) for r in self.rounds]}

    def to_json(self, path: Optional[PathLike] = None, indent: int = 2) -> str:
        """JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent, sort_keys=True, default=str)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        return text

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "History":
        return cls([RoundRecord.from_dict(r) for r in d.get("rounds", [])], d.get("metadata") or {})

    @classmethod
    def from_json(cls, text_or_path: Union[str, PathLike]) -> "History":
        """Accepts JSON text or a path to a JSON file."""
        s = os.fspath(text_or_path)
        if not s.lstrip().startswith("{"):
            with open(s, encoding="utf-8") as fh:
                s = fh.read()
        return cls.from_dict(json.loads(s))

    # ---- CSV -----------------------------------------------------------------------------
    def to_csv(self, path: Optional[PathLike] = None) -> str:
        """One row per round (lists joined by ';', dropped as 'client=reason;...')."""
        extra_keys = sorted({k for r in self.rounds for k in r.extra})
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(self.CSV_FIELDS + extra_keys)
        for r in self.rounds:
            w.writerow([
                r.round, "" if r.loss is None else r.loss, "" if r.accuracy is None else r.accuracy,
                len(r.participants), ";".join(r.participants), len(r.stragglers), ";".join(r.stragglers),
                len(r.dropped), ";".join(f"{k}={v}" for k, v in r.dropped.items()),
                "" if r.round_time_s is None else r.round_time_s, "" if r.epsilon is None else r.epsilon,
            ] + [r.extra.get(k, "") for k in extra_keys])
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
        return text

    # ---- plot ----------------------------------------------------------------------------
    def plot_png(self, path: PathLike, title: Optional[str] = None) -> str:
        """Loss and accuracy per round (two panels) to a PNG file. Needs matplotlib."""
        try:
            import matplotlib
            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "History.plot_png needs matplotlib, which is not installed: pip install matplotlib "
                "(to_json/to_csv work without it)"
            ) from exc
        rounds = [r.round for r in self.rounds]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
        try:
            ax1.plot(rounds, [math.nan if r.loss is None else r.loss for r in self.rounds], marker="o")
            ax1.set_xlabel("round")
            ax1.set_ylabel("loss")
            ax2.plot(rounds, [math.nan if r.accuracy is None else r.accuracy for r in self.rounds],
                     marker="o", color="tab:green")
            ax2.set_xlabel("round")
            ax2.set_ylabel("accuracy")
            if title or self.metadata.get("strategy"):
                fig.suptitle(title or f"strategy: {self.metadata['strategy']}")
            fig.tight_layout()
            fig.savefig(os.fspath(path), format="png", dpi=100)
        finally:
            plt.close(fig)
        return os.fspath(path)
