"""group_bench across emulated hosts: decode TPOT and bytes moved per rank for worlds 1, 2 and 4,
each rank in a network namespace (issue 35, item 6).

  host B: rank 0 (the leader, the rendezvous), and rank 1 at world 4
  host C: rank 1 at world 2; ranks 2 and 3 at world 4

The namespaces, the bridge and the links are tests/integration/netns_hosts.py's. Each rank is
`ip netns exec NS group_bench --rank R --host ADDR --rendezvous B:PORT ...`; Gloo binds to the
host's address on the link, so ranks on different hosts talk over it and ranks on one host through
its loopback. Links, each run in turn (--links):
  loopback  every rank in namespace B on 127.0.0.1 (group_bench's own setting: the baseline)
  veth      B and C through veths and a bridge, unshaped (the kernel's, no emulation)
  tun       B and C through a TUN device each and netns_hosts.DelayedLink's forwarder thread in
            this process, at most 10 Gbit/s per direction, no delay: the forwarder's own cost
  tun-1ms   the same with 1 ms of delay each way (2 ms a round trip): `netem rate 10gbit
            delay 1ms` for kernels without sch_netem
  netem     veth with `tc qdisc ... netem rate 10gbit delay 1ms` on the bridge side of B's and
            C's veths (needs sch_netem; not in the default list)
Each link's TCP round trip (1 byte, C to B, median of 50) is measured before its runs.
For each world, batch and link: --prompts prompts of --tokens tokens, greedy, world 1's tokens as
the reference. Prints one Markdown table; each cell holds the --runs runs' figures, in order.
Bytes: each rank's collective payload per generated token (prefill included, as group_bench's
table), and what B and C sent over the link per generated token (payload plus Gloo's and TCP's
framing; none for the loopback link).

Needs root, `ip` and /dev/net/tun (`tc` for netem); otherwise prints "skipped: <why>" and exits
77. The namespaces, the bridge, the veths, the TUN devices, the qdiscs and the ranks are removed
on every exit path, SIGINT and SIGTERM included. Standard library only:
  sudo python3 bench/multihost_bench.py --bin-dir build/bin --source-dir . [--runs 2]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "integration"))
import netns_hosts  # noqa: E402

SKIP = 77
NS_PREFIX = "fmoemb-"  # Namespaces: fmoemb-<pid>-{b,c,sw}.
RDZV_PORT = 29500  # The first config's; each next one takes the next two ports (no TIME_WAIT).
CONFIG_TIMEOUT_S = 600  # Bound on one configuration's ranks.
NETEM = ["rate", "10gbit", "delay", "1ms", "limit", "10000"]
LINKS = ("loopback", "veth", "tun", "tun-1ms", "netem")
DEFAULT_LINKS = "loopback,veth,tun,tun-1ms"
LINK_NAMES = {"loopback": "loopback (one namespace)", "veth": "veth + bridge, unshaped",
              "tun": "tun forwarder, 10 Gbit/s", "tun-1ms": "tun forwarder, 10 Gbit/s + 1 ms",
              "netem": "veth, netem 10 Gbit/s + 1 ms"}
TUN = {"tun": (0.0, 10e9), "tun-1ms": (1e-3, 10e9)}  # (delay s, rate bit/s)


def log(msg):
    print(f"multihost_bench: {msg}", file=sys.stderr, flush=True)


class Failure(Exception):
    pass


def placement(world):
    """The host of each rank: B holds the leader; the rest split as evenly as they go."""
    if world == 1:
        return ["b"]
    half = world // 2
    return ["b"] * (world - half) + ["c"] * half


def link_addr(net, tun, link):
    """Each host's address on `link`."""
    if link == "loopback":
        return {"b": "127.0.0.1", "c": "127.0.0.1"}
    return tun.addr if link in TUN else net.addr


def sent_bytes(net, tun, link):
    """{host: bytes it has sent over `link` so far}."""
    if link in TUN:
        return dict(tun.moved)
    return {h: net.veth_bytes(h)[0] for h in ("b", "c")}


def run_config(args, net, tun, work, link, world, batch, port):
    """Runs every rank of one configuration; returns (rank results, {host: bytes it sent over
    the link})."""
    hosts = ["b"] * world if link == "loopback" else placement(world)
    addr = link_addr(net, tun, link)
    rdzv = addr["b"]
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    before = sent_bytes(net, tun, link)
    procs = []
    for r, h in enumerate(hosts):
        host = addr[h]
        cmd = [os.path.join(args.bin_dir, "group_bench"), "--model", args.model,
               "--prompts", str(args.prompts), "--tokens", str(args.tokens),
               "--worlds", str(world), "--batch", str(batch), "--budget", str(args.budget),
               "--threads", str(threads), "--rank", str(r), "--host", host,
               "--rendezvous", f"{rdzv}:{port}"]
        if args.prompts_file:
            cmd += ["--prompts-file", args.prompts_file]
        err = open(os.path.join(work, f"{link}-w{world}-b{batch}-p{port}-rank{r}.log"), "wb")
        procs.append((subprocess.Popen(net.exec_cmd(h, cmd), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=err), err))
    deadline = time.monotonic() + CONFIG_TIMEOUT_S
    results = []
    try:
        for r, (p, err) in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise Failure(f"rank {r} did not finish within {CONFIG_TIMEOUT_S} s")
            lines = [ln for ln in out.decode("utf-8", "replace").splitlines()
                     if ln.startswith("{")]
            j = json.loads(lines[-1]) if lines else {"error": f"no result, exit {p.returncode}"}
            if "error" in j:
                raise Failure(f"rank {r} on host {hosts[r]}: {j['error']} (see {err.name})")
            results.append(j)
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    after = sent_bytes(net, tun, link)
    return results, {h: after[h] - before[h] for h in ("b", "c")}


def fmt_runs(values, spec):
    return ", ".join(format(v, spec) for v in values) if values else "failed"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--model", help="default: SOURCE/deploy/models/tiny-moe")
    ap.add_argument("--prompts-file", help="JSONL with a \"prompt\" per line (group_bench's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--links", default=DEFAULT_LINKS, help=f"of {', '.join(LINKS)}")
    ap.add_argument("--runs", type=int, default=2, help="runs of every configuration")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads per rank (0: max(1, cores / world), group_bench's; "
                    "under load from other work, LibTorch's OpenMP threads wait on each other)")
    ap.add_argument("--keep", action="store_true", help="keep the ranks' logs afterwards")
    args = ap.parse_args()
    args.bin_dir = os.path.abspath(args.bin_dir)
    args.model = os.path.abspath(args.model or os.path.join(args.source_dir, "deploy", "models",
                                                            "tiny-moe"))
    if args.prompts_file:
        args.prompts_file = os.path.abspath(args.prompts_file)
    worlds = [int(w) for w in args.worlds.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    links = args.links.split(",")
    if any(link not in LINKS for link in links):
        ap.error(f"--links: each of {', '.join(LINKS)}")

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    why = netns_hosts.cannot_run(need_tc="netem" in links)
    if not why and any(link in TUN for link in links) and not os.path.exists("/dev/net/tun"):
        why = "no /dev/net/tun for the tun links"
    if why:
        print(f"skipped: {why}", flush=True)
        return SKIP
    netns_hosts.remove_stale_namespaces(NS_PREFIX, log)
    net = netns_hosts.Network(NS_PREFIX, f"10.232.{os.getpid() % 250}", hosts=("b", "c"))
    tun = netns_hosts.DelayedLink(net, f"10.233.{os.getpid() % 250}")
    rtt = {}  # link -> [ms per run]
    work = tempfile.mkdtemp(prefix="fmoe-multihost-bench-")
    rows = {}  # (world, batch, link) -> [per-run figures]
    reference = {}  # (batch, run) -> world 1's tokens
    problems = []
    port = RDZV_PORT
    started = time.monotonic()
    try:
        try:
            net.create()
            if any(link in TUN for link in links):
                tun.start()
        except (netns_hosts.CommandError, OSError, subprocess.TimeoutExpired) as e:
            print(f"skipped: cannot make the network namespaces and links: {e}", flush=True)
            return SKIP
        log(f"hosts: B {net.addr['b']} ({net.names['b']}), C {net.addr['c']} "
            f"({net.names['c']}); bridge br0 in {net.names['sw']}; tun0 B {tun.addr['b']}, "
            f"C {tun.addr['c']}; logs in {work}")
        for run_i in range(args.runs):
            for link in links:
                if link == "netem":
                    try:
                        for h in ("b", "c"):
                            net.shape(h, NETEM)
                    except netns_hosts.CommandError as e:
                        problems.append(f"netem: {e}")
                        log(f"FAIL: {problems[-1]}")
                        continue
                    log(f"qdisc toward B: {net.qdisc('b')}")
                if link in TUN:
                    tun.set(*TUN[link])
                if link != "loopback":
                    ms = netns_hosts.tcp_rtt_ms(net, "c", "b", link_addr(net, tun, link)["b"])
                    rtt.setdefault(link, []).append(ms)
                    log(f"run {run_i + 1} {link}: TCP round trip C to B {ms:.3f} ms (median)")
                for batch in batches:
                    for world in worlds:
                        key = (world, batch, link)
                        load = os.getloadavg()[0]
                        t0 = time.monotonic()
                        try:
                            ranks, moved = run_config(args, net, tun, work, link, world, batch,
                                                      port)
                        except Failure as e:
                            problems.append(f"world {world} batch {batch} {link} run "
                                            f"{run_i + 1}: {e}")
                            log(f"FAIL: {problems[-1]}")
                            continue
                        finally:
                            port += 2  # group_bench --collectives takes two.
                        lead = ranks[0]
                        generated = max(1, lead["generated"])
                        ref = reference.setdefault((batch, run_i), lead["tokens"]
                                                   if world == 1 else None)
                        fig = {
                            "tpot_p50": lead["tpot_p50_ms"], "tpot_mean": lead["tpot_ms"],
                            "tok_s": lead["tokens_per_s"],
                            "wait": lead["leader_wait_ms"] / generated,
                            "payload": [r["payload_bytes"] / generated / 1e3 for r in ranks],
                            "wire": [moved[h] / generated / 1e3 for h in ("b", "c")],
                            "same": None if ref is None else ref == lead["tokens"],
                            "load": load,
                        }
                        rows.setdefault(key, []).append(fig)
                        log(f"run {run_i + 1} world {world} batch {batch} {link}: TPOT p50 "
                            f"{fig['tpot_p50']:.2f} ms mean {fig['tpot_mean']:.2f} ms, "
                            f"{time.monotonic() - t0:.1f} s, load average {load:.1f} at start")
                if link == "netem":
                    for h in ("b", "c"):
                        net.shape(h, None)
    except KeyboardInterrupt as e:
        problems.append(f"interrupted ({e})")
    except (netns_hosts.CommandError, OSError, subprocess.TimeoutExpired) as e:
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        tun.stop()
        net.destroy()
        if not args.keep and not problems:
            for name in os.listdir(work):
                os.remove(os.path.join(work, name))
            os.rmdir(work)
        else:
            log(f"kept {work}")

    print(f"model {args.model}; {args.prompts} prompts x {args.tokens} tokens, greedy; budget "
          f"{args.budget:.0%}; ranks are processes sharing {os.cpu_count()} cores (each "
          f"{args.threads or 'max(1, cores / world)'} intra-op threads); Gloo; {args.runs} runs "
          f"per configuration, "
          f"each cell lists them in order")
    print("TCP round trip C to B, 1 byte, median of 50: " + "; ".join(
        f"{link} {fmt_runs(v, '.3f')} ms" for link, v in rtt.items()) + "\n")
    print("| world | batch | link | ranks on | TPOT p50 ms | TPOT mean ms | decode tok/s | leader "
          "in collectives ms/token | collective payload KB/token per rank (run 1) | link KB/token "
          "out of B / C (run 1) | identical tokens | load average at start |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---|---|---|---|")
    for link in links:
        for batch in batches:
            for world in worlds:
                figs = rows.get((world, batch, link), [])
                where = "B" if link == "loopback" else \
                    " ".join(h.upper() for h in placement(world))
                if not figs:
                    print(f"| {world} | {batch} | {LINK_NAMES[link]} | {where} | failed | | | | "
                          f"| | | |")
                    continue
                payload = " / ".join(f"{p:.1f}" for p in figs[0]["payload"])
                wire = "-" if link == "loopback" else \
                    " / ".join(f"{w:.1f}" for w in figs[0]["wire"])
                same = [f["same"] for f in figs]
                same_text = "ref" if world == 1 else \
                    ("yes" if all(same) else "NO" if any(s is False for s in same) else "?")
                print(f"| {world} | {batch} | {LINK_NAMES[link]} | {where} | "
                      f"{fmt_runs([f['tpot_p50'] for f in figs], '.2f')} | "
                      f"{fmt_runs([f['tpot_mean'] for f in figs], '.2f')} | "
                      f"{fmt_runs([f['tok_s'] for f in figs], '.0f')} | "
                      f"{fmt_runs([f['wait'] for f in figs], '.2f')} | {payload} | {wire} | "
                      f"{same_text} | {fmt_runs([f['load'] for f in figs], '.1f')} |")
    medians = {k: statistics.median(f["tpot_p50"] for f in v) for k, v in rows.items()}
    for base, shaped in (("veth", "netem"), ("tun", "tun-1ms")):
        for batch in batches:
            for world in worlds:
                a, b = medians.get((world, batch, base)), medians.get((world, batch, shaped))
                if a is not None and b is not None:
                    print(f"world {world} batch {batch}: {shaped} adds {b - a:.2f} ms to the "
                          f"median TPOT p50 of {base}")
    log(f"{time.monotonic() - started:.1f} s in all")
    for p in problems:
        log(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
