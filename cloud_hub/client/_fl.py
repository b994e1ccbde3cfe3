"""SDK methods for FL runs stored in the hub (``/v1/fl/runs``), mixed into :class:`Client`.

``fl.Federation`` uses these to create a run, checkpoint each round and resume; they are
public so notebooks and dashboards can list runs and fetch a run's history or final model.
"""

from __future__ import annotations

import base64
from typing import Any

__all__ = ["FLRunsMixin"]


class FLRunsMixin:
    def request(self, method: str, path: str, **kw: Any) -> Any:  # provided by Client
        raise NotImplementedError

    def fl_create_run(self, name: str, *, strategy: str, rounds_planned: int, mode: str = "sync",
                      clients: list[str] | None = None, client_names: dict[str, str] | None = None,
                      config: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"name": name, "strategy": strategy, "mode": mode, "rounds_planned": rounds_planned,
                "clients": list(clients or []), "client_names": dict(client_names or {}), "config": dict(config or {})}
        return dict(self.request("POST", "/v1/fl/runs", json=body))

    def fl_runs(self, limit: int = 100, status: str | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        return list(self.request("GET", "/v1/fl/runs", params=params)["runs"])

    def fl_run(self, run_id: str) -> dict[str, Any]:
        """The run with every round record (see docs/fl.md for the shape)."""
        return dict(self.request("GET", f"/v1/fl/runs/{run_id}"))

    def fl_put_round(self, run_id: str, round: int, record: dict[str, Any], weights: bytes,
                     state: dict[str, Any] | None = None, status: str = "running") -> dict[str, Any]:
        body = {"record": record, "weights": base64.b64encode(weights).decode(), "state": dict(state or {}), "status": status}
        return dict(self.request("PUT", f"/v1/fl/runs/{run_id}/rounds/{int(round)}", json=body))

    def fl_checkpoint(self, run_id: str) -> dict[str, Any]:
        """``{"run_id", "round", "weights": bytes (an fl.wire blob), "state", "created"}``."""
        ck = dict(self.request("GET", f"/v1/fl/runs/{run_id}/checkpoint"))
        ck["weights"] = base64.b64decode(ck["weights"])
        return ck

    def fl_set_status(self, run_id: str, status: str, error: str | None = None) -> dict[str, Any]:
        return dict(self.request("PATCH", f"/v1/fl/runs/{run_id}", json={"status": status, "error": error}))

    def scheduler_predict(self, function_id: str, endpoint_ids: list[str], *, payload_bytes: int = 0,
                          horizon_s: float | None = None) -> dict[str, dict[str, Any]]:
        """The scheduler's prediction per endpoint for ``function_id`` (nothing is placed):
        ``{endpoint_id: {"predicted_s", "run_s", "p_online", "online", "known", "source", ...}}``."""
        body: dict[str, Any] = {"function_id": function_id, "endpoint_ids": list(endpoint_ids), "payload_bytes": int(payload_bytes)}
        if horizon_s is not None:
            body["horizon_s"] = float(horizon_s)
        out = self.request("POST", "/v1/scheduler/predict", json=body)
        return {p["endpoint_id"]: p for p in out["predictions"]}
