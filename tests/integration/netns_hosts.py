"""Emulated hosts for the multi-host test and bench: network namespaces joined by a bridge, each
with its own private address (issue 35).

  Network(prefix, subnet, hosts=("a", "b", "c")): namespaces PREFIX<pid>-<host> with eth0 at
  SUBNET.1, .2, ... (in the order of `hosts`), and PREFIX<pid>-sw holding the bridge br0 and the
  host end of each veth, named v<host>. Traffic between two hosts crosses exactly two veths:
  out of the sender's eth0, into v<sender>, through br0, out of v<receiver>. shape() puts a
  netem qdisc on the v<host> side (toward the host), so a packet meets it once per one-way trip;
  veth_bytes() reads the counters there.

  DelayedLink(net, subnet, delay_s, rate_bps): a second link between two of the hosts, for
  kernels without sch_netem: a TUN device tun0 in each (SUBNET.1, SUBNET.2) and a thread of this
  process that passes each packet to the other side `delay_s` after it has been sent at
  `rate_bps`, per direction, as `netem rate R delay D` does.

Needs root and `ip` (iproute2); `tc` for shape(). Standard library only. Whatever Network made
is removed by destroy() (processes in the namespaces first); namespaces left by a run that was
SIGKILLed are removed by remove_stale_namespaces(prefix) of the next run.

Used by tests/integration/multihost_test.py and bench/multihost_bench.py.
"""
import ctypes
import fcntl
import heapq
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import threading
import time

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454ca
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


class CommandError(Exception):
    """A command (ip, tc) that failed: its text and stderr."""


def run(cmd, check=True, timeout=60):
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    if check and out.returncode != 0:
        raise CommandError(f"{' '.join(cmd)}: exit {out.returncode}: "
                           f"{out.stderr.decode('utf-8', 'replace').strip()}")
    return out


def cannot_run(need_tc=False):
    """Why namespaces cannot be made here (a sentence), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    if need_tc and shutil.which("tc") is None:
        return "no `tc` (iproute2) on PATH"
    if not hasattr(_libc, "setns"):
        return "libc has no setns"
    return None


def netns_pids(ns):
    out = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def kill_netns_processes(ns):
    """SIGKILLs what still runs in `ns` (only the namespace's maker starts processes there)."""
    for pid in netns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def remove_stale_namespaces(prefix, log=print):
    """Namespaces PREFIX<pid>-* of an earlier run that was killed before it could clean up (its
    pid is gone)."""
    out = run(["ip", "netns", "list"], check=False)
    for line in out.stdout.decode("utf-8", "replace").splitlines():
        m = re.match(rf"^({re.escape(prefix)}(\d+)-[a-z0-9]+)\b", line)
        if not m or os.path.exists(f"/proc/{m.group(2)}"):
            continue
        log(f"removing namespace {m.group(1)} left by an earlier run")
        kill_netns_processes(m.group(1))
        run(["ip", "netns", "del", m.group(1)], check=False)


class Network:
    def __init__(self, prefix, subnet, hosts=("a", "b", "c")):
        pid = os.getpid()
        self.hosts = tuple(hosts)
        self.names = {h: f"{prefix}{pid}-{h}" for h in self.hosts + ("sw",)}
        self.subnet = subnet
        self.addr = {h: f"{subnet}.{i + 1}" for i, h in enumerate(self.hosts)}
        self.made = []

    def create(self):
        for h in ("sw",) + self.hosts:
            run(["ip", "netns", "add", self.names[h]])
            self.made.append(self.names[h])
            run(["ip", "-n", self.names[h], "link", "set", "lo", "up"])
        sw = self.names["sw"]
        # Interface names are per namespace: short fixed names cannot clash with anyone's.
        run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in self.hosts:
            ns = self.names[h]
            run(["ip", "-n", sw, "link", "add", f"v{h}", "type", "veth", "peer", "name", "eth0",
                 "netns", ns])
            run(["ip", "-n", sw, "link", "set", f"v{h}", "master", "br0"])
            run(["ip", "-n", sw, "link", "set", f"v{h}", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def shape(self, host, netem):
        """Every packet toward `host` through netem with these arguments, e.g. ["rate", "10gbit",
        "delay", "1ms"]; None removes it."""
        cmd = ["tc", "-n", self.names["sw"], "qdisc"]
        if netem is None:
            run(cmd + ["del", "dev", f"v{host}", "root"], check=False)
        else:
            run(cmd + ["replace", "dev", f"v{host}", "root", "netem"] + list(netem))

    def qdisc(self, host):
        out = run(["tc", "-n", self.names["sw"], "qdisc", "show", "dev", f"v{host}"], check=False)
        return out.stdout.decode("utf-8", "replace").strip()

    def veth_bytes(self, host):
        """(bytes the host sent, bytes it received) through its link so far."""
        out = run(["ip", "-n", self.names["sw"], "-s", "-j", "link", "show", f"v{host}"])
        stats = json.loads(out.stdout.decode("utf-8"))[0]["stats64"]
        # The bridge side's rx is what the host sent, its tx what the host received.
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def exec_cmd(self, host, cmd):
        """`cmd` run inside the host's namespace (ip execs it: same pid)."""
        return ["ip", "netns", "exec", self.names[host]] + list(cmd)

    def destroy(self):
        for ns in self.made:
            kill_netns_processes(ns)
        for ns in reversed(self.made):
            # Deleting a namespace deletes its links (the veth pairs, the bridge, their qdiscs).
            run(["ip", "netns", "del", ns], check=False)
        self.made = []


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd):
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_netns(ns, make):
    """make() called inside network namespace `ns` (setns on this thread for the call only;
    what it makes, a socket or a TUN device, keeps its namespace)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                return make()
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def socket_in(ns, addr, port, timeout):
    """A TCP connection to addr:port made from inside network namespace `ns`."""
    sock = in_netns(ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    try:
        sock.settimeout(timeout)
        sock.connect((addr, port))
    except OSError:
        sock.close()
        raise
    return sock


class NsHTTPConnection(http.client.HTTPConnection):
    def __init__(self, ns, host, port, timeout):
        super().__init__(host, port, timeout=timeout)
        self.ns = ns

    def connect(self):
        self.sock = socket_in(self.ns, self.host, self.port, self.timeout)


def tcp_rtt_ms(net, client, server, server_addr, rounds=50):
    """Median round trip of one byte over TCP from host `client` to `server_addr` on host
    `server` (TCP_NODELAY both ends), in ms."""
    def listener():
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((server_addr, 0))
        ls.listen(1)
        return ls

    ls = in_netns(net.names[server], listener)
    port = ls.getsockname()[1]

    def echo():
        conn, _ = ls.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while (b := conn.recv(1)):
                conn.sendall(b)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    times = []
    try:
        with socket_in(net.names[client], server_addr, port, 10) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                t0 = time.monotonic()
                c.sendall(b"x")
                if c.recv(1) != b"x":
                    break
                times.append((time.monotonic() - t0) * 1e3)
    finally:
        ls.close()
    t.join(timeout=5)
    return statistics.median(times) if times else None


class DelayedLink:
    """tun0 in hosts[0] (SUBNET.1) and hosts[1] (SUBNET.2); a thread forwards between them. A
    packet read from one side leaves toward the other once the direction's emulated wire is free
    and it has been serialised at rate_bps (None: no limit), then delay_s later. moved[h] counts
    the bytes host h sent. start() and stop() by the owner; set() from any thread."""

    def __init__(self, net, subnet, hosts=("b", "c"), delay_s=0.0, rate_bps=None, mtu=1500):
        self.net = net
        self.hosts = tuple(hosts)
        self.addr = {h: f"{subnet}.{i + 1}" for i, h in enumerate(self.hosts)}
        self.mtu = mtu
        self.delay_s, self.rate_bps = delay_s, rate_bps
        self.moved = {h: 0 for h in self.hosts}
        self.fds = {}
        self.stopping = False
        self.thread = None

    def set(self, delay_s, rate_bps):
        self.delay_s, self.rate_bps = delay_s, rate_bps

    def start(self):
        def open_tun():
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"tun0", IFF_TUN | IFF_NO_PI))
            except OSError:
                os.close(fd)
                raise
            return fd

        for h in self.hosts:
            ns = self.net.names[h]
            self.fds[h] = in_netns(ns, open_tun)
            run(["ip", "-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "tun0"])
            run(["ip", "-n", ns, "link", "set", "tun0", "mtu", str(self.mtu), "up"])
        self.thread = threading.Thread(target=self._forward, daemon=True)
        self.thread.start()

    def _forward(self):
        a, b = self.hosts
        peer = {self.fds[a]: (b, self.fds[b], a), self.fds[b]: (a, self.fds[a], b)}
        free_at = {a: 0.0, b: 0.0}  # When each direction's wire is free (by sender).
        queue = []  # (due, seq, fd to write, packet)
        seq = 0
        while not self.stopping:
            now = time.monotonic()
            timeout = min(0.05, max(0.0, queue[0][0] - now)) if queue else 0.05
            ready, _, _ = select.select(list(peer), [], [], timeout)
            now = time.monotonic()
            for fd in ready:
                _, out_fd, sender = peer[fd]
                while True:
                    try:
                        pkt = os.read(fd, 65536)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        return
                    start = max(now, free_at[sender])
                    rate = self.rate_bps
                    free_at[sender] = start + (len(pkt) * 8 / rate if rate else 0.0)
                    self.moved[sender] += len(pkt)
                    seq += 1
                    heapq.heappush(queue, (free_at[sender] + self.delay_s, seq, out_fd, pkt))
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, out_fd, pkt = heapq.heappop(queue)
                try:
                    os.write(out_fd, pkt)
                except (BlockingIOError, InterruptedError):
                    pass  # The receiver's queue is full: dropped, as a full link drops.
                except OSError:
                    return

    def stop(self):
        self.stopping = True
        if self.thread is not None:
            self.thread.join(timeout=5)
        for fd in self.fds.values():
            os.close(fd)  # Closing the last fd removes tun0.
        self.fds = {}
