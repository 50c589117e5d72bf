"""The federation service `collm-edge` attaches to its runtime: the round handlers (`client.FederatedEdge`)
run in-process by a `SuperNodeExecutor`, and a restarted edge's catch-up to the latest complete round."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from collm.common import lora_rank
from collm.common.adapter_io import check_compatible, load_adapter
from collm.common.errors import UserError
from collm.common.rounds import latest_complete_round, round_dir
from collm.edge_client.federation.client import FederatedEdge
from collm.edge_client.federation.records import fit_to_rank

if TYPE_CHECKING:
    from collm.edge_client.runtime import EdgeRuntime

log = logging.getLogger("collm.federation")


class EdgeFederation:
    """The service `collm-edge` attaches to its runtime when federation is enabled: the handlers of
    `client.FederatedEdge`, run in-process by a `SuperNodeExecutor` that keeps a child flower-supernode
    connected."""

    def __init__(self, runtime: EdgeRuntime):
        self.rt = runtime
        self.edge = FederatedEdge(runtime)
        self.executor = None

    def start(self) -> None:
        from collm.edge_client.federation.executor import SuperNodeExecutor

        cfg = self.rt.cfg
        f = cfg.federation
        if f.bootstrap_from:
            self.catch_up(f.bootstrap_from)
        self.edge.measure_reference()
        self.executor = SuperNodeExecutor(
            self.edge.client_app(), superlink=f.superlink, runtime_port=f.runtime_port,
            node_config={"name": cfg.name, **f.node_config}, insecure=f.insecure,
            root_certificates=f.root_certificates, auth_private_key=f.auth_private_key, name=cfg.name,
            nice=f.supernode_nice, fleet_poll_s=f.fleet_poll_s)
        self.executor.start()
        log.info("edge %s: taking part in federated rounds via SuperLink %s", cfg.name, f.superlink)

    def catch_up(self, checkpoint_dir: str) -> int | None:
        """Serve the latest complete round's global adapter from `checkpoint_dir` if it is newer than
        what this edge serves (a restarted edge must not serve a stale version until its next round)."""
        r = latest_complete_round(checkpoint_dir)
        engine = self.rt.engine
        if r <= self.rt.latest_round:
            return None
        try:
            state, adapter_cfg = load_adapter(round_dir(checkpoint_dir, r))
            state = self._at_own_rank(state, adapter_cfg)
        except UserError as e:
            log.warning("edge %s: cannot read round %d's adapter from %s: %s", self.rt.cfg.name, r, checkpoint_dir, e)
            return None
        if problems := check_compatible(state, engine.layers.expected_shapes()):
            log.warning("edge %s: round %d's adapter does not fit this model: %s", self.rt.cfg.name, r, problems[0])
            return None
        self.rt.publish_global(state, r, source="bootstrap")
        log.info("edge %s: caught up to the global adapter of round %d from %s", self.rt.cfg.name, r, checkpoint_dir)
        return r

    def _at_own_rank(self, state: dict, adapter_cfg: dict) -> dict:
        """A checkpoint of another rank (a mixed-rank federation) fitted to this edge's `lora.r`."""
        try:
            rank = lora_rank.rank_of({k: v.numpy() for k, v in state.items()})
        except ValueError as e:
            raise UserError(f"not a LoRA adapter: {e}") from None
        lora = self.rt.cfg.lora
        alpha = adapter_cfg.get("lora_alpha")
        if (rank == lora.r and alpha == lora.alpha) or not isinstance(alpha, (int, float)) or alpha <= 0:
            return state  # as this edge trains it, or no alpha to fit by: check_compatible decides
        want = {k: (rank, s[1]) if "lora_A" in k else (s[0], rank) for k, s in self.rt.engine.layers.expected_shapes().items()}
        if problems := check_compatible(state, want):  # other modules or sizes: no fit can make it this model's
            raise UserError(problems[0])
        state, energy = fit_to_rank(state, float(alpha), lora.r, lora.alpha, self.rt.engine.initial_state)
        log.info("edge %s: the checkpoint's rank-%d adapter fitted to rank %d (energy kept %.3f)", self.rt.cfg.name,
                 rank, lora.r, energy)
        return state

    def stop(self) -> None:
        if self.executor is not None:
            self.executor.stop()

    def status(self) -> dict:
        ex = self.executor
        return {**self.edge.status(), "superlink": self.rt.cfg.federation.superlink,
                "executor_running": bool(ex and ex.running), "tasks_done": ex.tasks_done if ex else 0,
                "last_error": ex.last_error if ex else None}
