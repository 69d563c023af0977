"""Soak test of the real processes: `fmoe launch` (map service, one group of two cpu ranks with
half the experts cached and an emulated link, a second group of one cpu rank whose paged KV pool
holds only 192 positions with prefix caching on, the router) under many concurrent sampled
requests, some of which share a long system prompt.

Sampled output is where the unusual text is: a byte-level token cut by max_tokens, a lead byte
followed by a space. Requests also mix in n, logprobs, the penalties and min_p. Every answer must still be a 200 with valid JSON (whole) or valid
server-sent events ending with [DONE] (streamed); clients that leave mid-stream must not hurt
anyone; afterwards the router still serves, no process has restarted, the small pool's group
found shared prefixes in its cache and preempted requests (counted in /metrics), and SIGINT
stops the launcher with exit 0.

Run by ctest (soak_test, label integration) with the system python3, standard library only:
  python3 soak_test.py --bin-dir BUILD/bin --source-dir SOURCE [--requests N] [--clients N]
                       [--seed S] [--keep]
The master seed is printed first; rerun with --seed to replay the same requests. Exits 0 when
every check passes; otherwise prints what failed and each process's log tail, and exits 1.
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_SEED = 20240611
MODEL = "tiny-moe"
READY_TIMEOUT_S = 300  # Bound on the wait for the router's /health 200.
REQUEST_TIMEOUT_S = 180  # Per socket operation; generous for a busy 2-core machine.
STOP_TIMEOUT_S = 120  # Bound on the launcher's exit after SIGINT.

PROMPTS = [
    "In the beginning",
    "And God said",
    "The LORD is my shepherd",
    "Water boils at",
    "Blessed are the",
    "And it came to pass",
    "Once upon a time",
    "\u00e9t\u00e9 \u2014 caf\u00e9",
    "x",
    "1 2 3 4",
]
# A system prompt some requests share: full 16-token KV blocks of it are found in the prefix
# cache by later requests.
SHARED = ("You are the keeper of an old library. You answer questions about its books, its "
          "rooms and its history, and you always answer briefly.")
QUESTIONS = [
    "Who made the earth?",
    "What is the light?",
    "Tell me a story.",
    "Why?",
    "Say something in French: caf\u00e9.",
]


def log(msg):
    print(msg, flush=True)


def free_ports(n):
    """n distinct loopback ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_manifest(path, source_dir, work, ports):
    map_port, http_port, worker_port, rdzv_port = ports
    text = f"""# Written by soak_test.py: the shape of deploy/manifests/local.yaml on free ports.
model:
  path: {source_dir}/deploy/models/tiny-moe
  name: {MODEL}
map_service:
  endpoint: tcp://127.0.0.1:{map_port}
  data_dir: {work}/maps
  store_capacity: 1000
  prefetch_distance: 3
worker_groups:
  - name: g0
    policy: fmoe
    max_batch: 8
    queue_limit: 64
    expert_cache_fraction: 0.5
    link:
      gbps: 16
      latency_us: 10
    rendezvous: 127.0.0.1:{rdzv_port}
    workers:
      - device: cpu
      - device: cpu
  - name: g1
    policy: lru
    max_batch: 8
    queue_limit: 64
    kv_cache_tokens: 192
    prefix_caching: true
    workers:
      - device: cpu
router:
  listen: 127.0.0.1:{http_port}
  worker_endpoint: tcp://127.0.0.1:{worker_port}
heartbeat:
  interval_ms: 500
  timeout_ms: 10000
logging:
  level: info
launcher:
  run_dir: {work}/run
  ready_timeout_s: {READY_TIMEOUT_S}
  stop_timeout_s: 20
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def http_get(port, path, timeout=10):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def health(port):
    try:
        status, _ = http_get(port, "/health", timeout=5)
        return status
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# The requests: planned up front from the master seed, so a failure replays.


def plan_requests(master_seed, count):
    rng = random.Random(master_seed)
    plan = []
    for i in range(count):
        chat = rng.random() < 0.5
        stream = rng.random() < 0.5
        body = {
            "model": MODEL,
            "max_tokens": rng.randint(1, 32),
            "temperature": round(rng.uniform(0.7, 2.0), 3),
            "seed": rng.randrange(2**31),
        }
        r = rng.random()
        if r < 0.6:
            body["top_p"] = round(rng.uniform(0.5, 1.0), 3)
        if rng.random() < 0.6:
            body["top_k"] = rng.randint(1, 50)
        # The OpenAI parameters that reach the sampler and the renderer.
        if rng.random() < 0.15:
            body["n"] = rng.randint(2, 3)
        if rng.random() < 0.2:
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = rng.randint(0, 5)
            else:
                body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            body["presence_penalty"] = round(rng.uniform(-2.0, 2.0), 2)
            body["frequency_penalty"] = round(rng.uniform(-2.0, 2.0), 2)
        if rng.random() < 0.1:
            body["repetition_penalty"] = round(rng.uniform(0.5, 2.0), 2)
        if rng.random() < 0.1:
            body["min_p"] = round(rng.uniform(0.0, 0.3), 3)
        if chat:
            messages = []
            r = rng.random()
            if r < 0.4:
                messages.append({"role": "system", "content": SHARED})
            elif r < 0.55:
                messages.append({"role": "system", "content": "You answer briefly."})
            messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
            body["messages"] = messages
        else:
            body["prompt"] = rng.choice(PROMPTS)
            if rng.random() < 0.4:
                body["prompt"] = SHARED + " " + body["prompt"]
        if stream:
            body["stream"] = True
            if rng.random() < 0.3:
                body["stream_options"] = {"include_usage": True}
        # About 10% of the streamed clients leave after a couple of events.
        disconnect_after = rng.randint(1, 3) if stream and rng.random() < 0.1 else 0
        plan.append({"index": i, "chat": chat, "stream": stream,
                     "disconnect_after": disconnect_after, "body": body})
    return plan


class Failure(Exception):
    pass


def check_text(value, what):
    """A text field: a str that is valid Unicode (no lone surrogates); U+FFFD is allowed."""
    if not isinstance(value, str):
        raise Failure(f"{what} is {type(value).__name__}, not str: {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Failure(f"{what} is not valid Unicode: {e}: {value!r}")


def parse_json(raw, what):
    try:
        return json.loads(raw.decode("utf-8"))  # Strict: invalid UTF-8 fails here.
    except (UnicodeDecodeError, ValueError) as e:
        raise Failure(f"{what} is not valid UTF-8 JSON: {e}: {raw[:300]!r}")


def check_whole(spec, status, raw):
    if status != 200:
        raise Failure(f"status {status}: {raw[:300]!r}")
    j = parse_json(raw, "body")
    if not isinstance(j, dict) or not isinstance(j.get("choices"), list) or not j["choices"]:
        raise Failure(f"no choices: {j!r}")
    n = spec["body"].get("n", 1)
    if len(j["choices"]) != n:
        raise Failure(f"{len(j['choices'])} choices for n={n}")
    for i, c in enumerate(j["choices"]):
        if c.get("index") != i:
            raise Failure(f"choices[{i}].index {c.get('index')!r}")
        if spec["chat"]:
            if j.get("object") != "chat.completion":
                raise Failure(f"object {j.get('object')!r}")
            msg = c.get("message")
            if not isinstance(msg, dict) or msg.get("role") != "assistant":
                raise Failure(f"message {msg!r}")
            check_text(msg.get("content"), f"choices[{i}].message.content")
        else:
            if j.get("object") != "text_completion":
                raise Failure(f"object {j.get('object')!r}")
            check_text(c.get("text"), f"choices[{i}].text")
        if c.get("finish_reason") not in ("stop", "length"):
            raise Failure(f"finish_reason {c.get('finish_reason')!r}")
        if spec["body"].get("logprobs") not in (None, False) and not isinstance(
                c.get("logprobs"), dict):
            raise Failure(f"choices[{i}].logprobs {c.get('logprobs')!r}")
    u = j.get("usage")
    if not isinstance(u, dict) or not isinstance(u.get("completion_tokens"), int):
        raise Failure(f"usage {u!r}")
    if u["completion_tokens"] > n * spec["body"]["max_tokens"]:
        raise Failure(f"usage.completion_tokens {u['completion_tokens']} > n * max_tokens")


def check_event(spec, payload, n):
    j = parse_json(payload, f"event {n}")
    if not isinstance(j, dict):
        raise Failure(f"event {n} is not an object: {j!r}")
    if "error" in j:
        raise Failure(f"event {n} is an error: {j!r}")
    if "usage" in j and j.get("choices") == []:
        return
    choices = j.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise Failure(f"event {n}: choices {choices!r}")
    index = choices[0].get("index")
    if not isinstance(index, int) or not 0 <= index < spec["body"].get("n", 1):
        raise Failure(f"event {n}: choice index {index!r}")
    if spec["chat"]:
        if j.get("object") != "chat.completion.chunk":
            raise Failure(f"event {n}: object {j.get('object')!r}")
        delta = choices[0].get("delta")
        if not isinstance(delta, dict):
            raise Failure(f"event {n}: delta {delta!r}")
        if "content" in delta:
            check_text(delta["content"], f"event {n} delta.content")
    else:
        if j.get("object") != "text_completion":
            raise Failure(f"event {n}: object {j.get('object')!r}")
        check_text(choices[0].get("text"), f"event {n} choices[0].text")


def run_stream(spec, res, conn):
    """Reads the event stream line by line; returns 'done' or 'left' (disconnected on purpose)."""
    if res.status != 200:
        raise Failure(f"status {res.status}: {res.read()[:300]!r}")
    ctype = res.getheader("Content-Type", "")
    if "text/event-stream" not in ctype:
        raise Failure(f"Content-Type {ctype!r}")
    events = 0
    done = False
    while True:
        line = res.readline()
        if not line:
            break
        line = line.rstrip(b"\r\n")
        if not line:
            continue
        if not line.startswith(b"data: "):
            raise Failure(f"not an SSE data line: {line[:300]!r}")
        if done:
            raise Failure(f"data after [DONE]: {line[:300]!r}")
        payload = line[len(b"data: "):]
        events += 1
        if payload == b"[DONE]":
            done = True
            continue
        check_event(spec, payload, events)
        if spec["disconnect_after"] and events >= spec["disconnect_after"]:
            # Leave mid-stream: close the socket under the response.
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass
            conn.close()
            return "left"
    if not done:
        raise Failure(f"stream ended after {events} events without data: [DONE]")
    return "done"


def run_one(port, spec):
    path = "/v1/chat/completions" if spec["chat"] else "/v1/completions"
    body = json.dumps(spec["body"]).encode("utf-8")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        if spec["stream"]:
            return run_stream(spec, res, conn)
        check_whole(spec, res.status, res.read())
        return "done"
    finally:
        conn.close()


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = 0
        self.left = 0
        self.failures = []  # (index, message)

    def add(self, spec, outcome, error=None):
        with self.lock:
            if error is not None:
                self.failures.append((spec, error))
            elif outcome == "left":
                self.left += 1
            else:
                self.done += 1


def soak(port, plan, clients):
    tally = Tally()

    def one(spec):
        try:
            tally.add(spec, run_one(port, spec))
        except Failure as e:
            tally.add(spec, None, str(e))
        except (OSError, http.client.HTTPException) as e:
            tally.add(spec, None, f"{type(e).__name__}: {e}")
        except Exception as e:  # A bug in this script is a failure too, not a hang.
            tally.add(spec, None, f"unexpected {type(e).__name__}: {e}")

    with concurrent.futures.ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, plan))
    return tally


# ---------------------------------------------------------------------------------------------
# The launcher.


class Launcher:
    def __init__(self, bin_dir, manifest, work):
        self.bin_dir = bin_dir
        self.manifest = manifest
        self.work = work
        self.log_path = os.path.join(work, "launcher.log")
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen([os.path.join(bin_dir, "fmoe"), "launch", manifest],
                                     stdin=subprocess.DEVNULL, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def status_json(self):
        """`fmoe status MANIFEST --json`, parsed (it exits 1 when something is unhealthy)."""
        out = subprocess.run([os.path.join(self.bin_dir, "fmoe"), "status", self.manifest,
                              "--json"], stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=60)
        try:
            return json.loads(out.stdout.decode("utf-8"))
        except ValueError:
            raise Failure(f"fmoe status --json printed no JSON (exit {out.returncode}): "
                          f"{out.stdout[:500]!r} {out.stderr[:500]!r}")

    def stop(self, timeout_s):
        """SIGINT, then wait; the exit code, or None when it did not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def children(self):
        """Pids the launcher recorded that are still our binaries."""
        try:
            with open(os.path.join(self.work, "run", "launcher.json"), encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError):
            return []
        pids = []
        for p in state.get("processes", []):
            pid = p.get("pid", -1)
            if not isinstance(pid, int) or pid <= 0:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if self.bin_dir.encode() in cmdline:
                pids.append(pid)
        return pids

    def kill_all(self):
        """Makes sure nothing outlives the test: the launcher's group, then its children."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log_file.close()

    def print_logs(self, lines=60):
        files = [self.log_path]
        logs = os.path.join(self.work, "run", "logs")
        if os.path.isdir(logs):
            files += [os.path.join(logs, n) for n in sorted(os.listdir(logs))]
        for path in files:
            try:
                with open(path, "rb") as f:
                    tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
            except OSError as e:
                tail = [f"(unreadable: {e})"]
            log(f"----- {path} (last {len(tail)} lines) -----")
            for line in tail:
                log(line)


def wait_until(pred, timeout_s, poll_s=0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll_s)
    return pred()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int,
                    default=int(os.environ.get("FMOE_SOAK_SEED", DEFAULT_SEED)))
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) afterwards")
    args = ap.parse_args()
    bin_dir = os.path.abspath(args.bin_dir)
    source_dir = os.path.abspath(args.source_dir)

    log(f"soak: master seed {args.seed} ({args.requests} requests, {args.clients} clients; "
        f"replay with --seed {args.seed})")
    work = tempfile.mkdtemp(prefix="fmoe-soak-")
    manifest = os.path.join(work, "manifest.yaml")
    ports = free_ports(4)
    http_port = ports[1]
    write_manifest(manifest, source_dir, work, ports)
    log(f"soak: manifest {manifest}, router http://127.0.0.1:{http_port}")

    problems = []
    launcher = Launcher(bin_dir, manifest, work)
    started = time.monotonic()
    try:
        # Ready: the router's /health answers 200 (or the launcher gave up).
        ready = wait_until(lambda: launcher.proc.poll() is not None or health(http_port) == 200,
                           READY_TIMEOUT_S)
        if not ready or launcher.proc.poll() is not None:
            raise Failure(f"the router's /health did not answer 200 within {READY_TIMEOUT_S} s "
                          f"(launcher exit code {launcher.proc.poll()})")
        log(f"soak: ready after {time.monotonic() - started:.1f} s")

        plan = plan_requests(args.seed, args.requests)
        t0 = time.monotonic()
        tally = soak(http_port, plan, args.clients)
        took = time.monotonic() - t0
        log(f"soak: load took {took:.1f} s: {tally.done} completed, {tally.left} left "
            f"mid-stream on purpose, {len(tally.failures)} failed")
        for spec, message in tally.failures[:20]:
            log(f"soak: FAILED request {spec['index']} "
                f"({'chat' if spec['chat'] else 'completion'}"
                f"{', stream' if spec['stream'] else ''}): {message}\n"
                f"      body: {json.dumps(spec['body'])}")
        if len(tally.failures) > 20:
            log(f"soak: ... and {len(tally.failures) - 20} more failures")
        if tally.failures:
            problems.append(f"{len(tally.failures)} of {len(plan)} requests failed")

        # After the load: still serving, nothing restarted.
        if health(http_port) != 200:
            problems.append("the router's /health does not answer 200 after the load")
        greedy = {"index": -1, "chat": False, "stream": False, "disconnect_after": 0,
                  "body": {"model": MODEL, "prompt": "In the beginning", "max_tokens": 8,
                           "temperature": 0}}
        try:
            run_one(http_port, greedy)
        except (Failure, OSError, http.client.HTTPException) as e:
            problems.append(f"the last greedy completion failed: {e}")
        # The small pool's group shared prefixes and preempted (its leader's heartbeats).
        def g1_metric(name):
            try:
                _, body = http_get(http_port, "/metrics")
            except OSError:
                return -1.0
            key = name + '{group="g1"} '
            for line in body.decode("utf-8", "replace").splitlines():
                if line.startswith(key):
                    return float(line[len(key):])
            return -1.0
        wait_until(lambda: g1_metric("fmoe_prefix_cache_hits_total") > 0
                   and g1_metric("fmoe_preemptions_total") > 0, 30)
        hits = g1_metric("fmoe_prefix_cache_hits_total")
        preemptions = g1_metric("fmoe_preemptions_total")
        log(f"soak: group g1 (192-position KV pool): {hits:.0f} prompt tokens from the prefix "
            f"cache, {preemptions:.0f} preemptions")
        if hits <= 0:
            problems.append("group g1 found no prompt tokens in its prefix cache")
        if preemptions <= 0:
            problems.append("group g1 preempted no request with its 192-position pool")
        status = launcher.status_json()
        if not status.get("launcher_alive"):
            problems.append(f"fmoe status: the launcher is not alive: {status}")
        for p in status.get("processes", []):
            if p.get("restarts") != 0:
                problems.append(f"fmoe status: {p.get('name')} restarted {p.get('restarts')} "
                                f"times")
        if not status.get("processes"):
            problems.append(f"fmoe status lists no processes: {status}")

        code = launcher.stop(STOP_TIMEOUT_S)
        if code != 0:
            problems.append(f"the launcher exited {code} after SIGINT (0 expected; None: it "
                            f"did not exit within {STOP_TIMEOUT_S} s)")
        log(f"soak: {len(plan)} requests, {len(tally.failures)} failed "
            f"({tally.left} disconnected on purpose), {took:.1f} s under load, "
            f"{time.monotonic() - started:.1f} s in all")
    except Failure as e:
        problems.append(str(e))
    except Exception as e:
        problems.append(f"unexpected {type(e).__name__}: {e}")
    finally:
        if problems:
            launcher.print_logs()
        launcher.kill_all()
        if args.keep or problems:
            log(f"soak: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    for p in problems:
        log(f"soak: FAIL: {p}")
    if problems:
        log(f"soak: FAILED (master seed {args.seed})")
        return 1
    log("soak: PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
