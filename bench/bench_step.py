"""One MiniGPT training step (fwd + bwd + AdamW) in numpy against the same GPT-2 in PyTorch, in one run.

    python bench/bench_step.py [--threads 2] [--steps 60]    # step times, ratio, GFLOP/s
    python bench/bench_step.py --memory                      # numpy peak RSS after 100 and 1000 steps

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
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pipeline.data.base import Batch, DataSpec  # noqa: E402
from pipeline.model.minigpt import MiniGPT  # noqa: E402

LR, WD, BETAS, EPS = 3e-4, 0.1, (0.9, 0.999), 1e-8


class NumpyAdamW:
    """torch.optim.AdamW's update (decoupled decay, bias-corrected), in place on float32 arrays."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.m = {k: np.zeros_like(p) for k, p in params.items()}
        self.v = {k: np.zeros_like(p) for k, p in params.items()}
        self.tmp = {k: np.empty_like(p) for k, p in params.items()}
        self.t = 0

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        b1, b2 = BETAS
        step_size = LR / (1.0 - b1**self.t)
        bc2_sqrt = math.sqrt(1.0 - b2**self.t)
        for k, p in params.items():
            g, m, v, tmp = grads[k], self.m[k], self.v[k], self.tmp[k]
            p *= 1.0 - LR * WD  # decoupled weight decay, on every parameter as in the torch run
            m *= b1
            m += (1.0 - b1) * g  # exp_avg.lerp_(grad, 1 - beta1)
            v *= b2
            np.multiply(g, g, out=tmp)
            tmp *= 1.0 - b2
            v += tmp  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
            np.sqrt(v, out=tmp)
            tmp /= bc2_sqrt
            tmp += EPS  # denom
            np.divide(m, tmp, out=tmp)
            tmp *= step_size
            p -= tmp  # p.addcdiv_(exp_avg, denom, value=-step_size)


def build_torch(np_model: MiniGPT, attn: str):
    """The same GPT-2 in torch (nn.Linear layout [out, in]), initialised from the numpy model's weights."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    V, T, d, nh = np_model.vocab_size, np_model.block_size, np_model.n_embd, np_model.n_head
    hs = d // nh

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).tril(), persistent=False)

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
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
            self.h = nn.ModuleList(Block() for _ in range(np_model.n_layer))
            self.ln_f = nn.LayerNorm(d, eps=1e-5)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    model = GPT()
    p = np_model.params
    with torch.no_grad():
        model.wte.weight.copy_(torch.from_numpy(p["transformer.wte.weight"]))
        model.wpe.weight.copy_(torch.from_numpy(p["transformer.wpe.weight"]))
        for i, blk in enumerate(model.h):
            h = f"transformer.h.{i}."
            for mod, name in ((blk.ln_1, "ln_1"), (blk.ln_2, "ln_2")):
                mod.weight.copy_(torch.from_numpy(p[h + name + ".weight"]))
                mod.bias.copy_(torch.from_numpy(p[h + name + ".bias"]))
            for mod, name in ((blk.c_attn, "attn.c_attn"), (blk.c_proj, "attn.c_proj"), (blk.c_fc, "mlp.c_fc"),
                              (blk.mlp_proj, "mlp.c_proj")):  # fmt: skip
                mod.weight.copy_(torch.from_numpy(p[h + name + ".weight"].T.copy()))  # Conv1D [in, out] -> [out, in]
                mod.bias.copy_(torch.from_numpy(p[h + name + ".bias"]))
        model.ln_f.weight.copy_(torch.from_numpy(p["transformer.ln_f.weight"]))
        model.ln_f.bias.copy_(torch.from_numpy(p["transformer.ln_f.bias"]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
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
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return peak, peak


def make_setup(args):
    spec = DataSpec(vocab_size=args.vocab, block_size=args.block)
    model = MiniGPT(spec, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block,
                    dtype="float32", rng=np.random.default_rng(0))  # fmt: skip
    r = np.random.default_rng(1)
    x = r.integers(0, args.vocab, (args.batch, args.block))
    y = r.integers(0, args.vocab, (args.batch, args.block))
    return model, Batch(ids=np.arange(args.batch), x=x, y=y)


def run_memory(args) -> dict:
    model, batch = make_setup(args)
    opt = NumpyAdamW(model.params)
    marks = {}
    for step in range(1, 1001):
        _, grads = model.loss_and_grads(batch, None)
        opt.step(model.params, grads)
        if step in (100, 1000):
            marks[step] = peak_rss_mb()
    growth = 100.0 * (marks[1000][0] - marks[100][0]) / marks[100][0]
    out = {
        "mode": "memory", "threads": args.threads,
        "peak_rss_mb_100": round(marks[100][0], 1), "peak_rss_mb_1000": round(marks[1000][0], 1),
        "rss_mb_100": round(marks[100][1], 1), "rss_mb_1000": round(marks[1000][1], 1),
        "peak_growth_pct": round(growth, 2),
    }  # fmt: skip
    print(f"numpy peak RSS (VmHWM): {out['peak_rss_mb_100']} MiB after 100 steps, "
          f"{out['peak_rss_mb_1000']} MiB after 1000 steps: growth {out['peak_growth_pct']}%")  # fmt: skip
    print(f"current RSS (VmRSS): {out['rss_mb_100']} -> {out['rss_mb_1000']} MiB")
    return out


def run_speed(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model, batch = make_setup(args)
    opt = NumpyAdamW(model.params)
    xt, yt = torch.from_numpy(batch.x), torch.from_numpy(batch.y)
    V = args.vocab
    torch_models = {a: build_torch(model, a) for a in ("sdpa", "manual")}
    # Same weights, same batch: the first losses must agree (a check that the two models are the same).
    with torch.no_grad():
        t_loss = torch.nn.functional.cross_entropy(torch_models["sdpa"][0](xt).view(-1, V), yt.view(-1)).item()
    np_loss = model.evaluate(batch)

    def numpy_step():
        t0 = time.perf_counter()
        _, grads = model.loss_and_grads(batch, None)
        t1 = time.perf_counter()
        opt.step(model.params, grads)
        return time.perf_counter() - t0, t1 - t0

    def torch_step(name):
        tm, topt = torch_models[name]

        def step():
            t0 = time.perf_counter()
            topt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(tm(xt).view(-1, V), yt.view(-1))
            loss.backward()
            t1 = time.perf_counter()
            topt.step()
            return time.perf_counter() - t0, t1 - t0

        return step

    runners = {"numpy": numpy_step, "torch_sdpa": torch_step("sdpa"), "torch_manual": torch_step("manual")}
    times = {k: [] for k in runners}
    for fn in runners.values():  # warm-up
        for _ in range(args.warmup):
            fn()
    # Interleaved blocks, so load from elsewhere on the machine hits every contestant alike.
    block = 10
    for _ in range(math.ceil(args.steps / block)):
        for name, fn in runners.items():
            times[name] += [fn() for _ in range(block)]
    med = {k: statistics.median(t[0] for t in v) * 1e3 for k, v in times.items()}
    fastest = {k: min(t[0] for t in v) * 1e3 for k, v in times.items()}  # less sensitive to neighbours' load
    med_fb = {k: statistics.median(t[1] for t in v) * 1e3 for k, v in times.items()}
    best_torch = min(("torch_sdpa", "torch_manual"), key=med.get)
    # Every contestant made the same number of AdamW updates on the same batch: the losses should still agree.
    final = {"numpy": model.evaluate(batch)}
    with torch.no_grad():
        for name, (tm, _) in torch_models.items():
            final[f"torch_{name}"] = torch.nn.functional.cross_entropy(tm(xt).view(-1, V), yt.view(-1)).item()
    step_flops = 3 * forward_flops(V, args.batch, args.block, args.n_embd, args.n_layer, args.n_head)
    mm = matmul_gflops()
    out = {
        "mode": "speed", "threads": args.threads, "steps": len(times["numpy"]), "warmup": args.warmup,
        "V": V, "B": args.batch, "T": args.block, "d": args.n_embd, "n_head": args.n_head, "n_layer": args.n_layer,
        "numpy_ms": round(med["numpy"], 2), "numpy_fwd_bwd_ms": round(med_fb["numpy"], 2),
        "torch_sdpa_ms": round(med["torch_sdpa"], 2), "torch_manual_ms": round(med["torch_manual"], 2),
        "numpy_min_ms": round(fastest["numpy"], 2), "torch_sdpa_min_ms": round(fastest["torch_sdpa"], 2),
        "torch_manual_min_ms": round(fastest["torch_manual"], 2),
        "torch_best": best_torch, "ratio_numpy_over_torch": round(med["numpy"] / med[best_torch], 3),
        "step_gflop": round(step_flops / 1e9, 3),
        "numpy_step_gflops": round(step_flops / med["numpy"] / 1e6, 1),
        "numpy_fwd_bwd_gflops": round(step_flops / med_fb["numpy"] / 1e6, 1),
        "numpy_matmul256_gflops": round(mm, 1),
        "init_loss_numpy": round(np_loss, 6), "init_loss_torch": round(t_loss, 6),
        "final_loss": {k: round(v, 6) for k, v in final.items()}, "updates_each": args.warmup + len(times["numpy"]),
        "loadavg_1min": round(os.getloadavg()[0], 2), "torch": torch.__version__, "numpy_version": np.__version__,
    }  # fmt: skip
    print(f"threads {args.threads}, V={V} B={args.batch} T={args.block} d={args.n_embd} heads={args.n_head} "
          f"layers={args.n_layer} float32; median of {out['steps']} steps after {args.warmup} warm-up")  # fmt: skip
    print(f"{'':14s} {'step ms':>9s} {'fwd+bwd ms':>11s} {'optim ms':>9s} {'min step ms':>12s}")
    for k in runners:
        print(f"{k:14s} {med[k]:9.2f} {med_fb[k]:11.2f} {med[k] - med_fb[k]:9.2f} {fastest[k]:12.2f}")
    print(f"numpy / {best_torch}: {out['ratio_numpy_over_torch']:.3f}   "
          f"step {out['step_gflop']} GFLOP -> numpy {out['numpy_step_gflops']} GFLOP/s "
          f"(fwd+bwd {out['numpy_fwd_bwd_gflops']}); numpy f32 matmul n=256: {out['numpy_matmul256_gflops']} GFLOP/s")  # fmt: skip
    print(f"loss numpy / torch: initial {np_loss:.6f} / {t_loss:.6f}, after {out['updates_each']} AdamW updates "
          + ", ".join(f"{k} {v:.6f}" for k, v in final.items()) + f"; 1-min load average {out['loadavg_1min']}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="BLAS threads for numpy and torch.set_num_threads")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per contestant (>= 50)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--memory", action="store_true", help="peak RSS after 100 and 1000 numpy steps instead")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    args = ap.parse_args(argv)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        out = run_memory(args) if args.memory else run_speed(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
