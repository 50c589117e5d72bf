"""The shadow adapter: the one owner of serving adapter versions (publish, pin, release).

`publish` checks that the version is newer (the one place that rule lives), builds the new
version's tensors off the serving path (in the caller's thread), lets the caller persist it, then
flips one reference under a lock held for nanoseconds. A request pins a version (the current one
when it is admitted, unless it named a retained one or the base) and keeps it for every token,
because its KV cache was computed with that adapter. The last `retain` published versions stay
servable by name; an older one is freed when its last pinned request releases it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from collm.edge_client.model.lora import BASE, LOCAL_VERSION, AdapterWeights, LoRALayers


class StaleVersion(ValueError):
    """A version that is not newer than the one being served."""


class UnknownVersion(LookupError):
    """A version that is not retained here (never published, or no longer kept)."""

    def __init__(self, version: int, available: list[int]):
        super().__init__(f"adapter version {version} is not retained here; available: "
                         f"{', '.join(map(str, available)) or 'none'}")
        self.version, self.available = version, available


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the adapter's tensors (float32, keys sorted): the same weights give the same digest."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().to("cpu", torch.float32).contiguous()
        h.update(k.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


@dataclass
class VersionInfo:
    version: int
    round: int | None
    published_at: float  # wall clock
    eval_loss: float | None
    source: str
    digest: str | None = None  # sha256 of the weights (`state_digest`)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ShadowAdapter:
    def __init__(self, layers: LoRALayers, device: torch.device, dtype: torch.dtype, history: int = 32,
                 retain: int = 1):
        self._layers = layers
        self._device = device
        self._dtype = dtype
        self._lock = threading.Lock()  # the flip and the pins (held for nanoseconds)
        self._publishing = threading.Lock()  # one publisher at a time (held while copying)
        self._current: AdapterWeights | None = None
        self._pins: dict[int, int] = {}  # version -> pinned requests
        self._alive: dict[int, AdapterWeights] = {}  # retained versions + superseded ones still pinned
        self._retained: deque[int] = deque(maxlen=max(1, retain))  # the last published (servable by name)
        self._states: dict[int, dict[str, torch.Tensor]] = {}  # PEFT state of each retained version (rollback)
        self._latest = -1  # the newest version ever published: a version number is never reused
        # the edge's own adapter (the global plus what it trained since), republished every few local
        # steps; requests hold a reference, so a replaced one is freed with its last request
        self._local: AdapterWeights | None = None
        self.local_publishes = 0
        self.history: deque[VersionInfo] = deque(maxlen=history)
        self.swaps = 0
        self.last_publish_s = 0.0
        self.observer: Callable[..., None] | None = None  # told of every publish (the engine's timeline)

    # -------------------------------------------------------------- publishing (any thread)
    def publish(self, state: dict[str, torch.Tensor], version: int, *, round: int | None = None,
                eval_loss: float | None = None, source: str = "federated",
                persist: Callable[[dict, VersionInfo], None] | None = None) -> AdapterWeights:
        """Make `state` (PEFT keys) the version new requests are served with.

        Raises StaleVersion if `version` is not newer than every version published so far (a rollback
        does not make an old number new again). `persist(state, info)`, if given, runs after the copy
        and before the flip: a version is served only once it is saved.
        """
        with self._publishing:
            if version <= self._latest:
                raise StaleVersion(f"adapter version {version} is not newer than {self._latest}")
            t0 = time.perf_counter()
            weights = self._layers.serving_weights(state, version, self._device, self._dtype)  # the copy
            info = VersionInfo(version, round, time.time(), eval_loss, source, state_digest(state))
            if persist is not None:
                persist(state, info)
            kept = {k: v.detach().to("cpu", torch.float32).clone() for k, v in state.items()}
            self._flip(weights, info, kept)
            self._latest = version
            self.last_publish_s = time.perf_counter() - t0
        self._observe(self.last_publish_s, version, source)
        return weights

    def reserve_through(self, version: int) -> None:
        """Count numbers up to `version` as published: after a restart that restored a rolled-back version, the
        numbers used before it must not be given to other weights."""
        with self._publishing:
            self._latest = max(self._latest, version)

    def publish_local(self, state: dict[str, torch.Tensor], steps: int) -> AdapterWeights:
        """Serve `state` (the training adapter) to requests that name the local adapter; the next global
        publish resets it to that global until the edge has trained on top of it again."""
        t0 = time.perf_counter()
        weights = self._layers.serving_weights(state, LOCAL_VERSION, self._device, self._dtype,
                                               meta={"local": True, "steps": steps, "based_on": self.current_version})
        self._observe(time.perf_counter() - t0, "local", "local")
        with self._lock:
            self._local = weights
            self.local_publishes += 1
        return weights

    def local_info(self) -> dict | None:
        w = self._local
        return None if w is None else dict(w.meta)

    def rollback(self, version: int, persist: Callable[[dict, VersionInfo], None] | None = None) -> VersionInfo:
        """Serve the retained `version` again (the admin's undo); UnknownVersion if it is not retained."""
        with self._publishing:
            t0 = time.perf_counter()  # its own duration, not the wait for a concurrent publish
            with self._lock:
                if version not in self._retained:
                    raise UnknownVersion(version, sorted(self._retained))
                weights, state = self._alive[version], self._states[version]
            old = self.info_of(version)
            info = VersionInfo(version, old.round if old else None, time.time(), old.eval_loss if old else None,
                               "rollback", old.digest if old else state_digest(state))
            if persist is not None:
                persist(state, info)
            with self._lock:
                if self._current is not weights:
                    self._current = weights
                    self.swaps += 1
                self.history.append(info)
            dt = time.perf_counter() - t0
        self._observe(dt, version, "rollback")
        return info

    def _observe(self, dt: float, version: int | str, source: str) -> None:
        """Tell the observer (the engine's timeline) of a publish that just took `dt` seconds."""
        if self.observer is not None:
            self.observer(t=time.time() - dt, s=dt, version=version, source=source)

    def _flip(self, weights: AdapterWeights, info: VersionInfo, state: dict[str, torch.Tensor]) -> None:
        version = weights.version
        with self._lock:
            old = self._current
            self._current = weights
            self._alive[version] = weights
            dropped = self._retained[0] if len(self._retained) == self._retained.maxlen else None
            self._retained.append(version)
            self._states[version] = state
            if old is not None:
                self.swaps += 1
            self._local = None  # the local adapter starts again from this global
            if dropped is not None:
                self._states.pop(dropped, None)
                if self._pins.get(dropped, 0) == 0 and dropped != self._current.version:
                    self._alive.pop(dropped, None)
            self.history.append(info)

    def set_eval_loss(self, version: int, loss: float) -> None:
        for info in self.history:
            if info.version == version:
                info.eval_loss = loss

    # -------------------------------------------------------------- pinning (engine thread)
    def pin(self, version: int | None = None) -> AdapterWeights:
        """The current version (None), a retained one, or `BASE.version` (no LoRA); held until `release`."""
        if version == BASE.version:
            return BASE
        with self._lock:
            if version == LOCAL_VERSION and self._local is not None:
                return self._local  # not counted: a reference keeps it, and it is never in `_alive`
            if version is None or version == LOCAL_VERSION:  # no local adapter yet: it is the global
                w = self._current
                if w is None:
                    raise RuntimeError("no adapter published yet")
            elif version in self._retained:
                w = self._alive[version]
            else:
                raise UnknownVersion(version, sorted(self._retained))
            self._pins[w.version] = self._pins.get(w.version, 0) + 1
            return w

    def release(self, w: AdapterWeights) -> None:
        if w is BASE or w.version == LOCAL_VERSION:
            return
        with self._lock:
            n = self._pins.get(w.version, 0) - 1
            if n > 0:
                self._pins[w.version] = n
                return
            self._pins.pop(w.version, None)
            if w.version not in self._retained and w is not self._current:
                self._alive.pop(w.version, None)  # no longer retained and no longer used: free it

    # -------------------------------------------------------------- views
    @property
    def current(self) -> AdapterWeights | None:
        return self._current

    @property
    def current_version(self) -> int:
        return -1 if self._current is None else self._current.version

    @property
    def latest_version(self) -> int:
        """The newest version ever published (-1: none); after a rollback it is above the current one."""
        return self._latest

    def current_info(self) -> VersionInfo | None:
        return self.history[-1] if self.history else None

    def alive_versions(self) -> list[int]:
        """Versions whose tensors are in memory (retained, or pinned by a running request)."""
        with self._lock:
            return sorted(self._alive)

    def retained_versions(self) -> list[int]:
        """Versions a new request may name (the last `retain` published, the current one included)."""
        with self._lock:
            return sorted(self._retained)

    def info_of(self, version: int) -> VersionInfo | None:
        return next((h for h in reversed(self.history) if h.version == version), None)

    def weights_of(self, version: int) -> AdapterWeights | None:
        with self._lock:
            return self._alive.get(version)
