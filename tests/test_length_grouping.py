"""Micro-batches of similar lengths: less padding computed, the same examples seen, the same evaluation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from collm.common.data import Example
from collm.common.errors import UserError
from collm.edge_client.training.evaluation import EvalJob, by_length
from collm.edge_client.training.trainer import ExampleStream
from helpers import random_adapter_state, tiny_config, tiny_engine


def _examples(n: int, seed: int = 1) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, 256)
        out.append(Example(input_ids=[i] * length, labels=[i] * length))
    return out


def _padding(batches: list[list[Example]]) -> float:
    computed = sum(len(b) * max(len(e.input_ids) for e in b) for b in batches)
    real = sum(len(e.input_ids) for b in batches for e in b)
    return computed / real


def test_grouped_stream_pads_less_and_sees_every_example_once_an_epoch():
    exs = _examples(301)  # not a multiple of the micro-batch: an epoch's remainder joins the next epoch
    flat, grouped = ExampleStream(exs, seed=3, k=2), ExampleStream(exs, seed=3, k=2, group=50)
    fb = [flat.take(2) for _ in range(602)]
    gb = [grouped.take(2) for _ in range(602)]
    assert _padding(fb) > 1.2  # random pairs of uniform 8-256 lengths: a third more computed than real
    assert _padding(gb) < 1.03
    seen = [e.input_ids[0] for b in gb for e in b]
    assert len(set(seen[:300])) == 300  # an epoch's micro-batches repeat no example
    assert Counter(seen) == {i: 4 for i in range(301)}  # four epochs: the remainders were carried, not lost
    # the windows are shuffled and grouped, not one sorted sweep: long and short micro-batches alternate
    lengths = [len(b[0].input_ids) for b in gb[:100]]
    assert sum(a > b for a, b in zip(lengths, lengths[1:])) > 25


@pytest.mark.parametrize("n,k,group", [(301, 2, 50), (301, 2, 0), (51, 2, 50), (7, 3, 0), (9, 4, 2), (301, 4, 50)])
def test_no_micro_batch_holds_one_example_twice(n, k, group):
    # an epoch that does not divide into micro-batches leaves examples over, which open the next epoch,
    # where their own next-epoch copies are; grouped by length, an example and its copy are neighbours
    s = ExampleStream(_examples(n), seed=5, k=k, group=group)
    batches = [s.take(k) for _ in range(n * 12)]  # k * 12 epochs
    assert all(len({id(e) for e in b}) == k for b in batches)
    seen = Counter(e.input_ids[0] for b in batches for e in b)
    assert seen == {i: 12 * k for i in range(n)}  # still every example once an epoch


def test_no_micro_batch_straddles_two_groups_when_the_epoch_is_not_a_multiple():
    exs = _examples(7)  # one window an epoch, three pairs and one left over
    ranked = sorted(exs, key=lambda e: len(e.input_ids))
    pairs = {tuple(e.input_ids[0] for e in ranked[i: i + 2]) for i in (0, 2, 4)}
    for seed in range(8):  # wherever the shuffle would put the short group
        s = ExampleStream(exs, seed=seed, k=2, group=50)
        first = {tuple(e.input_ids[0] for e in s.take(2)) for _ in range(3)}
        assert first == pairs  # neighbours in length, never the leftover with another group's half
        nxt = [e.input_ids[0] for _ in range(4) for e in s.take(2)]  # the leftover opens the next epoch
        assert Counter(nxt) == Counter([ranked[-1].input_ids[0]] + list(range(7)))
        out = by_length(exs, 2, seed=seed)
        assert out[-1] is ranked[-1]  # the short batch (the longest record) last
        assert {tuple(e.input_ids[0] for e in out[i: i + 2]) for i in (0, 2, 4)} == pairs


def test_ungrouped_stream_is_the_old_order():
    exs = _examples(50)
    s = ExampleStream(exs, seed=7, k=2)
    rng, ref = random.Random(7), []
    while len(ref) < 120:
        order = list(exs)
        rng.shuffle(order)
        ref.extend(order)
    assert [e for _ in range(60) for e in s.take(2)] == ref[:120]


def test_trainer_groups_by_default_and_the_setting_is_checked():
    eng = tiny_engine(start=False)
    assert eng.trainer.stream.group == 50 and eng.trainer.stream.k == eng.cfg.training.micro_batch_size
    assert tiny_engine(start=False, training={"group_by_length": 0}).trainer.stream.group == 0
    with pytest.raises(UserError, match="group_by_length"):
        tiny_config(training={"group_by_length": -1})


def test_by_length_keeps_every_example_and_batches_similar_lengths():
    exs = _examples(37)
    out = by_length(exs, 4)
    assert sorted(e.input_ids[0] for e in out) == list(range(37))

    def pad(xs):
        return _padding([xs[i: i + 4] for i in range(0, 37, 4)]) - 1

    assert pad(out) < pad(exs) / 3  # a third of the padding of the records' own order, or less
    assert out == by_length(exs, 4)  # a fixed order: every evaluation of a version runs the same batches


def test_evaluation_by_length_matches_unpadded_one_by_one():
    """A real forward pass: the batched, length-grouped evaluation scores what each example alone scores."""
    eng = tiny_engine(start=False)
    state = random_adapter_state(eng, seed=5)
    weights = eng.layers.serving_weights(state, 1, eng.device, eng.lm.dtype)
    hold = eng.holdout[:9]
    assert len({len(e.input_ids) for e in hold}) > 3  # lengths differ: batching pads

    def loss(batch_size: int) -> tuple[float, int]:
        job = EvalJob(eng.parts, weights, hold, batch_size, eng.tokenizer.pad_token_id, eng.device)
        job.run_all()
        return job.report.loss, job.report.answer_tokens

    one, four = loss(1), loss(4)
    assert four[1] == one[1]
    assert four[0] == pytest.approx(one[0], rel=1e-4)
