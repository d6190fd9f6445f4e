"""What bench/sweep.py's processes cost per second with NO load: the outbox's fixed background cost (issue #38).

Starts one bench/sweep.py stage (the same processes, command lines and environment: relay, the outbox worker,
the two plain workers, their clients), sends ``--warm`` orders through each mode at 25/s so every process has
done its first work, waits ``--settle`` seconds, then reads utime + stime of every process of the path from
``/proc`` before and after ``--seconds`` of idleness. Prints CPU ms per second per process (each pool process
and Postgres backend apart) and per kind; writes bench/results/<name>.json.

    .venv/bin/python bench/sweep_idle.py [--concurrency 2] [--seconds 60] [--warm 50] [--settle 10] [--spy DIR]
        [--strace DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import write_result  # noqa: E402
from bench.sweep import MODES, TICKS, DirectRabbit, Stage, git_head, uptime  # noqa: E402


def thread_ticks(pid: int) -> dict[str, int]:
    """utime + stime of each thread of ``pid`` (``<tid> <comm>`` -> clock ticks)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[f"{task.name} {comm}"] = int(fields[11]) + int(fields[12])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warm", type=int, default=50, help="orders per mode before the idle window (0: none)")
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--name", default="sweep_idle")
    parser.add_argument("--spy", default="", help="a directory: py-spy record (active samples) of the relay and "
                                                 "the outbox worker's parent during the idle window")
    parser.add_argument("--strace", default="", help="a directory: strace of the relay's and the outbox worker "
                                                    "parent's sends during the idle window (slows them: diagnosis "
                                                    "only, not figures)")
    args = parser.parse_args()

    from bench.e2e_latency import default_env
    from chaos.environment import ChaosEnvironment

    work = Path(tempfile.mkdtemp(prefix="outbox-idle-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = ChaosEnvironment(broker="rabbitmq", workdir=work, extra_env=default_env())
    env.broker = DirectRabbit()
    load_before = uptime()
    out: dict[str, Any] = {}
    with env:
        stage = Stage(env, work, concurrency=args.concurrency, threads=4, label=f"idle-c{args.concurrency}")
        try:
            stage.start()
            if args.warm:
                for i, mode in enumerate(MODES):
                    stage.run(mode, args.warm, 25.0, f"idle-warm-{i}")
            time.sleep(args.settle)
            spies = []
            if args.spy:
                Path(args.spy).mkdir(parents=True, exist_ok=True)
                for who, pid in (("relay", stage.relay.pid), ("worker_parent", stage.workers["outbox"].pid)):
                    spies.append(subprocess.Popen(
                        [str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking", "-r", "200", "-f",
                         "raw", "-d", str(int(args.seconds)), "-p", str(pid), "-o", f"{args.spy}/{who}.txt"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if args.strace:
                Path(args.strace).mkdir(parents=True, exist_ok=True)
                for who, pid in (("relay", stage.relay.pid), ("worker_parent", stage.workers["outbox"].pid)):
                    spies.append(subprocess.Popen(
                        ["timeout", "-s", "INT", str(int(args.seconds)), "strace", "-f", "-tt", "-s", "100",
                         "-e", "trace=sendto,write", "-p", str(pid), "-o", f"{args.strace}/{who}.txt"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            threads_before = {w: thread_ticks(pid) for w, pid in (("relay", stage.relay.pid),
                              *((f"worker_parent_{m}", stage.workers[m].pid) for m in MODES))}
            before = {m: stage.sample(m) for m in MODES}
            t0 = time.monotonic()
            time.sleep(args.seconds)
            after = {m: stage.sample(m) for m in MODES}
            elapsed = time.monotonic() - t0
            threads_after = {w: thread_ticks(pid) for w, pid in (("relay", stage.relay.pid),
                             *((f"worker_parent_{m}", stage.workers[m].pid) for m in MODES))}
            for spy in spies:
                spy.wait(timeout=60)
        finally:
            stage.stop()
    for mode in MODES:
        per = {kind: {str(p): round((t - before[mode][kind].get(p, t)) * 1000 / TICKS / elapsed, 2)
                      for p, t in pids.items()} for kind, pids in after[mode].items()}
        out[mode] = per
        print(f"{mode}: CPU ms per second idle ({elapsed:.0f} s)")
        for kind, cpu in per.items():
            print(f"  {kind:14} total {sum(cpu.values()):7.2f}   " + "  ".join(f"{p}:{v}" for p, v in cpu.items()))
    threads = {w: {name: round((t - threads_before[w].get(name, t)) * 1000 / TICKS / elapsed, 2)
                   for name, t in ticks.items()} for w, ticks in threads_after.items()}
    for w, per_thread in threads.items():
        print(f"{w} threads: " + "  ".join(f"{n}:{v}" for n, v in per_thread.items()))
    out["threads"] = threads
    load_after = uptime()
    print(f"main commit {git_head()}; load before {load_before}, after {load_after}")
    write_result(args.name, {"commit": git_head(), "concurrency": args.concurrency, "seconds": args.seconds,
                             "warm": args.warm, "load_before": load_before, "load_after": load_after,
                             "ms_per_s": out})


if __name__ == "__main__":
    main()
