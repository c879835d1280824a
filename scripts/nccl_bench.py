#!/usr/bin/env python3
"""NCCL's AllReduce, ReduceScatter, AllGather, Broadcast and Reduce through torch.distributed, one
process per GPU, in the nccl-tests convention, for comparison with `oxccl bench ... --gpus N`.

size = the larger per-rank buffer in bytes (AllReduce, Broadcast, Reduce: the tensor; ReduceScatter:
the input; AllGather: the output); algbw = size / time; busbw = algbw x 2(n-1)/n (AllReduce),
(n-1)/n (ReduceScatter, AllGather) or 1 (Broadcast, Reduce; root 0, as `oxccl bench`'s default).
time = the slowest rank's mean over the timed iterations (CUDA events), after warm-up.
AllReduce, Broadcast and Reduce run in place (torch's only form); ReduceScatter and AllGather out
of place.

Each value of --ctas runs in fresh processes with NCCL_MAX_CTAS set to it ("default": unset).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others below), whatever the caller's
environment says.

    python3 scripts/nccl_bench.py --gpus 2 --ctas 4,8,16,32,default -b 1M -e 4G -f 4
"""

import argparse
import json
import os
import sys

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    if s and s[-1] in units:
        return int(s[:-1]) * units[s[-1]]
    return int(s)


def worker(rank, world, args, ctas, port, out_path):
    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    rows = []
    dtype = torch.float32
    elem = 4
    for coll in args.collectives.split(","):
        size = args.min_bytes
        while size <= args.max_bytes:
            t = inp = out = call = None  # the previous size's tensors go before the next are made
            torch.cuda.empty_cache()
            if coll == "all_reduce":
                t = torch.ones(size // elem, dtype=dtype, device="cuda")
                call = lambda: dist.all_reduce(t)  # noqa: E731
            elif coll == "reduce_scatter":
                count = size // elem // world
                inp = torch.ones(count * world, dtype=dtype, device="cuda")
                out = torch.empty(count, dtype=dtype, device="cuda")
                call = lambda: dist.reduce_scatter_tensor(out, inp)  # noqa: E731
            elif coll == "broadcast":
                # The root's value everywhere after a call (and after every later one).
                t = torch.full((size // elem,), 7.0 if rank == 0 else 0.0, dtype=dtype, device="cuda")
                call = lambda: dist.broadcast(t, src=0)  # noqa: E731
            elif coll == "reduce":
                # Ones on every rank; the root's tensor holds the sum after the first call.
                t = torch.ones(size // elem, dtype=dtype, device="cuda")
                call = lambda: dist.reduce(t, dst=0)  # noqa: E731
            else:
                count = size // elem // world
                inp = torch.full((count,), float(rank), dtype=dtype, device="cuda")
                out = torch.empty(count * world, dtype=dtype, device="cuda")
                call = lambda: dist.all_gather_into_tensor(out, inp)  # noqa: E731
            # Correctness of one call, so a misconfigured run cannot report a bandwidth.
            call()
            torch.cuda.synchronize()
            if coll == "all_reduce":
                ok = bool((t == world).all())
            elif coll == "reduce_scatter":
                ok = bool((out == world).all())
            elif coll == "broadcast":
                ok = bool((t == 7.0).all())
            elif coll == "reduce":
                ok = rank != 0 or bool((t == world).all())
            else:
                ok = bool((out.view(world, -1) == torch.arange(world, dtype=dtype, device="cuda").view(world, 1)).all())
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            dist.barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                call()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / args.iters
            agg = torch.tensor([us, 0.0 if ok else 1.0], device="cuda")
            dist.all_reduce(agg, op=dist.ReduceOp.MAX)
            us, wrong = agg[0].item(), int(agg[1].item())
            algbw = size / (us * 1e-6) / 1e9
            factor = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0, "reduce": 1.0}.get(coll, (world - 1) / world)
            rows.append({"library": "nccl", "collective": coll, "ranks": world, "nccl_max_ctas": ctas,
                         "size": size, "time_us": us, "algbw": algbw, "busbw": algbw * factor,
                         "wrong_ranks": wrong})
            size *= args.factor
        t = inp = out = call = None
        torch.cuda.empty_cache()
    if rank == 0:
        with open(out_path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=0, help="GPUs (default: all visible)")
    p.add_argument("--ctas", default="default", help="comma-separated NCCL_MAX_CTAS values; 'default' leaves it unset")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("-b", "--minbytes", dest="min_bytes", type=parse_size, default=1 << 20)
    p.add_argument("-e", "--maxbytes", dest="max_bytes", type=parse_size, default=1 << 30)
    p.add_argument("-f", "--stepfactor", dest="factor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--json", action="store_true", help="also print each run's rows as JSON lines")
    args = p.parse_args()
    if args.factor < 2:
        sys.exit("--stepfactor must be at least 2")
    for c in args.collectives.split(","):
        if c not in COLLECTIVES:
            sys.exit(f"unknown collective {c!r} ({', '.join(COLLECTIVES)})")

    os.environ.update(NO_MULTICAST)
    import torch
    import torch.multiprocessing as mp

    world = args.gpus or torch.cuda.device_count()
    if world < 2 or world > torch.cuda.device_count():
        sys.exit(f"--gpus {world}: {torch.cuda.device_count()} GPUs visible, need at least 2")
    if args.min_bytes < 4 * world or args.max_bytes < args.min_bytes:
        sys.exit(f"sizes {args.min_bytes}..{args.max_bytes}: need {4 * world} <= -b <= -e "
                 "(ReduceScatter and AllGather give every rank at least one float)")
    print(f"# nccl {'.'.join(map(str, torch.cuda.nccl.version()))} via torch {torch.__version__}: {' '.join(sys.argv)}")
    print(f"# device: {torch.cuda.get_device_name(0)} x {world}, one process per GPU, float sum, "
          f"{args.iters} iterations after {args.warmup} warm-up; NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
    all_rows = []
    for i, ctas in enumerate(args.ctas.split(",")):
        if ctas == "default":
            os.environ.pop("NCCL_MAX_CTAS", None)
        else:
            os.environ["NCCL_MAX_CTAS"] = str(int(ctas))
        out_path = f"/tmp/nccl_bench_{os.getpid()}_{i}.jsonl"
        try:
            mp.spawn(worker, args=(world, args, ctas, 29500 + (os.getpid() + i) % 1000, out_path), nprocs=world)
            with open(out_path) as f:
                rows = [json.loads(line) for line in f]
        finally:
            if os.path.exists(out_path):
                os.remove(out_path)
        for coll in args.collectives.split(","):
            sel = [r for r in rows if r["collective"] == coll]
            print(f"# {coll}, NCCL_MAX_CTAS={ctas}")
            print(f"# {'size':>12} {'time(us)':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>6}")
            for r in sel:
                print(f"  {r['size']:>12} {r['time_us']:>10.1f} {r['algbw']:>8.2f} {r['busbw']:>8.2f} {r['wrong_ranks']:>6}")
            big = [r["busbw"] for r in sel if r["size"] >= 64 << 20]
            if big:
                print(f"# mean busbw at >= 64 MiB: {sum(big) / len(big):.2f} GB/s")
        if args.json:
            for r in rows:
                print(json.dumps(r))
        sys.stdout.flush()
        all_rows += rows
    if any(r["wrong_ranks"] for r in all_rows):
        sys.exit("wrong results (see #wrong)")


if __name__ == "__main__":
    main()
