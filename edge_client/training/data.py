"""The records one edge trains and evaluates on, as its `data` config selects them."""

from __future__ import annotations

from dataclasses import dataclass

from collm.common.data import Record, categories, load_records, partition_iid, split_holdout
from collm.common.errors import UserError
from collm.edge_client.config import DataConfig


@dataclass
class EdgeData:
    train: list[Record]
    holdout: list[Record]


def load_edge_data(cfg: DataConfig) -> EdgeData:
    """The records this edge trains and evaluates on, as its data config selects them."""
    records = load_records(cfg.path)
    if cfg.categories:
        known = set(categories(records))
        unknown = [c for c in cfg.categories if c not in known]
        if unknown:
            raise UserError(f"data.categories: unknown {unknown}; available: {sorted(known)}")
        records = [r for r in records if r.category in cfg.categories]
    if cfg.iid_shards:
        records = partition_iid(records, cfg.iid_shards, cfg.seed)[cfg.iid_shard_index]
    if cfg.max_records:
        records = records[: cfg.max_records]
    train, holdout = split_holdout(records, cfg.holdout_fraction, cfg.seed)
    if not train or not holdout:
        raise UserError(f"data: {len(records)} records leave an empty train or holdout split; "
                        "add records or change data.holdout_fraction")
    return EdgeData(train=train, holdout=holdout)
