"""`collm-bench --config bench.yaml`: trace-replay goodput of CoLLM against the deployments it replaces.

Every mode runs on the same number of replicas (edge processes on this machine), the same trace
window and the same SLOs, one mode after another:

* `collm`            every replica serves and trains (co-scheduled in the SLO slack), the balancer
                     sizes each round, the SLO-aware router spreads requests, shadow swaps;
* `isolated`         the usual split: half the replicas only serve, half only train federated; the
                     serving half reloads the new global adapter from disk after each round;
* `colocated-naive`  every replica serves and trains at full speed all the time (no SLO control,
                     no balancer: equal budgets), round-robin routing;
* `serve-only`       no training at all (quality stays where it started), round-robin routing.

Per mode: the trace window is replayed open-loop through the router (collm.lab.loadgen), then a
rate sweep replays further trace windows at multiples of the rate on the same running topology.
Served quality is measured after the mode, outside the window, on one fixed held-out set for all
modes: the loss of each global adapter that was served, at the time it was swapped in.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from collm.common import metric_names as M
from collm.common.config import load_config
from collm.edge_client.config import EdgeConfig
from collm.common.data import Record, categories, load_records, partition_by_category, split_holdout
from collm.common.errors import UserError, cli_entry
from collm.lab.loadgen import Planned, replay, summarize
from collm.common.procs import BIN_DIR, usable_cpus
from collm.common.traces import TraceScaling, load_trace

from collm.lab.bench_config import BenchConfig
from collm.lab.lab import BASE_CONFIGS, Lab, free_port, interrupt_on_signal, wait_http
from collm.router.state import parse_prometheus


# ----------------------------------------------------------------------------- requests
class PromptMaker:
    """Chat prompts from the edges' Dolly domains, about `tokens` long (4 characters per token)."""

    def __init__(self, records: list[Record]):
        self.records = records
        self.i = 0

    def __call__(self, tokens: int) -> str:
        want = max(8, tokens * 4)
        parts = []
        while sum(len(p) for p in parts) < want:
            parts.append(self.records[self.i % len(self.records)].prompt())
            self.i += 1
        return "\n\n".join(parts)[:want]


def plan_window(cfg: BenchConfig, model: str, start_s: float, seconds: float, speed: float,
                prompts: PromptMaker) -> list[Planned]:
    t = cfg.trace
    scaling = TraceScaling(speed=speed, token_scale=t.token_scale, max_prompt_tokens=t.max_prompt_tokens,
                           max_output_tokens=t.max_output_tokens, min_output_tokens=t.min_output_tokens,
                           start_s=start_s, duration_s=seconds * speed)
    plan = []
    for req in load_trace(t.path, scaling):
        body = {"model": model, "messages": [{"role": "user", "content": prompts(req.prompt_tokens)}],
                "max_tokens": req.output_tokens, "temperature": 0.7, "seed": len(plan), "ignore_eos": True,
                "slo": {"ttft_ms": cfg.ttft_ms, "tpot_ms": cfg.tpot_ms}}
        plan.append(Planned(req.arrival_s, body, ttft_slo_s=cfg.ttft_ms / 1000, tpot_slo_s=cfg.tpot_ms / 1000))
    return plan


# ----------------------------------------------------------------------------- topology
def mode_roles(mode: str, n: int) -> list[str]:
    """What each replica does in `mode`: serve+train, serve, or train."""
    if mode == "isolated":
        return ["serve"] * (n // 2) + ["train"] * (n // 2)
    if mode == "serve-only":
        return ["serve"] * n
    return ["serve+train"] * n


def edge_configs(cfg: BenchConfig, mode: str, superlink: str, out: Path) -> list[dict]:
    """One edge config per replica, in the order of `mode_roles`."""
    base = yaml.safe_load(Path(BASE_CONFIGS[cfg.model]).read_text())
    roles = mode_roles(mode, cfg.replicas)
    parts = [categories(p) for p in partition_by_category(load_records(), cfg.replicas)]
    if mode == "isolated":  # the training half holds all the training data, two domains each
        half = cfg.replicas // 2
        parts = [parts[i] + parts[i + half] for i in range(half)] * 2
    configs = []
    for i, role in enumerate(roles):
        c = json.loads(json.dumps(base))
        c["name"] = f"{role.replace('+', '-')}{i}"
        c["api"] = {**c.get("api", {}), "host": "127.0.0.1", "port": free_port(), "admin": True}
        c["slo"] = {**c.get("slo", {}), "ttft_ms": cfg.ttft_ms, "tpot_ms": cfg.tpot_ms}
        c["data"] = {**c.get("data", {}), "categories": parts[i]}
        c["training"] = {**c.get("training", {}), "co_schedule": "naive" if mode == "colocated-naive" else "work_conserving",
                         "max_eval_records": cfg.federation.eval_records}
        c["model"] = {**c["model"], "cpu_affinity": replica_cores(i, cfg.replicas)}
        c["federation"] = {"enabled": "train" in role, "superlink": superlink, "runtime_port": free_port()}
        c["state_dir"] = str(out / "state" / c["name"])
        configs.append(c)
    return configs


def replica_cores(i: int, n: int) -> list[int]:
    """The cores replica i of n is pinned to: each replica its own share, like separate devices."""
    cpus = usable_cpus()
    if n >= len(cpus):
        return [cpus[i % len(cpus)]]
    per = len(cpus) // n
    return cpus[i * per:(i + 1) * per]


class ModeRun:
    """The processes of one mode: SuperLink, edges, router and (if it trains) the ServerApp."""

    def __init__(self, cfg: BenchConfig, mode: str, out: Path):
        self.cfg, self.mode, self.out = cfg, mode, out
        self.lab = Lab(out)
        self.superlink = f"127.0.0.1:{free_port()}"
        self.lab.superlink = self.superlink  # so stop() also ends the ServerApp the SuperLink detached
        self.edges = edge_configs(cfg, mode, self.superlink, out)
        self.roles = dict(zip((e["name"] for e in self.edges), mode_roles(mode, cfg.replicas)))
        self.urls = {e["name"]: f"http://127.0.0.1:{e['api']['port']}" for e in self.edges}
        self.trains = any(e["federation"]["enabled"] for e in self.edges)
        self.reloads: list[dict] = []
        self._stop = threading.Event()

    def start(self) -> None:
        if self.trains:
            self.lab.spawn("superlink", [str(BIN_DIR / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                         "--port", self.superlink.split(":")[1],
                                         "--disable-runtime-dependency-installation"])
        for e in self.edges:
            path = self.out / f"{e['name']}.yaml"
            path.write_text(yaml.safe_dump(e))
            load_config(EdgeConfig, path)
            self.lab.spawn(e["name"], [str(BIN_DIR / "collm-edge"), "--config", str(path)])
        for name, url in self.urls.items():
            wait_http(url + "/health", self.lab, 900 if self.cfg.model == "bundled" else 120, f"edge {name}")
        serving = [e for e in self.edges if "serve" in self.roles[e["name"]]]
        policy = "slo" if self.mode == "collm" else "round_robin"
        router_port = free_port()
        rcfg = {"api": {"host": "127.0.0.1", "port": router_port},
                "edges": [{"name": e["name"], "url": self.urls[e["name"]]} for e in serving],
                "routing": {"policy": policy}}
        (self.out / "router.yaml").write_text(yaml.safe_dump(rcfg))
        self.lab.spawn("router", [str(BIN_DIR / "collm-router"), "--config", str(self.out / "router.yaml")])
        self.router = f"http://127.0.0.1:{router_port}"
        wait_http(self.router + "/health", self.lab, 60, "collm-router")
        self.model_id = httpx.get(self.router + "/v1/models").json()["data"][0]["id"]
        if self.trains:
            self._start_server()
            self._wait_first_round()
        if self.mode == "isolated":
            threading.Thread(target=self._reload_serving_replicas, daemon=True).start()

    def _start_server(self) -> None:
        f = self.cfg.federation
        trainers = [e for e in self.edges if e["federation"]["enabled"]]
        server = yaml.safe_load(Path("configs/server.yaml").read_text())
        server.update({"rounds": f.rounds, "min_nodes": len(trainers), "checkpoint_dir": str(self.ckpt_dir),
                       "round_timeout_s": 4 * f.round_deadline_s + 120, "query_timeout_s": 60,
                       "base_model_name": self.model_id, "lora": trainers[0].get("lora", server.get("lora"))})
        server["balancer"].update({"round_deadline_s": f.round_deadline_s, "round_token_budget": f.round_token_budget,
                                   "lr": f.lr, "mode": "slo" if self.mode == "collm" else "uniform"})
        (self.out / "server.yaml").write_text(yaml.safe_dump(server))
        self.lab.spawn("server", [str(BIN_DIR / "collm-server"), "--insecure", "--superlink", self.superlink,
                                  "-c", f'config="{self.out / "server.yaml"}"'])

    def _wait_first_round(self, timeout: float = 300) -> None:
        """Start the window only once round 1 is planned, so every training mode is measured while it
        trains (starting the ServerApp process takes seconds that would otherwise eat the window)."""
        log = self.out / "logs" / "server.log"
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.lab.check_alive()
            server = dict(self.lab.procs)["server"]
            if server.poll() is not None:
                raise UserError(f"the ServerApp exited with status {server.returncode} before round 1 (see {log})")
            if log.is_file() and re.search(r"round 1: \S+ (trains|sits out)", log.read_text(errors="replace")):
                return
            time.sleep(0.25)
        raise UserError(f"the ServerApp did not start round 1 within {timeout:.0f} s (see {log})")

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def _reload_serving_replicas(self) -> None:
        """The isolated deployment: after each round, the serving replicas load the new adapter from disk."""
        seen = 0
        while not self._stop.wait(0.5):
            done = complete_rounds(self.ckpt_dir)
            for r in [r for r in done if r > seen]:
                for e in self.edges:
                    if self.roles[e["name"]] == "serve":
                        t0 = time.time()
                        resp = httpx.post(self.urls[e["name"]] + "/admin/adapters",
                                          json={"path": str(self.ckpt_dir / f"round-{r:04d}"), "version": r}, timeout=60)
                        self.reloads.append({"round": r, "edge": e["name"], "status": resp.status_code,
                                             "at": time.time(), "seconds": time.time() - t0})
                seen = r

    def stop(self) -> None:
        self._stop.set()
        self.lab.stop()


def complete_rounds(ckpt: Path) -> list[int]:
    if not ckpt.is_dir():
        return []
    return sorted(int(d.name.split("-")[1]) for d in ckpt.glob("round-*") if (d / "metrics.json").is_file())


# ----------------------------------------------------------------------------- served quality
class QualityJudge:
    """Loss of adapters on one fixed held-out set (same for every mode), computed outside the windows."""

    def __init__(self, cfg: BenchConfig):
        from collm.edge_client.model.loading import load_model
        from collm.edge_client.engine import Engine

        base = load_config(EdgeConfig, BASE_CONFIGS[cfg.model])
        lm = load_model(base.model)
        from collm.common.data import format_example

        self.engine = Engine(lm, base)  # not started: evaluation runs synchronously here
        by_cat = self._records_by_category()
        per_cat = max(1, cfg.eval_records // max(1, len(by_cat)))
        self.records = [r for rs in by_cat.values() for r in rs[:per_cat]]
        self.examples = [format_example(lm.tokenizer, r, base.training.max_seq_len) for r in self.records]

    @staticmethod
    def _records_by_category() -> dict[str, list[Record]]:
        _, hold = split_holdout(load_records(), 0.1)
        out: dict[str, list[Record]] = {}
        for r in hold:
            out.setdefault(r.category, []).append(r)
        return out

    def loss(self, state: dict | None) -> float:
        from collm.edge_client.training.evaluation import EvalJob

        eng = self.engine
        weights = eng.shadow.current if state is None else eng.layers.serving_weights(state, -1, eng.device,
                                                                                       eng.lm.dtype)
        job = EvalJob(eng.parts, weights, self.examples, 8, eng.tokenizer.pad_token_id, eng.device)
        job.run_all()
        return float(job.report.loss)


def served_loss_timeline(judge: QualityJudge, run: ModeRun, t_window: float, base_loss: float) -> list[dict]:
    """(seconds after the window start, loss) of every adapter the mode served, from its swap time."""
    from collm.common.adapter_io import load_adapter

    points = [{"t": 0.0, "round": 0, "loss": base_loss}]
    for r in complete_rounds(run.ckpt_dir):
        d = run.ckpt_dir / f"round-{r:04d}"
        swapped = (d / "metrics.json").stat().st_mtime
        if run.mode == "isolated":
            at = [x["at"] for x in run.reloads if x["round"] == r and x["status"] == 200]
            if not at:
                continue  # written but never loaded by the serving replicas
            swapped = max(at)
        state, _ = load_adapter(d)
        points.append({"t": swapped - t_window, "round": r, "loss": judge.loss(state)})
    return points


# ----------------------------------------------------------------------------- one mode
def run_mode(cfg: BenchConfig, mode: str, out: Path, judge: QualityJudge, base_loss: float, bar) -> dict:
    records = [r for r in load_records()]
    prompts = PromptMaker(records[::7])
    run = ModeRun(cfg, mode, out)
    result: dict = {"mode": mode, "replicas": cfg.replicas, "roles": run.roles}
    try:
        t0 = time.time()
        run.start()
        result["startup_s"] = round(time.time() - t0, 1)
        time.sleep(cfg.warmup_s)
        plan = plan_window(cfg, run.model_id, cfg.trace.start_s, cfg.window_s, cfg.trace.speed, prompts)
        t_window = time.time()
        outcomes = replay(plan, run.router)
        result["window"] = {**summarize(outcomes, cfg.window_s), "rate": len(plan) / cfg.window_s,
                            "seconds": cfg.window_s}
        bar.update(1)
        result["versions_served"] = sorted({o.adapter_version for o in outcomes if o.adapter_version is not None})
        sweep = []
        offset = cfg.trace.start_s + cfg.window_s * cfg.trace.speed
        for f in cfg.sweep.factors:
            speed = cfg.trace.speed * f
            p = plan_window(cfg, run.model_id, offset, cfg.sweep.seconds, speed, prompts)
            offset += cfg.sweep.seconds * speed
            s = summarize(replay(p, run.router), cfg.sweep.seconds)
            sweep.append({"factor": f, "rate": len(p) / cfg.sweep.seconds, **s})
            bar.update(1)
        result["sweep"] = sweep
        result["max_rate"] = max_sustained_rate(sweep, cfg.sweep.target_attainment)
        result["train"] = training_totals(run)
        result["rounds_completed"] = len(complete_rounds(run.ckpt_dir))
        result["reloads"] = run.reloads
        result["wall_s"] = round(time.time() - t_window, 1)
    finally:
        run.stop()
    result["served_loss"] = served_loss_timeline(judge, run, t_window, base_loss)
    result["final_loss"] = result["served_loss"][-1]["loss"]
    return result


def training_totals(run: ModeRun) -> dict:
    """Training tokens the replicas processed (from their /metrics)."""
    tokens = 0.0
    for url in run.urls.values():
        try:
            tokens += parse_prometheus(httpx.get(url + "/metrics", timeout=5).text).get(M.TRAIN_TOKENS, 0.0)
        except httpx.HTTPError:
            pass
    return {"tokens": tokens}


def max_sustained_rate(sweep: list[dict], target: float) -> float:
    """Highest rate with attainment >= target, interpolated between the last pass and the first fail."""
    pts = sorted((p["rate"], p["slo_attainment"] or 0.0) for p in sweep)
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 1.0)] + pts, pts):
        if a1 >= target:
            best = r1
            continue
        if a0 >= target and a0 != a1:
            best = r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
        break
    return best


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-bench", description="Trace-replay goodput benchmark of CoLLM "
                                "against isolated, colocated-naive and serve-only deployments.")
    p.add_argument("--config", default="configs/bench-quick.yaml")
    p.add_argument("--out", help="override `out`")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from collm.lab.bench_report import write_report

    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt_on_signal)  # SIGTERM stops the mode's processes, like ^C
    cfg = load_config(BenchConfig, args.config, {"out": args.out} if args.out else None)
    out = Path(cfg.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    t0 = time.time()
    print(f"collm-bench: model {cfg.model}, {cfg.replicas} replicas, modes {', '.join(cfg.modes)}; "
          f"writing to {out}", flush=True)
    judge = QualityJudge(cfg)
    base_loss = judge.loss(None)
    results = {"config": cfg.model_dump(mode="json"), "base_loss": base_loss, "modes": {}}
    with tqdm(total=len(cfg.modes) * (1 + len(cfg.sweep.factors)), desc="collm-bench", unit="window",
              file=sys.stdout, dynamic_ncols=True) as bar:
        for mode in cfg.modes:
            bar.set_postfix_str(mode)
            results["modes"][mode] = run_mode(cfg, mode, out / mode, judge, base_loss, bar)
            w = results["modes"][mode]["window"]
            tqdm.write(f"  {mode}: goodput {w['goodput_rps']:.3f} req/s, attainment {w['slo_attainment']:.3f}, "
                       f"rounds {results['modes'][mode]['rounds_completed']}, "
                       f"served loss {results['modes'][mode]['final_loss']:.4f}")
            (out / "results.partial.json").write_text(json.dumps(results, indent=2))  # kept if a later mode fails
    results["wall_s"] = round(time.time() - t0, 1)
    paths = write_report(results, out)
    print(f"collm-bench: done in {results['wall_s']:.0f} s; report {paths['markdown']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
