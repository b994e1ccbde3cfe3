"""Per-round history of a federated run: JSON/CSV export and a PNG plot.

One ``RoundRecord`` per round: round number, global loss/accuracy (evaluated after
aggregation), participants (clients whose updates were used), stragglers (asked but not back
before the deadline), dropped (client -> reason the update was rejected), round time (s), and
free-form ``extra`` metrics. Pure Python; matplotlib is imported only by ``plot_png``.
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
                  "num_stragglers", "stragglers", "num_dropped", "dropped", "round_time_s"]

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
                "" if r.round_time_s is None else r.round_time_s,
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
