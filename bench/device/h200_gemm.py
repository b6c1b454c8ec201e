#!/usr/bin/env python3
"""Measurements for the GPU verification challenge (issue 40): GEMM throughput by size and dtype,
seeded generation of A and B, Merkle-commitment costs (GPU SHA-256 of rows, device-to-host copy,
CPU SHA-256), Freivalds cost and error by dtype, and a CPU-reproducible generator.

Read-only towards the GPU's settings: it only allocates memory and launches kernels.
Writes $OUT/gemm.json after every measurement, so a run cut short still leaves its data.
DRY=1 runs the same code on the CPU with tiny sizes (a check without a GPU)."""
import hashlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

T0 = time.time()
OUT = os.environ.get("OUT") or sys.exit("OUT is not set")
BUDGET = float(os.environ.get("BUDGET_S", "150"))  # seconds of measurements, import included
DRY = os.environ.get("DRY") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))
FILL = float(os.environ.get("FILL", "0.90"))  # fraction of free memory for A + B + C at the big size
GiB = 1 << 30


def elapsed():
    return time.time() - T0


def left():
    return BUDGET - elapsed()


def log(*a):
    print(f"[{elapsed():7.1f}s]", *a, flush=True)


R = {
    "schema": "gpumarket.gemm-bench/1",
    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0)),
    "started_epoch": T0,
    "budget_s": BUDGET,
    "dry_run": DRY,
    "fill": FILL,
    "env": {},
    "gemm": [],
    "big": [],
    "freivalds": [],
    "commit": {},
    "gen_portable": {},
    "cpu_verifier": {},
    "skipped": [],
    "errors": [],
    "phases": [],
}


def save():
    path = os.path.join(OUT, "gemm.json")
    R["elapsed_s"] = round(elapsed(), 2)
    with open(path + ".tmp", "w") as f:
        json.dump(R, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def err(where, e):
    log(f"ERROR in {where}: {type(e).__name__}: {e}")
    R["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
    save()


def skip(what, why):
    log(f"skip {what}: {why}")
    R["skipped"].append({"what": what, "why": why})


try:
    import torch
except Exception as e:
    err("import torch", e)
    print("FATAL: torch cannot be imported", file=sys.stderr)
    sys.exit(2)

R["env"].update(python=sys.version.split()[0], torch=torch.__version__, torch_cuda=torch.version.cuda,
                cpu_threads=torch.get_num_threads())
CUDA = torch.cuda.is_available()
if not CUDA and not DRY:
    R["errors"].append({"where": "init", "error": "CUDA is not available to torch (no GPU, driver or CUDA build)"})
    save()
    print("FATAL: torch.cuda.is_available() is False: no GPU here (set DRY=1 for a CPU dry run)", file=sys.stderr)
    sys.exit(3)
DEV = torch.device("cuda" if CUDA else "cpu")
log("torch", torch.__version__, "cuda", torch.version.cuda, "device", DEV)

if CUDA:
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    R["env"].update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    total_memory=p.total_memory, free_at_start=free, mem_total=total,
                    l2_bytes=getattr(p, "L2_cache_size", None))
for flag in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
    try:
        R["env"][flag + "_default"] = getattr(torch.backends.cuda.matmul, flag)
    except Exception as e:
        R["env"][flag + "_default"] = f"unreadable: {e}"
save()


def sync():
    if CUDA:
        torch.cuda.synchronize()


class Timer:
    """Seconds of GPU work between start and stop (CUDA events), or wall time on the CPU."""

    def __enter__(self):
        if CUDA:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if CUDA:
            self.b.record()
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t


def wall(fn):
    sync()
    t = time.perf_counter()
    r = fn()
    sync()
    return time.perf_counter() - t, r


def phase(name):
    R["phases"].append({"name": name, "t_epoch": time.time(), "t_rel": round(elapsed(), 2)})
    log("==", name)


def free_mem():
    if CUDA:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]
    return int(os.environ.get("DRY_FREE", str(64 << 20)))


def set_tf32(on):
    try:
        torch.backends.cuda.matmul.allow_tf32 = bool(on)
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except Exception as e:
        err("set allow_tf32", e)
        return None


# ---------------------------------------------------------------- configurations
F8 = getattr(torch, "float8_e4m3fn", None)
CONFIGS = [
    {"name": "fp32", "dt": torch.float32, "out": torch.float32, "tf32": False},
    {"name": "tf32", "dt": torch.float32, "out": torch.float32, "tf32": True},
    {"name": "bf16", "dt": torch.bfloat16, "out": torch.bfloat16, "tf32": False},
    {"name": "fp16", "dt": torch.float16, "out": torch.float16, "tf32": False},
]
FP8_OK = False
if F8 is not None and hasattr(torch, "_scaled_mm"):
    try:
        a = torch.randn(64, 64, device=DEV).to(F8)
        one = torch.ones((), device=DEV)
        c = torch.empty(64, 64, device=DEV, dtype=torch.bfloat16)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, out=c)
        ref = a.float() @ a.float().t()
        sync()
        FP8_OK = bool(torch.allclose(c.float(), ref, rtol=2e-2, atol=1e-1))
        if not FP8_OK:
            R["env"]["fp8_probe"] = "torch._scaled_mm ran but its product differs from the fp32 one"
    except Exception as e:
        R["env"]["fp8_probe"] = f"{type(e).__name__}: {str(e)[:300]}"
if FP8_OK:
    # C = A @ B^T with A, B row-major e4m3 (cuBLASLt wants the second operand column-major), out bf16
    CONFIGS.append({"name": "fp8e4m3", "dt": F8, "out": torch.bfloat16, "tf32": False, "fp8": True})
else:
    skip("fp8", R["env"].get("fp8_probe", "torch._scaled_mm or float8_e4m3fn missing"))
R["env"]["fp8"] = FP8_OK
ONE = torch.ones((), device=DEV, dtype=torch.float32)


def isz(dt):
    return torch.empty((), dtype=dt).element_size()


def gen_ab(n, cfg, seed):
    """A and B from a seed with torch's own generator on the device (Philox on CUDA)."""
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    if cfg.get("fp8"):
        rows = max(1, (256 << 20) // (2 * n))
        mats = []
        for _ in range(2):
            m = torch.empty(n, n, dtype=cfg["dt"], device=DEV)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                m[r0:r1].copy_(torch.randn(r1 - r0, n, generator=g, device=DEV, dtype=torch.float16))
            mats.append(m)
        return mats
    a = torch.randn(n, n, generator=g, device=DEV, dtype=cfg["dt"])
    b = torch.randn(n, n, generator=g, device=DEV, dtype=cfg["dt"])
    return [a, b]


def mm_fn(cfg, a, b, c):
    if cfg.get("fp8"):
        bt = b.t()

        def f():
            torch._scaled_mm(a, bt, scale_a=ONE, scale_b=ONE, out_dtype=torch.bfloat16, out=c)
    else:
        def f():
            torch.mm(a, b, out=c)
    return f


def time_gemm(f, n, cap_s=6.0):
    """First (cold) call, then up to 5 timed calls: median and all of them."""
    with Timer() as t:
        f()
    first = t.s
    reps = 5 if first * 5 <= 3 else (3 if first * 3 <= cap_s else 1)
    ts = []
    for _ in range(reps):
        with Timer() as t:
            f()
        ts.append(t.s)
        if sum(ts) > cap_s and len(ts) >= 1 and first > 1:
            break
    med = statistics.median(ts)
    return {"first_s": first, "times_s": ts, "median_s": med, "tflops": 2 * n ** 3 / med / 1e12,
            "tflops_first": 2 * n ** 3 / first / 1e12}


# ---------------------------------------------------------------- Freivalds
def matvec(m, v, rdt, transpose=False, absval=False, chunk_bytes=512 << 20):
    """m @ v (or m^T @ v) in dtype rdt, converting m by row chunks (never a full-size copy)."""
    n_rows, n_cols = m.shape
    rows = max(1, chunk_bytes // (n_cols * isz(rdt)))
    out = torch.zeros(n_cols if transpose else n_rows, dtype=rdt, device=DEV)
    for r0 in range(0, n_rows, rows):
        r1 = min(n_rows, r0 + rows)
        blk = m[r0:r1]
        blk = (blk.float() if blk.element_size() == 1 else blk).to(rdt)
        if absval:
            blk = blk.abs()
        if transpose:
            out += blk.t() @ v[r0:r1]
        else:
            out[r0:r1] = blk @ v
    return out


def freivalds(a, b, c, cfg, n, seed, where):
    """C r against A (B r) (A (B^T r) for fp8, where C = A B^T): time and error, r in fp32 and fp64."""
    bt = bool(cfg.get("fp8"))
    res = {"dtype": cfg["name"], "n": n, "where": where}
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    r64 = torch.randn(n, generator=g, device=DEV, dtype=torch.float64)
    with Timer() as t:
        scale = matvec(a, matvec(b, r64.abs(), torch.float64, transpose=bt, absval=True), torch.float64, absval=True)
    res["scale_s"] = t.s
    for rdt, rn in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        r = r64.to(rdt)
        with Timer() as t1:
            y_c = matvec(c, r, rdt)
        with Timer() as t2:
            y_ab = matvec(a, matvec(b, r, rdt, transpose=bt), rdt)
        d = (y_c.double() - y_ab.double()).abs()
        ref = y_ab.double().abs()
        big = ref >= 0.01 * ref.pow(2).mean().sqrt()
        ratio = d / scale.clamp_min(1e-300)
        q = ratio if ratio.numel() <= (1 << 24) else ratio[: 1 << 24]
        res[rn] = {
            "Cr_s": t1.s, "ABr_s": t2.s,
            "Cr_GBps": c.numel() * c.element_size() / t1.s / 1e9,
            "max_abs_diff": d.max().item(), "max_abs_ref": ref.max().item(),
            "rel_inf": (d.max() / ref.max()).item(),
            "rel_l2": (d.norm() / ref.norm()).item(),
            "max_rel_elem_over_1pct_rms": (d[big] / ref[big]).max().item() if big.any() else None,
            "max_diff_over_scale": ratio.max().item(),
            "p999_diff_over_scale": torch.quantile(q.float(), 0.999).item(),
            "median_diff_over_scale": q.float().median().item(),
        }
        del y_c, y_ab, d, ref, big, ratio, q
    R["freivalds"].append(res)
    f32 = res["fp32"]
    log(f"  freivalds {cfg['name']} n={n}: C·r {f32['Cr_s']*1e3:.2f} ms, A(Br) {f32['ABr_s']*1e3:.2f} ms, "
        f"rel_inf fp32 {f32['rel_inf']:.2e} fp64 {res['fp64']['rel_inf']:.2e}, "
        f"max |d|/(|A||B||r|) fp64 {res['fp64']['max_diff_over_scale']:.2e}")
    save()
    return res


# ---------------------------------------------------------------- GPU SHA-256 of rows
SHA = {"kernel": None, "why": None}


def sha_kernel():
    if SHA["kernel"] is not None or SHA["why"] is not None:
        return SHA["kernel"]
    if not CUDA:
        SHA["why"] = "no GPU"
        return None
    try:
        import cupy
        src = open(os.path.join(HERE, "sha256_rows.cu")).read()
        t = time.perf_counter()
        k = cupy.RawKernel(src, "sha256_rows", options=("-std=c++14",))
        k.compile()
        R["commit"]["gpu_sha_compile_s"] = time.perf_counter() - t
        R["commit"]["cupy"] = cupy.__version__
        SHA["kernel"] = (cupy, k)
    except Exception as e:
        SHA["why"] = f"{type(e).__name__}: {str(e)[:300]}"
        err("gpu sha256 kernel", e)
    return SHA["kernel"]


def gpu_sha_rows(c, r0, r1):
    """SHA-256 of rows r0..r1 of c on the GPU: (seconds, digests as a (rows, 32) uint8 torch tensor)."""
    cupy, k = SHA["kernel"]
    u8 = c[r0:r1].view(torch.uint8)
    row_bytes = c.shape[1] * c.element_size()
    assert row_bytes % 64 == 0 and u8.is_contiguous()
    rows = r1 - r0
    out = torch.empty(rows, 32, dtype=torch.uint8, device=DEV)
    src = cupy.from_dlpack(u8)
    dst = cupy.from_dlpack(out)
    threads = 128
    sync()
    with Timer() as t:
        k(((rows + threads - 1) // threads,), (threads,), (src, cupy.uint64(row_bytes), cupy.uint64(rows), dst))
    return t.s, out


def gpu_hash_all(c, label, max_s=6.0):
    """Hash every row of c on the GPU if the estimate fits max_s, else as many rows as fit."""
    res = {"label": label, "rows": c.shape[0], "row_bytes": c.shape[1] * c.element_size()}
    if sha_kernel() is None:
        res["skipped"] = SHA["why"]
        return res, None
    n_rows = c.shape[0]
    probe = min(n_rows, 1024)
    t_probe, _ = gpu_sha_rows(c, 0, probe)
    res["probe_rows"], res["probe_s"] = probe, t_probe
    est = t_probe * math.ceil(n_rows / probe)  # pessimistic: no gain from more rows in flight
    res["estimate_full_s_pessimistic"] = est
    rows = n_rows if est <= max_s else max(probe, int(probe * max_s / t_probe))
    t_all, dig = gpu_sha_rows(c, 0, rows)
    res.update(hashed_rows=rows, hashed_s=t_all, GBps=rows * res["row_bytes"] / t_all / 1e9,
               full_s=t_all * n_rows / rows)
    log(f"  gpu sha256 {label}: {rows} rows of {res['row_bytes']} B in {t_all:.3f} s = {res['GBps']:.1f} GB/s")
    return res, dig


def merkle_root(leaves):
    level = list(leaves)
    while len(level) > 1:
        if len(level) % 2:
            level.append(level[-1])
        level = [hashlib.sha256(level[i] + level[i + 1]).digest() for i in range(0, len(level), 2)]
    return level[0]


def commit_costs(c, label):
    """Device-to-host copy, CPU SHA-256 of rows (1 and 16 threads), GPU SHA-256, Merkle root on the CPU."""
    res = {"label": label, "n": c.shape[0], "C_bytes": c.numel() * c.element_size()}
    row_bytes = c.shape[1] * c.element_size()
    try:
        gres, gdig = gpu_hash_all(c, label)
    except Exception as e:
        err("gpu sha " + label, e)
        gres, gdig = {"error": f"{type(e).__name__}: {e}"}, None
    res["gpu_sha"] = gres
    R["commit"][label] = res
    save()
    # device-to-host: pinned (2 GiB of rows at most) and pageable (1 GiB)
    k = max(1, min(c.shape[0], (2 * GiB) // row_bytes if not DRY else c.shape[0]))
    try:
        ta, host = wall(lambda: torch.empty(k, c.shape[1], dtype=c.dtype, pin_memory=CUDA))
        tc, _ = wall(lambda: host.copy_(c[:k], non_blocking=True))  # noqa: F821
        res["d2h_pinned"] = {"bytes": k * row_bytes, "alloc_s": ta, "copy_s": tc, "GBps": k * row_bytes / tc / 1e9}
        kp = max(1, min(k, GiB // row_bytes))
        tp, _ = wall(lambda: c[:kp].cpu())
        res["d2h_pageable"] = {"bytes": kp * row_bytes, "copy_s": tp, "GBps": kp * row_bytes / tp / 1e9}
        log(f"  d2h pinned {res['d2h_pinned']['GBps']:.1f} GB/s, pageable {res['d2h_pageable']['GBps']:.1f} GB/s")
    except Exception as e:
        err("d2h " + label, e)
        return res
    # CPU SHA-256 over the copied rows
    hv = host.view(torch.uint8).numpy()
    one = max(1, min(k, (256 << 20) // row_bytes))
    t = time.perf_counter()
    d1 = [hashlib.sha256(hv[i]).digest() for i in range(one)]
    t1 = time.perf_counter() - t
    threads = os.cpu_count() or 1
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        dn = list(ex.map(lambda i: hashlib.sha256(hv[i]).digest(), range(k)))  # noqa: F821
    tn = time.perf_counter() - t
    res["cpu_sha_1thread"] = {"rows": one, "s": t1, "GBps": one * row_bytes / t1 / 1e9}
    res["cpu_sha_threads"] = {"threads": threads, "rows": k, "s": tn, "GBps": k * row_bytes / tn / 1e9}
    res["cpu_sha_matches_first_rows"] = d1 == dn[:one]
    if gdig is not None:
        g = gdig[: min(k, gdig.shape[0])].cpu().numpy()
        res["gpu_sha_equals_hashlib"] = all(bytes(g[i]) == dn[i] for i in range(g.shape[0]))
        res["gpu_sha_compared_rows"] = int(g.shape[0])
    log(f"  cpu sha256 1 thread {res['cpu_sha_1thread']['GBps']:.2f} GB/s, {threads} threads "
        f"{res['cpu_sha_threads']['GBps']:.2f} GB/s, gpu==hashlib {res.get('gpu_sha_equals_hashlib')}")
    del host, hv
    save()
    return res


def merkle_cost(dig, n, label):
    leaves = [bytes(x) for x in dig.cpu().numpy()] if dig is not None else [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(n)]
    t = time.perf_counter()
    root = merkle_root(leaves)
    s = time.perf_counter() - t
    R["commit"].setdefault("merkle", []).append({"label": label, "leaves": len(leaves), "s": s, "root": root.hex(),
                                                  "from_gpu_digests": dig is not None})
    log(f"  merkle root over {len(leaves)} leaves on the CPU: {s*1e3:.0f} ms")


# ---------------------------------------------------------------- a generator the verifier can replay on a CPU
M64 = (1 << 64) - 1


def s64(x):
    return x - (1 << 64) if x >= (1 << 63) else x


def portable_rows(seed, r0, r1, n, dt, device):
    """splitmix64 of (seed, element index), top 24 bits -> uniform [-1, 1) -> dt. Integer ops only,
    so CPU and GPU give the same bits (int64 wraps on both)."""
    x = torch.arange(r0 * n, r1 * n, dtype=torch.int64, device=device)
    x.add_(s64((seed * 0x9E3779B97F4A7C15) & M64)).mul_(s64(0x9E3779B97F4A7C15))
    for sh, mul in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x.bitwise_xor_((x >> sh) & ((1 << (64 - sh)) - 1)).mul_(s64(mul))
    x.bitwise_xor_((x >> 31) & ((1 << 33) - 1))
    v = ((x >> 40) & 0xFFFFFF).to(torch.float32).mul_(1.0 / (1 << 23)).sub_(1.0)
    return v.view(r1 - r0, n).to(dt)


def portable_gen(n, dt, seed, device, chunk_elems=1 << 27):
    m = torch.empty(n, n, dtype=dt, device=device)
    rows = max(1, chunk_elems // n)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        m[r0:r1] = portable_rows(seed, r0, r1, n, dt, device)
    return m


# ================================================================= measurements
SEED = 20261130
SIZES = [4096, 8192, 16384, 32768] if not DRY else [256, 512]
RESERVE = 12.0  # seconds kept for the end
rate = {}  # (cfg name) -> tflops at the largest small n


def run_small():
    phase("small sizes")
    # torch's CUDA generator: same seed, same bits?
    try:
        g1 = gen_ab(SIZES[0], CONFIGS[2], SEED)
        g2 = gen_ab(SIZES[0], CONFIGS[2], SEED)
        R["env"]["randn_same_seed_same_bits"] = bool(torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1]))
        del g1, g2
    except Exception as e:
        err("randn determinism", e)
    for cfg in CONFIGS:
        R["env"][cfg["name"] + "_allow_tf32"] = set_tf32(cfg["tf32"])
        for n in SIZES:
            if left() < RESERVE + 70:  # keep time for the big sizes
                skip(f"{cfg['name']} n={n}", f"time: {left():.0f} s left")
                continue
            try:
                row = {"dtype": cfg["name"], "n": n, "t_start": time.time()}
                with Timer() as t:
                    a, b = gen_ab(n, cfg, SEED + n)
                row["gen_s"] = t.s
                row["gen_GBps"] = 2 * n * n * isz(cfg["dt"]) / t.s / 1e9
                c = torch.empty(n, n, dtype=cfg["out"], device=DEV)
                f = mm_fn(cfg, a, b, c)
                row.update(time_gemm(f, n))
                if n == SIZES[-1]:
                    c2 = torch.empty_like(c)
                    mm_fn(cfg, a, b, c2)()
                    sync()
                    row["same_bits_on_rerun"] = bool(torch.equal(c.view(torch.uint8), c2.view(torch.uint8)))
                    del c2
                row["t_end"] = time.time()
                R["gemm"].append(row)
                log(f"{cfg['name']:8s} n={n:6d}: {row['tflops']:8.1f} TFLOP/s (first {row['tflops_first']:.1f}), "
                    f"median {row['median_s']*1e3:.2f} ms of {len(row['times_s'])}, gen {row['gen_s']*1e3:.2f} ms")
                rate[cfg["name"]] = row["tflops"]
                freivalds(a, b, c, cfg, n, SEED + 7 * n, "small")
                if cfg["name"] == "bf16" and n == SIZES[-1]:
                    commit_costs(c, f"bf16_n{n}")
                del a, b, c, f
                save()
            except Exception as e:
                err(f"small {cfg['name']} n={n}", e)
            if CUDA:
                torch.cuda.empty_cache()
    set_tf32(False)


def run_portable():
    phase("portable generator and CPU verifier rates")
    n = SIZES[-1]
    res = {"n": n, "dtype": "bf16"}
    try:
        t, m = wall(lambda: portable_gen(n, torch.bfloat16, SEED, DEV))
        res["gpu_gen_s"], res["gpu_gen_Gelem_per_s"] = t, n * n / t / 1e9
        rows = min(n, 256 if not DRY else n)
        t, cpu = wall(lambda: portable_rows(SEED, 0, rows, n, torch.bfloat16, "cpu"))
        res["cpu_rows"], res["cpu_gen_s"], res["cpu_gen_Gelem_per_s"] = rows, t, rows * n / t / 1e9
        res["cpu_equals_gpu"] = bool(torch.equal(cpu.view(torch.int16), m[:rows].cpu().view(torch.int16)))
        res["mean"], res["std"] = m[:rows].float().mean().item(), m[:rows].float().std().item()
        del m, cpu
        log(f"  portable gen: GPU {res['gpu_gen_Gelem_per_s']:.1f} Gelem/s, CPU {res['cpu_gen_Gelem_per_s']:.3f} Gelem/s, "
            f"CPU==GPU {res['cpu_equals_gpu']}")
    except Exception as e:
        err("portable generator", e)
    R["gen_portable"] = res
    # CPU matrix-vector rate (the verifier's A(Br) if it regenerates A and B on a CPU)
    try:
        rows = 2048 if not DRY else 128
        m = torch.randn(rows, n, dtype=torch.float32)
        v = torch.randn(n, dtype=torch.float32)
        m @ v
        t = time.perf_counter()
        for _ in range(5):
            m @ v
        s = (time.perf_counter() - t) / 5
        md = m.double()
        vd = v.double()
        t = time.perf_counter()
        for _ in range(3):
            md @ vd
        sd = (time.perf_counter() - t) / 3
        R["cpu_verifier"] = {"rows": rows, "n": n, "fp32_matvec_s": s, "fp32_GBps": rows * n * 4 / s / 1e9,
                             "fp64_matvec_s": sd, "fp64_GBps": rows * n * 8 / sd / 1e9,
                             "threads": torch.get_num_threads()}
        log(f"  cpu matvec fp32 {R['cpu_verifier']['fp32_GBps']:.1f} GB/s, fp64 {R['cpu_verifier']['fp64_GBps']:.1f} GB/s")
    except Exception as e:
        err("cpu verifier", e)
    save()


def run_big(cfg):
    name = cfg["name"]
    free = free_mem()
    per_el = 2 * isz(cfg["dt"]) + isz(cfg["out"])
    n = int(math.sqrt(FILL * free / per_el)) // 1024 * 1024 if not DRY else int(math.sqrt(FILL * free / per_el)) // 64 * 64
    res = {"dtype": name, "n": n, "free_before": free, "bytes_ABC": n * n * per_el, "fill_of_free": n * n * per_el / free,
           "t_start": time.time()}
    if CUDA:
        res["fill_of_total"] = n * n * per_el / torch.cuda.mem_get_info()[1]
    r = rate.get(name)
    est = 2 * n ** 3 / (r * 1e12) if r else None
    res["estimate_gemm_s"] = est
    if est is None:
        skip(f"big {name}", "no small-size rate")
        return
    # generation + 2 products + Freivalds/hash (~ a few s); fall back to one product
    runs = 2 if est * 2 + 8 <= left() - RESERVE else (1 if est + 6 <= left() - RESERVE else 0)
    if runs == 0:
        res["skipped"] = f"estimate {est:.1f} s per product, {left():.0f} s left"
        R["big"].append(res)
        skip(f"big {name} n={n}", res["skipped"])
        save()
        return
    phase(f"big {name} n={n}")
    R["big"].append(res)
    try:
        set_tf32(cfg["tf32"])
        with Timer() as t:
            a, b = gen_ab(n, cfg, SEED + 1)
        res["gen_s"], res["gen_GBps"] = t.s, 2 * n * n * isz(cfg["dt"]) / t.s / 1e9
        c = torch.empty(n, n, dtype=cfg["out"], device=DEV)
        if CUDA:
            res["mem_used_after_alloc"] = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        f = mm_fn(cfg, a, b, c)
        ts, te = [], []
        for i in range(runs):
            te.append(time.time())
            with Timer() as t:
                f()
            ts.append(t.s)
            log(f"  big {name} n={n} run {i+1}: {t.s:.3f} s = {2*n**3/t.s/1e12:.1f} TFLOP/s")
            res.update(times_s=ts, run_start_epoch=te, tflops=[2 * n ** 3 / x / 1e12 for x in ts])
            save()
        res["t_gemm_end"] = time.time()
        if left() > RESERVE + 4:
            freivalds(a, b, c, cfg, n, SEED + 99, "big")
        if left() > RESERVE + 4:
            try:
                g, dig = gpu_hash_all(c, f"{name}_n{n}", max_s=min(6.0, left() - RESERVE - 2))
                res["gpu_sha"] = g
                if dig is not None and dig.shape[0] == n:
                    merkle_cost(dig, n, f"{name}_n{n}")
            except Exception as e:
                err(f"gpu sha big {name}", e)
        res["t_end"] = time.time()
        del a, b, c, f
    except Exception as e:
        err(f"big {name} n={n}", e)
    finally:
        set_tf32(False)
        free_mem()
    save()


def main():
    run_small()
    run_portable()
    order = ["bf16", "fp16", "tf32", "fp8e4m3", "fp32"]
    for name in order:
        cfg = next((c for c in CONFIGS if c["name"] == name), None)
        if cfg is None:
            continue
        if left() < RESERVE + 5:
            skip(f"big {name}", f"time: {left():.0f} s left")
            continue
        run_big(cfg)
    phase("done")
    save()
    log("done; errors:", len(R["errors"]), "skipped:", len(R["skipped"]))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        err("main", e)
        sys.exit(1)
