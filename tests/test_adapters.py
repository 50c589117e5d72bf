"""Adapters as a public API: naming a version per request, retention, rollback and the canary gate."""

import math
import time

import pytest
from helpers import prompt, random_adapter_state, tiny_engine

from collm.edge_client.training.jobs import TrainBudget

from collm.edge_client.engine import FinishEvent
from collm.edge_client.model.sampling import SamplingParams

from collm.edge_client.federation.canary import canary_verdict
from collm.edge_client.model.lora import BASE, LOCAL_VERSION
from collm.edge_client.model.shadow import StaleVersion, UnknownVersion
from collm.edge_client.serve.models import Choice, UnknownModel, model_ids, resolve

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_model_names_resolve_to_the_global_a_retained_version_or_the_base():
    args = ("SmolLM2", "collm-global", [3, 4, 5])
    assert resolve(None, *args) == resolve("", *args) == resolve("collm-global", *args) == Choice(None, "collm-global")
    assert resolve("SmolLM2", *args) == Choice(BASE.version, "SmolLM2")
    assert resolve("collm-global@4", *args) == Choice(4, "collm-global@4")
    assert resolve("collm-global:local", *args) == Choice(LOCAL_VERSION, "collm-global:local")
    assert model_ids(*args) == ["collm-global", "collm-global:local", "collm-global@5", "collm-global@4",
                                "collm-global@3", "SmolLM2"]
    for bad in ("collm-global@2", "collm-global@-1", "collm-global@", "other@4", "gpt-4o", "other:local"):
        with pytest.raises(UnknownModel, match="available: collm-global, collm-global:local, collm-global@5"):
            resolve(bad, *args)


def test_canary_verdict():
    assert canary_verdict(2.0, 2.0, 0.05).accept
    assert canary_verdict(2.09, 2.0, 0.05).accept
    assert not canary_verdict(2.11, 2.0, 0.05).accept
    assert not canary_verdict(2.01, 2.0, 0.0).accept
    assert canary_verdict(5.0, None, 0.05).accept  # nothing to compare with: serve it
    assert not canary_verdict(math.nan, 2.0, 0.05).accept and not canary_verdict(None, 2.0, 0.05).accept
    assert "2.1100 > 2.1000" in canary_verdict(2.11, 2.0, 0.05).reason


def test_a_named_version_is_pinned_at_submit_and_kept_while_newer_ones_arrive():
    ref_eng = tiny_engine(adapters={"retain": 2})
    eng = tiny_engine(start=False, adapters={"retain": 2})  # same seeded tiny model; its loop starts later
    try:
        s = {v: random_adapter_state(ref_eng, 60 + v) for v in (1, 2, 3)}
        p = prompt(ref_eng, "the river")
        ref = {0: ref_eng.generate(p, GREEDY).text}
        for v in (1, 2, 3):
            ref_eng.shadow.publish(s[v], v)
            ref[v] = ref_eng.generate(p, GREEDY).text
        assert len(set(ref.values())) == 4
        base = ref_eng.generate(p, GREEDY, adapter=BASE.version)
        assert base.text == ref[0] and base.record.adapter_version == BASE.version  # version 0 has B = 0
        assert ref_eng.generate(p, GREEDY, adapter=2).text == ref[2]
        with pytest.raises(UnknownVersion, match="available: 2, 3"):
            ref_eng.generate(p, GREEDY, adapter=1)

        eng.shadow.publish(s[1], 1)
        eng.shadow.publish(s[2], 2)
        box = []
        eng.submit(p, GREEDY, lambda ev: box.append(ev) if isinstance(ev, FinishEvent) else None, adapter=1)
        eng.shadow.publish(s[3], 3)  # version 1 leaves retention while the request waits; it stays pinned
        assert eng.shadow.retained_versions() == [2, 3] and eng.shadow.alive_versions() == [1, 2, 3]
        eng.start()
        deadline = time.time() + 30
        while not box and time.time() < deadline:
            time.sleep(0.01)
        assert box[0].text == ref[1] and box[0].record.adapter_version == 1
        assert eng.shadow.alive_versions() == [2, 3]  # freed once its last request ended
    finally:
        ref_eng.stop()
        eng.stop()


def test_rollback_serves_a_retained_version_again_and_numbers_are_never_reused():
    eng = tiny_engine(adapters={"retain": 3})
    try:
        s = {v: random_adapter_state(eng, 70 + v) for v in (1, 2)}
        p = prompt(eng, "a cat")
        eng.shadow.publish(s[1], 1)
        ref1 = eng.generate(p, GREEDY).text
        eng.shadow.publish(s[2], 2)
        info = eng.shadow.rollback(1)
        assert info.source == "rollback" and eng.shadow.current_version == 1 and eng.shadow.latest_version == 2
        ev = eng.generate(p, GREEDY)
        assert ev.record.adapter_version == 1 and ev.text == ref1
        with pytest.raises(StaleVersion):
            eng.shadow.publish(s[2], 2)  # the version rolled back from cannot come back under its number
        with pytest.raises(UnknownVersion):
            eng.shadow.rollback(7)
        eng.shadow.publish(s[2], 3)
        assert eng.shadow.current_version == 3
    finally:
        eng.stop()


def test_the_local_adapter_serves_what_this_edge_trained_since_the_last_global():
    eng = tiny_engine(adapters={"local_every": 1}, training={"lr": 0.05})
    try:
        p = prompt(eng, "once upon")
        before = eng.generate(p, GREEDY, adapter=LOCAL_VERSION)  # nothing trained yet: it is the global
        assert before.record.adapter_version == 0
        eng.train(TrainBudget(steps=2)).result(timeout=120)
        assert eng.shadow.local_info()["steps"] == eng.trainer.total_steps and eng.shadow.local_publishes == 2
        local = eng.generate(p, GREEDY, adapter=LOCAL_VERSION)
        assert local.record.adapter_version == LOCAL_VERSION
        assert eng.generate(p, GREEDY).record.adapter_version == 0  # the global is still version 0
        eng.shadow.publish(eng.trainer.adapter.state_dict_peft(), 1)  # the same weights as a global version
        assert eng.generate(p, GREEDY).text == local.text != before.text
        after = eng.generate(p, GREEDY, adapter=LOCAL_VERSION)  # a new global resets the local adapter to it
        assert after.record.adapter_version == 1 and eng.shadow.local_info() is None
    finally:
        eng.stop()
