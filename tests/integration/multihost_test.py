"""A worker group across three "hosts": network namespaces made by this test, joined by a bridge,
each with its own address (issue 35, item 1).

  host A (10.231.N.1): `fmoe launch cluster.yaml --host A`: the map service and the router
  host B (10.231.N.2): `fmoe launch cluster.yaml --workers-only --host B`: ranks 0 and 1 of g0
  host C (10.231.N.3): `fmoe launch cluster.yaml --workers-only --host C`: ranks 2 and 3 of g0

One manifest text on every host (each host's copy in its own directory, so `run_dir: run` and
the cluster key beside it are per host); A's launcher writes the cluster key and the test copies
it to B and C, as docs/DEPLOY.md says. The group is world 4 (cpu ranks, Gloo, rendezvous on B).
Greedy completions and chat completions, whole and streamed, must give the same text and tokens
as a world-1 group: a one-host cluster on loopback in namespace A, run first. Each rank's log
names B's rendezvous and A's map service, `fmoe status` on each host reports its processes
healthy and never restarted; then SIGTERM stops every launcher (A first), and each must exit 0.

Needs root, `ip` and network namespaces; otherwise prints "skipped: <why>" and exits 77 (ctest's
SKIP_RETURN_CODE). Whatever it made (namespaces, the bridge and veths inside them, processes,
the temp dir) is removed on every exit path, SIGINT and SIGTERM included; namespaces left by a
run that was SIGKILLed are removed by the next run.

Run by ctest (multihost_test, labels integration;torch) with the system python3, standard library
only:
  python3 multihost_test.py --bin-dir BUILD/bin --source-dir SOURCE [--keep]
"""
import argparse
import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77  # ctest SKIP_RETURN_CODE (tests/CMakeLists.txt).
MODEL = "tiny-moe"
READY_TIMEOUT_S = 420  # Bound on the wait for each state (a busy 2-core machine runs 7 processes).
REQUEST_TIMEOUT_S = 180  # Per socket operation.
STOP_TIMEOUT_S = 120  # Bound on a launcher's exit after SIGTERM, before SIGKILL.
NS_PREFIX = "fmoemh-"  # Namespaces: fmoemh-<pid>-{a,b,c,sw}.
CLONE_NEWNET = 0x40000000

# Ports inside the namespaces: each has its own network stack, so nothing else can hold them.
MAP_PORT, WORKER_PORT, HTTP_PORT, RDZV_PORT = 5555, 5556, 8000, 29500
# The world-1 reference on loopback in namespace A (other ports: no TIME_WAIT overlap).
REF_MAP_PORT, REF_WORKER_PORT, REF_HTTP_PORT, REF_RDZV_PORT = 6555, 6556, 8100, 29600

PROMPTS = ["In the beginning", "And God said", "The LORD is my shepherd", "Once upon a time"]
QUESTIONS = ["Who made the earth?", "Tell me a story."]
MAX_TOKENS = 12


def log(msg):
    print(f"multihost: {msg}", flush=True)


class Failure(Exception):
    pass


class Skip(Exception):
    pass


def run(cmd, check=True, timeout=60):
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    if check and out.returncode != 0:
        raise Failure(f"{' '.join(cmd)}: exit {out.returncode}: "
                      f"{out.stderr.decode('utf-8', 'replace').strip()}")
    return out


# ---------------------------------------------------------------------------------------------
# The network: namespaces a, b, c with one address each, and sw holding the bridge.


def netns_pids(ns):
    out = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def kill_netns_processes(ns):
    """SIGKILLs what still runs in `ns` (only this test starts processes there)."""
    for pid in netns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def remove_stale_namespaces():
    """Namespaces of an earlier run that was killed before it could clean up (its pid is gone)."""
    out = run(["ip", "netns", "list"], check=False)
    for line in out.stdout.decode("utf-8", "replace").splitlines():
        m = re.match(rf"^({re.escape(NS_PREFIX)}(\d+)-(a|b|c|sw))\b", line)
        if not m or os.path.exists(f"/proc/{m.group(2)}"):
            continue
        log(f"removing namespace {m.group(1)} left by an earlier run")
        kill_netns_processes(m.group(1))
        run(["ip", "netns", "del", m.group(1)], check=False)


class Network:
    def __init__(self):
        pid = os.getpid()
        self.names = {h: f"{NS_PREFIX}{pid}-{h}" for h in ("a", "b", "c", "sw")}
        self.subnet = f"10.231.{pid % 250}"
        self.addr = {"a": f"{self.subnet}.1", "b": f"{self.subnet}.2", "c": f"{self.subnet}.3"}
        self.made = []

    def create(self):
        for h in ("sw", "a", "b", "c"):
            run(["ip", "netns", "add", self.names[h]])
            self.made.append(self.names[h])
            run(["ip", "-n", self.names[h], "link", "set", "lo", "up"])
        sw = self.names["sw"]
        # Interface names are per namespace: short fixed names cannot clash with anyone's.
        run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in ("a", "b", "c"):
            ns = self.names[h]
            run(["ip", "-n", sw, "link", "add", f"v{h}", "type", "veth", "peer", "name", "eth0",
                 "netns", ns])
            run(["ip", "-n", sw, "link", "set", f"v{h}", "master", "br0"])
            run(["ip", "-n", sw, "link", "set", f"v{h}", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def destroy(self):
        for ns in self.made:
            kill_netns_processes(ns)
        for ns in reversed(self.made):
            # Deleting a namespace deletes its links (the veth pairs, the bridge).
            run(["ip", "netns", "del", ns], check=False)
        self.made = []


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd):
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def socket_in(ns, addr, port, timeout):
    """A TCP connection to addr:port made from inside network namespace `ns` (setns on this
    thread for the socket's creation only; the socket keeps its namespace)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)
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


# ---------------------------------------------------------------------------------------------
# Manifests and launchers.


def cluster_manifest(source_dir, net):
    a, b, c = net.addr["a"], net.addr["b"], net.addr["c"]
    return f"""# Written by multihost_test.py: one group of world 4 on hosts B and C; A serves.
# The same text on every host; each host's copy sits in its own directory (run_dir: run).
model:
  path: {source_dir}/deploy/models/tiny-moe
  name: {MODEL}
map_service:
  endpoint: tcp://{a}:{MAP_PORT}
  data_dir: maps
  store_capacity: 1000
  prefetch_distance: 3
worker_groups:
  - name: g0
    policy: fmoe
    max_batch: 8
    queue_limit: 64
    expert_cache_fraction: 0.5
    rendezvous: {b}:{RDZV_PORT}
    collective_timeout_s: 120
    rendezvous_timeout_s: {READY_TIMEOUT_S}
    workers:
      - {{host: {b}, device: cpu}}
      - {{host: {b}, device: cpu}}
      - {{host: {c}, device: cpu}}
      - {{host: {c}, device: cpu}}
router:
  listen: {a}:{HTTP_PORT}
  worker_endpoint: tcp://{a}:{WORKER_PORT}
heartbeat:
  interval_ms: 500
  timeout_ms: 10000
logging:
  level: info
launcher:
  run_dir: run
  ready_timeout_s: {READY_TIMEOUT_S}
  stop_timeout_s: 20
"""


def reference_manifest(source_dir):
    return f"""# Written by multihost_test.py: the world-1 reference, on loopback in namespace A.
model:
  path: {source_dir}/deploy/models/tiny-moe
  name: {MODEL}
map_service:
  endpoint: tcp://127.0.0.1:{REF_MAP_PORT}
  data_dir: maps
  store_capacity: 1000
  prefetch_distance: 3
worker_groups:
  - name: g0
    policy: fmoe
    max_batch: 8
    queue_limit: 64
    expert_cache_fraction: 0.5
    rendezvous: 127.0.0.1:{REF_RDZV_PORT}
    workers:
      - device: cpu
router:
  listen: 127.0.0.1:{REF_HTTP_PORT}
  worker_endpoint: tcp://127.0.0.1:{REF_WORKER_PORT}
heartbeat:
  interval_ms: 500
  timeout_ms: 10000
logging:
  level: info
launcher:
  run_dir: run
  ready_timeout_s: {READY_TIMEOUT_S}
  stop_timeout_s: 20
"""


class Launcher:
    """`ip netns exec NS fmoe launch MANIFEST [args]` (ip execs the launcher: same pid)."""

    def __init__(self, name, bin_dir, ns, host_dir, args):
        self.name = name
        self.bin_dir = bin_dir
        self.host_dir = host_dir
        self.manifest = os.path.join(host_dir, "cluster.yaml")
        self.log_path = os.path.join(host_dir, "launcher.log")
        self.log_file = open(self.log_path, "ab")
        self.cmd = ["ip", "netns", "exec", ns, os.path.join(bin_dir, "fmoe"), "launch",
                    self.manifest] + args
        log(f"host {name}: {' '.join(self.cmd)}")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def output(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def run_logs(self):
        logs = os.path.join(self.host_dir, "run", "logs")
        if not os.path.isdir(logs):
            return []
        return [os.path.join(logs, n) for n in sorted(os.listdir(logs))]

    def read_log(self, name):
        try:
            with open(os.path.join(self.host_dir, "run", "logs", name), "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def status(self):
        try:
            with open(os.path.join(self.host_dir, "run", "launcher.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def terminate(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s):
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill_all(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for p in self.status().get("processes", []):
            pid = p.get("pid", -1)
            if not isinstance(pid, int) or pid <= 0:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.bin_dir.encode() not in f.read():
                        continue
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not self.log_file.closed:
            self.log_file.close()

    def print_logs(self, lines=50):
        for path in [self.log_path] + self.run_logs():
            try:
                with open(path, "rb") as f:
                    tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
            except OSError as e:
                tail = [f"(unreadable: {e})"]
            print(f"----- host {self.name}: {path} (last {len(tail)} lines) -----", flush=True)
            for line in tail:
                print(line, flush=True)


def wait_until(what, pred, timeout_s, poll_s=0.25):
    """Waits for a state; raises Failure naming it when the bound passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(poll_s)
    if not pred():
        raise Failure(f"{what}: not within {timeout_s} s")


def all_alive(launchers):
    for la in launchers:
        if la.proc.poll() is not None:
            raise Failure(f"host {la.name}'s launcher exited {la.proc.returncode} early")


# ---------------------------------------------------------------------------------------------
# Requests.


def health(ns, addr, port):
    try:
        conn = NsHTTPConnection(ns, addr, port, timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return 0


def plan():
    reqs = []
    for p in PROMPTS:
        for stream in (False, True):
            reqs.append(("/v1/completions", stream,
                         {"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS,
                          "temperature": 0, "logprobs": 0, "stream": stream}))
    for q in QUESTIONS:
        for stream in (False, True):
            reqs.append(("/v1/chat/completions", stream,
                         {"model": MODEL, "messages": [{"role": "user", "content": q}],
                          "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
                          "stream": stream}))
    return reqs


def answer_of(path, stream, raw_status, raw):
    """(text, tokens, finish_reason) of one answer; tokens from its logprobs."""
    if raw_status != 200:
        raise Failure(f"{path}: status {raw_status}: {raw[:300]!r}")
    chat = path.endswith("chat/completions")
    if not stream:
        j = json.loads(raw.decode("utf-8"))
        c = j["choices"][0]
        if chat:
            tokens = [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
            return c["message"]["content"], tokens, c["finish_reason"]
        return c["text"], (c.get("logprobs") or {}).get("tokens", []), c["finish_reason"]
    text, tokens, finish, done = "", [], None, False
    for line in raw.decode("utf-8").splitlines():
        if not line:
            continue
        if not line.startswith("data: "):
            raise Failure(f"{path}: not an SSE data line: {line[:300]!r}")
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        j = json.loads(payload)
        if "error" in j:
            raise Failure(f"{path}: error event {j!r}")
        if not j.get("choices"):
            continue
        c = j["choices"][0]
        if chat:
            text += c.get("delta", {}).get("content") or ""
            tokens += [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
        else:
            text += c.get("text") or ""
            tokens += (c.get("logprobs") or {}).get("tokens") or []
        finish = c.get("finish_reason") or finish
    if not done:
        raise Failure(f"{path}: the stream ended without data: [DONE]")
    return text, tokens, finish


def ask_all(ns, addr, port):
    out = []
    for path, stream, body in plan():
        conn = NsHTTPConnection(ns, addr, port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", path, body=json.dumps(body).encode("utf-8"),
                         headers={"Content-Type": "application/json"})
            res = conn.getresponse()
            out.append(answer_of(path, stream, res.status, res.read()))
        finally:
            conn.close()
    return out


def describe(i):
    path, stream, body = plan()[i]
    what = body.get("prompt") or body["messages"][0]["content"]
    return f"{path} {'streamed' if stream else 'whole'} {what!r}"


# ---------------------------------------------------------------------------------------------


def fmoe_status(bin_dir, ns, manifest):
    """`fmoe status MANIFEST --json` run on host `ns`, parsed."""
    out = run(["ip", "netns", "exec", ns, os.path.join(bin_dir, "fmoe"), "status", manifest,
               "--json"], check=False)
    try:
        return json.loads(out.stdout.decode("utf-8"))
    except ValueError:
        raise Failure(f"fmoe status --json on {ns} printed no JSON (exit {out.returncode}): "
                      f"{out.stdout[:500]!r} {out.stderr[:500]!r}")


def stop_launchers(launchers, problems):
    """SIGTERM to each, together; each must exit 0 within the bound (else SIGKILL)."""
    for la in launchers:
        la.terminate()
    for la in launchers:
        code = la.wait(STOP_TIMEOUT_S)
        if code is None:
            problems.append(f"host {la.name}'s launcher did not exit within {STOP_TIMEOUT_S} s "
                            f"of SIGTERM (killed)")
            la.kill_all()
        elif code != 0:
            problems.append(f"host {la.name}'s launcher exited {code} after SIGTERM (0 expected)")


def run_reference(bin_dir, source_dir, net, work, launchers):
    host_dir = os.path.join(work, "ref")
    os.makedirs(host_dir)
    with open(os.path.join(host_dir, "cluster.yaml"), "w", encoding="utf-8") as f:
        f.write(reference_manifest(source_dir))
    ref = Launcher("A (world-1 reference)", bin_dir, net.names["a"], host_dir, [])
    launchers.append(ref)
    t0 = time.monotonic()

    def up():
        all_alive([ref])
        return health(net.names["a"], "127.0.0.1", REF_HTTP_PORT) == 200

    wait_until("the world-1 reference's /health 200", up, READY_TIMEOUT_S)
    log(f"world-1 reference ready after {time.monotonic() - t0:.1f} s")
    answers = ask_all(net.names["a"], "127.0.0.1", REF_HTTP_PORT)
    problems = []
    stop_launchers([ref], problems)
    if problems:
        raise Failure("; ".join(problems))
    for i, (text, tokens, _) in enumerate(answers):
        if not tokens:
            raise Failure(f"the reference gave no tokens for {describe(i)}")
    return answers


def run_cluster(bin_dir, source_dir, net, work, launchers, reference):
    text = cluster_manifest(source_dir, net)
    dirs = {}
    for h in ("a", "b", "c"):
        dirs[h] = os.path.join(work, "hosts", h)
        os.makedirs(dirs[h])
        with open(os.path.join(dirs[h], "cluster.yaml"), "w", encoding="utf-8") as f:
            f.write(text)
    log(f"manifest (each host's copy in {work}/hosts/<host>/cluster.yaml):\n{text}")
    a = Launcher("A", bin_dir, net.names["a"], dirs["a"], ["--host", net.addr["a"]])
    launchers.append(a)
    t0 = time.monotonic()
    # A's launcher writes the cluster key before it starts anything; copy it to B and C.
    key_a = os.path.join(dirs["a"], "run", "cluster.key")

    def key_written():
        all_alive([a])
        return os.path.exists(key_a)

    wait_until(f"host A's cluster key {key_a}", key_written, READY_TIMEOUT_S)
    for h in ("b", "c"):
        os.makedirs(os.path.join(dirs[h], "run"), exist_ok=True)
        dst = os.path.join(dirs[h], "run", "cluster.key")
        shutil.copyfile(key_a, dst)
        os.chmod(dst, 0o600)
    b = Launcher("B", bin_dir, net.names["b"], dirs["b"],
                 ["--workers-only", "--host", net.addr["b"]])
    c = Launcher("C", bin_dir, net.names["c"], dirs["c"],
                 ["--workers-only", "--host", net.addr["c"]])
    launchers += [b, c]
    hosts = [a, b, c]

    def serving():
        all_alive(hosts)
        return health(net.names["a"], net.addr["a"], HTTP_PORT) == 200

    wait_until(f"the router's /health 200 at {net.addr['a']}:{HTTP_PORT}", serving,
               READY_TIMEOUT_S)
    log(f"the world-4 group serves after {time.monotonic() - t0:.1f} s")
    for la in (b, c):
        wait_until(f"host {la.name}'s launcher saying `fmoe is up (worker ranks only)`",
                   lambda: (all_alive(hosts), "fmoe is up (worker ranks only)" in la.output())[1],
                   READY_TIMEOUT_S)
    # Each rank joined the group of four through B's rendezvous and registered with A's map
    # service; rank 0 leads the group at A's router.
    for la, ranks in ((b, (0, 1)), (c, (2, 3))):
        for r in ranks:
            text_r = la.read_log(f"worker-g0-{r}.log")
            wants = [f"rank {r}/4: joined through {net.addr['b']}:{RDZV_PORT}",
                     f"registered with map service tcp://{net.addr['a']}:{MAP_PORT}"]
            if r == 0:
                wants.append(f"joined router tcp://{net.addr['a']}:{WORKER_PORT} as leader")
            for want in wants:
                if want not in text_r:
                    raise Failure(f"host {la.name}: worker-g0-{r}.log lacks {want!r}")
    answers = ask_all(net.names["a"], net.addr["a"], HTTP_PORT)
    mismatches = []
    for i, (got, want) in enumerate(zip(answers, reference)):
        if got[0] != want[0] or got[1] != want[1] or got[2] != want[2]:
            mismatches.append(f"{describe(i)}: world 4 gave {got!r}, world 1 gave {want!r}")
    for i, (t, toks, fin) in enumerate(answers):
        log(f"  {describe(i)}: {len(toks)} tokens, {fin}: {t!r}")
    if mismatches:
        raise Failure("world 4 across hosts differs from world 1:\n  " + "\n  ".join(mismatches))
    log(f"{len(answers)} answers equal the world-1 group's text and tokens")
    # `fmoe status` on each host: its own processes, all healthy, none restarted.
    for h, la in zip(("a", "b", "c"), hosts):
        st = fmoe_status(bin_dir, net.names[h], la.manifest)
        procs = st.get("processes") or []
        if not st.get("healthy") or not st.get("launcher_alive") or len(procs) != 2:
            raise Failure(f"host {la.name}: fmoe status: {st}")
        for p in procs:
            if p.get("state") != "running" or p.get("restarts") != 0:
                raise Failure(f"host {la.name}: fmoe status: {p}")
    # Stop: the main host first (the router drains), then B and C together.
    problems = []
    stop_launchers([a], problems)
    stop_launchers([b, c], problems)
    if problems:
        raise Failure("; ".join(problems))


def check_can_run():
    if os.geteuid() != 0:
        raise Skip("network namespaces need root")
    if shutil.which("ip") is None:
        raise Skip("no `ip` (iproute2) on PATH")
    if not hasattr(_libc, "setns"):
        raise Skip("libc has no setns")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) afterwards")
    args = ap.parse_args()
    bin_dir = os.path.abspath(args.bin_dir)
    source_dir = os.path.abspath(args.source_dir)

    # SIGTERM (ctest's timeout, a user) unwinds through the finally below like SIGINT does.
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        check_can_run()
    except Skip as e:
        print(f"skipped: {e}", flush=True)
        return SKIP
    remove_stale_namespaces()
    net = Network()
    work = tempfile.mkdtemp(prefix="fmoe-multihost-")
    launchers = []
    problems = []
    started = time.monotonic()
    try:
        try:
            net.create()
        except (Failure, OSError, subprocess.TimeoutExpired) as e:
            raise Skip(f"cannot make the test's network namespaces: {e}")
        log(f"hosts: A {net.addr['a']} ({net.names['a']}), B {net.addr['b']} "
            f"({net.names['b']}), C {net.addr['c']} ({net.names['c']}); bridge br0 in "
            f"{net.names['sw']}; work dir {work}")
        reference = run_reference(bin_dir, source_dir, net, work, launchers)
        run_cluster(bin_dir, source_dir, net, work, launchers, reference)
        log(f"{time.monotonic() - started:.1f} s in all")
    except Skip as e:
        print(f"skipped: {e}", flush=True)
        problems = None
    except Failure as e:
        problems.append(str(e))
    except KeyboardInterrupt as e:
        problems.append(f"interrupted ({e})")
    except Exception as e:
        problems.append(f"unexpected {type(e).__name__}: {e}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Let the clean-up finish.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if problems:
            for la in launchers:
                la.print_logs()
        for la in launchers:
            la.kill_all()
        net.destroy()
        if args.keep or problems:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if problems is None:
        return SKIP
    for p in problems:
        log(f"FAIL: {p}")
    if problems:
        log("FAILED")
        return 1
    log("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
