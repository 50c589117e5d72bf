"""Aggregation rules: what a round's updates must follow and what the aggregate becomes, as objects.

The strategy (`server/strategy.py`) averages the kept updates with flwr's own FedAvg / FedAdam; a
rule chosen by the server config adds to that, at four points of a round:

* `train_config()`, `evaluate_config()`: keys every TRAIN / EVALUATE message carries (an edge needs them
  to follow the rule);
* `prepare(update)`: the update in the global's form before it is screened, or why it cannot be;
  `norm(arrays, global_)`: the update norm the robust screen compares (None: the screen's own);
* `screen_norm_k(k)`: the robust screen's norm bound (DP turns the data-dependent screen off);
* `breaks(update, kept, global_)`: why an update that passed the robust screen breaks the rule;
* `weight()`: each kept update's aggregation weight, if the rule fixes it; `after(arrays, kept, rec)`:
  the aggregate made final (FFA-LoRA keeps A bit for bit, DP adds calibrated noise and accounts it).

Rules compose: FFA-LoRA and DP may both be on (`rules_for`). Pure over numpy arrays and plain data,
except DP's ledger, which is the privacy spent so far.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from collm.common import protocol as P
from collm.common.lora_rank import combine, fit_rank, product_distance, rank_of
from collm.server.config import ServerConfig
from collm.server.privacy import PrivacyLedger, Release, noised
from collm.server.robust import Update, update_norm

Arrays = Mapping[str, np.ndarray]


class Rule:
    """A rule that changes nothing (the base of the others)."""

    name = "rule"

    def train_config(self) -> dict:
        return {}

    def evaluate_config(self) -> dict:
        return {}

    def prepare(self, u: Update) -> Update | str:
        return u

    def norm(self, arrays: Arrays, global_: Arrays) -> float | None:
        return None

    def screen_norm_k(self, norm_k: float) -> float:
        return norm_k

    def breaks(self, u: Update, kept: Sequence[Update], global_: Arrays) -> str | None:
        return None

    def weight(self) -> float | None:
        return None

    def after(self, arrays: dict[str, np.ndarray], kept: Sequence[Update], rec) -> dict:
        """`rec`: the round's record (DP writes what it released into `rec.privacy`)."""
        return arrays


class FfaLora(Rule):
    """FFA-LoRA (`lora_aggregation: ffa`): edges train only B; every update carries the same A (the global's,
    or in round 1, an empty global, the A most updates agree on), so the average of the B's is the exact
    average of the products B·A; the aggregate keeps that A bit for bit (an average of equal floats can
    differ in the last bit and drift over rounds)."""

    name = "ffa"

    def train_config(self) -> dict:
        return {P.FREEZE_A: 1}

    @staticmethod
    def reference_a(kept: Sequence[Update], global_: Arrays) -> dict[str, np.ndarray]:
        if global_:
            return {k: v for k, v in global_.items() if "lora_A" in k}
        groups: dict[bytes, list[Update]] = {}
        for u in kept:
            digest = b"".join(np.ascontiguousarray(u.arrays[k]).tobytes() for k in sorted(u.arrays) if "lora_A" in k)
            groups.setdefault(digest, []).append(u)
        if not groups:
            return {}
        most = max(groups.values(), key=lambda g: (len(g), sum(u.num_examples for u in g)))
        return {k: v for k, v in most[0].arrays.items() if "lora_A" in k}

    def breaks(self, u: Update, kept: Sequence[Update], global_: Arrays) -> str | None:
        ref = self.reference_a(kept, global_)
        changed = next((k for k in sorted(ref) if k in u.arrays and not np.array_equal(u.arrays[k], ref[k])), None)
        return None if changed is None else f"lora_aggregation ffa: the update changed {changed} (A must stay frozen)"

    def after(self, arrays: dict[str, np.ndarray], kept: Sequence[Update], rec) -> dict:
        same_a = kept[0].arrays
        return {k: (np.asarray(same_a[k]) if "lora_A" in k else v) for k, v in arrays.items()}


class DifferentialPrivacy(Rule):
    """Client-level central DP (`dp:`, server/privacy.py): edges clip their update to `clipping_norm`; the
    server checks it, averages the kept updates with equal weights, adds Gaussian noise of std
    z·C/n (to the B's only under FFA-LoRA: the A's are the shared seed) and records the release."""

    name = "dp"

    def __init__(self, cfg: ServerConfig, ledger: PrivacyLedger, noise_keys_b_only: bool,
                 population: Callable[[], int]):
        """`population`: how many edges have been seen (the accountant's population)."""
        self.dp, self.ledger, self.b_only, self.population = cfg.dp, ledger, noise_keys_b_only, population

    def train_config(self) -> dict:
        return {P.CLIPPING_NORM: self.dp.clipping_norm}

    def screen_norm_k(self, norm_k: float) -> float:
        return math.inf  # clipping bounds each update; comparing norms across edges is outside the analysis

    def breaks(self, u: Update, kept: Sequence[Update], global_: Arrays) -> str | None:
        if not global_:
            return None
        norm = update_norm(u.arrays, global_)
        if norm > self.dp.clipping_norm * (1 + 1e-4) + 1e-6:
            return f"dp: update norm {norm:.4g} is above clipping_norm {self.dp.clipping_norm:g} (not clipped)"
        return None

    def weight(self) -> float | None:
        return 1.0  # one edge moves the mean by at most clipping_norm / n, what the noise is calibrated to

    def after(self, arrays: dict[str, np.ndarray], kept: Sequence[Update], rec) -> dict:
        dp, n = self.dp, len(kept)
        keys = [k for k in arrays if "lora_B" in k] if self.b_only else list(arrays)
        arrays, std = noised(arrays, keys, dp.noise_multiplier, dp.clipping_norm, n)
        info = {"clipping_norm": dp.clipping_norm, "noise_multiplier": dp.noise_multiplier, "noise_std": std,
                "updates": n, "release": None, "epsilon": None, "delta": dp.target_delta,
                "max_epsilon": dp.max_epsilon}
        if dp.noise_multiplier > 0:
            release = Release(dp.noise_multiplier, n)
            self.ledger.record(release)
            spent = self.ledger.spent(population=self.population())
            info.update(release=vars(release), epsilon=spent.epsilon, releases=spent.num_releases)
        rec.privacy = info
        return {k: np.asarray(v, np.float32) for k, v in arrays.items()}


class ProductLora(Rule):
    """Mixed-rank LoRA (`lora_aggregation: product`, common/lora_rank.py): each edge trains the rank its
    `lora.r` says; the aggregate is the weighted average of the products scale·B·A (exact, by stacking),
    brought to the server's `lora.r` by truncated SVD (the energy kept is in the round record). An update
    of rank up to `lora.r` is first written at that rank exactly, so the screen and the checkpoint see one
    shape; the screen compares products, not factors (factors in different bases are not comparable).
    Edges fit each global to their own rank (the TRAIN/EVALUATE config carries the global's alpha)."""

    name = "product"

    def __init__(self, cfg: ServerConfig):
        self.r, self.alpha = cfg.lora.r, cfg.lora.alpha

    def train_config(self) -> dict:
        return {P.LORA_ALPHA: self.alpha}

    def evaluate_config(self) -> dict:
        return {P.LORA_ALPHA: self.alpha}

    def prepare(self, u: Update) -> Update | str:
        if u.lora_alpha is None:
            return f"lora_aggregation product: the reply has no numeric '{P.LORA_ALPHA}' (the edge's LoRA alpha)"
        try:
            rank = rank_of(u.arrays)
            if rank > self.r:
                return f"rank {rank} is above the server's lora.r {self.r}"
            if bad := next((k for k, v in u.arrays.items() if not np.isfinite(v).all()), None):
                return f"non-finite values in {bad}"
            arrays, _ = fit_rank(u.arrays, u.lora_alpha, self.r, self.alpha)
        except ValueError as e:
            return f"malformed reply: {e}"
        return replace(u, arrays=arrays, lora_alpha=self.alpha)

    def norm(self, arrays: Arrays, global_: Arrays) -> float:
        return product_distance(arrays, self.alpha, global_, self.alpha)

    def after(self, arrays: dict[str, np.ndarray], kept: Sequence[Update], rec) -> dict:
        total = sum(u.num_examples for u in kept)
        scale = self.alpha / self.r
        state, energy = combine([(u.arrays, scale * u.num_examples / total) for u in kept], self.r, self.alpha)
        rec.rank_energy = round(energy, 6)
        return state


def rules_for(cfg: ServerConfig, ledger: PrivacyLedger | None, population: Callable[[], int]) -> list[Rule]:
    """The rules a server config asks for, in the order they apply."""
    rules: list[Rule] = []
    if cfg.lora_aggregation == "ffa":
        rules.append(FfaLora())
    if cfg.lora_aggregation == "product":
        rules.append(ProductLora(cfg))
    if cfg.dp is not None:
        rules.append(DifferentialPrivacy(cfg, ledger, cfg.lora_aggregation == "ffa", population))
    return rules
