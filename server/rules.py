"""Aggregation rules: what a round's updates must follow and what the aggregate becomes, as objects.

The strategy (`server/strategy.py`) averages the kept updates with flwr's own FedAvg / FedAdam; a
rule chosen by the server config adds to that, at four points of a round:

* `train_config()`, `evaluate_config()`: keys every TRAIN / EVALUATE message carries (an edge needs them
  to follow the rule);
* `prepare(update, global_)`: the update in the global's form before it is screened, or why it cannot
  be; `norm(update, global_)`: the update norm the robust screen compares (None: the screen's own);
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

    def prepare(self, u: Update, global_: Arrays) -> Update | str:
        return u

    def norm(self, u: Update, global_: Arrays) -> float | None:
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
    `lora.r` says, from the global cut to that rank. The new global is the old one plus the weighted mean of
    each edge's change from its own start, as products scale·B·A (exact, by stacking), brought to the
    server's `lora.r` by truncated SVD (the energy kept is in the round record); an edge's start is computed
    here as it computes it (the same fit, the same products), so a round in which nobody trains leaves the
    global as it was. The screen compares those changes (factors in different bases are not comparable).
    An update is also written at the server's rank, exactly, so the screen's shape check and flwr's own
    average see one shape (that average is replaced by this rule's). Edges fit each global to their own
    rank (TRAIN/EVALUATE carry the global's alpha; TRAIN also the server's rank, the most an edge may train)."""

    name = "product"

    def __init__(self, cfg: ServerConfig):
        self.r, self.alpha = cfg.lora.r, cfg.lora.alpha
        self._global: Arrays = {}
        self._changes: dict[str, tuple[Arrays, float, Arrays]] = {}  # edge -> (its local, its alpha, its start)

    def train_config(self) -> dict:
        return {P.LORA_ALPHA: self.alpha, P.LORA_MAX_RANK: self.r}

    def evaluate_config(self) -> dict:
        return {P.LORA_ALPHA: self.alpha}

    def prepare(self, u: Update, global_: Arrays) -> Update | str:
        if u.lora_alpha is None:
            return f"lora_aggregation product: the reply has no numeric '{P.LORA_ALPHA}' (the edge's LoRA alpha)"
        try:
            rank = rank_of(u.arrays)
            if rank > self.r:
                return f"rank {rank} is above the server's lora.r {self.r}"
            if bad := next((k for k, v in u.arrays.items() if not np.isfinite(v).all()), None):
                return f"non-finite values in {bad}"
            # where it started: the global at its rank (round 1: the seeded init, B = 0, a zero product)
            start = fit_rank(global_, self.alpha, rank, u.lora_alpha)[0] if global_ else {}
            arrays, _ = fit_rank(u.arrays, u.lora_alpha, self.r, self.alpha)
        except ValueError as e:
            return f"malformed reply: {e}"
        self._global = global_
        self._changes[u.name] = (u.arrays, u.lora_alpha, start)
        return replace(u, arrays=arrays, lora_alpha=self.alpha)

    def norm(self, u: Update, global_: Arrays) -> float:
        local, alpha, start = self._changes[u.name]
        return product_distance(local, alpha, start, alpha)

    def after(self, arrays: dict[str, np.ndarray], kept: Sequence[Update], rec) -> dict:
        total = sum(u.num_examples for u in kept)
        terms = [(self._global, self.alpha / self.r)] if self._global else []
        for u in kept:
            local, alpha, start = self._changes[u.name]
            coef = alpha / rank_of(local) * u.num_examples / total
            terms += [(local, coef)] + ([(start, -coef)] if start else [])
        state, energy = combine(terms, self.r, self.alpha)
        rec.rank_energy = round(energy, 6)
        self._changes.clear()
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
