"""The shadow adapter: the one owner of serving adapter versions (publish, pin, release).

`publish` checks that the version is newer (the one place that rule lives), builds the new
version's tensors off the serving path (in the caller's thread), lets the caller persist it, then
flips one reference under a lock held for nanoseconds. A request pins the version that is current
when it is admitted and keeps it for every token, because its KV cache was computed with that
adapter; a superseded version is freed when its last pinned request releases it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from collm.edge_client.model.lora import AdapterWeights, LoRALayers


class StaleVersion(ValueError):
    """A version that is not newer than the one being served."""


@dataclass
class VersionInfo:
    version: int
    round: int | None
    published_at: float  # wall clock
    eval_loss: float | None
    source: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ShadowAdapter:
    def __init__(self, layers: LoRALayers, device: torch.device, dtype: torch.dtype, history: int = 32):
        self._layers = layers
        self._device = device
        self._dtype = dtype
        self._lock = threading.Lock()  # the flip and the pins (held for nanoseconds)
        self._publishing = threading.Lock()  # one publisher at a time (held while copying)
        self._current: AdapterWeights | None = None
        self._pins: dict[int, int] = {}  # version -> pinned requests
        self._alive: dict[int, AdapterWeights] = {}  # current + superseded versions still pinned
        self.history: deque[VersionInfo] = deque(maxlen=history)
        self.swaps = 0
        self.last_publish_s = 0.0

    # -------------------------------------------------------------- publishing (any thread)
    def publish(self, state: dict[str, torch.Tensor], version: int, *, round: int | None = None,
                eval_loss: float | None = None, source: str = "federated",
                persist: Callable[[dict, VersionInfo], None] | None = None) -> AdapterWeights:
        """Make `state` (PEFT keys) the version new requests are served with.

        Raises StaleVersion if `version` is not newer than the current one. `persist(state, info)`,
        if given, runs after the copy and before the flip: a version is served only once it is saved.
        """
        with self._publishing:
            if version <= self.current_version:
                raise StaleVersion(f"adapter version {version} is not newer than {self.current_version}")
            t0 = time.perf_counter()
            weights = self._layers.serving_weights(state, version, self._device, self._dtype)  # the copy
            info = VersionInfo(version, round, time.time(), eval_loss, source)
            if persist is not None:
                persist(state, info)
            self._flip(weights, info)
            self.last_publish_s = time.perf_counter() - t0
        return weights

    def _flip(self, weights: AdapterWeights, info: VersionInfo) -> None:
        version = weights.version
        with self._lock:
            old = self._current
            self._current = weights
            self._alive[version] = weights
            if old is not None:
                self.swaps += 1
                if self._pins.get(old.version, 0) == 0:
                    self._alive.pop(old.version, None)
            self.history.append(info)

    def set_eval_loss(self, version: int, loss: float) -> None:
        for info in self.history:
            if info.version == version:
                info.eval_loss = loss

    # -------------------------------------------------------------- pinning (engine thread)
    def pin(self) -> AdapterWeights:
        with self._lock:
            w = self._current
            if w is None:
                raise RuntimeError("no adapter published yet")
            self._pins[w.version] = self._pins.get(w.version, 0) + 1
            return w

    def release(self, w: AdapterWeights) -> None:
        with self._lock:
            n = self._pins.get(w.version, 0) - 1
            if n > 0:
                self._pins[w.version] = n
                return
            self._pins.pop(w.version, None)
            if self._current is None or w.version != self._current.version:
                self._alive.pop(w.version, None)  # superseded and no longer used: free it

    # -------------------------------------------------------------- views
    @property
    def current(self) -> AdapterWeights | None:
        return self._current

    @property
    def current_version(self) -> int:
        return -1 if self._current is None else self._current.version

    def current_info(self) -> VersionInfo | None:
        return self.history[-1] if self.history else None

    def alive_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._alive)

    def weights_of(self, version: int) -> AdapterWeights | None:
        with self._lock:
            return self._alive.get(version)
