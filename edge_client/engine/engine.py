"""The edge replica engine: one frozen base model, serving and training on it in one step loop.

The loop (`Engine._loop`) is the algorithm, in order; every decision in it is the replica core's
(`engine.replica.ReplicaCore`, the object the simulator drives too). The serving step and a
request's end are in `engine.serving`, the background units in `engine.background`, the KV plan and
EOS ids in `engine.model_limits`:

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

from collm.common.adapter_io import check_compatible
from collm.common.data import format_example
from collm.common.slo import SLO
from collm.edge_client.config import EdgeConfig
from collm.edge_client.engine.background import BackgroundRunner
from collm.edge_client.engine.co_schedule import make_policy
from collm.edge_client.engine.cost_model import CostModels
from collm.edge_client.engine.model_limits import eos_ids, plan_kv
from collm.edge_client.engine.replica import ReplicaCore
from collm.edge_client.engine.serving import StepRunner
from collm.edge_client.engine.requests import (AdmittedEvent, EngineError, EngineFailed, FinishEvent, PromptTooLong,
                                               QueueFull, Request, ShuttingDown, TokenEvent)
from collm.edge_client.engine.telemetry import EdgeSnapshot, Telemetry
from collm.edge_client.engine.timeline import open_timeline
from collm.edge_client.model.loading import LoadedModel
from collm.edge_client.model.lora import TrainableAdapter, inject_lora
from collm.edge_client.model.runner import ModelRunner
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.model.shadow import ShadowAdapter
from collm.edge_client.training.data import EdgeData
from collm.edge_client.training.evaluation import EvalJob
from collm.edge_client.training.jobs import BackgroundJob, TrainBudget
from collm.edge_client.training.layerwise import ModelParts
from collm.edge_client.training.trainer import LocalTrainer

__all__ = ["AdmittedEvent", "Engine", "EngineError", "EngineFailed", "FinishEvent", "PromptTooLong", "QueueFull",
           "Request", "ShuttingDown", "TokenEvent"]

log = logging.getLogger("collm.engine")


class Engine(StepRunner, BackgroundRunner):
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
        adapter = self._set_up_adapters(seed)
        self.trainer: LocalTrainer | None = None
        self.holdout: list = []
        if data is not None:
            self._set_up_training(data, adapter, seed)
        self.eos_ids = eos_ids(lm)

        self._lock = threading.Condition()
        self._incoming: deque[Request] = deque()  # submitted, not yet in the core's queue (other threads)
        self._new_jobs: deque[BackgroundJob] = deque()  # queued, not yet in the core's (other threads)
        self._share_seen = 0.0  # the rule's share beside serving, as the timeline last recorded it
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # set if the loop dies; /health then answers 503
        self.on_failure: list[Callable[[str], None]] = []  # called once, from the dying loop thread

    def _set_up_adapters(self, seed: int) -> TrainableAdapter:
        """The shadow adapter serving the initial state (B = 0: the base model), the trainable adapter
        that state comes from (identical on every edge: the round-1 start), and the timeline, which
        records every publish from the first."""
        lm = self.lm
        self.shadow = ShadowAdapter(self.layers, lm.device, lm.dtype, retain=self.cfg.adapters.retain)
        adapter = TrainableAdapter(self.layers, lm.device, seed=seed)
        self.initial_state = adapter.state_dict_peft()
        self.timeline = open_timeline(self.cfg.engine.timeline)
        if self.timeline is not None:
            self.shadow.observer = lambda **kw: self.timeline.record("publish", **kw)
        self.shadow.publish(self.initial_state, 0, source="initial")
        return adapter

    def _set_up_training(self, data: EdgeData, adapter: TrainableAdapter, seed: int) -> None:
        """The edge's training and holdout examples, and the trainer on the serving model's own layers."""
        cfg, tok = self.cfg, self.tokenizer
        L = cfg.training.max_seq_len
        train = [format_example(tok, r, L) for r in data.train]
        self.holdout = [format_example(tok, r, L) for r in data.holdout]
        if cfg.training.max_eval_records:
            self.holdout = self.holdout[: cfg.training.max_eval_records]
        self.trainer = LocalTrainer(self.parts, self.layers, adapter, cfg.training, train, tok.pad_token_id,
                                    cfg.lora.dropout, seed)
        if cfg.adapters.local_every:
            self.trainer.on_step = self._publish_local

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
        if (closed := self._closed()) is not None:
            raise closed
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
            # closed again under the lock: a loop that failed or stopped since the check above has drained
            # _incoming for the last time, and a request appended now would never be answered (nor released)
            refusal = self._closed()
            if refusal is None and self.core.queue_full(len(self.core.waiting) + len(self._incoming),
                                                         self.free_slots()):
                refusal = QueueFull(f"the queue is full ({self.cfg.engine.max_queue} waiting requests)")
            if refusal is not None:
                if pinned is not None:
                    self.shadow.release(pinned)
                raise refusal
            req.adapter = pinned
            self._incoming.append(req)
            self._lock.notify()
        return req

    def _closed(self) -> EngineError | None:
        """Why no request is taken now (the engine failed, or the edge is shutting down); None: it is open."""
        if self.failure is not None:
            return EngineFailed(f"the engine failed ({self.failure}); this edge must be restarted")
        if not self._accepting:
            return ShuttingDown("the edge is shutting down")
        return None

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
        if global_state is not None and (problems := check_compatible(global_state, self.layers.expected_shapes())):
            raise EngineError(f"the global adapter does not fit this model: {problems[0]}")  # before a layer is loaded
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

    def queue_room(self) -> int:
        """How many more requests `submit` takes now before it answers QueueFull."""
        with self._lock:
            return self.core.queue_room(len(self.core.waiting) + len(self._incoming), self.free_slots())

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
