"""An edge profile: the measured costs one simulated edge runs on (`collm-edge --profile` writes one).

The simulator's world is the profile: a serving step of d decoding sequences, p prefill tokens
and k attended KV tokens takes  (c0 + c1 d + c2 p + c3 k/1000) * noise + overhead  seconds, the
coefficients fitted by the edge's own `LinearCostModel` on a grid of real steps, `noise` a
lognormal factor with the spread the fit left on those steps, `overhead` what the engine loop
spends around the forward it times. A training or evaluation micro-batch takes its measured
median and is split into its measured number of resumable units. `speed` divides every time:
a profile at speed 4.0 stands for a device four times as fast. A request's prompt is the trace's
message plus the model's chat template (`model.chat_template_tokens`), which the edge prefills too.

Shipped profiles live in `collm/sim/profiles/` and are named by file stem (`smollm2-cpu1`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from collm.common.errors import UserError
from collm.common.step_cost import step_seconds
from collm.router.requests import ROLE_MARKER_TOKENS  # a profile without model.chat_template_tokens: the router's guess

PROFILE_DIR = Path(__file__).parent / "profiles"
SCHEMA = "collm-profile/1"
# What a quantized base (`model.quantization`) costs against a float one: (serving step, background
# unit) time factors, from the decode and training tokens/s `benchmarks/quantized_base.py` measured on
# SmolLM2-135M, one CPU thread (2026-12-04, docs/federation.md: 26.5 / 23.6 / 21.2 decode, 98 / 96 / 110
# training tokens/s for float / nf4 / int8).
PRECISION_COST = {"none": (1.0, 1.0), "nf4": (26.52 / 23.57, 98.42 / 95.69), "int8": (26.52 / 21.18, 98.42 / 109.56)}


@dataclass(frozen=True)
class EdgeProfile:
    name: str
    coef: tuple[float, float, float, float]  # serving step c0..c3, seconds (already divided by speed)
    overhead_s: float                         # loop overhead per step
    noise_sigma: float                        # lognormal sigma of a step's time around the fit
    max_running: int
    step_token_budget: int
    max_context: int
    max_queue: int
    train_tokens: int                         # input tokens of one training micro-batch
    train_s: float                            # seconds of one training micro-batch
    train_units: int                          # its resumable units (layer forward/backward, head)
    eval_tokens: int
    eval_s: float
    eval_units: int
    eval_batch: int                           # records per evaluation micro-batch
    speed: float = 1.0
    source: str = ""
    decode_fix: tuple[float, ...] = ()       # measured - fitted, decode-only steps, by batch size 0..max
    overhead_per_seq_s: float = 0.0          # loop overhead per running sequence beyond the first
    upload_s: float = 0.0                    # sending one update to the server (its device class's uplink)
    template_tokens: int = ROLE_MARKER_TOKENS  # the chat template's tokens around a message (model.chat_template_tokens)

    def step_s(self, decode: int, prefill: int, attended: int) -> float:
        """Noise-free seconds of one serving step (the cost model's features); a decode-only step also
        gets its batch size's measured residual (the linear fit misses e.g. batch 1 being cheaper)."""
        t = step_seconds(self.coef, decode, prefill, attended) + self.overhead_s
        t += self.overhead_per_seq_s * max(decode - 1, 0)
        if not prefill and self.decode_fix:
            t += self.decode_fix[min(decode, len(self.decode_fix) - 1)]
        return max(t, 1e-6)

    def belief(self) -> tuple[float, float, float, float]:
        """What the edge's own cost model exports (collm_step_cost_seconds): its fit of the forward and
        sampling it times (not the loop's overhead, not the residuals)."""
        return self.coef

    @property
    def idle_train_tokens_per_s(self) -> float:
        return self.train_tokens / self.train_s

    def scaled(self, speed: float) -> EdgeProfile:
        """The same device `speed` times faster (times divided; limits unchanged)."""
        if speed <= 0:
            raise UserError(f"speed: expected a positive number, got {speed}")
        k = 1.0 / speed
        return EdgeProfile(f"{self.name}x{speed:g}", tuple(c * k for c in self.coef), self.overhead_s * k,
                           self.noise_sigma, self.max_running, self.step_token_budget, self.max_context,
                           self.max_queue, self.train_tokens, self.train_s * k, self.train_units, self.eval_tokens,
                           self.eval_s * k, self.eval_units, self.eval_batch, self.speed * speed, self.source,
                           tuple(x * k for x in self.decode_fix), self.overhead_per_seq_s * k, self.upload_s,
                           self.template_tokens)

    def for_device(self, precision: str = "none", upload_s: float = 0.0) -> EdgeProfile:
        """The same device with its base at `precision` (PRECISION_COST: steps and background units
        slow down by the measured factors) and `upload_s` to send an update."""
        if precision not in PRECISION_COST:
            raise UserError(f"precision: expected one of {', '.join(PRECISION_COST)}, got {precision!r}")
        step, unit = PRECISION_COST[precision]
        return replace(self, name=self.name if precision == "none" else f"{self.name}-{precision}",
                       coef=tuple(c * step for c in self.coef), overhead_s=self.overhead_s * step,
                       decode_fix=tuple(x * step for x in self.decode_fix),
                       overhead_per_seq_s=self.overhead_per_seq_s * step, train_s=self.train_s * unit,
                       eval_s=self.eval_s * unit, upload_s=upload_s)


def noise_sigma(samples: list[list[float]], coef: list[float]) -> float:
    """Spread of log(measured / fitted) over the profile's step samples (at most 0.5)."""
    logs = []
    for d, p, kv, s in samples:
        pred = step_seconds(coef, d, p, kv)
        if pred > 0 and s > 0:
            logs.append(math.log(s / pred))
    if len(logs) < 2:
        return 0.0
    mu = sum(logs) / len(logs)
    return min(0.5, math.sqrt(sum((x - mu) ** 2 for x in logs) / (len(logs) - 1)))


def decode_residuals(samples: list[list[float]], coef, max_running: int) -> tuple[float, ...]:
    """Median (measured - fitted) of the decode-only samples at each batch size 0..max_running,
    linearly interpolated between measured sizes (held flat beyond them)."""
    import statistics

    by_d: dict[int, list[float]] = {}
    for d, p, kv, s in samples:
        if p == 0 and d > 0:
            by_d.setdefault(int(d), []).append(s - step_seconds(coef, d, p, kv))
    if not by_d:
        return ()
    xs = sorted(by_d)
    ys = [statistics.median(by_d[x]) for x in xs]
    out = []
    for d in range(max_running + 1):
        if d <= xs[0]:
            out.append(ys[0] if d else 0.0)
        elif d >= xs[-1]:
            out.append(ys[-1])
        else:
            j = next(i for i, x in enumerate(xs) if x >= d)
            x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
            out.append(y0 + (y1 - y0) * (d - x0) / (x1 - x0))
    return tuple(out)


def loop_overhead(step: dict) -> tuple[float, float]:
    """(overhead per step at batch 1, extra per further sequence) from the profile's loop runs."""
    runs = sorted(step.get("overhead_runs", []), key=lambda r: r["batch"])
    if not runs:
        return float(step.get("overhead_s", 0.0)), 0.0
    first, last = runs[0], runs[-1]
    per_seq = 0.0
    if last["batch"] > first["batch"]:
        per_seq = max(0.0, (last["per_step_s"] - first["per_step_s"]) / (last["batch"] - first["batch"]))
    return float(first["per_step_s"]), per_seq


def from_dict(d: dict, name: str = "profile", source: str = "") -> EdgeProfile:
    """An EdgeProfile from a profile's JSON (`collm-edge --profile`), with its own `speed` applied."""
    if d.get("schema") != SCHEMA:
        raise UserError(f"profile {source or name}: expected schema {SCHEMA!r}, got {d.get('schema')!r} "
                        "(write one with `collm-edge --config edge.yaml --profile out.json`)")
    try:
        step, eng, tr, ev = d["step"], d["engine"], d["train_microbatch"], d["eval_microbatch"]
        if tr is None or ev is None:
            raise UserError(f"profile {source or name}: it has no training or evaluation micro-batch (the edge "
                            "that measured it had no data: give its config data.categories)")
        o1, per_seq = loop_overhead(step)
        p = EdgeProfile(name, tuple(float(c) for c in step["coef"]), o1,
                        float(step.get("noise_sigma", noise_sigma(step.get("samples", []), step["coef"]))),
                        int(eng["max_running"]), int(eng["step_token_budget"]), int(eng["max_context"]),
                        int(eng.get("max_queue", 256)), int(tr["tokens"]), float(tr["seconds"]), int(tr["units"]),
                        int(ev["tokens"]), float(ev["seconds"]), int(ev["units"]), int(ev["batch_size"]),
                        1.0, source, decode_residuals(step.get("samples", []), step["coef"], int(eng["max_running"])),
                        per_seq, template_tokens=max(0, int(d.get("model", {}).get("chat_template_tokens",
                                                                                    ROLE_MARKER_TOKENS))))
    except KeyError as e:
        raise UserError(f"profile {source or name}: missing field {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"profile {source or name}: a field is not the number or object it should be ({e}); "
                        "write it again with `collm-edge --profile`") from None
    speed = float(d.get("speed", 1.0))
    return p if speed == 1.0 else p.scaled(speed)


def shipped() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(ref: str, speed: float = 1.0) -> EdgeProfile:
    """A shipped profile by name (`smollm2-cpu1`) or a path to a profile JSON; `speed` scales it."""
    path = Path(ref)
    if not path.suffix and (PROFILE_DIR / f"{ref}.json").is_file():
        path = PROFILE_DIR / f"{ref}.json"
    if not path.is_file():
        raise UserError(f"profile {ref!r}: no such file, and not a shipped profile ({', '.join(shipped())})")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"profile {path}: not JSON ({e})") from None
    p = from_dict(d, path.stem, str(path))
    return p if speed == 1.0 else p.scaled(speed)
