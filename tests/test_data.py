"""Dolly records, category (non-IID) and IID partitions, holdout split, traces."""

import pytest

from collm.common.errors import UserError

from collm.edge_client.config import DataConfig
from collm.common.data import categories, format_example, load_records, partition_by_category, partition_iid, split_holdout
from collm.edge_client.training.data import load_edge_data
from collm.common.traces import TraceScaling, load_trace, mean_rate


def test_shipped_dolly_subset():
    recs = load_records()
    assert len(recs) == 2400
    assert len(categories(recs)) == 8


def test_category_partition_across_three_edges_is_disjoint_and_deterministic():
    recs = load_records()
    parts = partition_by_category(recs, 3)
    again = partition_by_category(list(reversed(recs)), 3)
    cats = [{r.category for r in p} for p in parts]
    assert all(cats) and not (cats[0] & cats[1]) and not (cats[0] & cats[2]) and not (cats[1] & cats[2])
    keys = [{r.key for r in p} for p in parts]
    assert sum(len(k) for k in keys) == len({r.key for r in recs})
    assert keys == [{r.key for r in p} for p in again]


def test_iid_partition_and_holdout_are_deterministic():
    recs = load_records()
    a, b = partition_iid(recs, 4, seed=3), partition_iid(recs, 4, seed=3)
    assert [[r.key for r in p] for p in a] == [[r.key for r in p] for p in b]
    assert {len(p) for p in a} == {600}
    tr, ho = split_holdout(recs, 0.1)
    tr2, ho2 = split_holdout(list(reversed(recs)), 0.1)
    assert {r.key for r in ho} == {r.key for r in ho2} and not {r.key for r in ho} & {r.key for r in tr}
    assert 180 < len(ho) < 300


def test_edge_data_selects_categories():
    d = load_edge_data(DataConfig(categories=["open_qa", "summarization"]))
    assert {r.category for r in d.train + d.holdout} == {"open_qa", "summarization"}


def test_format_example_masks_prompt(tiny_lm):
    rec = load_records()[0]
    ex = format_example(tiny_lm.tokenizer, rec, max_len=128)
    assert len(ex.input_ids) == len(ex.labels) <= 128
    answer = [t for t in ex.labels if t != -100]
    assert answer and ex.labels[0] == -100
    n = len(ex.labels) - len(answer)
    assert ex.input_ids[n:] == answer


def test_trace_loads_and_scales():
    full = load_trace()
    assert len(full) == 19366
    assert 5.0 < mean_rate(full) < 6.0
    fast = load_trace(scaling=TraceScaling(speed=2.0, token_scale=0.1, max_prompt_tokens=64, duration_s=60))
    assert fast[0].arrival_s == 0.0 and fast[-1].arrival_s <= 30.0
    assert max(r.prompt_tokens for r in fast) <= 64
    window = load_trace(scaling=TraceScaling(duration_s=60))
    assert abs(mean_rate(fast) - 2 * mean_rate(window)) < 1e-6 * mean_rate(fast)


@pytest.mark.parametrize("body, said", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374\n", "bad row: TypeError"),   # short row
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n,374,20\n", "bad row"),                                 # no time
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,37\xff4,2\n", "not UTF-8"),
])
def test_a_trace_with_bad_rows_is_a_one_line_error_naming_the_line(tmp_path, body, said):
    p = tmp_path / "trace.csv"
    p.write_bytes(body.encode("latin-1"))  # \xff: a byte that is no UTF-8
    with pytest.raises(UserError, match=said):
        load_trace(p)


def test_a_trace_saved_with_a_byte_order_mark_loads(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,20\n"
                 "2023-11-16 18:15:47.68,100,10\n", encoding="utf-8")
    assert [r.prompt_tokens for r in load_trace(p)] == [374, 100]


@pytest.mark.parametrize("line, said", [('[1, 2]', "a record is a JSON object"),
                                        ('{"instruction": "a", "response": "b", "category": 7}', "are strings")])
def test_a_record_that_is_no_object_is_a_one_line_error(tmp_path, line, said):
    p = tmp_path / "records.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(UserError, match=said):
        load_records(p)
