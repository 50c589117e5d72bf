"""The edge replica engine: one frozen base model, serving and training on it in one step loop.

The loop (`Engine._loop`) is the algorithm, in order:

1. take new requests and cancellations from other threads;
2. admit waiting requests while a KV slot is free, pinning the current serving adapter version;
3. plan a step: one decode token per running request, then prefill chunks (first come, first
   served) up to the step token budget, so a long prompt never stalls running decodes;
4. run the step (one forward over all of it, each request with its pinned adapter), sample, stream;
5. maybe run one training or evaluation micro-batch, if the co-scheduler's rule
   (`co_scheduler.allowance`) says every request keeps its SLO slack.

Other threads talk to the engine through `submit`, `cancel`, `publish`, `train`, `evaluate` and
`snapshot`; only the loop thread runs the model.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from collm.edge_client.config import EdgeConfig
from collm.common.data import format_example
from collm.edge_client.training.data import EdgeData
from collm.edge_client.model.loading import LoadedModel

from collm.edge_client.engine.co_schedule import RequestSlack, allowance, pick_microbatch
from collm.edge_client.engine.cost_model import CostModels, step_features
from collm.edge_client.model.lora import AdapterWeights, TrainableAdapter, inject_lora
from collm.edge_client.model.runner import KVPool, ModelRunner, Segment
from collm.edge_client.engine.preemption import Preempted, preemptible
from collm.edge_client.model.sampling import SamplingParams, TextStream, make_generator, sample_next
from collm.edge_client.model.shadow import ShadowAdapter
from collm.edge_client.engine.telemetry import RequestRecord, Telemetry
from collm.edge_client.training.trainer import BackgroundJob, EvalJob, JobReport, LocalTrainer, Option, TrainBudget

log = logging.getLogger("collm.engine")


class EngineError(Exception):
    """A request the engine cannot take; the message says why and what the limit is."""


class QueueFull(EngineError):
    pass


class PromptTooLong(EngineError):
    pass


class ShuttingDown(EngineError):
    pass


class EngineFailed(EngineError):
    """The engine loop died (a bug, not a request's fault): the process should be restarted."""


@dataclass
class AdmittedEvent:
    """The request got a slot; it is pinned to this adapter version for its whole life."""

    adapter_version: int


@dataclass
class TokenEvent:
    text: str
    token_id: int
    index: int


@dataclass
class FinishEvent:
    reason: str
    record: RequestRecord
    text: str  # the whole generated text
    token_ids: list[int]


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    ttft_slo: float
    tpot_slo: float
    on_event: Callable[[object], None]
    arrival: float = field(default_factory=time.perf_counter)
    slot: int | None = None
    adapter: AdapterWeights | None = None
    prefilled: int = 0
    out_ids: list[int] = field(default_factory=list)
    stream: TextStream | None = None
    generator: torch.Generator | None = None
    first_token_at: float | None = None
    cancelled: bool = False
    finished: bool = False

    @property
    def adapter_version(self) -> int | None:
        return None if self.adapter is None else self.adapter.version


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
                 costs: CostModels | None = None, seed: int = 0):
        self.lm, self.cfg = lm, cfg
        self.tokenizer = lm.tokenizer
        self.device = lm.device
        self.layers = inject_lora(lm.model, cfg.lora.target_modules, cfg.lora.r, cfg.lora.alpha)
        self.runner = ModelRunner(lm.model)
        slots, slot_len = plan_kv(cfg, self.runner, lm.max_context)
        self.pool = self.runner.new_pool(slots, slot_len)
        self.max_context = slot_len
        self.costs = costs or CostModels()
        self.telemetry = Telemetry()
        self.shadow = ShadowAdapter(self.layers, lm.device, lm.dtype)
        adapter = TrainableAdapter(self.layers, lm.device, seed=seed)
        self.initial_state = adapter.state_dict_peft()  # identical on every edge: the round-1 start
        self.shadow.publish(self.initial_state, 0, source="initial")  # B = 0: the base model
        self.trainer: LocalTrainer | None = None
        self.holdout: list = []
        if data is not None:
            tok, L = self.tokenizer, cfg.training.max_seq_len
            train = [format_example(tok, r, L) for r in data.train]
            self.holdout = [format_example(tok, r, L) for r in data.holdout]
            if cfg.training.max_eval_records:
                self.holdout = self.holdout[: cfg.training.max_eval_records]
            self.trainer = LocalTrainer(lm.model, adapter, cfg.training, train, tok.pad_token_id,
                                        cfg.lora.dropout, seed)
        eos = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = {e for e in eos if e is not None}

        self._lock = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._jobs: deque[BackgroundJob] = deque()
        self._job: BackgroundJob | None = None
        self._ending_jobs = False  # set at shutdown: end background jobs at the next micro-batch boundary
        self._typical_prompt = 128.0
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self._arrivals: deque[float] = deque()
        self.failure: str | None = None  # set if the loop dies; /health then answers 503
        self.on_failure: list[Callable[[str], None]] = []  # called once, from the dying loop thread

    # ================================================================= public API (any thread)
    def start(self) -> Engine:
        if self.cfg.engine.warmup:
            self.warmup()
        self._thread = threading.Thread(target=self._run_loop, name="collm-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callable[[object], None],
               ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
               request_id: str | None = None) -> Request:
        """Queue a request; events (TokenEvent..., FinishEvent) arrive on the engine thread."""
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
        req = Request(
            id=request_id or f"req-{uuid.uuid4().hex[:12]}", prompt_ids=list(prompt_ids), params=params,
            ttft_slo=(ttft_slo_s or self.cfg.slo.ttft_ms / 1000), tpot_slo=(tpot_slo_s or self.cfg.slo.tpot_ms / 1000),
            on_event=on_event)
        with self._lock:
            if len(self._waiting) + len(self._incoming) >= self.cfg.engine.max_queue + self.free_slots():
                raise QueueFull(f"the queue is full ({self.cfg.engine.max_queue} waiting requests)")
            self._incoming.append(req)
            self._arrivals.append(req.arrival)
            self._lock.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (e.g. its client went away); its slot is freed at the next step."""
        req.cancelled = True
        with self._lock:
            self._lock.notify()

    def publish(self, state: dict, version: int, **meta) -> None:
        """Swap serving to a new adapter version (copy off the serving path, then an atomic flip)."""
        self.shadow.publish(state, version, **meta)

    def train(self, budget: TrainBudget, global_state: dict | None = None, proximal_mu: float = 0.0,
              lr: float | None = None) -> Future:
        """Queue local training in SLO slack; the future resolves to a JobReport."""
        if self.trainer is None:
            raise EngineError("this engine has no training data")
        return self._queue_job(self.trainer.job(budget, global_state, proximal_mu, lr))

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
        job = EvalJob(self.lm.model, weights, self.holdout, self.cfg.training.eval_batch_size,
                      self.tokenizer.pad_token_id, self.device, deadline_s)
        return self._queue_job(job)

    def _queue_job(self, job: BackgroundJob) -> Future:
        with self._lock:
            self._jobs.append(job)
            self._lock.notify()
        return job.future

    def end_jobs(self) -> None:
        """End the current and queued background jobs at the next micro-batch boundary (shutdown):
        their futures resolve with what was done so far, marked as cut short by the deadline."""
        with self._lock:
            self._ending_jobs = True
            self._lock.notify()

    def free_slots(self) -> int:
        return self.pool.free_slots

    def load(self) -> dict:
        """Requests and work queued on this replica (read by the router and the balancer)."""
        with self._lock:
            running, waiting = list(self._running), list(self._waiting) + list(self._incoming)
            jobs = len(self._jobs) + (self._job is not None)
        return {
            "running": len(running), "waiting": len(waiting), "jobs": jobs,
            "pending_decode_tokens": sum(r.params.max_tokens - len(r.out_ids) for r in running + waiting),
            "pending_prefill_tokens": sum(len(r.prompt_ids) - r.prefilled for r in running + waiting),
            "running_kv_tokens": sum(len(r.prompt_ids) + len(r.out_ids) for r in running),
        }

    def snapshot(self) -> dict:
        snap = self.telemetry.snapshot()
        snap.update(self.load())
        snap.update({
            "adapter_version": self.shadow.current_version,
            "adapter_versions_alive": self.shadow.alive_versions(),
            "swaps": self.shadow.swaps,
            "max_context": self.max_context,
            "max_running": self.pool.slots,
            "train_steps_total": self.trainer.total_steps if self.trainer else 0,
            "last_train_loss": self.trainer.last_loss if self.trainer else None,
            "costs": self.costs.snapshot(),
            "predicted_decode_step_s": self.costs.step_time(max(1, snap["running"]), 0, snap["running_kv_tokens"]),
        })
        return snap

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

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    break
                self._waiting.extend(self._incoming)
                self._incoming.clear()
                if not self._running and not self._waiting and not self._has_job():
                    self._lock.wait(0.05)
                    continue
            self._drop_cancelled()
            self._admit()
            segments = self._plan_step()
            if segments:
                self._serve_step(segments)
            ran = self._maybe_background()
            if not segments and not ran:
                with self._lock:
                    self._lock.wait(0.01)  # a deferred job with nothing to serve: don't spin
        self._fail_all("the edge stopped")

    def _has_job(self) -> bool:
        return self._job is not None or bool(self._jobs)

    def _drop_cancelled(self) -> None:
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self._finish(r, "cancelled")
        for r in [r for r in self._running if r.cancelled]:
            self._finish(r, "cancelled")

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.pool.slots:
            slot = self.pool.allocate()
            if slot is None:
                return
            r = self._waiting.popleft()
            r.slot = slot
            self._running.append(r)
            try:
                r.adapter = self.shadow.pin()
                r.stream = TextStream(self.tokenizer, r.params.stop)
                r.generator = make_generator(r.params, self.device)
            except Exception:  # noqa: BLE001 - one request's set-up must not stop the engine
                log.exception("request %s: could not be admitted", r.id)
                self._finish(r, "error")
                continue
            self._typical_prompt = 0.9 * self._typical_prompt + 0.1 * len(r.prompt_ids)
            self._emit(r, AdmittedEvent(r.adapter.version))

    def _plan_step(self) -> list[Segment]:
        budget = self.cfg.engine.step_token_budget
        segs = []
        for r in self._running:  # decodes first: one token each
            if r.prefilled == len(r.prompt_ids):
                pos = len(r.prompt_ids) + len(r.out_ids) - 1
                segs.append(Segment(r.slot, pos, [r.out_ids[-1]], r.adapter, True))
                budget -= 1
        for r in self._running:  # then prefill chunks, oldest request first
            left = len(r.prompt_ids) - r.prefilled
            if left and budget > 0:
                n = min(left, budget)
                segs.append(Segment(r.slot, r.prefilled, r.prompt_ids[r.prefilled:r.prefilled + n], r.adapter,
                                    r.prefilled + n == len(r.prompt_ids)))
                budget -= n
        segs.sort(key=lambda s: s.adapter.version)  # contiguous rows per adapter version
        return segs

    def _serve_step(self, segments: list[Segment]) -> None:
        by_slot = {r.slot: r for r in self._running}
        # a request's segment is a prefill chunk until its prompt is all in (a 1-token last chunk
        # looks like a decode but is not one)
        prefilling = {s.slot for s in segments if by_slot[s.slot].prefilled < len(by_slot[s.slot].prompt_ids)}
        decode = sum(1 for s in segments if s.slot not in prefilling)
        prefill = sum(len(s.tokens) for s in segments) - decode
        attended = sum(s.start + len(s.tokens) for s in segments)
        t0 = time.perf_counter()
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
        now = time.perf_counter()
        self.costs.step.observe(step_features(decode, prefill, attended), now - t0)
        self.telemetry.record_step(now - t0, len(segments))
        for s in segments:
            if s.slot in prefilling:
                by_slot[s.slot].prefilled += len(s.tokens)
        for r, tok in zip(wanting, tokens):
            try:
                self._on_token(r, tok, now)
            except Exception:  # noqa: BLE001 - e.g. detokenization: this request fails, not the engine
                log.exception("request %s: token handling failed", r.id)
                if r in self._running:
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
        now = time.perf_counter()
        if r in self._running:
            self._running.remove(r)
            self.pool.release(r.slot)
        if r.adapter is not None:
            self.shadow.release(r.adapter)
        n = len(r.out_ids)
        ttft = None if r.first_token_at is None else r.first_token_at - r.arrival
        tpot = (now - r.first_token_at) / (n - 1) if r.first_token_at is not None and n > 1 else (0.0 if n else None)
        rec = RequestRecord(
            id=r.id, adapter_version=-1 if r.adapter is None else r.adapter.version,
            prompt_tokens=len(r.prompt_ids), output_tokens=n, ttft_s=ttft, tpot_s=tpot, e2e_s=now - r.arrival,
            ttft_slo_s=r.ttft_slo, tpot_slo_s=r.tpot_slo, finish_reason=reason, finished_at=time.time())
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
        for r in list(self._running) + list(self._waiting) + list(self._incoming):
            self._finish(r, "error")
        self._waiting.clear()
        self._incoming.clear()
        for job in ([self._job] if self._job else []) + list(self._jobs):
            job.finish() if job.started_at is not None else job.fail(RuntimeError(reason))
        self._job = None
        self._jobs.clear()

    # ================================================================= background work
    def _slack(self, now: float) -> float:
        """The co-scheduler's allowance for background work right now (seconds)."""
        budget = self.cfg.engine.step_token_budget
        decoding = [r for r in self._running if r.prefilled == len(r.prompt_ids)]
        pending_prefill = sum(len(r.prompt_ids) - r.prefilled for r in self._running)
        step_s = self.costs.step_time(len(decoding), min(pending_prefill, budget),
                                      sum(len(r.prompt_ids) + len(r.out_ids) for r in self._running))
        reqs = [RequestSlack(r.arrival, r.first_token_at, len(r.out_ids), r.ttft_slo, r.tpot_slo,
                             len(r.prompt_ids) - r.prefilled) for r in self._running]
        reqs += [RequestSlack(r.arrival, None, 0, r.ttft_slo, r.tpot_slo, len(r.prompt_ids)) for r in self._waiting]
        p = int(self._typical_prompt)
        a = allowance(now, reqs, step_s=step_s, step_token_budget=budget,
                      default_ttft_slo=self.cfg.slo.ttft_ms / 1000,
                      new_arrival_prefill_s=self.costs.step_time(0, min(p, budget), p),
                      safety=self.cfg.slo.safety, n_layers=self.runner.n_layers)
        return a.seconds

    def _maybe_background(self) -> bool:
        """Run one micro-batch of the current job if it fits in the slack. True if one ran."""
        with self._lock:
            if self._job is None and self._jobs:
                self._job = self._jobs.popleft()
                self._job.start()
        job = self._job
        if job is None:
            return False
        now = time.perf_counter()
        if job.done() or job.past_deadline(now) or self._ending_jobs:
            self._end_job(job, deadline_hit=not job.done())
            return False
        if self.cfg.training.co_schedule == "naive":  # baseline: no SLO control, no preemption
            option, should_stop = job.options()[0], (lambda: False)
        else:
            slack = self._slack(now)
            options = [(o, self.costs.microbatch_time(job.kind, o.tokens)) for o in job.options()]
            option = pick_microbatch(options, slack, self._arrival_gap(now))
            if option is None:
                job.report.deferrals += 1
                self.telemetry.record_deferral()
                return False
            stop_at = now + min(slack, 1e9)
            if job.deadline_s is not None:
                stop_at = min(stop_at, job.started_at + job.deadline_s)

            def should_stop() -> bool:
                return bool(self._incoming) or self._stop or self._ending_jobs or time.perf_counter() > stop_at

        t0 = time.perf_counter()
        try:
            with preemptible(self.runner.layers, should_stop):
                job.run(option)
        except Preempted:
            dt = time.perf_counter() - t0
            job.report.extra["preempted"] = job.report.extra.get("preempted", 0) + 1
            job.report.extra["preempted_s"] = job.report.extra.get("preempted_s", 0.0) + dt
            self.telemetry.record_preemption(dt)
            return True
        except Exception as e:  # noqa: BLE001 - a failed job must not take serving down
            log.exception("%s job failed", job.kind)
            job.fail(e)
            self._job = None
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        (self.costs.train if job.kind == "train" else self.costs.eval).observe([option.tokens], dt)
        self.telemetry.record_background(job.kind, dt, option.tokens)
        job.report.compute_seconds += dt
        if job.done():
            self._end_job(job)
        return True

    def _arrival_gap(self, now: float) -> float:
        """Expected seconds to the next arrival, from the last 30 s of arrivals."""
        while self._arrivals and self._arrivals[0] < now - 30.0:
            self._arrivals.popleft()
        if not self._arrivals:
            return float("inf")
        return 30.0 / len(self._arrivals)

    def _end_job(self, job: BackgroundJob, deadline_hit: bool = False) -> JobReport:
        self._job = None
        report = job.finish(deadline_hit)
        log.info("%s job done: %s", job.kind, {k: v for k, v in report.as_dict().items() if k != "extra"})
        return report

    # ================================================================= warmup
    def warmup(self) -> None:
        """Measure step and micro-batch costs once before serving, so the first decisions are informed.

        Each shape runs three times and the fastest counts: a hiccup from another process must not
        become this replica's idea of its own speed.
        """
        t0 = time.perf_counter()
        w = self.shadow.pin()
        slots = [self.pool.allocate() for _ in range(min(4, self.pool.slots))]

        def fastest(fn, reps: int = 3) -> float:
            fn()  # allocations, first-call paths
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        try:
            g = torch.Generator().manual_seed(0)
            vocab = self.runner.vocab_size
            for n in (16, min(64, self.max_context // 2)):
                ids = torch.randint(3, vocab, (n,), generator=g).tolist()
                seconds = fastest(lambda: self.runner.forward([Segment(slots[0], 0, ids, w, True)], self.pool))
                self.costs.step.observe(step_features(0, n, n), seconds)
            for b in range(1, len(slots) + 1):
                segs = [Segment(s, 8, [5], w, True) for s in slots[:b]]
                seconds = fastest(lambda: self.runner.forward(segs, self.pool))
                self.costs.step.observe(step_features(b, 0, 9 * b), seconds)
            if self.trainer is not None:
                self._measure_train_microbatch()
            if self.holdout:
                job = EvalJob(self.lm.model, w, self.holdout[:1], 1, self.tokenizer.pad_token_id, self.device)

                def one_eval():
                    job.pos = 0
                    job.run(Option(1, None, 0))

                seconds = fastest(one_eval, reps=2)
                self.costs.eval.observe([len(self.holdout[0].input_ids)], seconds)
        finally:
            for s in slots:
                self.pool.release(s)
            self.shadow.release(w)
        for model in (self.costs.step, self.costs.train, self.costs.eval):
            model.adopt_fit_as_prior()
        log.info("warmup done in %.1f s: decode step (1 seq) %.1f ms, train micro-batch %.2f s",
                 time.perf_counter() - t0, 1000 * self.costs.step_time(1, 0, 64),
                 self.costs.microbatch_time("train", self.cfg.training.max_seq_len))

    def _measure_train_microbatch(self) -> None:
        """Time forward+backward of one training sequence without changing the adapter."""
        from collm.edge_client.model.lora import TrainingBinding, bind
        from collm.edge_client.training.trainer import collate, token_loss

        t = self.trainer
        ex = t.stream.peek(1)
        ids, mask, labels = collate(ex, t.pad_id, self.device)
        best = float("inf")
        for rep in range(3):
            start = time.perf_counter()
            with bind(TrainingBinding(t.adapter, t.dropout)):
                loss, _, _ = token_loss(t.model, ids, mask, labels)
            loss.backward()
            if rep:
                best = min(best, time.perf_counter() - start)
        self.costs.train.observe([int(mask.sum())], best)
        t.optimizer.zero_grad(set_to_none=True)
