"""Highest request rate one collm-edge sustains with >= 95% of requests meeting the SLO.

For each model (tiny, bundled SmolLM2) and each mode (serving alone; serving with local training
co-scheduled in the SLO slack), a fresh `collm-edge` process is started and driven over real HTTP
by open-loop Poisson load (collm.lab.loadgen). The rate grows by `--growth` until attainment
falls below the target, then a few bisection steps narrow it down. Client-side TTFT/TPOT decide
the SLO. All four searches run in the same invocation, so the ratios compare like with like.

    python benchmarks/bench_api.py                 # both models (SmolLM2 takes ~15 min on 2 cores)
    python benchmarks/bench_api.py --models tiny   # ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from collm.common.data import load_records
from collm.lab.loadgen import poisson_schedule, replay, summarize
from collm.lab.topology import free_port

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    # model: (edge config, first rate, seconds per probe, max_tokens)
    "tiny": ("configs/edge-tiny.yaml", 4.0, 15.0, 32),
    "bundled": ("configs/edge-smollm2.yaml", 0.3, 40.0, 24),
}


class Edge:
    def __init__(self, base_config: str, workdir: Path, name: str):
        cfg = yaml.safe_load((ROOT / base_config).read_text())
        self.port = free_port()
        cfg.update({"name": name, "state_dir": str(workdir / name)})
        cfg["api"] = {**cfg.get("api", {}), "host": "127.0.0.1", "port": self.port, "admin": True,
                     "admin_without_token": True}
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "collm.edge_client", "--config", str(path)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            assert self.proc.poll() is None, f"edge exited; see {workdir / name}.log"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def train_forever(self) -> None:
        r = httpx.post(self.url + "/admin/train", json={"tokens": 10**9, "deadline_s": 10**6})
        r.raise_for_status()

    def train_tokens_per_s(self) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("collm_training_tokens_per_second "):
                return float(line.split()[1])
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def probe(edge: Edge, rate: float, seconds: float, max_tokens: int, prompts: list[str], slo: dict) -> dict:
    def body(i: int) -> dict:
        return {"model": edge.model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    plan = poisson_schedule(rate, seconds, body, seed=int(rate * 1000), ttft_slo_s=slo["ttft_ms"] / 1000,
                            tpot_slo_s=slo["tpot_ms"] / 1000)
    outcomes = replay(plan, edge.url)
    s = summarize(outcomes, seconds)
    s["rate"] = rate
    s["train_tokens_per_s"] = edge.train_tokens_per_s()
    return s


def max_rate(edge: Edge, first: float, seconds: float, max_tokens: int, prompts: list[str], slo: dict,
             target: float, growth: float, bisect: int) -> tuple[float, list[dict]]:
    probes, good, bad, rate = [], 0.0, None, first
    while bad is None:
        p = probe(edge, rate, seconds, max_tokens, prompts, slo)
        probes.append(p)
        print(f"    {rate:7.3f} req/s: attainment {p['slo_attainment']:.3f}, ttft p90 {p['ttft_p90']}, "
              f"tpot p90 {p['tpot_p90']}, train {p['train_tokens_per_s']:.0f} tok/s", flush=True)
        if p["slo_attainment"] >= target:
            good, rate = rate, rate * growth
        else:
            bad = rate
        if rate > first * growth ** 12:
            break
    for _ in range(bisect if bad else 0):
        mid = (good + bad) / 2 if good else bad / growth
        p = probe(edge, mid, seconds, max_tokens, prompts, slo)
        probes.append(p)
        print(f"    {mid:7.3f} req/s: attainment {p['slo_attainment']:.3f}", flush=True)
        if p["slo_attainment"] >= target:
            good = mid
        else:
            bad = mid
    return good, probes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=["tiny", "bundled"])
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--growth", type=float, default=1.6)
    ap.add_argument("--bisect", type=int, default=2)
    ap.add_argument("--seconds", type=float, help="seconds per probe (default per model)")
    ap.add_argument("--out", default="runs/bench_api.json")
    ap.add_argument("--workdir", default="runs/bench_api")
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prompts = [r.instruction for r in load_records()[:400] if len(r.instruction) < 200]
    results = {}
    for model in args.models:
        config, first, seconds, max_tokens = PRESETS[model]
        seconds = args.seconds or seconds
        for mode in ("serve-only", "co-train"):
            print(f"[{model} / {mode}] starting edge", flush=True)
            edge = Edge(config, workdir, f"{model}-{mode}")
            try:
                slo = edge.cfg["slo"]
                if mode == "co-train":
                    edge.train_forever()
                rate, probes = max_rate(edge, first, seconds, max_tokens, prompts, slo, args.target,
                                        args.growth, args.bisect)
            finally:
                edge.stop()
            results[f"{model}/{mode}"] = {"max_rate": rate, "slo": slo, "probes": probes,
                                          "max_tokens": max_tokens, "seconds_per_probe": seconds}
            print(f"[{model} / {mode}] highest rate with >= {args.target:.0%} SLO attainment: {rate:.3f} req/s",
                  flush=True)
    print("\nmodel      serve-only   co-train   ratio   co-train tokens/s at that rate")
    for model in args.models:
        a, b = results[f"{model}/serve-only"], results[f"{model}/co-train"]
        at = [p for p in b["probes"] if p["rate"] == b["max_rate"]]
        tps = at[0]["train_tokens_per_s"] if at else 0.0
        ratio = b["max_rate"] / a["max_rate"] if a["max_rate"] else float("nan")
        print(f"{model:9s} {a['max_rate']:10.3f} {b['max_rate']:10.3f} {ratio:7.2f}   {tps:.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
