"""Central differential privacy for the federated adapter, built from Flower's own pieces.

The privacy unit is an edge (client-level DP): whether one edge's data took part or not changes the
released global adapter only within the (ε, δ) bound reported each round. The mechanism is Flower's
central DP with client-side fixed clipping (McMahan et al. 2018, `flwr.supercore.differential_privacy`):

* each edge clips its update, ‖w_local − w_start‖ ≤ C, with Flower's `compute_clip_model_update`
  (`edge_client/federation/client.py`; the server sends C as Flower's `clipping_norm` config key);
* the server averages the kept updates with equal weights (a weight by examples would let a large
  edge move the mean by more than C / n), then adds Gaussian noise of standard deviation
  z · C / n (Flower's `compute_stdv`) to every tensor that training changes (under FFA-LoRA only the
  B matrices: the A's are the shared seed, not a function of anyone's data);
* Flower's RDP accountant (`flwr.supercore.privacy_accounting.RdpAccountant`, backed by Google's
  dp-accounting) composes one Gaussian release per round that aggregates anything.

Why not Flower's wrapper classes (`DifferentialPrivacyClientSideFixedClipping` + `fixedclipping_mod`):
the wrapper replaces the strategy's `start` (CoLLM's checkpoints and round status hang off it), its
accounted mode requires `FedAvg.aggregate_train` itself and exactly `num_sampled_clients` replies
every round (the balancer decides per round who trains), and the mod subtracts the incoming
ArrayRecord from the reply's, which fails on CoLLM's packed records and on round 1's empty global.

No sampling amplification is claimed: which edges train is the balancer's choice from their load,
not a random sample, so every round is accounted as a full Gaussian release (`no-amplification`).
The robust norm screen (`collm.server.robust`) drops an update by comparing it with the others' norms,
a data-dependent choice outside this analysis, so under DP only the non-finite and shape checks run;
clipping already bounds what one update can do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_stdv
from flwr.supercore.privacy_accounting import (GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig,
                                               PrivacySpent, SamplingMethod)


def noised(aggregate: Mapping[str, np.ndarray], keys: Iterable[str], noise_multiplier: float,
           clipping_norm: float, n: int) -> tuple[dict[str, np.ndarray], float]:
    """The aggregate with Gaussian noise of std z · C / n added to `keys`; returns it and the std."""
    out = {k: np.array(v, copy=True) for k, v in aggregate.items()}
    std = compute_stdv(noise_multiplier, clipping_norm, n)
    if std > 0:
        chosen = [k for k in keys if k in out]
        arrays = [out[k] for k in chosen]
        add_gaussian_noise_inplace(arrays, std)
        out.update(zip(chosen, arrays))
    return out, std


@dataclass(frozen=True)
class Release:
    """One round's private release: the noise multiplier and how many updates it averaged."""

    noise_multiplier: float
    sample_size: int


class PrivacyLedger:
    """The releases so far and the (ε, δ) they add up to, from Flower's RDP accountant.

    The population (edges ever seen) grows with churn; under no-amplification accounting it does
    not enter the bound, so the accountant is rebuilt with the current one and the releases replayed.
    """

    def __init__(self, target_delta: float, releases: Iterable[Release] = ()):
        self.target_delta = target_delta
        self.releases: list[Release] = list(releases)

    def spent(self, extra: Release | None = None, population: int = 1) -> PrivacySpent | None:
        """Privacy spent by the releases (and `extra`, to look ahead); None before the first one."""
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

        releases = self.releases + ([extra] if extra else [])
        releases = [r for r in releases if r.noise_multiplier > 0]
        if not releases:
            return None
        population = max([population] + [r.sample_size for r in releases])
        acc = RdpAccountant(PrivacyConfig(target_delta=self.target_delta, population_size=population,
                                          neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                          sampling_method=SamplingMethod.NO_AMPLIFICATION))
        for r in releases:
            acc.compose(GaussianPrivacyEvent(r.noise_multiplier, r.sample_size, population))
        return acc.get_privacy_spent()

    def record(self, release: Release) -> None:
        self.releases.append(release)

    @classmethod
    def from_history(cls, target_delta: float, metrics_by_round: Mapping[int, dict]) -> PrivacyLedger:
        """The ledger of a resumed run: the releases the checkpointed rounds recorded."""
        releases = []
        for r in sorted(metrics_by_round):
            rel = (metrics_by_round[r].get("privacy") or {}).get("release")
            if rel:
                releases.append(Release(float(rel["noise_multiplier"]), int(rel["sample_size"])))
        return cls(target_delta, releases)
