"""One MiniGPT training step (fwd + bwd + AdamW) in numpy against the same GPT-2 in PyTorch, in one run.

    python bench/bench_step.py [--threads 2] [--shards 2] [--steps 60]   # step times, ratio, GFLOP/s
    python bench/bench_step.py --shape all        # every named shape in turn (SHAPES), a summary at the end
    python bench/bench_step.py --contend 2        # numpy (and torch) beside 2 busy-looping processes
    python bench/bench_step.py --profile          # one shard's step per layer and op, each against its own bound,
                                                  # and where the step's time beyond one shard goes
    python bench/bench_step.py --memory           # numpy peak RSS after 100 and 1000 steps

The numpy side is the real training computation: MiniGPT through pipeline.trainer.parallel.Shards (the batch
split into --shards pieces run on --threads threads, BLAS single-threaded inside each) and AdamW from
pipeline.optimizer.adam. torch gets the same --threads (torch.set_num_threads), in two worker processes (OpenMP's
default wait policy and OMP_WAIT_POLICY=PASSIVE), each timing sdpa and manual attention; the ratio is numpy's
against the best of the four. Blocks of 10 steps go round the contestants, so load hits them alike.
Every mode first prints where it was measured: the CPU model, the BLAS numpy calls (threadpoolctl's internal_api,
version, architecture) and the load average; the JSON line repeats them under "machine".

FLOP count (stated, analytic): forward = 2 * tokens * (12 * n_layer * d^2 + V * d)   [c_attn, c_proj, c_fc,
mlp.c_proj and the tied head; embeddings, biases, LayerNorm, softmax and GELU not counted]
+ n_layer * 2 * 2 * B * n_head * T^2 * hs   [q.k and att.v, full T x T as computed];  step = 3 x forward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout without installing

from pipeline.data.base import Batch, DataSpec
from pipeline.model import minigpt as minigpt_module
from pipeline.model.minigpt import MiniGPT
from pipeline.optimizer.adam import AdamW
from pipeline.trainer.parallel import Shards, split

LR, WD, BETAS, EPS = 3e-4, 0.1, (0.9, 0.999), 1e-8


def build_torch(np_model, attn: str, lr=LR, betas=BETAS, weight_decay=WD, weight_decay_on="all"):
    """The same GPT-2 in torch (nn.Linear layout [out, in]), initialised from the numpy model's weights; bias and
    GELU as np_model's; AdamW decaying every parameter (all) or the 2-D ones (matrices: nanoGPT's groups)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    V, T, d, nh = np_model.vocab_size, np_model.block_size, np_model.n_embd, np_model.n_head
    hs, bias = d // nh, np_model.bias
    approximate = "tanh" if np_model.gelu == "tanh" else "none"

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = (nn.LayerNorm(d, eps=1e-5, bias=bias) for _ in range(2))
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)
            self.c_fc, self.mlp_proj = (
                nn.Linear(d, 4 * d, bias=bias),
                nn.Linear(4 * d, d, bias=bias),
            )
            self.register_buffer(
                "mask", torch.ones(T, T, dtype=torch.bool).tril(), persistent=False
            )

        def forward(self, x):
            B, t, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (a.view(B, t, nh, hs).transpose(1, 2) for a in (q, k, v))  # [B, nh, T, hs]
            if attn == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # [B, nh, T, T]
                att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
                y = att @ v
            x = x + self.c_proj(y.transpose(1, 2).reshape(B, t, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate=approximate))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
            self.h = nn.ModuleList(Block() for _ in range(np_model.n_layer))
            self.ln_f = nn.LayerNorm(d, eps=1e-5, bias=bias)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    model = GPT()
    p = np_model.params

    def put(mod, name, transpose=False):
        w = p[name + ".weight"]
        mod.weight.copy_(
            torch.from_numpy(w.T.copy() if transpose else w)
        )  # Conv1D [in, out] -> [out, in]
        if bias and name + ".bias" in p:
            mod.bias.copy_(torch.from_numpy(p[name + ".bias"]))

    with torch.no_grad():
        put(model.wte, "transformer.wte")
        put(model.wpe, "transformer.wpe")
        for i, blk in enumerate(model.h):
            h = f"transformer.h.{i}."
            put(blk.ln_1, h + "ln_1")
            put(blk.ln_2, h + "ln_2")
            for mod, name in ((blk.c_attn, "attn.c_attn"), (blk.c_proj, "attn.c_proj"), (blk.c_fc, "mlp.c_fc"),
                              (blk.mlp_proj, "mlp.c_proj")):  # fmt: skip
                put(mod, h + name, transpose=True)
        put(model.ln_f, "transformer.ln_f")
    params = list(model.parameters())
    decays = [q.dim() >= 2 or weight_decay_on == "all" for q in params]
    groups = [{"params": [q for q, dq in zip(params, decays) if dq]},
              {"params": [q for q, dq in zip(params, decays) if not dq], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=EPS,
                            weight_decay=weight_decay)  # fmt: skip
    return model, opt


def forward_flops(V, B, T, d, n_layer, n_head) -> float:
    hs = d // n_head
    return 2.0 * B * T * (12 * n_layer * d * d + V * d) + n_layer * 2 * 2 * B * n_head * T * T * hs


def matmul_gflops(n: int = 256, reps: int = 200) -> float:
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = a.T.copy()
    for _ in range(10):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def peak_rss_mb() -> tuple[float, float]:
    """(VmHWM, VmRSS) in MiB from /proc, falling back to ru_maxrss for both."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
        )
        return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return peak, peak


def make_setup(args):
    spec = DataSpec(vocab_size=args.vocab, block_size=args.block)
    model = MiniGPT(spec, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block,
                    dropout=0.0, attn_dropout=None, init_std=0.02, bias=True, gelu="tanh", dtype="float32",
                    rng=np.random.default_rng(0))  # fmt: skip
    r = np.random.default_rng(1)
    x = r.integers(0, args.vocab, (args.batch, args.block))
    y = r.integers(0, args.vocab, (args.batch, args.block))
    return model, Batch(ids=np.arange(args.batch), x=x, y=y)


def make_numpy_step(args, model, batch):
    """The trainer's step: Shards.loss_and_grads then the real AdamW (no dropout: torch's twin has none)."""
    shards = Shards(args.shards, args.threads)
    opt = AdamW(model.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, weight_decay_on="all")

    def step():
        t0 = time.perf_counter()
        _, grads = shards.loss_and_grads(model, batch, None)
        t1 = time.perf_counter()
        opt.step(grads)
        return time.perf_counter() - t0, t1 - t0

    return step, shards


def loadavg() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def machine() -> dict:
    """Where a figure was measured: the CPU model, its cores, the BLAS numpy calls, the load."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blas = [{k: lib.get(k) for k in ("internal_api", "architecture", "version", "threading_layer")}
            for lib in threadpool_info() if lib.get("user_api") == "blas"]  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "blas": blas, "numpy": np.__version__,
            "loadavg": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


def print_machine() -> dict:
    m = machine()
    blas = "; ".join(f"{b['internal_api']} {b['version']} ({b['architecture']}, {b['threading_layer']})"
                     for b in m["blas"]) or "none found"  # fmt: skip
    print(f"cpu: {m['cpu']} ({m['cores']} cores); numpy {m['numpy']}, BLAS {blas}; {loadavg()}")
    return m


def run_memory(args) -> dict:
    model, batch = make_setup(args)
    step, shards = make_numpy_step(args, model, batch)
    marks = {}
    with shards:
        for i in range(1, 1001):
            step()
            if i in (100, 1000):
                marks[i] = peak_rss_mb()
    growth = 100.0 * (marks[1000][0] - marks[100][0]) / marks[100][0]
    out = {
        "mode": "memory", "threads": args.threads, "shards": args.shards,
        "peak_rss_mb_100": round(marks[100][0], 1), "peak_rss_mb_1000": round(marks[1000][0], 1),
        "rss_mb_100": round(marks[100][1], 1), "rss_mb_1000": round(marks[1000][1], 1),
        "peak_growth_pct": round(growth, 2),
    }  # fmt: skip
    print(
        f"numpy, {args.shards} shards on {args.threads} threads: peak RSS (VmHWM) {out['peak_rss_mb_100']} MiB "
        f"after 100 steps, {out['peak_rss_mb_1000']} MiB after 1000 steps: "
        f"growth {out['peak_growth_pct']}%"
    )
    print(f"current RSS (VmRSS): {out['rss_mb_100']} -> {out['rss_mb_1000']} MiB")
    return out


class OpProfile:
    """Times every layer function MiniGPT calls, by layer and op, forward and backward apart.

    Forward ops are named from the parameter they use (linear, LayerNorm) or from the block index in the
    caller's frame (attention, GELU, dropout); a backward takes the name of its forward, found by popping a
    per-function stack since the backward visits each function's calls in reverse order.
    """

    def __init__(self, model):
        self.names = {
            id(p): n.removeprefix("transformer.").removesuffix(".weight")
            for n, p in model.params.items()
        }
        self.order: list[str] = []  # row labels, first seen first
        self.pending = defaultdict(
            list
        )  # function family -> forward labels awaiting their backward
        self.step_times = defaultdict(
            float
        )  # (label, "fwd" | "bwd") -> seconds in the current step
        self.samples = defaultdict(list)  # (label, "fwd" | "bwd") -> per-step seconds

    def _label(self, family: str, args) -> str:
        if family in ("linear", "layernorm"):
            return self.names.get(id(args[1]), family)
        if family == "layernorm_linear":
            linear = self.names.get(id(args[3]), "linear").rsplit(".", 2)
            return f"{self.names.get(id(args[1]), 'layernorm')} + {'.'.join(linear[-2:])}"
        if family in ("head", "embedding"):
            return {"head": "head (tied wte)", "embedding": "embedding"}[family]
        i = sys._getframe(2).f_locals.get("i")  # the block loop's index in MiniGPT._forward
        return f"h.{i}.{family}" if i is not None else f"embedding {family}"

    def wrap(self, name: str, fn):
        family, direction = name.rsplit("_", 1)
        direction = {"forward": "fwd", "backward": "bwd"}[direction]

        def timed(*args, **kw):
            if direction == "fwd":
                label = self._label(family, args)
                self.pending[family].append(label)
                if label not in self.order:
                    self.order.append(label)
            else:
                label = self.pending[family].pop()
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            self.step_times[label, direction] += time.perf_counter() - t0
            return out

        return timed

    def end_step(self) -> None:
        for key, t in self.step_times.items():
            self.samples[key].append(t)
        self.step_times.clear()


def op_costs(args, b: int) -> dict[str, dict[str, tuple[list, int]]]:
    """Each profiled op's unavoidable work for one shard of b samples: {label: {"fwd"|"bwd": (gemms, bytes)}}.

    gemms are (batch, M, K, N) products as the op computes them (attention's full T x T); bytes are the element-wise
    traffic a fused op could not avoid (its inputs read once, its outputs written once), gemm operands excluded.
    """
    T, d, V, nh = args.block, args.n_embd, args.vocab, args.n_head
    n, hs, e = b * T, d // nh, 4  # tokens, head size, bytes per float32
    att = b * nh * T * T  # attention probabilities
    ops = {"embedding": {"fwd": ([], e * 3 * n * d), "bwd": ([], e * (n * d + V * d + T * d))}}
    for i in range(args.n_layer):
        h = f"h.{i}."
        ops[h + "ln_1 + attn.c_attn"] = {
            "fwd": ([(1, n, d, 3 * d)], e * 2 * n * d),
            "bwd": ([(1, d, n, 3 * d), (1, n, 3 * d, d)], e * 3 * n * d),
        }
        ops[h + "attention"] = {
            "fwd": ([(b * nh, T, hs, T), (b * nh, T, T, hs)], e * 2 * att),
            "bwd": (
                [(b * nh, T, T, hs), (b * nh, T, hs, T), (b * nh, T, T, hs), (b * nh, T, T, hs)],
                e * 3 * att,
            ),
        }
        ops[h + "attn.c_proj"] = {
            "fwd": ([(1, n, d, d)], 0),
            "bwd": ([(1, n, d, d), (1, d, n, d)], 0),
        }
        ops[h + "ln_2 + mlp.c_fc"] = {
            "fwd": ([(1, n, d, 4 * d)], e * 2 * n * d),
            "bwd": ([(1, d, n, 4 * d), (1, n, 4 * d, d)], e * 3 * n * d),
        }
        ops[h + "gelu"] = {"fwd": ([], e * 3 * n * 4 * d), "bwd": ([], e * 3 * n * 4 * d)}
        ops[h + "mlp.c_proj"] = {
            "fwd": ([(1, n, 4 * d, d)], 0),
            "bwd": ([(1, n, d, 4 * d), (1, 4 * d, n, d)], 0),
        }
    ops["ln_f"] = {"fwd": ([], e * 2 * n * d), "bwd": ([], e * 3 * n * d)}
    ops["head (tied wte)"] = {"fwd": ([(1, n, d, V)], 0), "bwd": ([(1, n, V, d), (1, V, n, d)], 0)}
    ops["cross-entropy (value and grad)"] = {"fwd": ([], e * 2 * n * V), "bwd": ([], 0)}
    return ops


def gemm_seconds(shape: tuple, reps: int = 30) -> float:
    """Median seconds of one np.matmul of contiguous float32 operands of this (batch, M, K, N), out= given."""
    batch, m, k, n = shape
    r = np.random.default_rng(0)
    a, b = (
        r.standard_normal((batch, m, k), dtype=np.float32),
        r.standard_normal((batch, k, n), dtype=np.float32),
    )
    out = np.empty((batch, m, n), np.float32)
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def memory_rate(nbytes: int, reps: int = 30) -> float:
    """Bytes per second of np.multiply(a, b, out=c) on float32 arrays of nbytes each (3 x nbytes moved)."""
    size = max(nbytes // 4, 1024)
    a, b, c = np.ones(size, np.float32), np.ones(size, np.float32), np.empty(size, np.float32)
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        np.multiply(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 3 * 4 * size / statistics.median(times[3:])


def run_profile(args) -> dict:
    model, batch = make_setup(args)
    piece = split(batch, args.shards)[0]
    prof = OpProfile(model)
    layers = minigpt_module.L
    patched = {
        n: prof.wrap(n, getattr(layers, n))
        for n in dir(layers)
        if n.endswith(("_forward", "_backward"))
    }
    loss_fn = minigpt_module.cross_entropy_factored  # what MiniGPT.loss_and_grads calls

    def timed_loss(*a, **kw):
        t0 = time.perf_counter()
        out = loss_fn(*a, **kw)
        prof.step_times["cross-entropy (value and grad)", "fwd"] += time.perf_counter() - t0
        return out

    opt = AdamW(model.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, weight_decay_on="all")
    shard_total, opt_total = [], []
    every = {n: getattr(layers, n) for n in dir(layers) if not n.startswith("__")}
    minigpt_module.L = SimpleNamespace(**{**every, **patched})
    minigpt_module.cross_entropy_factored = timed_loss
    try:
        with Shards(
            1, 1
        ) as one:  # a shard's work on this thread, BLAS single-threaded as in the runner
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                _, grads = one.loss_and_grads(model, piece, None)
                t1 = time.perf_counter()
                opt.step(grads)
                t2 = time.perf_counter()
                prof.end_step()
                if i >= args.warmup:
                    shard_total.append(t1 - t0)
                    opt_total.append(t2 - t1)
                else:
                    prof.samples.clear()
            # The bounds, measured now under the same single-threaded BLAS: each gemm shape's own rate and the
            # element-wise memory rate at each op's array size.
            costs = op_costs(args, len(piece.ids))
            shapes = {g for c in costs.values() for gs, _ in c.values() for g in gs}
            gemm_s = {g: gemm_seconds(g) for g in sorted(shapes)}
            sizes = {nb // 3 for c in costs.values() for _, nb in c.values() if nb}
            mem = {nb: memory_rate(nb) for nb in sorted(sizes)}
            mm1 = matmul_gflops()
    finally:
        minigpt_module.L, minigpt_module.cross_entropy_factored = layers, loss_fn
    prof.order.insert(prof.order.index("head (tied wte)") + 1, "cross-entropy (value and grad)")

    def bound_ms(label: str) -> tuple[float, float, float]:
        # (bound ms, GFLOP, MB) of an op's forward and backward together
        total, flop, nbytes = 0.0, 0.0, 0
        for gemms, nb in costs.get(label, {}).values():
            for g in gemms:
                total += gemm_s[g]
                flop += 2.0 * g[0] * g[1] * g[2] * g[3]
            if nb:
                total += nb / mem[nb // 3]
                nbytes += nb
        return total * 1e3, flop / 1e9, nbytes / 1e6

    # The whole step as the trainer runs it, for scale: all shards on the pool, then AdamW; each shard's own
    # start and end recorded to say where the step's time beyond one shard goes.
    model2, batch2 = make_setup(args)
    step, shards = make_numpy_step(args, model2, batch2)
    spans: list[tuple[float, float]] = []
    inner = model2.loss_and_grads

    def recorded(b, rng):
        t0 = time.perf_counter()
        out = inner(b, rng)
        spans.append((t0, time.perf_counter()))
        return out

    model2.loss_and_grads = recorded
    with shards:
        for _ in range(args.warmup):
            step()
        full, parts = [], []
        for _ in range(args.steps):
            spans.clear()
            t0 = time.perf_counter()
            full.append(step())
            t_fb = t0 + full[-1][1]
            starts, ends = [a for a, _ in spans], [b for _, b in spans]
            parts.append(
                {
                    "dispatch": min(starts) - t0,  # split, child rngs, pool hand-over
                    "shard": statistics.mean(
                        b - a for a, b in spans
                    ),  # one shard's own wall, on its thread
                    "imbalance": max(ends) - min(ends),  # the first shard done waits for the last
                    "start skew": max(starts) - min(starts),
                    "reduction": t_fb - max(ends),
                }
            )  # the fixed-order sum of the shards' gradients

    def med(xs):
        return statistics.median(xs) * 1e3 if xs else 0.0

    rows, attributed, bound_total = [], 0.0, 0.0
    print(
        f"one shard ({len(piece.ids)} of B={args.batch} samples, T={args.block}) on one thread, "
        f"single-threaded BLAS; median ms over {args.steps} steps after {args.warmup} warm-up; "
        f"{loadavg()}"
    )
    print("bound: the op's gemms at the rate np.matmul reaches on their own shapes (contiguous, measured now) plus its "
          "unavoidable element-wise bytes at the np.multiply rate of its array size")  # fmt: skip
    print(f"{'op':34s} {'fwd ms':>8s} {'bwd ms':>8s} {'total':>8s} {'min total':>10s} {'MFLOP':>7s} {'MB':>6s} "
          f"{'bound':>7s} {'min/bound':>9s}")  # fmt: skip
    for label in prof.order:
        fs, bs = prof.samples.get((label, "fwd"), []), prof.samples.get((label, "bwd"), [])
        f, b = med(fs), med(bs)
        low = min(x + y for x, y in zip(fs, bs)) * 1e3 if fs and bs else min(fs or bs) * 1e3
        bnd, gf, mb = bound_ms(label)
        attributed += f + b
        bound_total += bnd
        ratio = (
            low / bnd if bnd else float("nan")
        )  # the minimum: on a shared machine a median measures the load
        rows.append({"op": label, "fwd_ms": round(f, 3), "bwd_ms": round(b, 3), "min_total_ms": round(low, 3),
                     "mflop": round(gf * 1e3, 2), "mbytes": round(mb, 2), "bound_ms": round(bnd, 3),
                     "x_bound": round(ratio, 2)})  # fmt: skip
        print(
            f"{label:34s} {f:8.3f} {b:8.3f} {f + b:8.3f} {low:10.3f} {gf * 1e3:7.1f} {mb:6.2f} {bnd:7.3f} "
            f"{ratio:9.2f}"
        )
    shard_ms, opt_ms = med(shard_total), med(opt_total)
    shard_min, opt_min = min(shard_total) * 1e3, min(opt_total) * 1e3
    attributed_min = sum(r["min_total_ms"] for r in rows)
    n_params = sum(p.size for p in model.params.values())
    opt_bound = 7 * 4 * n_params / memory_rate(4 * n_params) * 1e3  # read p, g, m, v; write p, m, v
    print(f"{'sum of ops':34s} {'':8s} {'':8s} {attributed:8.3f} {attributed_min:10.3f} {'':7s} {'':6s} "
          f"{bound_total:7.3f} {attributed_min / bound_total:9.2f}")  # fmt: skip
    print(f"{'glue (residual adds, Python)':34s} {'':8s} {'':8s} {shard_ms - attributed:8.3f}")
    print(f"{'shard fwd+bwd':34s} {'':8s} {'':8s} {shard_ms:8.3f} {shard_min:10.3f} {'':7s} {'':6s} "
          f"{bound_total:7.3f} {shard_min / bound_total:9.2f}")  # fmt: skip
    print(f"{'AdamW (all parameters)':34s} {'':8s} {'':8s} {opt_ms:8.3f} {opt_min:10.3f} {'':7s} "
          f"{7 * 4 * n_params / 1e6:6.2f} {opt_bound:7.3f} {opt_min / opt_bound:9.2f}")  # fmt: skip
    full_step, full_fb = med([t[0] for t in full]), med([t[1] for t in full])
    print(
        f"the trainer's step, {args.shards} shards on {args.threads} threads: {full_step:.2f} ms "
        f"(fwd+bwd of all shards and their reduction {full_fb:.2f}, AdamW {full_step - full_fb:.2f})"
    )
    over = {k: med([p[k] for p in parts]) for k in parts[0]}
    print(f"  beyond one shard alone ({shard_ms:.2f} ms): {full_fb - shard_ms:+.2f} ms = a shard beside the other "
          f"{over['shard'] - shard_ms:+.2f} (median shard {over['shard']:.2f}), start skew {over['start skew']:.2f}, "
          f"imbalance {over['imbalance']:.2f}, dispatch {over['dispatch']:.2f}, reduction {over['reduction']:.2f} "
          f"(medians: they need not add up)")  # fmt: skip
    step_gflop = (
        3
        * forward_flops(args.vocab, args.batch, args.block, args.n_embd, args.n_layer, args.n_head)
        / 1e9
    )
    print(f"f32 matmul n=256 on one thread: {mm1:.1f} GFLOP/s; the step's {step_gflop:.3f} GFLOP at that rate on "
          f"{args.threads} threads: {step_gflop / mm1 / args.threads * 1e3:.2f} ms; {loadavg()}")  # fmt: skip
    return {
        "mode": "profile", "shards": args.shards, "threads": args.threads, "shard_samples": len(piece.ids),
        "ops": rows, "shard_fwd_bwd_ms": round(shard_ms, 3), "shard_fwd_bwd_min_ms": round(shard_min, 3),
        "shard_bound_ms": round(bound_total, 3),
        "adamw_ms": round(opt_ms, 3), "adamw_bound_ms": round(opt_bound, 3),
        "step_ms": round(full_step, 3), "step_fwd_bwd_ms": round(full_fb, 3),
        "two_shard_overhead_ms": {k: round(v, 3) for k, v in over.items()},
        "gemm_gflops": {"x".join(map(str, g)): round(2 * g[0] * g[1] * g[2] * g[3] / t / 1e9, 1)
                        for g, t in gemm_s.items()},
        "matmul256_gflops_1thread": round(mm1, 1), "loadavg_1min": round(os.getloadavg()[0], 2),
    }  # fmt: skip


class BusyLoops:
    """K busy-looping processes (pure Python `while True`), paused (SIGSTOP) or running (SIGCONT) on demand."""

    def __init__(self, k: int):
        self.procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)
        ]
        self.pause()

    def pause(self) -> None:
        for p in self.procs:
            os.kill(p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for p in self.procs:
            os.kill(p.pid, signal.SIGCONT)

    def close(self) -> None:
        for p in self.procs:
            p.kill()  # SIGKILL works on a stopped process too
            p.wait()


SHAPES = {  # name: (vocab, n_embd, n_layer, n_head, block, batch)
    "default": (512, 64, 2, 4, 64, 32),
    "nanogpt-cpu": (65, 128, 4, 4, 64, 12),  # nanoGPT's README CPU recipe (shakespeare_char)
    "d256": (65, 256, 6, 8, 128, 16),
    "nanogpt-gpu-scaled": (
        65,
        384,
        6,
        6,
        256,
        8,
    ),  # train_shakespeare_char.py's model, batch 64 -> 8
}
SHAPE_ARGS = ("vocab", "n_embd", "n_layer", "n_head", "block", "batch")
TORCH = ("torch_sdpa", "torch_manual", "torch_sdpa_passive", "torch_manual_passive")


def torch_worker(args) -> None:
    """A torch contestant in its own process (OMP_WAIT_POLICY is read once, when torch loads): reads
    `run NAME N` / `losses` / `quit` on stdin, answers one JSON line each on stdout."""
    import torch

    torch.set_num_threads(args.threads)
    model, batch = make_setup(args)
    xt, yt, V = torch.from_numpy(batch.x), torch.from_numpy(batch.y), args.vocab
    models = {a: build_torch(model, a) for a in ("sdpa", "manual")}

    def loss_of(tm):
        return torch.nn.functional.cross_entropy(tm(xt).view(-1, V), yt.view(-1))

    def step(name):
        tm, topt = models[name]
        t0 = time.perf_counter()
        topt.zero_grad(set_to_none=True)
        loss_of(tm).backward()
        t1 = time.perf_counter()
        topt.step()
        return time.perf_counter() - t0, t1 - t0

    def send(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    with torch.no_grad():
        send({"init_loss": loss_of(models["sdpa"][0]).item(), "torch": torch.__version__})
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            send([step(cmd[1]) for _ in range(int(cmd[2]))])
        elif cmd[0] == "losses":
            with torch.no_grad():
                send({a: loss_of(tm).item() for a, (tm, _) in models.items()})
        else:
            return


class TorchWorker:
    """bench_step.py --torch-worker in a subprocess, OpenMP's default wait policy or PASSIVE."""

    def __init__(self, args, passive: bool):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if passive:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        shape = [f"--{a.replace('_', '-')}={getattr(args, a)}" for a in SHAPE_ARGS]
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--torch-worker", f"--threads={args.threads}", *shape],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.hello = self.read()

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the torch worker exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def run_speed(args) -> dict:
    model, batch = make_setup(args)
    numpy_step, shards = make_numpy_step(args, model, batch)
    np_loss = model.evaluate(batch)
    policies = {"both": ("", "_passive"), "default": ("",), "passive": ("_passive",)}[args.omp]
    workers = {suffix: TorchWorker(args, suffix == "_passive") for suffix in policies}
    t_loss = next(iter(workers.values())).hello[
        "init_loss"
    ]  # same weights, same batch: the losses must agree
    runners = {"numpy": lambda n: [numpy_step() for _ in range(n)]}
    for suffix, w in workers.items():
        for a in ("sdpa", "manual"):
            runners[f"torch_{a}{suffix}"] = lambda n, w=w, a=a: [
                tuple(t) for t in w.ask(f"run {a} {n}")
            ]
    conditions = ["quiet"] + (["contended"] if args.contend else [])
    times = {(c, k): [] for c in conditions for k in runners}
    busy = BusyLoops(args.contend) if args.contend else None
    try:
        for fn in runners.values():  # warm-up
            fn(args.warmup)
        # Interleaved blocks, so load from elsewhere on the machine hits every contestant (and condition) alike.
        block, mm = 10, 0.0
        for _ in range(math.ceil(args.steps / block)):
            for cond in conditions:
                if busy:
                    busy.resume() if cond == "contended" else busy.pause()
                    time.sleep(0.05)  # let the scheduler see the new load
                for name, fn in runners.items():
                    times[cond, name] += fn(block)
            with threadpool_limits(args.threads, "blas"):  # Shards pins BLAS to 1 thread while open
                mm = max(mm, matmul_gflops(reps=20))  # the bound from the run's quietest moment
        # Every contestant made the same number of AdamW updates on the same batch: the losses should still agree.
        final = {"numpy": model.evaluate(batch)}
        for suffix, w in workers.items():
            final.update({f"torch_{a}{suffix}": v for a, v in w.ask("losses").items()})
    finally:
        if busy:
            busy.close()
        shards.close()
        for w in workers.values():
            w.close()
    med = {k: statistics.median(t[0] for t in v) * 1e3 for k, v in times.items()}
    fastest = {k: min(t[0] for t in v) * 1e3 for k, v in times.items()}
    med_fb = {k: statistics.median(t[1] for t in v) * 1e3 for k, v in times.items()}
    q, V = "quiet", args.vocab
    timed = [k for k in TORCH if (q, k) in times]
    best_min = min(timed, key=lambda k: fastest[q, k])
    best_med = min(timed, key=lambda k: med[q, k])
    step_flops = 3 * forward_flops(
        V, args.batch, args.block, args.n_embd, args.n_layer, args.n_head
    )
    bound = step_flops / (mm * 1e9) * 1e3  # the step's GEMM FLOP at the run's own matmul rate
    out = {
        "mode": "speed", "shape": args.shape, "threads": args.threads, "shards": args.shards,
        "steps": len(times[q, "numpy"]), "warmup": args.warmup, "V": V, "B": args.batch, "T": args.block,
        "d": args.n_embd, "n_head": args.n_head, "n_layer": args.n_layer,
        "numpy_ms": round(med[q, "numpy"], 2), "numpy_fwd_bwd_ms": round(med_fb[q, "numpy"], 2),
        **{f"{k}_ms": round(med[q, k], 2) for k in timed},
        "numpy_min_ms": round(fastest[q, "numpy"], 2),
        **{f"{k}_min_ms": round(fastest[q, k], 2) for k in timed},
        "ratio_min": round(fastest[q, "numpy"] / fastest[q, best_min], 3), "torch_best_min": best_min,
        "ratio_median": round(med[q, "numpy"] / med[q, best_med], 3), "torch_best_median": best_med,
        "step_gflop": round(step_flops / 1e9, 3),
        "numpy_step_gflops": round(step_flops / med[q, "numpy"] / 1e6, 1),
        "numpy_matmul256_gflops": round(mm, 1), "bound_ms": round(bound, 2),
        "min_over_bound": round(fastest[q, "numpy"] / bound, 2),
        "init_loss_numpy": round(np_loss, 6), "init_loss_torch": round(t_loss, 6),
        "final_loss": {k: round(v, 6) for k, v in final.items()},
        "updates_each": args.warmup + len(times[q, "numpy"]) * len(conditions),
        "loadavg": [round(x, 2) for x in os.getloadavg()], "torch": next(iter(workers.values())).hello["torch"],
        "numpy_version": np.__version__,
    }  # fmt: skip
    if args.contend:
        c = "contended"
        out.update({
            "contend": args.contend,
            **{f"contended_{k}_ms": round(med[c, k], 2) for k in runners},
            **{f"contended_{k}_min_ms": round(fastest[c, k], 2) for k in runners},
            **{f"contention_factor_{k}": round(med[c, k] / med[q, k], 2) for k in runners},
        })  # fmt: skip
    print(f"shape {args.shape}: threads {args.threads} (numpy: {args.shards} shards), V={V} B={args.batch} "
          f"T={args.block} d={args.n_embd} heads={args.n_head} layers={args.n_layer} float32; {out['steps']} "
          f"steps each after {args.warmup} warm-up; torch *_passive: OMP_WAIT_POLICY=PASSIVE")  # fmt: skip
    for cond in conditions:
        extra = f" beside {args.contend} busy-looping processes" if cond == "contended" else ""
        print(f"{cond}{extra}:")
        print(f"  {'':20s} {'median ms':>10s} {'min ms':>8s} {'fwd+bwd ms':>11s} {'optim ms':>9s}")
        for k in runners:
            m, fb = med[cond, k], med_fb[cond, k]
            print(f"  {k:20s} {m:10.2f} {fastest[cond, k]:8.2f} {fb:11.2f} {m - fb:9.2f}")
    print(f"numpy / torch: min {out['ratio_min']:.3f} (vs {best_min}), median {out['ratio_median']:.3f} "
          f"(vs {best_med}); step {out['step_gflop']} GFLOP -> numpy {out['numpy_step_gflops']} GFLOP/s; "
          f"numpy f32 matmul n=256: {mm:.1f} GFLOP/s, so the bound is {bound:.2f} ms and numpy's minimum "
          f"{out['min_over_bound']:.2f}x it")  # fmt: skip
    if args.contend:
        print(
            "median contended / quiet: "
            + ", ".join(f"{k} {out[f'contention_factor_{k}']:.2f}x" for k in runners)
        )
    print(
        f"loss numpy / torch: initial {np_loss:.6f} / {t_loss:.6f}, after {out['updates_each']} AdamW updates "
        + ", ".join(f"{k} {v:.6f}" for k, v in final.items())
        + f"; {loadavg()}"
    )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--threads", type=int, default=2, help="numpy shard threads and torch.set_num_threads"
    )
    ap.add_argument("--shards", type=int, default=2, help="pieces each numpy batch is split into")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per contestant (>= 50)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--contend", type=int, default=0, metavar="K",
                    help="also time every contestant beside K busy-looping processes (K = cores)")  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true", help="one shard's step per layer and op instead"
    )
    ap.add_argument(
        "--memory", action="store_true", help="peak RSS after 100 and 1000 numpy steps instead"
    )
    ap.add_argument("--shape", action="append", choices=[*SHAPES, "all"],
                    help="a named shape (repeatable; all: every one in turn); default: default")  # fmt: skip
    ap.add_argument("--omp", choices=("both", "default", "passive"), default="both",
                    help="torch's OpenMP wait policies to time (the ratio is against the best)")  # fmt: skip
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    for a in SHAPE_ARGS:  # each overrides the named shape's value
        ap.add_argument(f"--{a.replace('_', '-')}", type=int)
    args = ap.parse_args(argv)
    names = list(SHAPES) if "all" in (args.shape or []) else args.shape or ["default"]
    runs = []
    for name in names:
        shape = SimpleNamespace(**{**vars(args), "shape": name})
        for a, v in zip(SHAPE_ARGS, SHAPES[name]):
            setattr(shape, a, v if getattr(args, a) is None else getattr(args, a))
        runs.append(shape)
    if args.torch_worker:
        with threadpool_limits(limits=args.threads, user_api="blas"):
            return torch_worker(runs[0])
    where = print_machine()
    outs = []
    # The caller's BLAS setting: what the matmul figure sees; Shards pins 1 inside its calls.
    with threadpool_limits(limits=args.threads, user_api="blas"):
        for shape in runs:
            mode = run_memory if args.memory else run_profile if args.profile else run_speed
            outs.append(mode(shape))
    machine_end = {**where, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if len(outs) > 1 and not (args.memory or args.profile):
        print(
            f"{'shape':20s} {'ratio min':>9s} {'ratio median':>12s} {'numpy min ms':>12s} {'min / bound':>11s}"
        )
        for o in outs:
            print(f"{o['shape']:20s} {o['ratio_min']:9.3f} {o['ratio_median']:12.3f} {o['numpy_min_ms']:12.2f} "
                  f"{o['min_over_bound']:11.2f}")  # fmt: skip
    for o in outs:
        o["machine"] = machine_end
    print(
        json.dumps(
            outs[0] if len(outs) == 1 else {"mode": "shapes", "runs": outs, "machine": machine_end}
        )
    )


if __name__ == "__main__":
    main()
