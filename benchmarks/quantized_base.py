"""A 4-bit (nf4) or 8-bit (int8) base on an edge, measured against the float base (issue #35).

One SmolLM2-135M-Instruct edge per precision (configs/edge-smollm2.yaml, edge1's Dolly categories), each
in a child process of its own so its memory is its own: resident memory after loading and at its peak,
decode tokens/s (greedy, one request at a time), LoRA training tokens/s (QLoRA on the quantized base),
and the holdout loss of the base and of the adapter it trained (the same seed, tokens and records for
every precision). A last child, on the float base, evaluates each adapter trained on a quantized base:
what a float edge would serve after aggregating it (the adapter is the same PEFT form either way).

    python benchmarks/quantized_base.py --tokens 3000 --decode 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapter_quality import edge_cfg  # noqa: E402  (the same edges as the quality tables)

PRECISIONS = ("none", "nf4", "int8")


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def child(precision: str, args, adapters: list[str]) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from collm.edge_client.engine import Engine
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.model.sampling import SamplingParams
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.training.jobs import TrainBudget

    torch.manual_seed(0)
    cfg = edge_cfg(1, args.eval_records)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"quantization": precision})})
    t0 = time.time()
    eng = Engine(load_model(cfg.model), cfg, load_edge_data(cfg.data)).start()
    out = {"precision": precision, "load_s": round(time.time() - t0, 1)}
    out["rss_loaded_mib"], _ = rss_mib()
    try:
        if adapters:  # the float base evaluating adapters trained elsewhere
            out["foreign"] = {p: eng.evaluate(state=load_file(p)).result().loss for p in adapters}
            return out
        out["base_loss"] = eng.evaluate(state=eng.initial_state).result().loss
        ids = eng.tokenizer("Give me three tips for a good night's sleep.")["input_ids"]
        rates = []
        for _ in range(3):
            ev = eng.generate(ids, SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True))
            rec = ev.record
            rates.append((len(ev.token_ids) - 1) / max(rec.e2e_s - (rec.ttft_s or 0), 1e-9))
        out["decode_tok_s"] = statistics.median(rates)
        rep = eng.train(TrainBudget(tokens=args.tokens)).result()
        out["train_tok_s"] = rep.tokens / max(rep.seconds, 1e-9)
        out["trained_loss"] = eng.evaluate(state=rep.adapter_state).result().loss
        path = Path(args.workdir) / f"adapter-{precision}.safetensors"
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in rep.adapter_state.items()}, str(path))
        out["adapter"] = str(path)
    finally:
        eng.stop()
        out["rss_peak_mib"] = rss_mib()[1]
    return out


def run_child(precision: str, args, adapters: list[str] = ()) -> dict:
    cmd = [sys.executable, __file__, "--child", precision, "--tokens", str(args.tokens), "--decode", str(args.decode),
           "--eval-records", str(args.eval_records), "--workdir", args.workdir, *[f"--adapter={a}" for a in adapters]]
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        return {"precision": precision, "error": (p.stderr or p.stdout)[-800:]}
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3000, help="training tokens per precision")
    ap.add_argument("--decode", type=int, default=64, help="tokens per decode measurement (3 repeats, median)")
    ap.add_argument("--eval-records", type=int, default=16)
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--out", default="runs/quantized_base.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--adapter", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args, args.adapter)), flush=True)
        return
    args.workdir = tempfile.mkdtemp(prefix="quantized-base-")
    t0 = time.time()
    rows = []
    for p in [x.strip() for x in args.precisions.split(",") if x.strip()]:
        print(f"{p}: ...", flush=True)
        rows.append(run_child(p, args))
        print(f"  {rows[-1]}", flush=True)
    quantized = [r["adapter"] for r in rows if r.get("adapter") and r["precision"] != "none"]
    foreign = run_child("none", args, quantized).get("foreign", {}) if quantized else {}
    print(f"\nSmolLM2-135M-Instruct, one edge per precision, {args.tokens} training tokens (same seed and records)\n")
    print("| base | RSS loaded / peak (MiB) | decode tok/s | training tok/s | holdout loss: base -> trained "
          "| its adapter on a float base |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['precision']} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} | | | | |")
            continue
        on_float = foreign.get(r.get("adapter"), r["trained_loss"] if r["precision"] == "none" else None)
        print(f"| {r['precision']} | {r['rss_loaded_mib']:.0f} / {r['rss_peak_mib']:.0f} | {r['decode_tok_s']:.1f} | "
              f"{r['train_tok_s']:.0f} | {r['base_loss']:.4f} -> {r['trained_loss']:.4f} | "
              + (f"{on_float:.4f}" if on_float is not None else "-") + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "on_float_base": foreign,
                               "wall_s": time.time() - t0}, indent=1))
    print(f"\nwrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
