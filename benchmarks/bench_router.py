"""Benchmark of collm-router's routing policies: slo vs round_robin vs least_outstanding, same run.

    python benchmarks/bench_router.py --quick            # ~1.5-minute smoke run
    python benchmarks/bench_router.py                    # full run (~4 minutes on 2 CPU cores)
    python benchmarks/bench_router.py --mode sequential  # one policy at a time, 6 rotated rounds
    python benchmarks/bench_router.py --edges 2 --pin    # one CPU per edge: replicas that do not share cores

Setup: three `collm-edge` processes on the tiny model (OMP_NUM_THREADS=1 each, `api.admin: true`),
one of them (--train-edge) made busier by a large local training job (`POST /admin/train` with a
huge token budget) that its co-scheduler runs in the SLO slack for the whole phase.

Load: the bundled Azure LLM conversation trace (`collm.common.traces.load_trace`), scaled to this
machine with `TraceScaling` (the JSON records every knob): arrivals sped up by --speed, token
counts multiplied by --token-scale and clipped to [--min/max-prompt] and [--min/max-output];
prompts are built to the trace's prompt token counts (calibrated on the edge's tokenizer) and
outputs are forced to the trace's counts (`ignore_eos`). Open loop: every request is sent at its
trace time whatever happened to the earlier ones, as a stream, through the router.

Modes (--mode):
* interleaved (default): the three policies' routers run at once in front of the same edges, and
  the replay is cut into --slot-s slots, each slot's requests going to one policy's router (a seeded
  random permutation of the policies in every block of three slots). Every policy sees the same
  trace and, slot by slot, the same background load from whatever else runs on the machine; one
  slot's requests may still be running when the next slot starts (a few hundred ms of spill-over).
  The training job runs for the whole replay; its tokens are credited to the slots' policies.
* sequential: one policy at a time (a fresh `collm-router --policy P`, the training job restarted)
  replays the same --duration window; each of --rounds rounds takes the next window of the trace
  and rotates the policies' order.

Per policy: SLO attainment (requests that completed and met every SLO / requests sent), goodput
(requests that met every SLO per second of the policy's slots, or of a phase from its first send
to its last completion), p50/p99 TTFT and TPOT of completed requests (measured by this client:
TTFT to the first token event, TPOT = (end - TTFT) / (tokens - 1)), the share of requests each edge
served, retries, failures, and the training tokens/s the busy edge got meanwhile. Results go to
--out (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from benchkit import table

from collm.common import sse
from collm.common.stats import percentile
from collm.lab.topology import free_port

ROOT = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()
POLICIES = ("slo", "round_robin", "least_outstanding")


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180, want=lambda r: True) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and want(r):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready in {timeout:.0f} s")


# =============================================================================== processes
def edge_config(name: str, port: int, state: Path, args) -> dict:
    return {
        "name": name,
        "model": {"source": "tiny", "device": "cpu"},
        "engine": {"max_running": args.max_running, "kv_cache_mb": 16, "step_token_budget": args.step_token_budget,
                   "max_queue": 512},
        "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
        "data": {"categories": ["open_qa"], "max_records": 200},
        "training": {"micro_batch_size": 2, "grad_accum_steps": 2, "max_seq_len": 96, "max_eval_records": 16},
        "api": {"port": port, "admin": True, "admin_without_token": True, "shutdown_grace_s": 2},
        "state_dir": str(state / name),
    }


class Proc:
    def __init__(self, name: str, cmd: list[str], workdir: Path, env: dict | None = None, cpu: int | None = None):
        self.name = name
        self.log = workdir / f"{name}.log"
        pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                     env={**os.environ, **(env or {})}, cwd=str(ROOT), preexec_fn=pin)

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_edges(n: int, workdir: Path, args) -> list[tuple[Proc, str]]:
    out = []
    for i in range(n):
        name, port = f"edge{i + 1}", free_port()
        cfg = workdir / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(edge_config(name, port, workdir / "state", args)))
        cpus = sorted(os.sched_getaffinity(0))
        p = Proc(name, [sys.executable, "-m", "collm.edge_client", "--config", str(cfg)], workdir,
                 {"OMP_NUM_THREADS": str(args.edge_threads)}, cpus[i % len(cpus)] if args.pin else None)
        out.append((p, f"http://127.0.0.1:{port}"))
    for p, url in out:
        wait_http(url + "/health", p.proc, p.log)
    return out


def start_router(policy: str, edges: list[tuple[Proc, str]], workdir: Path, args) -> tuple[Proc, str]:
    port = free_port()
    cfg = {"name": f"router-{policy}", "edges": [{"name": p.name, "url": u} for p, u in edges],
           "api": {"port": port, "shutdown_grace_s": 5},
           "health": {"interval_s": args.poll_s},
           "routing": {"policy": policy, "step_token_budget": args.step_token_budget, "seed": 0}}
    path = workdir / f"router-{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = Proc(f"router-{policy}", [sys.executable, "-m", "collm.router.cli", "--config", str(path)], workdir)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", p.proc, p.log, 60, want=lambda r: r.json()["healthy_edges"] == len(edges))
    return p, url


# =============================================================================== load
def calibrate_words(edge_url: str) -> float:
    """Tokens per ' word' in the edge's tokenizer (prompt sizes are built from it)."""
    r = httpx.post(edge_url + "/v1/completions", json={"prompt": "word " * 200, "max_tokens": 1}, timeout=60)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"] / 200


def build_prompts(trace, tokens_per_word: float) -> list[str]:
    vocab = ("alpha", "river", "stone", "cloud", "amber", "violet", "north", "lumen", "quartz", "meadow")
    out = []
    for i, r in enumerate(trace):
        words = max(1, round(r.prompt_tokens / tokens_per_word))
        out.append(" ".join(vocab[(i + j) % len(vocab)] for j in range(words)))
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, t_sched: float,
                      out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    t_send = time.perf_counter()
    out.update(sent=t_send - t_sched, status=None, edge=None, ttft=None, end=None, tokens=0, complete=False,
               error=None)
    first = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            out["edge"] = r.headers.get("x-collm-edge")
            out["attempts"] = int(r.headers.get("x-collm-router-attempts", "1"))
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                ev = sse.data_of(line)
                if ev is None:
                    continue
                if "error" in ev:
                    out["error"] = ev["error"].get("message")
                    continue
                if first is None and sse.is_first_token(ev):
                    first = time.perf_counter()
                if (n := sse.completion_tokens(ev)) is not None:
                    out["tokens"] = n
                if (reason := sse.finish_reason_of(ev)) is not None:
                    out["complete"] = reason in ("length", "stop")
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        end = time.perf_counter()
        out["end"] = end
        out["start"] = t_send
        if first is not None:
            out["ttft"] = first - t_send
            out["tpot"] = (end - first) / (out["tokens"] - 1) if out["tokens"] > 1 else 0.0


async def replay(trace, prompts: list[str], urls: list[str], timeout_s: float,
                 monitor=None) -> list[dict]:
    """Send request i at its trace time to urls[i] (open loop); `monitor(t0)` runs alongside."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=limits) as client:
        results = [{"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
                   for r in trace]
        t0 = time.perf_counter()
        side = asyncio.create_task(monitor(client, t0)) if monitor else None
        tasks = []
        for r, p, url, out in zip(trace, prompts, urls, results, strict=True):
            delay = t0 + r.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, url, p, r.output_tokens, t0 + r.arrival_s, out)))
        await asyncio.gather(*tasks)
        if side is not None:
            side.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await side
    return results


def summarize(results: list[dict], ttft_s: float, tpot_s: float) -> dict:
    done = [r for r in results if r["status"] == 200 and r["complete"] and r["ttft"] is not None]
    good = [r for r in done if r["ttft"] <= ttft_s and r["tpot"] <= tpot_s]
    t_first = min(r["start"] for r in results)
    t_last = max(r["end"] for r in results)
    span = max(t_last - t_first, 1e-9)
    edges: dict[str, int] = {}
    for r in results:
        if r["edge"]:
            edges[r["edge"]] = edges.get(r["edge"], 0) + 1
    ttfts = [r["ttft"] for r in done]
    tpots = [r["tpot"] for r in done if r["tokens"] > 1]
    return {
        "sent": len(results), "completed": len(done), "good": len(good),
        "failed": sum(1 for r in results if not (r["status"] == 200 and r["complete"])),
        "attainment": len(good) / len(results), "goodput_rps": len(good) / span, "span_s": span,
        "throughput_rps": len(done) / span,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "tpot_p50_s": percentile(tpots, 0.5), "tpot_p99_s": percentile(tpots, 0.99),
        "ttft_miss": sum(1 for r in done if r["ttft"] > ttft_s),
        "tpot_miss": sum(1 for r in done if r["tpot"] > tpot_s),
        "retried": sum(1 for r in results if r.get("attempts", 1) > 1),
        "late_send_p99_s": percentile([r["sent"] for r in results], 0.99),
        "by_edge": dict(sorted(edges.items())),
    }


def training_tokens(edge_url: str) -> float:
    return _training_tokens(httpx.get(edge_url + "/metrics", timeout=5).text)


def _training_tokens(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("collm_training_tokens_total "):
            return float(line.split()[1])
    return 0.0


def start_training(edge_url: str, seconds: float) -> str:
    r = httpx.post(edge_url + "/admin/train", json={"tokens": 10**9, "deadline_s": seconds}, timeout=10)
    r.raise_for_status()
    return r.json()["job"]


def wait_job(edge_url: str, job: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(edge_url + f"/admin/jobs/{job}", timeout=5).json()["status"] != "running":
            return
        time.sleep(0.5)


def router_report(router: Proc, url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {"retries": sum(float(ln.split()[-1]) for ln in text.splitlines()
                           if ln.startswith("collm_router_retries_total{")),
            "log_problems": _problems(router.log.read_text())}


def _problems(log: str) -> list[str]:
    """The log from its first ERROR line on (60 lines: the traceback), and how many ERROR lines there were."""
    lines = log.splitlines()
    errors = [i for i, ln in enumerate(lines) if "ERROR" in ln]
    if not errors:
        return []
    return [f"{len(errors)} ERROR lines; the first:", *lines[errors[0]:errors[0] + 60]]


def report_line(label: str, s: dict) -> None:
    say(f"[{label}] attainment {s['attainment']:.3f}, goodput {s['goodput_rps']:.2f} rps, TTFT p50/p99 "
        f"{1000 * (s['ttft_p50_s'] or 0):.0f}/{1000 * (s['ttft_p99_s'] or 0):.0f} ms, by edge {s['by_edge']}, "
        f"failed {s['failed']}, training {s['train_tokens_per_s']:.0f} tok/s")


def run_phase(policy: str, edges, train_idx: int, trace, prompts, workdir: Path, args) -> dict:
    """Sequential mode: one policy replays the window alone (fresh router, training restarted)."""
    router, url = start_router(policy, edges, workdir, args)
    train_url = edges[train_idx][1] if train_idx >= 0 else None
    span = trace[-1].arrival_s if trace else 0.0
    try:
        job = start_training(train_url, span + args.settle_s + 2) if train_url else None
        time.sleep(args.settle_s)  # training is under way; the router has fresh metrics
        tok0, t0 = (training_tokens(train_url) if train_url else 0.0), time.perf_counter()
        say(f"[{policy}] replaying {len(trace)} requests over {span:.0f} s")
        results = asyncio.run(replay(trace, prompts, [url] * len(trace), args.request_timeout_s))
        train_tps = ((training_tokens(train_url) - tok0) / (time.perf_counter() - t0)) if train_url else 0.0
        rep = router_report(router, url)
        if job is not None:  # the job ends at its deadline, before the next phase
            wait_job(train_url, job, args.settle_s + 60)
    finally:
        router.stop()
    s = summarize(results, args.ttft_ms / 1000, args.tpot_ms / 1000)
    s["train_tokens_per_s"] = train_tps
    s["router_retries"] = rep["retries"]
    errors = [r["error"] for r in results if r["error"]][:5]
    report_line(policy, s)
    return {"policy": policy, "summary": s, "errors": errors, "router_log_problems": rep["log_problems"],
            "requests": results}


def run_interleaved(policies: list[str], edges, train_idx: int, trace, prompts, workdir: Path, args) -> dict:
    """Interleaved mode: every policy's router runs at once; each --slot-s slot of the replay goes to one.

    The slots' owners are a seeded random permutation of the policies in every block of len(policies)
    slots, so each policy gets the same share of the trace and of whatever else the machine runs.
    """
    span = trace[-1].arrival_s if trace else 0.0
    n_slots = int(span // args.slot_s) + 1
    rng = random.Random(args.seed)
    owner: list[str] = []
    while len(owner) < n_slots:
        block = list(policies)
        rng.shuffle(block)
        owner += block
    owner = owner[:n_slots]
    routers = {p: start_router(p, edges, workdir, args) for p in policies}
    train_url = edges[train_idx][1] if train_idx >= 0 else None
    slot_tokens = [0.0] * n_slots

    async def monitor(client: httpx.AsyncClient, t0: float) -> None:  # training tokens per slot
        async def read() -> float | None:
            try:
                return _training_tokens((await client.get(train_url + "/metrics", timeout=1.0)).text)
            except httpx.HTTPError:  # an overloaded edge: credit these tokens to a later slot
                return None

        last = await read() or 0.0
        for j in range(n_slots):
            await asyncio.sleep(max(0.0, t0 + (j + 1) * args.slot_s - time.perf_counter()))
            now = await read()
            if now is not None:
                slot_tokens[j], last = now - last, now

    try:
        job = start_training(train_url, span + args.settle_s + 10) if train_url else None
        time.sleep(args.settle_s)
        urls = [routers[owner[int(r.arrival_s // args.slot_s)]][1] for r in trace]
        say(f"[interleaved] replaying {len(trace)} requests over {span:.0f} s in {n_slots} slots of "
            f"{args.slot_s:g} s: {', '.join(f'{p} {owner.count(p)}' for p in policies)}")
        results = asyncio.run(replay(trace, prompts, urls, args.request_timeout_s, monitor if train_url else None))
        reports = {p: router_report(*routers[p]) for p in policies}
        if job is not None:
            wait_job(train_url, job, 60)
    finally:
        for proc, _ in routers.values():
            proc.stop()
    phases = []
    for p in policies:
        mine = [r for r, t in zip(results, trace, strict=True) if owner[int(t.arrival_s // args.slot_s)] == p]
        s = summarize(mine, args.ttft_ms / 1000, args.tpot_ms / 1000)
        slots = [j for j in range(n_slots) if owner[j] == p]
        s["goodput_rps"] = s["good"] / (len(slots) * args.slot_s)  # per second of this policy's slots
        s["train_tokens_per_s"] = sum(slot_tokens[j] for j in slots) / (len(slots) * args.slot_s)
        s["router_retries"] = reports[p]["retries"]
        report_line(p, s)
        phases.append({"policy": p, "round": 0, "summary": s, "errors": [r["error"] for r in mine if r["error"]][:5],
                       "router_log_problems": reports[p]["log_problems"], "slots": slots, "requests": mine})
    return {"slot_owner": owner, "slot_train_tokens": slot_tokens, "phases": phases}


# =============================================================================== main
def machine_info() -> dict:
    info = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a quarter of the trace")
    ap.add_argument("--mode", choices=["interleaved", "sequential"], default="interleaved")
    ap.add_argument("--duration", type=float, help="seconds of (sped-up) trace per policy (interleaved: default "
                                                   "60, quick 15) or per phase (sequential: default 10)")
    ap.add_argument("--slot-s", type=float, default=2.0, help="interleaved: seconds per slot")
    ap.add_argument("--rounds", type=int, help="sequential: rounds, each a new trace window replayed once per "
                                               "policy, the order rotated (default 6, quick 1)")
    ap.add_argument("--seed", type=int, default=0, help="interleaved: seed of the slot order")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--speed", type=float, default=3.0, help="trace arrivals sped up this much")
    ap.add_argument("--start-s", type=float, default=600.0, help="trace window start (s into the trace)")
    ap.add_argument("--token-scale", type=float, default=0.1)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=192)
    ap.add_argument("--min-output", type=int, default=4)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--ttft-ms", type=float, default=250.0, help="TTFT SLO (the edges' default target)")
    ap.add_argument("--tpot-ms", type=float, default=25.0, help="TPOT SLO (the edges' default target)")
    ap.add_argument("--edges", type=int, default=3)
    ap.add_argument("--train-edge", type=int, default=0, help="index of the edge that trains (-1: none)")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--step-token-budget", type=int, default=128)
    ap.add_argument("--edge-threads", type=int, default=1, help="OMP_NUM_THREADS of each edge")
    ap.add_argument("--pin", action="store_true", help="pin edge i to CPU i mod #CPUs (independent replicas "
                                                        "need as many CPUs as edges)")
    ap.add_argument("--poll-s", type=float, default=0.5, help="router health/metrics poll interval")
    ap.add_argument("--settle-s", type=float, default=2.0, help="wait after starting training, before the load")
    ap.add_argument("--request-timeout-s", type=float, default=60.0)
    ap.add_argument("--out", default="runs/bench_router.json")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: unknown policy {p!r}; expected {', '.join(POLICIES)}")
    interleaved = args.mode == "interleaved"
    if interleaved:
        duration = args.duration or (15.0 if args.quick else 60.0)
        args.rounds = 1
        window = duration * len(policies)  # one window, shared out slot by slot
    else:
        duration = args.duration or 10.0
        args.rounds = args.rounds or (1 if args.quick else 6)
        window = duration

    from collm.common.traces import TraceScaling, load_trace

    def scaling_of(rnd: int) -> TraceScaling:  # round r replays the r-th window of the trace
        return TraceScaling(speed=args.speed, token_scale=args.token_scale, min_prompt_tokens=args.min_prompt,
                            max_prompt_tokens=args.max_prompt, min_output_tokens=args.min_output,
                            max_output_tokens=args.max_output, start_s=args.start_s + rnd * window * args.speed,
                            duration_s=window * args.speed)

    traces = [load_trace(None, scaling_of(r)) for r in range(args.rounds)]
    all_reqs = [r for t in traces for r in t]
    rate = len(all_reqs) / (window * args.rounds)
    info = machine_info()
    how = (f"interleaved in {args.slot_s:g} s slots, {duration:.0f} s of trace per policy" if interleaved else
           f"sequential, {args.rounds} rounds x {duration:.0f} s per policy, order rotated")
    say(f"bench_router: {how}; {len(all_reqs)} requests, {rate:.2f} req/s, policies {policies}; SLO TTFT "
        f"{args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms; {info.get('cpu', '?')} x {info['cpus']}, load average "
        f"{info['loadavg_at_start']}")
    out_path = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = {"machine": info, "args": vars(args),
               "trace": {"scaling": [scaling_of(r).describe() for r in range(args.rounds)],
                         "requests": len(all_reqs), "mean_rate_rps": rate,
                         "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in all_reqs),
                         "output_tokens_mean": statistics.mean(r.output_tokens for r in all_reqs)},
               "goodput_definition": "requests that completed with TTFT <= ttft_ms and TPOT <= tpot_ms, per second: "
                                     "interleaved, of the policy's slots; sequential, from a phase's first send to "
                                     "its last completion (mean over phases)",
               "attainment_definition": "requests that completed and met both SLOs / requests sent",
               "phases": []}

    with tempfile.TemporaryDirectory(prefix="bench_router_") as tmp:
        workdir = Path(tmp)
        say(f"starting {args.edges} tiny edges (OMP_NUM_THREADS={args.edge_threads}) in {workdir}")
        edges = start_edges(args.edges, workdir, args)
        try:
            tpw = calibrate_words(edges[0][1])
            say(f"edges ready: {', '.join(u for _, u in edges)}; {tpw:.2f} tokens per prompt word")
            if interleaved:
                run = run_interleaved(policies, edges, args.train_edge, traces[0], build_prompts(traces[0], tpw),
                                      workdir, args)
                results["phases"] = run.pop("phases")
                results["interleaving"] = run
            for rnd, trace in enumerate(traces if not interleaved else []):
                prompts = build_prompts(trace, tpw)
                order = policies[rnd % len(policies):] + policies[: rnd % len(policies)]
                for policy in order:
                    ph = run_phase(policy, edges, args.train_edge, trace, prompts, workdir, args)
                    ph["round"] = rnd
                    results["phases"].append(ph)
                    out_path.write_text(json.dumps(results, indent=1, default=str))
        finally:
            for p, _ in edges:
                p.stop()

    results["loadavg_at_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - T0
    rows, agg = [], {}
    for p in policies:
        phases = [ph["summary"] for ph in results["phases"] if ph["policy"] == p]
        reqs = [r for ph in results["phases"] if ph["policy"] == p for r in ph["requests"]]
        s = summarize(reqs, args.ttft_ms / 1000, args.tpot_ms / 1000)
        s["goodput_rps"] = statistics.mean(x["goodput_rps"] for x in phases)
        s["train_tokens_per_s"] = statistics.mean(x["train_tokens_per_s"] for x in phases)
        agg[p] = s
        share = s["by_edge"].get(f"edge{args.train_edge + 1}", 0) / max(1, s["sent"]) if args.train_edge >= 0 else None
        rows.append([p, s["sent"], f"{s['goodput_rps']:.2f}", f"{s['attainment']:.3f}",
                     f"{1000 * s['ttft_p50_s']:.0f}" if s["ttft_p50_s"] is not None else "-",
                     f"{1000 * s['ttft_p99_s']:.0f}" if s["ttft_p99_s"] is not None else "-",
                     f"{1000 * s['tpot_p50_s']:.1f}" if s["tpot_p50_s"] is not None else "-",
                     f"{1000 * s['tpot_p99_s']:.1f}" if s["tpot_p99_s"] is not None else "-",
                     f"{s['ttft_miss']}/{s['tpot_miss']}", s["failed"],
                     "-" if share is None else f"{share:.2f}", f"{s['train_tokens_per_s']:.0f}"])
    results["summary"] = agg
    out_path.write_text(json.dumps(results, indent=1, default=str))
    print(f"\n== collm-router policies: {args.edges} tiny edges{' (pinned)' if args.pin else ''}, "
          f"edge{args.train_edge + 1} training; Azure conv trace x{args.speed:g} speed, tokens x{args.token_scale:g} "
          f"(prompt {args.min_prompt}-{args.max_prompt}, output {args.min_output}-{args.max_output}), {rate:.1f} req/s "
          f"open loop, {how}; SLO TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms")
    print(table(["policy", "sent", "goodput rps", "SLO attain", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                 "TPOT p99 ms", "miss TTFT/TPOT", "failed", "share to training edge", "train tok/s"], rows))
    print(f"load average at start {info['loadavg_at_start']}, at end {results['loadavg_at_end']}; "
          f"results in {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
