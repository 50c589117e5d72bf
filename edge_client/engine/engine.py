"""The edge replica engine: one frozen base model, serving and training on it in one step loop.

The loop (`Engine._loop`) is the algorithm, in order; every decision in it is the replica core's
(`engine.replica.ReplicaCore`, the object the simulator drives too):

1. take new requests, cancellations and jobs from other threads; shed (`engine.shed_late`) a waiting
   request whose wait plus the prefill ahead of it and its own is past its TTFT target;
2. admit waiting requests while a KV slot is free, pinning the current serving adapter version;
3. plan a step (`planner.plan_step`): one decode token per running request, then prefill chunks
   (first come, first served) up to the step token budget;
4. run the step (one forward over all of it, each request with its pinned adapter), sample, stream;
5. run background work (a training or evaluation micro-batch is a sequence of layer-sized units,
   `training.layerwise`) as far as the co-execution rule (`co_schedule`) admits it: in idle time one
   unit per pass, beside decodes unit after unit until the rule refuses.

Other threads talk to the engine through `submit`, `cancel`, `train`, `evaluate`, `end_jobs` and
`snapshot`; adapters are published through `engine.shadow`. Only the loop thread runs the model and
makes decisions; other threads hand requests and jobs over under the engine's lock (`_incoming`,
`_new_jobs`) and only read the core's queues (`load`, the queue-full test), which the loop changes
under that lock, except for removing a request that ends; `clock` (perf_counter) is every
decision's time.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from collm.common.data import format_example
from collm.common.slo import SLO
from collm.common.step_cost import step_features
from collm.edge_client.config import EdgeConfig
from collm.edge_client.engine.co_schedule import make_policy
from collm.edge_client.engine.cost_model import CostModels
from collm.edge_client.engine.planner import StepShape
from collm.edge_client.engine.replica import ReplicaCore
from collm.edge_client.engine.requests import (AdmittedEvent, EngineError, EngineFailed, FinishEvent, PromptTooLong,
                                               QueueFull, Request, ShuttingDown, TokenEvent)
from collm.edge_client.engine.telemetry import EdgeSnapshot, RequestRecord, Telemetry
from collm.edge_client.engine.timeline import open_timeline
from collm.edge_client.model.loading import LoadedModel
from collm.edge_client.model.lora import TrainableAdapter, inject_lora
from collm.edge_client.model.runner import KVPool, ModelRunner, Segment
from collm.edge_client.model.sampling import SamplingParams, TextStream, make_generator, sample_next
from collm.edge_client.model.shadow import ShadowAdapter
from collm.edge_client.training.data import EdgeData
from collm.edge_client.training.evaluation import EvalJob
from collm.edge_client.training.jobs import BackgroundJob, TrainBudget
from collm.edge_client.training.layerwise import ModelParts
from collm.edge_client.training.trainer import LocalTrainer, TrainJob

__all__ = ["AdmittedEvent", "Engine", "EngineError", "EngineFailed", "FinishEvent", "PromptTooLong", "QueueFull",
           "Request", "ShuttingDown", "TokenEvent", "plan_kv"]

log = logging.getLogger("collm.engine")


def plan_kv(cfg: EdgeConfig, runner: ModelRunner, model_max: int) -> tuple[int, int]:
    """(slots, tokens per slot) that fit engine.kv_cache_mb; one slot per running request."""
    bpt = KVPool.bytes_per_token(runner.n_layers, runner.n_kv, runner.head_dim, runner.dtype)
    limit = min(cfg.engine.max_context or model_max, model_max)
    per_slot = int(cfg.engine.kv_cache_mb * 2**20 // (cfg.engine.max_running * bpt))
    slot_len = min(limit, per_slot)
    if slot_len < 32:
        raise ValueError(
            f"engine.kv_cache_mb={cfg.engine.kv_cache_mb:g} gives {per_slot} tokens per request with "
            f"max_running={cfg.engine.max_running}; raise kv_cache_mb or lower max_running")
    return cfg.engine.max_running, slot_len


class Engine:
    def __init__(self, lm: LoadedModel, cfg: EdgeConfig, data: EdgeData | None = None,
                 costs: CostModels | None = None, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter, decision_log: list | None = None):
        """`clock`: the time every decision is made at (perf_counter; a test may drive a virtual one);
        `decision_log`: a list the replica core appends each decision to (tests)."""
        self.lm, self.cfg = lm, cfg
        self.clock = clock
        self.tokenizer = lm.tokenizer
        self.device = lm.device
        self.layers = inject_lora(lm.model, cfg.lora.target_modules, cfg.lora.r, cfg.lora.alpha)
        self.runner = ModelRunner(lm.model, fuse=cfg.engine.fuse_projections)
        self.parts = ModelParts(lm.model)
        slots, slot_len = plan_kv(cfg, self.runner, lm.max_context)
        self.pool = self.runner.new_pool(slots, slot_len)
        self.max_context = slot_len
        self.slo = cfg.slo.targets
        self.costs = costs or CostModels()
        self.policy = make_policy(cfg.training)
        self.core = ReplicaCore(self.policy, self.costs.step_time, slots=self.pool.slots,
                                max_queue=cfg.engine.max_queue, step_token_budget=cfg.engine.step_token_budget,
                                safety=cfg.slo.safety, shed_late=cfg.engine.shed_late, log=decision_log)
        self.core.on_job_end = self._job_ended
        self.telemetry = Telemetry()
        self.shadow = ShadowAdapter(self.layers, lm.device, lm.dtype, retain=cfg.adapters.retain)
        adapter = TrainableAdapter(self.layers, lm.device, seed=seed)
        self.initial_state = adapter.state_dict_peft()  # identical on every edge: the round-1 start
        self.timeline = open_timeline(cfg.engine.timeline)
        if self.timeline is not None:
            self.shadow.observer = lambda **kw: self.timeline.record("publish", **kw)
        self.shadow.publish(self.initial_state, 0, source="initial")  # B = 0: the base model
        self.trainer: LocalTrainer | None = None
        self.holdout: list = []
        if data is not None:
            tok, L = self.tokenizer, cfg.training.max_seq_len
            train = [format_example(tok, r, L) for r in data.train]
            self.holdout = [format_example(tok, r, L) for r in data.holdout]
            if cfg.training.max_eval_records:
                self.holdout = self.holdout[: cfg.training.max_eval_records]
            self.trainer = LocalTrainer(self.parts, self.layers, adapter, cfg.training, train, tok.pad_token_id,
                                        cfg.lora.dropout, seed)
            if cfg.adapters.local_every:
                self.trainer.on_step = self._publish_local
        eos = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = {e for e in eos if e is not None}

        self._lock = threading.Condition()
        self._incoming: deque[Request] = deque()  # submitted, not yet in the core's queue (other threads)
        self._new_jobs: deque[BackgroundJob] = deque()  # queued, not yet in the core's (other threads)
        self._share_seen = 0.0  # the rule's share beside serving, as the timeline last recorded it
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # set if the loop dies; /health then answers 503
        self.on_failure: list[Callable[[str], None]] = []  # called once, from the dying loop thread

    # ================================================================= public API (any thread)
    def start(self) -> Engine:
        if self.cfg.engine.warmup:
            from collm.edge_client.engine.warmup import warm_up

            warm_up(self)
        self._thread = threading.Thread(target=self._run_loop, name="collm-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callable[[object], None],
               slo: SLO | None = None, request_id: str | None = None, adapter: int | None = None) -> Request:
        """Queue a request; events (AdmittedEvent, TokenEvent..., FinishEvent) arrive on the engine thread.

        `adapter`: None serves the version current at admission; a retained version or `BASE.version`
        is pinned now (UnknownVersion if it is not retained), so it cannot be freed while the request waits.
        """
        params.validate()
        if self.failure is not None:
            raise EngineFailed(f"the engine failed ({self.failure}); this edge must be restarted")
        if not self._accepting:
            raise ShuttingDown("the edge is shutting down")
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_context:
            raise PromptTooLong(
                f"this edge's maximum context length is {self.max_context} tokens; the request needs "
                f"{need} ({len(prompt_ids)} prompt + {params.max_tokens} max_tokens)")
        req = Request(id=request_id or f"req-{uuid.uuid4().hex[:12]}", prompt_ids=list(prompt_ids), params=params,
                      slo=slo or self.slo, on_event=on_event, arrival=self.clock())
        pinned = None if adapter is None else self.shadow.pin(adapter)
        with self._lock:
            if self.core.queue_full(len(self.core.waiting) + len(self._incoming), self.free_slots()):
                if pinned is not None:
                    self.shadow.release(pinned)
                raise QueueFull(f"the queue is full ({self.cfg.engine.max_queue} waiting requests)")
            req.adapter = pinned
            self._incoming.append(req)
            self._lock.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (e.g. its client went away); its slot is freed at the next step."""
        req.cancelled = True
        with self._lock:
            self._lock.notify()

    def train(self, budget: TrainBudget, global_state: dict | None = None, proximal_mu: float = 0.0,
              lr: float | None = None, serve_local: bool = True, carry: bool = False,
              freeze_a: bool = False, rebase=None) -> Future:
        """Queue local training; the future resolves to a JobReport (its `adapter_state` is the update).
        `serve_local`: publish its steps as `<name>:local` (every `adapters.local_every`). `carry` (a
        federated round; with `training.carry_between_rounds`): keep training in idle time after it,
        for the next round's job to absorb (see `training.trainer`). `freeze_a`: FFA-LoRA, only B is trained.
        `rebase`: how the absorbed carry goes onto the new global (mixed ranks: as products)."""
        if self.trainer is None:
            raise EngineError("this engine has no training data")
        return self._queue_job(self.trainer.job(budget, global_state, proximal_mu, lr, serve_local,
                                                carry_after=carry and self.cfg.training.carry_between_rounds,
                                                freeze_a=freeze_a, rebase=rebase))

    def carried_tokens(self) -> int:
        """Tokens trained since the last round's update that the next round's update will carry."""
        c = self.core.carry
        return c.report.tokens if c is not None else 0

    def evaluate(self, version: int | None = None, state: dict | None = None,
                 deadline_s: float | None = None) -> Future:
        """Queue holdout evaluation of a serving version (default: current) or of an adapter state."""
        if not self.holdout:
            raise EngineError("this engine has no holdout data")
        if state is not None:
            weights = self.layers.serving_weights(state, -1, self.device, self.lm.dtype)
        else:
            weights = self.shadow.current if version is None else self.shadow.weights_of(version)
            if weights is None:
                raise EngineError(f"adapter version {version} is not loaded")
        job = EvalJob(self.parts, weights, self.holdout, self.cfg.training.eval_batch_size,
                      self.tokenizer.pad_token_id, self.device, deadline_s)
        return self._queue_job(job)

    def _publish_local(self, steps: int) -> None:
        """Every `adapters.local_every` optimizer steps: serve the training adapter as `<name>:local`
        (engine thread, between units; a copy of the adapter, milliseconds)."""
        if steps % self.cfg.adapters.local_every == 0:
            self.shadow.publish_local(self.trainer.adapter.state_dict_peft(), steps)

    def _queue_job(self, job: BackgroundJob) -> Future:
        with self._lock:
            self._new_jobs.append(job)
            self._lock.notify()
        return job.future

    def end_jobs(self) -> None:
        """End the current and queued background jobs at the next unit boundary (shutdown): their
        futures resolve with what was done so far, marked as cut short by the deadline."""
        with self._lock:
            self.core.ending = True
            self._lock.notify()

    def free_slots(self) -> int:
        return self.pool.free_slots

    def load(self) -> dict:
        """Requests and work queued on this replica now."""
        with self._lock:
            running, waiting = list(self.core.running), list(self.core.waiting) + list(self._incoming)
            jobs = len(self.core.jobs) + len(self._new_jobs) + (self.core.job is not None)
        return {
            "running": len(running), "waiting": len(waiting), "jobs": jobs,
            "pending_decode_tokens": sum(r.params.max_tokens - len(r.out_ids) for r in running + waiting),
            "pending_prefill_tokens": sum(r.prefill_left for r in running + waiting),
            "running_kv_tokens": sum(len(r.prompt_ids) + len(r.out_ids) for r in running),
        }

    def idle_train_tokens_per_s(self) -> float:
        """Training throughput of this replica when it does nothing else (a typical micro-batch)."""
        t = self.cfg.training
        ref = max(1, t.micro_batch_size * t.max_seq_len // 2)
        return ref / max(self.costs.microbatch_time("train", ref), 1e-6)

    def snapshot(self) -> EdgeSnapshot:
        load = self.load()
        t = self.trainer
        return EdgeSnapshot(
            window=self.telemetry.snapshot(), **load,
            adapter_version=self.shadow.current_version, adapter_versions_alive=self.shadow.alive_versions(),
            swaps=self.shadow.swaps, max_context=self.max_context, max_running=self.pool.slots,
            step_token_budget=self.cfg.engine.step_token_budget, ttft_target_s=self.slo.ttft_s,
            tpot_target_s=self.slo.tpot_s, slo_safety=self.cfg.slo.safety,
            train_examples=len(t.stream.examples) if t else 0, train_steps_total=t.total_steps if t else 0,
            last_train_loss=t.last_loss if t else None,
            idle_train_tokens_per_s=self.idle_train_tokens_per_s() if t else 0.0,
            step_coef=tuple(float(c) for c in self.costs.step.coef), train_share=self.policy.share,
            predicted_decode_step_s=self.costs.step_time(max(1, load["running"]), 0, load["running_kv_tokens"]),
            failure=self.failure)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop admitting; let running and queued requests finish within `grace_s`; stop the loop."""
        self._accepting = False
        deadline = time.perf_counter() + grace_s
        while time.perf_counter() < deadline and any(self.load()[k] for k in ("running", "waiting")):
            time.sleep(0.02)
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.timeline is not None:
            self.timeline.close()  # also when the loop never started or did not stop in time

    def generate(self, prompt_ids: list[int], params: SamplingParams, timeout: float = 300.0, **kw) -> FinishEvent:
        """Blocking helper: submit and wait for the finish event."""
        done = threading.Event()
        box: list[FinishEvent] = []

        def on_event(ev):
            if isinstance(ev, FinishEvent):
                box.append(ev)
                done.set()

        self.submit(prompt_ids, params, on_event, **kw)
        if not done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        return box[0]

    # ================================================================= the loop (engine thread)
    def _run_loop(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - never die silently: fail everything that waits on us
            log.exception("engine loop crashed")
            self.failure = f"{type(e).__name__}: {e}"
            self._accepting = False
            self._fail_all("engine error")
            for fn in list(self.on_failure):
                try:
                    fn(self.failure)
                except Exception:  # noqa: BLE001
                    log.exception("engine failure callback failed")
        finally:
            if self.timeline is not None:
                self.timeline.close()

    def _loop(self) -> None:
        while self._pass():
            pass
        self._fail_all("the edge stopped")

    def _pass(self) -> bool:
        """One pass of the loop (the module docstring); False once the engine is stopping."""
        core = self.core
        with self._lock:
            if self._stop:
                return False
            core.waiting.extend(self._incoming)
            self._incoming.clear()
            core.jobs.extend(self._new_jobs)
            self._new_jobs.clear()
            idle = not core.running and not core.waiting and not core.has_job()
            if idle:
                self._lock.wait(0.05)
            else:  # the queue changes only under the lock: load() and submit() read it from other threads
                dropped = core.shed(self.clock())
        if idle:
            self._flush_timeline()
            return True
        for r, why in dropped:
            self._finish(r, why)
        with self._lock:
            admitted = core.admit(self.pool.allocate)
        for r in admitted:
            self._set_up(r)
        segments, prefilling, shape = core.plan()
        if segments:
            self._serve_step(segments, prefilling, shape)
        ran = self._run_background()
        if not segments and not ran:
            with self._lock:
                self._lock.wait(0.01)  # a job that must wait with nothing to serve: don't spin
            self._flush_timeline()
        return True

    def _flush_timeline(self) -> None:
        """A quiet replica's last events reach the file (outside the engine lock: a slow disk must not
        hold up submit and cancel)."""
        if self.timeline is not None:
            self.timeline.flush()

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

    def _fail_all(self, reason: str) -> None:
        core = self.core
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            new_jobs, self._new_jobs = list(self._new_jobs), deque()
        for r in list(core.running) + list(core.waiting) + incoming:
            self._finish(r, "error")
        core.waiting.clear()
        for job in ([core.job] if core.job else []) + list(core.jobs) + new_jobs:
            job.finish() if job.started else job.fail(RuntimeError(reason))
        core.job = None
        core.jobs.clear()
        core.carry = None

    # ================================================================= background work
    def _run_background(self) -> bool:
        """Run background work the rule admits: in idle time one unit (the loop then looks for arrivals);
        beside decodes, unit after unit while the rule admits each (the gap before the next serving step);
        the naive policy a whole micro-batch. True if anything ran."""
        core = self.core
        job = core.current_job(self.clock())
        if job is None:
            return False
        ran = False
        verdict = None
        try:
            while True:
                unit = job.next_unit()
                if verdict is None or verdict.reason == "busy-share":  # beside decodes: ask before every unit
                    with self._lock:
                        arriving = list(self._incoming)
                    verdict, load = core.verdict(self.clock(), self.costs.unit_time(job.kind, unit.kind, unit.tokens),
                                                 arriving)
                    self._note_share()
                    if not verdict.run:
                        if not ran:
                            job.report.deferrals += 1
                            self.telemetry.record_deferral()
                        return ran
                t0 = self.clock()
                completed_tokens = job.run_unit()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                now = self.clock()
                dt = now - t0
                if self.timeline is not None:
                    self.timeline.record("unit", t=time.time() - dt, s=dt, job=job.kind,
                                         unit=unit.kind, tok=unit.tokens, why=verdict.reason)
                self.costs.observe_unit(job.kind, unit.kind, unit.tokens, dt)
                self.telemetry.record_background(job.kind, dt, completed_tokens, beside_serving=not load.idle)
                core.ran(verdict, dt)
                job.report.compute_seconds += dt
                job.pass_s += dt
                if completed_tokens:  # a micro-batch completed: what a whole one costs, for the load report
                    (self.costs.train if job.kind == "train" else self.costs.eval).observe([completed_tokens],
                                                                                         job.pass_s)
                    job.pass_s = 0.0
                ran = True
                if core.after_units(job, now) or core.ending:
                    return True  # it ended (or ends at the next pass: shutdown)
                if verdict.reason == "busy-share":
                    continue  # the gap before the next serving step may hold more (the verdict decides)
                if not self.policy.whole_passes or job.at_pass_boundary():
                    return True  # idle: one unit per pass, so an arrival waits at most for it
        except Exception as e:  # noqa: BLE001 - a failed job must not take serving down
            log.exception("%s job failed", job.kind)
            job.fail(e)
            if core.job is job:
                core.job = None
            return False

    def _note_share(self) -> None:
        """The timeline records each change of the share the co-execution rule grants beside serving."""
        share = self.policy.share
        if self.timeline is not None and share != self._share_seen:
            ctl = getattr(self.policy, "controller", None)
            self.timeline.record("share", t=time.time(), f=round(share, 4),
                                 **({"slack": ctl.slack, "act": ctl.action} if ctl is not None else {}))
        self._share_seen = share

    def _job_ended(self, job: BackgroundJob, deadline_hit: bool) -> None:
        """The core ended a job (its future now holds the report)."""
        train = job if isinstance(job, TrainJob) else None
        carry = " (carry, until the next round)" if train and train.is_carry else ""
        log.info("%s job done%s: %s", job.kind, carry,
                 {k: v for k, v in job.report.as_dict().items() if k != "extra"})
