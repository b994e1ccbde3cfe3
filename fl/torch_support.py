"""torch glue: state_dict <-> numpy weights, shipping a model's architecture without its
weights, device selection, and the plain supervised training/evaluation loops.

Imported only inside FL code paths (a round function on an endpoint, the driver's evaluation):
``import fl`` and the agent never import torch.
"""

from __future__ import annotations

import copy
import pickle
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

__all__ = [
    "select_device",
    "get_weights",
    "set_weights",
    "architecture_blob",
    "model_from_blob",
    "train_supervised",
    "evaluate_supervised",
]


def select_device(spec: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``: CUDA when this machine has a usable GPU, else CPU; anything else as given."""
    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {spec!r} requested but CUDA is not available on this endpoint")
    return dev


def get_weights(model: nn.Module) -> List[np.ndarray]:
    """Every state_dict entry (parameters and buffers) as a CPU numpy array, in state_dict order."""
    return [t.detach().to("cpu").numpy().copy() for t in model.state_dict().values()]


def set_weights(model: nn.Module, weights: Sequence[np.ndarray]) -> None:
    """Load numpy arrays into the model in state_dict order, casting back to each entry's dtype
    (aggregation averages integer buffers such as BatchNorm's ``num_batches_tracked`` in float)."""
    sd = model.state_dict()
    if len(weights) != len(sd):
        raise ValueError(f"model has {len(sd)} state_dict entries, got {len(weights)} arrays")
    new: Dict[str, torch.Tensor] = {}
    for (k, ref), w in zip(sd.items(), weights):
        a = np.asarray(w)
        if tuple(a.shape) != tuple(ref.shape):
            raise ValueError(f"{k}: shape {tuple(a.shape)} does not match the model's {tuple(ref.shape)}")
        if not ref.dtype.is_floating_point:
            a = np.rint(a)
        new[k] = torch.as_tensor(a).to(dtype=ref.dtype, device=ref.device)
    model.load_state_dict(new)


def architecture_blob(model: nn.Module) -> bytes:
    """The model without its weights: a copy on the ``meta`` device, serialized by the mesh's
    facade (about 1 KB for an MLP), so a model class defined in the driver script or in a module
    next to it travels by value. Weights travel separately, compressed (``fl.wire``)."""
    from mesh_agent.protocol.serialize import serialize

    return serialize(copy.deepcopy(model).to("meta"), user_modules=True)  # the driver's own modules by value


def model_from_blob(blob: bytes, weights: Optional[Sequence[np.ndarray]], device: torch.device) -> nn.Module:
    from mesh_agent.protocol.serialize import deserialize

    # (a bare pickle is an architecture blob from before the facade was used here)
    model: nn.Module = pickle.loads(blob) if blob[:1] == b"\x80" else deserialize(blob)
    model = model.to_empty(device=device)
    if weights is not None:
        set_weights(model, weights)
    return model


def _tensors(X: Any, y: Any, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    Xt = torch.as_tensor(np.asarray(X, dtype=np.float32), device=device)
    yt = torch.as_tensor(np.asarray(y, dtype=np.int64), device=device)
    return Xt, yt


def train_supervised(
    model: nn.Module,
    X: Any,
    y: Any,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    optimizer: str = "sgd",
    proximal_mu: float = 0.0,
    seed: int = 0,
    device: torch.device,
) -> Dict[str, float]:
    """Minibatch cross-entropy training in place; FedProx's ``mu/2 ||w - w_start||^2`` when
    ``proximal_mu > 0`` (w_start = the global weights the round started from)."""
    Xt, yt = _tensors(X, y, device)
    n = int(yt.shape[0])
    if n == 0:
        raise ValueError("no training samples")
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":  # (lr=0 is the warm-up pass: every code path runs, no weight moves)
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r} (use 'sgd' or 'adam')")
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else None
    gen = torch.Generator().manual_seed(int(seed))
    model.train()
    total, correct, seen = 0.0, 0, 0
    t0 = time.perf_counter()
    for _ in range(int(epochs)):
        perm = torch.randperm(n, generator=gen).to(device)
        for i in range(0, n, int(batch_size)):
            idx = perm[i : i + int(batch_size)]
            opt.zero_grad(set_to_none=True)
            out = model(Xt[idx])
            loss = nn.functional.cross_entropy(out, yt[idx])
            if anchor is not None:
                loss = loss + 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            correct += int((out.detach().argmax(1) == yt[idx]).sum())
            seen += len(idx)
    return {"loss": total / max(seen, 1), "accuracy": correct / max(seen, 1), "train_time_s": time.perf_counter() - t0}


@torch.no_grad()
def evaluate_supervised(model: nn.Module, X: Any, y: Any, *, device: torch.device, batch_size: int = 1024) -> Tuple[float, float]:
    """``(mean cross-entropy, accuracy)``."""
    Xt, yt = _tensors(X, y, device)
    model.eval()
    n = int(yt.shape[0])
    if n == 0:
        raise ValueError("no evaluation samples")
    loss, correct = 0.0, 0
    for i in range(0, n, batch_size):
        out = model(Xt[i : i + batch_size])
        loss += float(nn.functional.cross_entropy(out, yt[i : i + batch_size], reduction="sum"))
        correct += int((out.argmax(1) == yt[i : i + batch_size]).sum())
    return loss / n, correct / n
