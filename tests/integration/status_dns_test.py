"""`fmoe status` and `fmoe launch` on a host whose DNS server never answers end in bounded time.

The test makes one network namespace whose resolv.conf (`ip netns exec` bind-mounts
/etc/netns/NS/resolv.conf) names a server on a veth whose peer answers nothing: every query
leaves and is lost, and the system resolver waits out resolv.conf's timeout (15 s; `getent` is
timed as the control). The manifest names every process by host name. `fmoe
status --timeout-ms 1000` must exit 3 (not reachable) within 1 s plus SLACK_S, naming
"resolving HOST timed out after 1000 ms" for the map service, the router and the rendezvous.
`fmoe launch` with those names refuses within its 5 s resolution bound plus SLACK_S, saying
"HOST does not resolve (resolving HOST timed out after 5000 ms)".

Needs root and `ip`; otherwise prints "skipped: <why>" and exits 77. The namespace and its
resolv.conf are removed on every exit path. Standard library only:
  python3 status_dns_test.py --bin-dir BUILD/bin --source-dir SOURCE
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402 (beside this file)

SKIP = 77
NS_PREFIX = "fmoedns-"
TIMEOUT_MS = 1000
SLACK_S = 2.5  # Process start and the probes' connect on a busy 2-core machine.
LAUNCH_RESOLVE_S = 5  # How long `fmoe launch` waits for a name (services/launcher.cc).
RESOLVER_TIMEOUT_S = 15  # resolv.conf's timeout in the namespace.
NAMESERVER = "10.9.9.53"  # On v0's subnet; v1, v0's peer, has no address: nobody answers.

MANIFEST = """# Written by status_dns_test.py: every process named by a host name no DNS answers for.
model:
  path: {source_dir}/deploy/models/tiny-moe
  name: tiny-moe
map_service:
  endpoint: tcp://map.cluster.example:5555
  data_dir: maps
worker_groups:
  - name: g0
    rendezvous: rank0.cluster.example:29500
    workers:
      - {{host: rank0.cluster.example, device: cpu}}
      - {{host: rank1.cluster.example, device: cpu}}
router:
  listen: router.cluster.example:8000
  worker_endpoint: tcp://router.cluster.example:5556
launcher:
  run_dir: run
"""


def log(msg):
    print(f"status_dns: {msg}", flush=True)


def check_launch(bin_dir, ns, manifest, control_s, problems):
    """`fmoe launch --host rank0.cluster.example` must refuse within LAUNCH_RESOLVE_S + SLACK_S."""
    t0 = time.monotonic()
    out = netns_hosts.run(["ip", "netns", "exec", ns, os.path.join(bin_dir, "fmoe"),
                           "launch", manifest, "--host", "rank0.cluster.example"],
                          check=False, timeout=120)
    launch_s = time.monotonic() - t0
    text = (out.stdout + out.stderr).decode("utf-8", "replace")
    log(f"fmoe launch exit {out.returncode} after {launch_s:.2f} s:\n{text}")
    bound = LAUNCH_RESOLVE_S + SLACK_S
    if out.returncode == 0:
        problems.append("fmoe launch exit 0 with hosts no DNS answers for")
    if launch_s > bound:
        problems.append(f"fmoe launch took {launch_s:.2f} s, more than its {bound} s bound "
                        f"(the resolver alone took {control_s:.2f} s)")
    want = f"does not resolve (resolving rank0.cluster.example timed out after " \
           f"{int(LAUNCH_RESOLVE_S * 1000)} ms)"
    if want not in text:
        problems.append(f"fmoe launch does not say {want!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    args = ap.parse_args()
    why = netns_hosts.cannot_run()
    if why:
        print(f"skipped: {why}", flush=True)
        return SKIP
    netns_hosts.remove_stale_namespaces(NS_PREFIX, log)
    ns = f"{NS_PREFIX}{os.getpid()}-a"
    etc = f"/etc/netns/{ns}"
    made_etc_netns = not os.path.exists("/etc/netns")
    work = tempfile.mkdtemp(prefix="fmoe-status-dns-")
    problems = []
    try:
        try:
            netns_hosts.run(["ip", "netns", "add", ns])
            netns_hosts.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            netns_hosts.run(["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name",
                             "v1"])
            netns_hosts.run(["ip", "-n", ns, "addr", "add", "10.9.9.1/24", "dev", "v0"])
            netns_hosts.run(["ip", "-n", ns, "link", "set", "v0", "up"])
            netns_hosts.run(["ip", "-n", ns, "link", "set", "v1", "up"])
            # A fixed neighbour for the server, so queries leave at once and are lost (without
            # it, ARP gives up after about 3 s and the resolver fails early).
            netns_hosts.run(["ip", "-n", ns, "neigh", "add", NAMESERVER, "lladdr",
                             "02:00:00:00:00:53", "dev", "v0", "nud", "permanent"])
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "resolv.conf"), "w", encoding="utf-8") as f:
                # One long try: the resolver alone waits RESOLVER_TIMEOUT_S, well past every
                # bound below, so a check that waits it out fails.
                f.write(f"nameserver {NAMESERVER}\noptions timeout:{RESOLVER_TIMEOUT_S} "
                        "attempts:1\n")
        except (netns_hosts.CommandError, OSError, subprocess.TimeoutExpired) as e:
            print(f"skipped: cannot make the namespace: {e}", flush=True)
            return SKIP
        manifest = os.path.join(work, "cluster.yaml")
        with open(manifest, "w", encoding="utf-8") as f:
            f.write(MANIFEST.format(source_dir=os.path.abspath(args.source_dir)))

        t0 = time.monotonic()
        control = netns_hosts.run(["ip", "netns", "exec", ns, "getent", "ahostsv4",
                                   "map.cluster.example"], check=False, timeout=120)
        control_s = time.monotonic() - t0
        log(f"control: getent ahostsv4 map.cluster.example exit {control.returncode} after "
            f"{control_s:.2f} s")
        if control.returncode == 0:
            problems.append(f"the namespace's DNS answered: {control.stdout!r}")

        t0 = time.monotonic()
        out = netns_hosts.run(["ip", "netns", "exec", ns, os.path.join(args.bin_dir, "fmoe"),
                               "status", manifest, "--timeout-ms", str(TIMEOUT_MS)], check=False,
                              timeout=120)
        status_s = time.monotonic() - t0
        text = (out.stdout + out.stderr).decode("utf-8", "replace")
        log(f"fmoe status exit {out.returncode} after {status_s:.2f} s:\n{text}")
        bound = TIMEOUT_MS / 1000 + SLACK_S
        if out.returncode != 3:
            problems.append(f"fmoe status exit {out.returncode}, want 3 (not reachable)")
        if status_s > bound:
            problems.append(f"fmoe status took {status_s:.2f} s, more than its {bound} s bound "
                            f"(the resolver alone took {control_s:.2f} s)")
        for name in ("map.cluster.example", "router.cluster.example", "rank0.cluster.example"):
            want = f"resolving {name} timed out after {TIMEOUT_MS} ms"
            if want not in text:
                problems.append(f"fmoe status does not say {want!r}")

        # `fmoe launch` checks its local hosts and ports before it starts anything: each name
        # resolved within LAUNCH_RESOLVE_S, then a clear refusal, not the resolver's timeouts.
        # A build without LibTorch has no fmoe-worker, and the launcher refuses before that.
        if not os.access(os.path.join(args.bin_dir, "fmoe-worker"), os.X_OK):
            log("fmoe launch not checked: this build has no fmoe-worker (a build without "
                "LibTorch)")
        else:
            check_launch(args.bin_dir, ns, manifest, control_s, problems)
    finally:
        netns_hosts.kill_netns_processes(ns)
        netns_hosts.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(etc, ignore_errors=True)
        if made_etc_netns:
            try:
                os.rmdir("/etc/netns")
            except OSError:
                pass
        shutil.rmtree(work, ignore_errors=True)
    for p in problems:
        log(f"FAIL: {p}")
    if problems:
        log("FAILED")
        return 1
    log("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
