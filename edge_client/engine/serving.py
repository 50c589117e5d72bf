"""The engine's serving step and what follows from each token (a mixin of `engine.Engine`, on the loop
thread): an admitted request's set-up (its pinned adapter, detokenizer, sampler), one forward over
the planned segments with sampling, streaming each token to its request, and a request's end
(its KV slot, its adapter pin, its record). One request's failure ends that request, never the loop.
"""

from __future__ import annotations

import logging
import time

import torch

from collm.common.step_cost import step_features
from collm.edge_client.engine.planner import StepShape
from collm.edge_client.engine.requests import AdmittedEvent, FinishEvent, Request, TokenEvent
from collm.edge_client.engine.telemetry import RequestRecord
from collm.edge_client.model.runner import Segment
from collm.edge_client.model.sampling import TextStream, make_generator, sample_next

log = logging.getLogger("collm.engine")


class StepRunner:
    """Needs the engine's `core`, `pool`, `runner`, `shadow`, `costs`, `telemetry`, `timeline`, `tokenizer`,
    `device`, `eos_ids` and `clock`."""

    def _set_up(self, r: Request) -> None:
        """An admitted request gets its adapter version (unless it asked for one), its detokenizer and
        its sampler, and hears that it was admitted."""
        try:
            if r.adapter is None:
                r.adapter = self.shadow.pin()
            r.stream = TextStream(self.tokenizer, r.params.stop)
            r.generator = make_generator(r.params, self.device)
        except Exception:  # noqa: BLE001 - one request's set-up must not stop the engine
            log.exception("request %s: could not be admitted", r.id)
            self._finish(r, "error")
            return
        self._emit(r, AdmittedEvent(r.adapter.version))

    def _serve_step(self, segments: list[Segment], prefilling: set[int], shape: StepShape) -> None:
        by_slot = {r.slot: r for r in self.core.running}
        t0 = self.clock()
        wanting = [by_slot[s.slot] for s in segments if s.want_logits]
        try:
            logits = self.runner.forward(segments, self.pool)
            tokens = sample_next(logits, [r.params for r in wanting], [r.generator for r in wanting])
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - fail this step's requests, keep serving the others
            log.exception("engine step failed; failing its %d request(s)", len(segments))
            for s in segments:
                self._finish(by_slot[s.slot], "error")
            return
        now = self.clock()
        if self.timeline is not None:
            self.timeline.record("step", t=time.time() - (now - t0), s=now - t0, dec=shape.decode,
                                 pf=shape.prefill, att=shape.attended, run=len(self.core.running),
                                 wait=len(self.core.waiting))
        self.costs.step.observe(step_features(shape.decode, shape.prefill, shape.attended), now - t0)
        self.telemetry.record_step(now - t0, len(segments))
        self.core.stepped(now, now - t0)
        for s in segments:
            if s.slot in prefilling:
                by_slot[s.slot].prefilled += len(s.tokens)
        for r, tok in zip(wanting, tokens):
            try:
                self._on_token(r, tok, now)
            except Exception:  # noqa: BLE001 - e.g. detokenization: this request fails, not the engine
                log.exception("request %s: token handling failed", r.id)
                self._finish(r, "error")

    def _on_token(self, r: Request, tok: int, now: float) -> None:
        if r.first_token_at is None:
            r.first_token_at = now
        r.out_ids.append(tok)
        if tok in self.eos_ids and not r.params.ignore_eos:
            self._emit(r, TokenEvent(r.stream.flush(), tok, len(r.out_ids) - 1))
            self._finish(r, "stop")
            return
        delta = r.stream.push(tok)
        if r.stream.stopped:
            self._emit(r, TokenEvent(delta, tok, len(r.out_ids) - 1))
            self._finish(r, "stop")
        elif len(r.out_ids) >= r.params.max_tokens:
            self._emit(r, TokenEvent(delta + r.stream.flush(), tok, len(r.out_ids) - 1))
            self._finish(r, "length")
        else:
            self._emit(r, TokenEvent(delta, tok, len(r.out_ids) - 1))

    def _finish(self, r: Request, reason: str) -> None:
        if r.finished:
            return
        r.finished = True
        now = self.clock()
        if r in self.core.running:
            self.pool.release(r.slot)
        ttft, tpot = self.core.ended(r, reason, now)  # out of the queue; the co-execution policy learns it
        if r.adapter is not None:
            self.shadow.release(r.adapter)
        n = len(r.out_ids)
        rec = RequestRecord(
            id=r.id, adapter_version=-1 if r.adapter is None else r.adapter.version,
            prompt_tokens=len(r.prompt_ids), output_tokens=n, ttft_s=ttft, tpot_s=tpot, e2e_s=now - r.arrival,
            ttft_slo_s=r.slo.ttft_s, tpot_slo_s=r.slo.tpot_s, finish_reason=reason, finished_at=time.time())
        self.telemetry.record_request(rec)
        text = r.stream.text if r.stream is not None else ""
        self._emit(r, FinishEvent(reason, rec, text, list(r.out_ids)))

    @staticmethod
    def _emit(r: Request, event: object) -> None:
        try:
            r.on_event(event)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
            log.exception("request %s: event callback failed; cancelling it", r.id)
            r.cancelled = True
