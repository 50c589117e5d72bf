"""One edge replica's lifetime: load once, serve, publish adapters durably, shut down cleanly.

`EdgeRuntime` owns the engine and what must survive a crash or restart, under `state_dir`:

    serving             the serving adapter and its version, written on every publish
    training            the training adapter and optimizer state, written at shutdown
(`edge_client/state_store.py`: crash-safe generations, read back with a fallback to the previous one).

Federation is a service the CLI attaches (`rt.federation = EdgeFederation(rt)`): the runtime
starts it once the engine runs and stops it first at shutdown, without knowing about Flower.
"""

from __future__ import annotations

import logging
import threading
import time

from collm.common.adapter_io import check_compatible
from collm.edge_client.config import EdgeConfig
from collm.edge_client.engine import Engine
from collm.edge_client.model.loading import load_model
from collm.edge_client.model.shadow import StaleVersion, VersionInfo
from collm.edge_client.state_store import read_serving, read_training, write_serving, write_training
from collm.edge_client.training.data import load_edge_data

log = logging.getLogger("collm.edge")


class EdgeRuntime:
    def __init__(self, cfg: EdgeConfig):
        self.cfg = cfg
        self.state_dir = cfg.resolved_state_dir
        self.engine: Engine | None = None
        self.model_name = "loading"
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.started_at = time.time()
        self.on_ready: list = []  # called once the engine runs, before the edge reports ready
        self.federation = None  # a service with start(), stop() and status() (federation.EdgeFederation)
        self.latest_round = -1  # the newest federated round whose global this edge served (persisted)

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> Engine:
        """Load the model and data, start the engine, restore the last serving adapter."""
        cfg = self.cfg
        log.info("edge %s: loading model (%s)", cfg.name, cfg.model.source)
        lm = load_model(cfg.model)
        self.model_name = lm.name
        data = load_edge_data(cfg.data)
        log.info("edge %s: %d training and %d holdout records", cfg.name, len(data.train), len(data.holdout))
        engine = Engine(lm, cfg, data)
        self._restore(engine)
        engine.start()
        self.engine = engine
        for fn in self.on_ready:
            fn()
        if self.federation is not None:
            self.federation.start()
        self.ready.set()
        log.info("edge %s: ready (max context %d tokens, %d slots, adapter version %d)", cfg.name,
                 engine.max_context, engine.pool.slots, engine.shadow.current_version)
        return engine

    def load_in_background(self) -> threading.Thread:
        def run():
            try:
                self.load()
            except Exception as e:  # noqa: BLE001 - reported by /health and the log
                self.load_error = f"{type(e).__name__}: {e}"
                log.error("edge %s: loading failed: %s", self.cfg.name, self.load_error)

        t = threading.Thread(target=run, name="collm-load", daemon=True)
        t.start()
        return t

    def shutdown(self, grace_s: float) -> None:
        """Leave the federation, finish in-flight requests within `grace_s`, save the training state."""
        if self.engine is not None:
            self.engine.end_jobs()  # a round's training task replies with what it did instead of running on
        if self.federation is not None:
            self.federation.stop()
        if self.engine is None:
            return
        self.engine.stop(grace_s)
        self.save_training_state()
        log.info("edge %s: stopped", self.cfg.name)

    # ------------------------------------------------------------------ adapters
    def publish(self, state: dict, version: int, round: int | None = None, eval_loss: float | None = None,
                source: str = "federated") -> bool:
        """Serve `state` from now on as `version`; persisted first, so a crash cannot lose it.

        Returns False (and does nothing) if `version` is not newer than what is served.
        """
        engine = self.engine
        try:
            engine.shadow.publish(state, version, round=round, eval_loss=eval_loss, source=source,
                                  persist=self._write_serving)
        except StaleVersion:
            return False
        if round is not None:
            self.latest_round = max(self.latest_round, round)
        log.info("edge %s: serving adapter version %d (round %s) swapped in, %.1f ms", self.cfg.name, version,
                 round, 1000 * engine.shadow.last_publish_s)
        return True

    def publish_global(self, state: dict, rnd: int, eval_loss: float | None = None, source: str = "federated") -> bool:
        """Serve round `rnd`'s global adapter unless this edge has served that round or a later one. Rounds, not
        version numbers, decide: an admin publish may have taken the next version numbers, so the global gets
        the next free version above them (it is then version != round, and /v1/models says both)."""
        for _ in range(100):  # a concurrent (admin) publish may take the number chosen: take the next one
            if rnd <= self.latest_round:
                return False
            version = max(rnd, self.engine.shadow.latest_version + 1)
            if self.publish(state, version, round=rnd, eval_loss=eval_loss, source=source):
                return True
        return False

    def rollback(self, version: int) -> VersionInfo:
        """Serve the retained `version` again (persisted first, like a publish); UnknownVersion if not retained."""
        info = self.engine.shadow.rollback(version, persist=self._write_serving)
        log.warning("edge %s: rolled back to adapter version %d (round %s)", self.cfg.name, version, info.round)
        return info

    def _write_serving(self, state: dict, info: VersionInfo) -> None:
        latest = max(self.latest_round, info.round if info.round is not None else -1)
        numbered = max(self.engine.shadow.latest_version, info.version)  # above a rolled-back version: never reused
        write_serving(self.state_dir, state, {**info.as_dict(), "latest_round": latest, "latest_version": numbered},
                      self.cfg.lora, self.model_name)

    def _restore(self, engine: Engine) -> None:
        problems = lambda state: _shape_problems(engine, state)  # noqa: E731
        found = read_serving(self.state_dir, problems)
        if found is not None:
            state, meta = found
            try:
                engine.shadow.publish(state, int(meta["version"]), round=meta.get("round"),
                                      eval_loss=meta.get("eval_loss"), source="restored")
                log.info("edge %s: restored serving adapter version %s", self.cfg.name, meta["version"])
            except StaleVersion:  # e.g. a rollback to the initial adapter, version 0: already served
                log.info("edge %s: saved serving version %s is the initial adapter", self.cfg.name, meta["version"])
            rounds = [r for r in (meta.get("latest_round"), meta.get("round")) if isinstance(r, int)]
            self.latest_round = max(rounds, default=self.latest_round)
            if isinstance(meta.get("latest_version"), int):
                engine.shadow.reserve_through(meta["latest_version"])
        training = read_training(self.state_dir, problems) if engine.trainer is not None else None
        if training is not None:
            state, opt = training
            engine.trainer.adapter.load_peft(state)
            if opt is not None:
                engine.trainer.optimizer.load_state_dict(opt)
            log.info("edge %s: restored training adapter and optimizer state", self.cfg.name)

    def save_training_state(self) -> None:
        engine = self.engine
        if engine is None or engine.trainer is None:
            return
        d = write_training(self.state_dir, engine.trainer.adapter.state_dict_peft(),
                           engine.trainer.optimizer.state_dict(), self.cfg.lora, self.model_name)
        log.info("edge %s: saved training adapter to %s", self.cfg.name, d)

    def federation_status(self) -> dict | None:
        """Rounds taken part in, last train/eval results and the executor's state (None if off)."""
        return None if self.federation is None else self.federation.status()

    def adapters_view(self) -> dict:
        shadow = self.engine.shadow
        info = shadow.current_info()
        return {
            "serving_version": shadow.current_version,
            "round": info.round if info else None,
            "swapped_at": info.published_at if info else None,
            "eval_loss": info.eval_loss if info else None,
            "source": info.source if info else None,
            "sha256": info.digest if info else None,
            "latest_version": shadow.latest_version,
            "retained": shadow.retained_versions(),
            "versions_in_use": shadow.alive_versions(),
            "swaps": shadow.swaps,
            "history": [h.as_dict() for h in shadow.history],
        }


def _shape_problems(engine: Engine, state: dict) -> list[str]:
    return check_compatible(state, engine.layers.expected_shapes())
