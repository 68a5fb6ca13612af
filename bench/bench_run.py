"""A whole run, cold start to the last update: `experiment=nanogpt_char_cpu` against a plain PyTorch loop.

    python bench/bench_run.py [--text FILE | --bytes 1100000] [--max-steps N] [--threads 2] [--keep DIR]

The PyTorch side is nanoGPT's train.py reduced to its CPU path: bench_step's torch GPT (bias and GELU as the
experiment says), AdamW with weight decay on the 2-D weights only, nanoGPT's get_lr, clip, batches at random
offsets, estimate_loss (eval_iters random batches of each split, at update 0, every eval_every and at the end)
and a torch.save checkpoint when the val loss improves. Its hyperparameters are read from the experiment as
composed (`python -m pipeline ... --cfg job`). Each contestant runs in its own process; reported: wall time, peak
RSS (wait4), bytes written (/proc/self/io at exit), the final val loss (each side's own estimate, and both final
models scored alike over every non-overlapping window of the validation split) and the time split, the
pipeline's from `debug=profile`. Without --text a pseudo-English text is generated (the bench ships none).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILE_ROWS = ("data", "forward/backward", "optimizer", "evaluation", "checkpoint", "tracking hand-over",
                "end summary", "other", "wall")  # fmt: skip


def child(kind: str, io_out: str, argv: list[str]) -> None:
    """Run a contestant in this process; its /proc/self/io is written to io_out at exit."""
    import atexit

    def dump_io() -> None:
        with contextlib.suppress(OSError):
            Path(io_out).write_text(Path("/proc/self/io").read_text())

    atexit.register(dump_io)
    if kind == "pipeline":
        import runpy

        sys.argv = ["pipeline", *argv]
        runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
    else:
        torch_loop(json.loads(argv[0]))


def generate_text(n: int, seed: int = 0) -> str:
    """~n characters of pseudo-English: words drawn with Zipf-like weights, lines of 4-14 words."""
    import random

    r = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = [
        "".join(r.choices(letters, weights=range(26, 0, -1), k=r.randint(1, 9)))
        for _ in range(2000)
    ]
    weights = [1 / (k + 1) for k in range(len(words))]
    out, size = [], 0
    while size < n:
        line = " ".join(r.choices(words, weights, k=r.randint(4, 14))).capitalize() + r.choice(
            ".,;?!"
        )
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)[:n]


def read_text(path: str):
    import numpy as np

    text = Path(path).read_text(encoding="utf-8")
    chars = sorted(set(text))
    lut = {c: i for i, c in enumerate(chars)}
    return chars, np.array([lut[c] for c in text], dtype=np.int64)


def scored(model, val, T: int) -> float:
    """Mean cross-entropy over every non-overlapping window of the validation split (the same for both)."""
    import torch

    n = (len(val) - 1) // T
    x = torch.from_numpy(val[: n * T].reshape(n, T))
    y = torch.from_numpy(val[1 : n * T + 1].reshape(n, T))
    total = 0.0
    with torch.no_grad():
        for s in range(0, n, 64):
            logits = model(x[s : s + 64])
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y[s : s + 64].reshape(-1), reduction="sum"
            ).item()
    return total / (n * T)


def torch_loop(a: dict) -> None:
    import math

    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from bench_step import build_torch

    from pipeline.data.base import DataSpec
    from pipeline.model.minigpt import MiniGPT

    torch.set_num_threads(a["threads"])
    torch.manual_seed(a["seed"])
    t_start = time.perf_counter()
    split = {
        "data": 0.0,
        "forward/backward": 0.0,
        "optimizer": 0.0,
        "evaluation": 0.0,
        "checkpoint": 0.0,
    }
    _, data = read_text(a["text"])
    n = int(len(data) * (1 - a["val_fraction"]))
    parts = {"train": data[:n], "val": data[n:]}
    T, B, m = a["block_size"], a["batch_size"], a["model"]
    spec = DataSpec(vocab_size=a["vocab"], block_size=T)
    init = MiniGPT(spec, m["n_layer"], m["n_head"], m["n_embd"], T, 0.0, None, 0.02, m["bias"], m["gelu"],
                   "float32", np.random.default_rng(a["seed"]))  # fmt: skip
    o = a["optimizer"]
    model, opt = build_torch(
        init, "sdpa", o["lr"], tuple(o["betas"]), o["weight_decay"], o["weight_decay_on"]
    )
    del init

    def batch(name):
        d = parts[name]
        ix = torch.randint(len(d) - T, (B,)).tolist()
        x = torch.from_numpy(np.stack([d[i : i + T] for i in ix]))
        y = torch.from_numpy(np.stack([d[i + 1 : i + 1 + T] for i in ix]))
        return x, y

    def loss_of(x, y):
        logits = model(x)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )

    s = a["scheduler"]
    steps, warmup, lr = a["max_steps"], s["warmup_steps"], o["lr"]

    def lr_at(it: int) -> float:  # nanoGPT's get_lr (warmup_offset 1) or HF's (0)
        if it < warmup:
            return lr * (it + s["warmup_offset"]) / max(1, warmup + s["warmup_offset"])
        ratio = (it - warmup) / max(1, steps - warmup)
        return lr * (
            s["min_lr_ratio"] + (1 - s["min_lr_ratio"]) * 0.5 * (1.0 + math.cos(math.pi * ratio))
        )

    best, evals = float("inf"), []
    for it in range(steps + 1):
        if it % a["eval_every"] == 0 or it == steps:
            t0 = time.perf_counter()
            model.eval()
            with torch.no_grad():
                est = {k: float(np.mean([loss_of(*batch(k)).item() for _ in range(a["eval_batches"])]))
                       for k in ("train", "val")}  # fmt: skip
            model.train()
            evals.append((it, est["val"]))
            split["evaluation"] += time.perf_counter() - t0
            if est["val"] < best and it > 0:
                t0 = time.perf_counter()
                best = est["val"]
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": it},
                           Path(a["out"]) / "ckpt.pt")  # fmt: skip
                split["checkpoint"] += time.perf_counter() - t0
        if it == steps:
            break
        t0 = time.perf_counter()
        x, y = batch("train")
        t1 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a["grad_clip"])
        t2 = time.perf_counter()
        opt.step()
        split["data"] += t1 - t0
        split["forward/backward"] += t2 - t1
        split["optimizer"] += time.perf_counter() - t2
    wall = time.perf_counter() - t_start
    t0 = time.perf_counter()
    model.eval()
    final = scored(model, parts["val"], T)
    out = {"split": split, "wall_in_process": wall, "evals": evals, "final_val_scored": final,
           "scoring_s": time.perf_counter() - t0}  # fmt: skip
    (Path(a["out"]) / "torch_loop.json").write_text(json.dumps(out))


def run_child(kind: str, argv: list[str], cwd: Path, passive: bool = False) -> dict:
    io_out = cwd / f"{kind}.io"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "PYTHONHASHSEED": "0",
            **({"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}),
        }
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(io_out), "--", *argv], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{kind} failed ({os.waitstatus_to_exitcode(status)}):\n{output[-4000:]}")
    io = {}
    if io_out.exists():
        io = {k: int(v) for k, v in (line.split(":") for line in io_out.read_text().splitlines())}
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "write_bytes": io.get("write_bytes"),
            "wchar": io.get("wchar"), "output": output}  # fmt: skip


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def composed(overrides: list[str], cwd: Path) -> dict:
    import yaml

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pipeline", *overrides, "--cfg", "job"], cwd=cwd, env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return yaml.safe_load(out.stdout)


def score_pipeline_checkpoint(run_dir: Path, val, T: int, chars: list[str]):
    """The pipeline's final model, scored as the torch loop's (None if its vocabulary is not the file's chars)."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    files = sorted((run_dir / "checkpoints" / "final").rglob("*.safetensors"))
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    if "transformer.wte.weight" not in weights or weights["transformer.wte.weight"].shape[0] != len(
        chars
    ):
        return None
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_step import build_torch

    p = {k: np.ascontiguousarray(v) for k, v in weights.items() if k.startswith("transformer.")}
    shell = type("Weights", (), {})()
    c = p["transformer.h.0.attn.c_attn.weight"]
    shell.params, shell.vocab_size, shell.n_embd = p, len(chars), c.shape[0]
    shell.block_size = p["transformer.wpe.weight"].shape[0]
    shell.n_layer = len({k.split(".")[2] for k in p if k.startswith("transformer.h.")})
    shell.n_head, shell.bias = _n_head(run_dir), "transformer.ln_f.bias" in p
    shell.gelu = _gelu(run_dir)
    model, _ = build_torch(shell, "sdpa")
    model.eval()
    with torch.no_grad():
        return scored(model, val, T)


def _job(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())


def _n_head(run_dir: Path) -> int:
    return int(_job(run_dir)["model"]["n_head"])


def _gelu(run_dir: Path) -> str:
    return str(_job(run_dir)["model"].get("gelu", "tanh"))


def profile_table(output: str) -> dict:
    """{phase: seconds} from the table debug=profile prints at the end."""
    rows, lines = {}, output.split("profile (trainer.profile=true):", 1)[-1].splitlines()
    for line in lines:
        name = next((n for n in PROFILE_ROWS if line.startswith(n + " ")), None)
        if name:
            rows[name] = float(line[len(name) :].split()[-2])
    return rows


def last_val_loss(run_dir: Path):
    val = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val/loss" in rec:
            val = rec["val/loss"]
    return val


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], sys.argv[5:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", help="a UTF-8 file (default: a generated one of --bytes characters)")
    ap.add_argument("--bytes", type=int, default=1_100_000, help="size of the generated text")
    ap.add_argument("--max-steps", type=int, help="updates (default: the experiment's)")
    ap.add_argument(
        "--eval-every", type=int, help="updates between evaluations (default: the experiment's)"
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="trainer.threads and torch.set_num_threads"
    )
    ap.add_argument("--only", choices=("pipeline", "torch"), help="run one side only")
    ap.add_argument("--omp", choices=("both", "default", "passive"), default="both",
                    help="torch's OpenMP wait policies to run (the ratio is against the faster)")  # fmt: skip
    ap.add_argument("--keep", help="work in this directory (kept) instead of a temporary one")
    ap.add_argument(
        "--override", action="append", default=[], help="another override for the pipeline"
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_step import loadavg, print_machine

    where = print_machine()
    with tempfile.TemporaryDirectory(prefix="bench_run_") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        text = Path(args.text).resolve() if args.text else work / "input.txt"
        if not args.text:
            text.write_text(generate_text(args.bytes), encoding="utf-8")
        chars, data = read_text(str(text))
        out_dir = work / "outputs"
        overrides = ["experiment=nanogpt_char_cpu", f"data.path={text}", f"paths.output_dir={out_dir}",
                     f"trainer.threads={args.threads}", "trainer.progress_bar=false", "debug=profile"]  # fmt: skip
        if args.max_steps is not None:
            overrides.append(f"trainer.max_steps={args.max_steps}")
        if args.eval_every is not None:
            overrides.append(f"trainer.eval_every={args.eval_every}")
        overrides += args.override
        cfg = composed(overrides, work)
        tr, dcfg = cfg["trainer"], cfg["data"]
        T, steps = int(dcfg["block_size"]), int(tr["max_steps"])
        print(f"text {text} ({text.stat().st_size:,} bytes, {len(chars)} characters); {steps} updates, "
              f"B={tr['batch_size']} T={T}; threads {args.threads}; {loadavg()}")  # fmt: skip
        results = {}
        if args.only != "torch":
            (work / "pipeline").mkdir(exist_ok=True)
            r = run_child("pipeline", overrides, work / "pipeline")
            run_dir = next((out_dir / "runs").iterdir())
            r["split"] = profile_table(r["output"])
            r["final_val_own"] = last_val_loss(run_dir)
            r["bytes_on_disk"] = tree_bytes(out_dir)
            try:
                r["final_val_scored"] = score_pipeline_checkpoint(
                    run_dir, data[int(len(data) * 0.9) :], T, chars
                )
            except ImportError:
                r["final_val_scored"] = None
            results["pipeline"] = r
            print(f"pipeline done: {r['wall_s']:.1f} s; {loadavg()}")
        policies = {"both": (False, True), "default": (False,), "passive": (True,)}[args.omp]
        for passive in policies if args.only != "pipeline" else ():
            name = "torch_passive" if passive else "torch"
            tdir = work / name
            tdir.mkdir(exist_ok=True)
            spec = {"text": str(text), "threads": args.threads, "seed": int(tr.get("seed", 0) or 0),
                    "val_fraction": float(dcfg["val_fraction"]), "block_size": T,
                    "batch_size": int(tr["batch_size"]), "vocab": len(chars), "model": cfg["model"],
                    "optimizer": cfg["optimizer"], "scheduler": cfg["scheduler"], "max_steps": steps,
                    "eval_every": int(tr["eval_every"]), "eval_batches": int(tr.get("eval_batches") or 20),
                    "grad_clip": float(tr.get("grad_clip") or 0.0), "out": str(tdir)}  # fmt: skip
            r = run_child("torch", [json.dumps(spec)], tdir, passive)
            inner = json.loads((tdir / "torch_loop.json").read_text())
            r["wall_s"] -= inner[
                "scoring_s"
            ]  # the bench's own scoring after the last update: not the loop's
            r["split"] = {**inner["split"], "wall": inner["wall_in_process"]}
            r["final_val_own"], r["final_val_scored"] = (
                inner["evals"][-1][1],
                inner["final_val_scored"],
            )
            r["bytes_on_disk"] = tree_bytes(tdir) - (tdir / "torch_loop.json").stat().st_size
            results[name] = r
            print(f"{name} done: {r['wall_s']:.1f} s; {loadavg()}")
    keys = (
        "wall_s",
        "peak_rss_mib",
        "write_bytes",
        "wchar",
        "bytes_on_disk",
        "final_val_own",
        "final_val_scored",
    )
    print(f"{'':26s}" + "".join(f"{k:>14s}" for k in results))
    for k in keys:
        cells = [results[c].get(k) for c in results]
        print(
            f"{k:26s}"
            + "".join(f"{v:14.4f}" if isinstance(v, float) else f"{v!s:>14s}" for v in cells)
        )
    for name in PROFILE_ROWS:
        cells = [results[c]["split"].get(name) for c in results]
        print(
            f"  {name:24s}"
            + "".join(f"{v:14.2f}" if v is not None else f"{'-':>14s}" for v in cells)
        )
    summary = {k: {f: v for f, v in r.items() if f != "output"} for k, r in results.items()}
    if "pipeline" in results and len(results) > 1:
        best = min((k for k in results if k != "pipeline"), key=lambda k: results[k]["wall_s"])
        summary["wall_ratio"] = round(results["pipeline"]["wall_s"] / results[best]["wall_s"], 3)
        summary["torch_best"] = best
        print(f"pipeline / {best} wall: {summary['wall_ratio']:.3f}; {loadavg()}")
    end = {**where, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    summary.update(
        {"steps": steps, "threads": args.threads, "text_chars": len(data), "machine": end}
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
