"""A third-party Antidote backend agent in Python: antidote.agent.v1 over gRPC.

It realises every presentation of a live lesson as a local process on loopback (presenter.py):
an http presentation is a small web server naming the lesson, the endpoint and the stage, an ssh
presentation writes an SSH banner. Shell check files (RunChecks) run as local processes too. It is written from proto/PROTOCOL.md and
proto/antidote/agent/v1/agent.proto alone.

    python3 agent.py --listen 127.0.0.1:0 [--state-dir DIR] [--max-live-lessons N]
                     [--images busybox,...] [--silent-port 9] [--probe-timeout 60]

Prints exactly one line, "listening on HOST:PORT", on stdout once it serves; logs go to stderr.

The "objects" of this backend are the presenter processes (which die with the agent) and one
record per live lesson in --state-dir (live-lessons/<hash of id>.json, carrying the spec's
labels). List/Get are computed from those records plus the processes; after a restart the
records are found again: List shows them (BOOTING, "not recovered yet"), Get and Watch do not
until Recover (or Provision) adopts them and starts their processes again (PROTOCOL.md [G1],
[G2], [A2], [A6]).

Every refusal carries a google.rpc.ErrorInfo (domain antidote.io, an ErrorReason name and its
metadata) through grpcio-status (PROTOCOL.md "Errors").
"""

import argparse
import base64
import hashlib
import json
import logging
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from antidote.agent.v1 import agent_pb2 as pb
from antidote.agent.v1 import agent_pb2_grpc as pb_grpc

AGENT_NAME = "python-agent"
BUILD_VERSION = "0.1.0"
SERVICE = "antidote.agent.v1.Backend"
MAJORS = [1]
CAPABILITIES = ["presentation.http", "presentation.ssh", "watch", "recover", "plan", "checks"]
REQUIRED_LABELS = ["antidote.io/instance", "antidote.io/live-lesson", "antidote.io/session",
                   "antidote.io/generation", "antidote.io/lesson"]
PRESENTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presenter.py")
DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
TYPES = {pb.PRESENTATION_TYPE_HTTP: "http", pb.PRESENTATION_TYPE_SSH: "ssh"}

PROBE_TIMEOUT = 2.0       # one probe: connect + banner / status line
START_TIMEOUT = 5.0       # a presenter must say its port within this
READY_TIMEOUT = 60.0      # CONFIGURING longer than this with failing probes -> FAILED (--probe-timeout)
IMAGES = {"busybox"}      # the image slugs this agent "runs" (--images): others never start
SILENT_PORT = 9           # presentations on this port accept and never answer (--silent-port)
REQUEST_LIMIT = 4 << 20   # requests larger than this are REQUEST_TOO_LARGE (PROTOCOL.md [E4])
DOMAIN = "antidote.io"    # the ErrorInfo domain of every refusal
READY_PROBE_EVERY = 5.0   # probing of READY live lessons
READY_FAILURES = 3        # consecutive failed rounds that turn READY into FAILED
DEFAULT_PAGE, MAX_PAGE = 100, 500
DEFAULT_HEARTBEAT, MAX_HEARTBEAT = 10.0, 30.0
WATCH_QUEUE = 1024        # events a watcher may fall behind before it gets a resync
MAX_LABELS, MAX_LABEL_BYTES = 32, 253  # label bounds of a spec (PROTOCOL.md [S2])
CHECK_LIMIT = 300.0       # seconds a check file may run at most (PROTOCOL.md [X3])
CHECK_OUTPUT = 16 * 1024  # the tail of a check file's output answered (PROTOCOL.md [X3])
MAX_CHECK_FILE, MAX_CHECK_FILES = 256 * 1024, 1024 * 1024  # bytes (PROTOCOL.md [X2])
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,253}$")

log = logging.getLogger(AGENT_NAME)


class RpcError(Exception):
    """A refusal: its gRPC code, its antidote.agent.v1.ErrorReason name, a message for people and
    the reason's metadata (PROTOCOL.md "Errors")."""

    def __init__(self, code, reason, message, **metadata):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.metadata = {k: str(v) for k, v in metadata.items()}

    def status(self):
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN,
                                           metadata=self.metadata)
        detail = any_pb2.Any()
        detail.Pack(info)
        return rpc_status.to_status(status_pb2.Status(
            code=self.code.value[0], message=self.message, details=[detail]))


def invalid(field, why):
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SPEC", f"{field}: {why}",
                    field=field)


def not_found(live_lesson_id, message):
    return RpcError(grpc.StatusCode.NOT_FOUND, "LIVE_LESSON_NOT_FOUND", message,
                    live_lesson_id=live_lesson_id)


# ----------------------------------------------------------------------------- spec checks

def check_spec(spec):
    """Returns [(severity, field, message)] with fields relative to the spec."""
    out = []
    err = lambda f, m: out.append((pb.SEVERITY_ERROR, f, m))  # noqa: E731
    warn = lambda f, m: out.append((pb.SEVERITY_WARNING, f, m))  # noqa: E731
    try:
        if str(uuid.UUID(spec.live_lesson_id)) != spec.live_lesson_id:
            raise ValueError
    except ValueError:
        err("live_lesson_id", f"`{spec.live_lesson_id}` is not a lower-case hyphenated UUID")
    if spec.generation < 1:
        err("generation", "must be at least 1")
    if not spec.endpoints:
        err("endpoints", "must not be empty")
    for key in REQUIRED_LABELS:
        if not spec.labels.get(key):
            err(f"labels[{key}]", "missing; the scheduler always sends it")
    if spec.labels.get("antidote.io/live-lesson", spec.live_lesson_id) != spec.live_lesson_id:
        err("labels[antidote.io/live-lesson]", "differs from live_lesson_id")
    if len(spec.labels) > MAX_LABELS:
        err("labels", f"{len(spec.labels)} labels, over the {MAX_LABELS} a spec may carry")
    for key, value in sorted(spec.labels.items()):
        if max(len(key.encode()), len(value.encode())) > MAX_LABEL_BYTES:
            err(f"labels[{key}]", f"key or value over {MAX_LABEL_BYTES} bytes")
    names = set()
    for i, ep in enumerate(spec.endpoints):
        f = f"endpoints[{i}]"
        if not DNS_LABEL.match(ep.name):
            err(f + ".name", f"`{ep.name}` is not a DNS label (1-63 of a-z, 0-9 and -, "
                "starting with a letter)")
        elif ep.name in names:
            err(f + ".name", f"`{ep.name}` is used by another endpoint")
        names.add(ep.name)
        if not ep.image.slug:
            err(f + ".image.slug", "is empty")
        if ep.HasField("jupyter_guide"):
            err(f + ".jupyter_guide", "this agent does not offer guide.jupyter")
        if ep.HasField("configuration"):
            err(f + ".configuration", f"this agent cannot apply configuration "
                f"`{ep.configuration.file_name}`: it does not offer stage.configuration")
        for j, port in enumerate(ep.additional_ports):
            if not 1 <= port <= 65535:
                err(f"{f}.additional_ports[{j}]", f"{port} is not in 1..65535")
        if ep.additional_ports:
            warn(f + ".additional_ports", "not exposed: only presentations get a process")
        pnames = set()
        for j, p in enumerate(ep.presentations):
            pf = f"{f}.presentations[{j}]"
            if not p.name:
                err(pf + ".name", "empty")
            elif p.name in pnames:
                err(pf + ".name", f"`{p.name}` is used twice in endpoint `{ep.name}`")
            pnames.add(p.name)
            if p.type not in TYPES:
                err(pf + ".type", "must be PRESENTATION_TYPE_SSH or PRESENTATION_TYPE_HTTP")
            if not 1 <= p.port <= 65535:
                err(pf + ".port", f"{p.port} is not in 1..65535")
    for i, c in enumerate(spec.connections):
        for side in ("a", "b"):
            if getattr(c, side) not in names:
                err(f"connections[{i}].{side}", f"`{getattr(c, side)}` is not an endpoint")
        warn(f"connections[{i}]", "not realised: local processes share the host's loopback")
    return out


def rule_errors(spec):
    """The spec rules broken (PROTOCOL.md [S2]): (field, message), fields relative to the spec."""
    return [(f, m) for s, f, m in check_spec(spec) if s == pb.SEVERITY_ERROR]


def unknown_images(spec):
    """(field, slug) of every endpoint whose image this agent does not run. Not a spec rule: the
    generation goes FAILED while booting (PROTOCOL.md [R5])."""
    return [(f"endpoints[{i}].image.slug", ep.image.slug) for i, ep in enumerate(spec.endpoints)
            if ep.image.slug not in IMAGES]


def require_valid(request):
    """The request's spec, if it is there and keeps every rule; else INVALID_SPEC naming the first
    field broken (PROTOCOL.md [S1])."""
    if not request.HasField("spec"):
        raise invalid("spec", "missing")
    errors = rule_errors(request.spec)
    if errors:
        field = f"spec.{errors[0][0]}"
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SPEC",
                       "; ".join(f"spec.{f}: {m}" for f, m in errors), field=field)
    return request.spec


def fixed(spec):
    """What must not change between generations of a live lesson (PROTOCOL.md [S3]), by field."""
    endpoints = []
    for ep in spec.endpoints:
        copy = pb.Endpoint()
        copy.CopyFrom(ep)
        copy.ClearField("configuration")
        for secret in ("ssh_user", "ssh_password", "config_user", "config_password"):
            setattr(copy.image, secret, "")
        endpoints.append(copy.SerializeToString(deterministic=True))
    labels = {k: v for k, v in spec.labels.items() if k != "antidote.io/generation"}
    return [("session_id", spec.session_id), ("lesson_slug", spec.lesson_slug),
            ("endpoints", endpoints),
            ("connections", [c.SerializeToString(deterministic=True) for c in spec.connections]),
            ("labels", sorted(labels.items()))]


def digest(spec):
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()


def without_secrets(spec):
    copy = pb.LessonSpec()
    copy.CopyFrom(spec)
    for ep in copy.endpoints:
        ep.image.ssh_password = ""
        ep.image.config_password = ""
    return copy


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def seconds(duration):
    return duration.seconds + duration.nanos / 1e9


# ----------------------------------------------------------------------------- processes

class Child:
    """One presenter process, in its own process group."""

    def __init__(self, key, kind, spec, popen, port):
        self.key, self.kind, self.popen, self.port = key, kind, popen, port
        self.stage, self.slug = spec.stage, spec.lesson_slug

    def exit_code(self):
        return self.popen.poll()

    def stop(self):
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def spawn(spec, ep, pres, prefer_port):
    kind = TYPES[pres.type]
    # A presentation on the silent port stands for one whose server never answers.
    mode = "silent" if SILENT_PORT and pres.port == SILENT_PORT else kind
    args = [sys.executable, PRESENTER, "--type", mode, "--port", str(prefer_port or 0),
            "--live-lesson", spec.live_lesson_id, "--lesson", spec.lesson_slug,
            "--endpoint", ep.name, "--presentation", pres.name, "--stage", str(spec.stage),
            "--generation", str(spec.generation), "--parent", str(os.getpid())]
    popen = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             start_new_session=True, close_fds=True)
    line, deadline = b"", time.monotonic() + START_TIMEOUT
    while not line.endswith(b"\n") and time.monotonic() < deadline:
        ready, _, _ = select.select([popen.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(popen.stdout.fileno(), 64) if ready else b""
        if ready and not chunk:
            break
        line += chunk
    popen.stdout.close()
    child = Child((ep.name, pres.name), kind, spec, popen, 0)
    if not line.startswith(b"port "):
        try:
            code = popen.wait(1.0)
            why = f"the {kind} presenter exited with code {code} before listening"
        except subprocess.TimeoutExpired:
            why = f"the {kind} presenter did not listen within {START_TIMEOUT:.0f} s"
        child.stop()
        raise RuntimeError(why)
    child.port = int(line.split()[1])
    return child


def probe(kind, port):
    """(ok, error) for one presentation, probed as a learner connects: over 127.0.0.1."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT) as s:
            s.settimeout(PROBE_TIMEOUT)
            if kind == "http":
                s.sendall(f"GET / HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
                          "User-Agent: antidote-python-agent-probe\r\n\r\n".encode())
            data = b""
            while b"\n" not in data and len(data) < 512:
                chunk = s.recv(512)
                if not chunk:
                    break
                data += chunk
            want = b"HTTP/" if kind == "http" else b"SSH-"
            if data.startswith(want):
                return True, ""
            return False, f"answered {data[:40]!r}, not a line starting {want.decode()!r}"
    except OSError as e:
        return False, str(e) or type(e).__name__


def kill_stale(live_lesson_id, pids):
    """Kills presenters of a previous agent process that are still alive (found by label)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if PRESENTER.encode() in argv and live_lesson_id.encode() in argv:
            log.info("killing leftover presenter %d of %s", pid, live_lesson_id)
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


# ----------------------------------------------------------------------------- the book

class Lesson:
    def __init__(self, spec, handle):
        self.id = spec.live_lesson_id
        self.spec, self.digest, self.handle = spec, digest(spec), handle
        self.phase, self.reason = pb.PHASE_PENDING, ""
        self.children = {}      # (endpoint, presentation) -> Child; only the worker touches it
        self.ports = {}         # (endpoint, presentation) -> port learners connect to
        self.healthy = {}       # (endpoint, presentation) -> bool
        self.reachable = None   # Condition "Reachable"
        self.state = None       # last published LiveLessonState
        self.dirty = True       # the worker must (re)create processes for self.spec
        self.dormant = False    # loaded from disk after a restart; no processes yet
        self.stopping = False
        self.wake = threading.Event()
        self.worker = None
        self.remover = None


class Book:
    """Live lessons, the revision counter and Watch subscribers; every change under self.mu."""

    def __init__(self, state_dir, max_live_lessons):
        self.mu = threading.RLock()
        self.lessons = {}
        self.revision = 0
        self.watchers = set()
        self.closing = False
        self.max = max_live_lessons
        self.dir = os.path.join(state_dir, "live-lessons") if state_dir else None
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
            self.load()

    # --- persistence: one JSON record per live lesson, the backend's durable "object"

    def path(self, live_lesson_id):
        return os.path.join(self.dir, hashlib.sha256(live_lesson_id.encode()).hexdigest()[:32]
                            + ".json")

    def save(self, lesson):
        if not self.dir:
            return
        record = {
            "live_lesson_id": lesson.id,
            "labels": dict(lesson.spec.labels),
            "handle": base64.b64encode(lesson.handle).decode(),
            "spec": base64.b64encode(without_secrets(lesson.spec).SerializeToString()).decode(),
            "spec_digest": lesson.digest,
            "failed": lesson.reason if lesson.phase == pb.PHASE_FAILED else None,
            "ports": [[e, p, port] for (e, p), port in sorted(lesson.ports.items())],
            "pids": [c.popen.pid for c in list(lesson.children.values())],
        }
        tmp = self.path(lesson.id) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, self.path(lesson.id))

    def unsave(self, lesson):
        if self.dir:
            try:
                os.remove(self.path(lesson.id))
            except FileNotFoundError:
                pass

    def load(self):
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.dir, name)) as f:
                    record = json.load(f)
                spec = pb.LessonSpec.FromString(base64.b64decode(record["spec"]))
                lesson = Lesson(spec, base64.b64decode(record["handle"]))
            except (OSError, ValueError, KeyError) as e:
                log.warning("ignoring unreadable record %s: %s", name, e)
                continue
            kill_stale(lesson.id, record.get("pids", []))
            lesson.digest = record["spec_digest"]
            lesson.ports = {(e, p): port for e, p, port in record.get("ports", [])}
            lesson.dormant = True
            if record.get("failed") is not None:
                # Kept for the adoption: a FAILED generation stays FAILED.
                lesson.phase, lesson.reason = pb.PHASE_FAILED, record["failed"]
            self.lessons[lesson.id] = lesson
            self.publish(lesson)
            log.info("found live lesson %s (generation %d) from before the restart",
                     lesson.id, spec.generation)

    # --- states and events

    def build(self, lesson):
        spec = lesson.spec
        phase, reason = lesson.phase, lesson.reason
        if lesson.dormant and not lesson.stopping:
            # Found after a restart, not adopted yet: what List shows (PROTOCOL.md [G2]).
            phase = pb.PHASE_BOOTING
            reason = ("found after an agent restart, not recovered yet: the presentation "
                      "processes are gone; Recover (or Provision) starts them again")
        s = pb.LiveLessonState(live_lesson_id=lesson.id, generation=spec.generation,
                               stage=spec.stage, phase=phase, reason=reason,
                               handle=lesson.handle, labels=dict(spec.labels))
        shown = not lesson.dormant and lesson.phase != pb.PHASE_TERMINATING
        ok_all = total_all = 0
        for ep in spec.endpoints:
            es = s.endpoints.add(name=ep.name, total=len(ep.presentations))
            for p in ep.presentations:
                key = (ep.name, p.name)
                es.healthy += bool(shown and lesson.healthy.get(key))
                port = lesson.ports.get(key) if shown else None
                ps = es.presentations.add(name=p.name, type=p.type)
                if port:
                    ps.address = f"127.0.0.1:{port}"
                    if p.type == pb.PRESENTATION_TYPE_HTTP:
                        ps.url = f"http://127.0.0.1:{port}/"
            ok_all, total_all = ok_all + es.healthy, total_all + es.total
        status = shown and ok_all == total_all
        cond = lesson.reachable
        if cond is None or cond.status != status:
            cond = pb.Condition(type="Reachable", status=status)
            cond.last_transition.GetCurrentTime()
        cond.reason = "AllProbesPass" if status else "ProbesFailing"
        cond.message = f"{ok_all} of {total_all} presentations answer their probe"
        lesson.reachable = cond
        s.conditions.append(cond)
        return s

    def publish(self, lesson):
        """Rebuilds the state; on a change, bumps the revision and tells the watchers (of held
        live lessons only: one found after a restart shows on Watch once adopted)."""
        with self.mu:
            state = self.build(lesson)
            old = lesson.state
            if old is not None:
                old_cmp = pb.LiveLessonState()
                old_cmp.CopyFrom(old)
                old_cmp.revision = 0
                if old_cmp.SerializeToString(deterministic=True) == \
                        state.SerializeToString(deterministic=True):
                    return old
            self.revision += 1
            state.revision = self.revision
            lesson.state = state
            if not lesson.dormant:
                self.send(dict(state.labels), pb.WatchEvent(revision=self.revision,
                                                            changed=state))
            return state

    def forget(self, lesson, quietly=False):
        """Drops a removed live lesson; watchers are told unless no stream ever showed it."""
        with self.mu:
            self.lessons.pop(lesson.id, None)
            if quietly:
                return
            self.revision += 1
            event = pb.WatchEvent(revision=self.revision,
                                  deleted=pb.Deleted(live_lesson_id=lesson.id))
            self.send(dict(lesson.spec.labels), event)

    def send(self, labels, event):
        for w in list(self.watchers):
            if matches(w.selector, labels):
                w.offer(event)

    def set_phase(self, lesson, generation, phase, reason):
        """Moves the phase unless a newer generation or a removal overtook the caller."""
        with self.mu:
            if lesson.spec.generation != generation or lesson.stopping or lesson.dirty:
                return
            was_failed = lesson.phase == pb.PHASE_FAILED
            lesson.phase, lesson.reason = phase, reason
            self.publish(lesson)
            if (phase == pb.PHASE_FAILED) != was_failed:
                self.save(lesson)
            log.info("%s generation %d: %s %s", lesson.id, generation,
                     pb.Phase.Name(phase), reason)

    def matching(self, selector, found=False):
        """States of the live lessons held (and, with `found`, of those found after a restart
        and not adopted yet) whose labels match, in id order."""
        return [l.state for _, l in sorted(self.lessons.items())
                if matches(selector, l.spec.labels) and (found or not l.dormant)]

    def held(self):
        """How many live lessons count against capacity: accepted and not being removed, those
        found after a restart excepted until adopted (PROTOCOL.md [C1])."""
        return sum(1 for l in self.lessons.values() if not l.dormant and not l.stopping)


class Watcher:
    def __init__(self, selector):
        self.selector = selector
        self.events = queue.Queue(maxsize=WATCH_QUEUE)
        self.overflow = False

    def offer(self, event):
        try:
            self.events.put_nowait(event)
        except queue.Full:
            self.overflow = True


# ----------------------------------------------------------------------------- the work

class Worker:
    """Moves one live lesson towards its spec: processes, probes, phases."""

    def __init__(self, book, lesson):
        self.book, self.l = book, lesson

    def run(self):
        l, book = self.l, self.book
        ready_since = deadline = None
        last_probe, failures, generation = 0.0, 0, 0
        while True:
            with book.mu:
                if l.stopping or book.closing:
                    return
                dirty, l.dirty = l.dirty, False
                spec = l.spec
            generation = spec.generation
            try:
                if dirty:
                    if not self.reconcile(spec):
                        continue
                    ready_since, failures, last_probe = None, 0, 0.0
                    deadline = time.monotonic() + READY_TIMEOUT
                phase = l.phase
                if phase in (pb.PHASE_CONFIGURING, pb.PHASE_READY):
                    for child in list(l.children.values()):
                        code = child.exit_code()
                        if code is not None:
                            book.set_phase(l, generation, pb.PHASE_FAILED,
                                           f"the {child.kind} presentation `{child.key[1]}` of "
                                           f"endpoint `{child.key[0]}` exited with code {code}")
                            break
                    phase = l.phase
                now = time.monotonic()
                if phase == pb.PHASE_CONFIGURING or (
                        phase == pb.PHASE_READY and now - last_probe >= READY_PROBE_EVERY):
                    last_probe = now
                    results = {key: probe(c.kind, c.port) for key, c in list(l.children.items())}
                    with book.mu:
                        if l.dirty or l.stopping or l.spec.generation != generation:
                            continue
                        l.healthy = {key: ok for key, (ok, _) in results.items()}
                        book.publish(l)
                    bad = [(key, e) for key, (ok, e) in results.items() if not ok]
                    first = bad and (f"the {l.children[bad[0][0]].kind} presentation "
                                     f"`{bad[0][0][1]}` of endpoint `{bad[0][0][0]}` "
                                     f"(127.0.0.1:{l.children[bad[0][0]].port})")
                    if phase == pb.PHASE_CONFIGURING:
                        if not bad:
                            ready_since = ready_since or now
                            if now - ready_since >= seconds(spec.ready_delay):
                                book.set_phase(l, generation, pb.PHASE_READY,
                                               f"all {len(results)} presentations answer")
                        else:
                            ready_since = None
                            if now > deadline:
                                book.set_phase(l, generation, pb.PHASE_FAILED,
                                               f"{first} did not answer within "
                                               f"{READY_TIMEOUT:.0f} s: {bad[0][1]}")
                    else:
                        failures = failures + 1 if bad else 0
                        if failures >= READY_FAILURES:
                            book.set_phase(l, generation, pb.PHASE_FAILED,
                                           f"{first} stopped answering: {bad[0][1]}")
            except Exception as e:  # a bug must show as FAILED, not as a silent thread
                log.exception("worker of %s", l.id)
                book.set_phase(l, generation, pb.PHASE_FAILED, f"agent error: {e}")
            wait = 0.5 if l.phase == pb.PHASE_CONFIGURING else 1.0
            if l.wake.wait(wait):
                l.wake.clear()

    def reconcile(self, spec):
        """Makes the processes match spec: keeps what still fits, restarts http presenters whose
        stage changed, starts what is missing. False when overtaken or failed."""
        l, book = self.l, self.book
        unknown = unknown_images(spec)
        if unknown:
            field, slug = unknown[0]
            book.set_phase(l, spec.generation, pb.PHASE_FAILED,
                           f"image `{slug}` does not start: this agent runs only "
                           f"{', '.join(sorted(IMAGES))} ({field})")
            return False
        want = {(ep.name, p.name): (ep, p) for ep in spec.endpoints for p in ep.presentations}
        missing = [k for k in want if k not in l.children]
        with book.mu:
            if l.phase == pb.PHASE_PENDING and missing:
                # The first creation (adoption after a restart sets BOOTING itself).
                l.phase, l.reason = pb.PHASE_BOOTING, f"starting {len(want)} presentation processes"
                book.publish(l)
        for key, child in list(l.children.items()):
            entry = want.get(key)
            stale = (entry is None or TYPES[entry[1].type] != child.kind
                     or child.exit_code() is not None
                     or (child.kind == "http" and (child.stage, child.slug)
                         != (spec.stage, spec.lesson_slug)))
            if stale:
                child.stop()
                del l.children[key]
                with book.mu:
                    l.healthy[key] = False
                    if entry is None:
                        l.ports.pop(key, None)
                    book.publish(l)
        for key, (ep, pres) in want.items():
            if key in l.children:
                continue
            with book.mu:
                if l.stopping or book.closing or l.dirty:
                    return False
            try:
                child = spawn(spec, ep, pres, l.ports.get(key))
            except Exception as e:
                book.set_phase(l, spec.generation, pb.PHASE_FAILED,
                               f"cannot start the {TYPES[pres.type]} presentation `{pres.name}` "
                               f"of endpoint `{ep.name}`: {e}")
                return False
            l.children[key] = child
            with book.mu:
                l.ports[key], l.healthy[key] = child.port, False
                book.publish(l)
                if l.stopping or book.closing:
                    return False  # the remover stops what is in l.children
        with book.mu:
            book.save(l)
            if l.dirty or l.spec.generation != spec.generation:
                return False
        book.set_phase(l, spec.generation, pb.PHASE_CONFIGURING,
                       f"stage {spec.stage}: waiting for {len(want)} presentations to answer")
        return True


# ----------------------------------------------------------------------------- the service

# ----------------------------------------------------------------------------- checks

def check_files(request, spec):
    """INVALID_SPEC naming the first rule a RunChecks request breaks (PROTOCOL.md [X2]); `spec`
    is the held live lesson's, or None."""
    try:
        ok = str(uuid.UUID(request.live_lesson_id)) == request.live_lesson_id
    except ValueError:
        ok = False
    if not ok:
        raise invalid("live_lesson_id", "a UUID, hyphenated, lower case")
    if not request.files:
        raise invalid("files", "at least one file")
    seen, total = set(), 0
    for i, f in enumerate(request.files):
        if f.endpoint in seen:
            raise invalid(f"files[{i}].endpoint",
                          f"endpoint `{f.endpoint}` has another file in this request")
        seen.add(f.endpoint)
        if spec is not None and f.endpoint not in {ep.name for ep in spec.endpoints}:
            raise invalid(f"files[{i}].endpoint",
                          f"`{f.endpoint}` is not an endpoint of the live lesson")
        if f.type != pb.CONFIGURATION_TYPE_SHELL:
            raise invalid(f"files[{i}].type", "this agent runs shell files only (it does not "
                                              "offer configuration.python)")
        if not FILE_NAME.match(f.file_name) or f.file_name in (".", ".."):
            raise invalid(f"files[{i}].file_name", "1-253 of A-Za-z0-9._-, not `.` or `..`")
        if len(f.contents) > MAX_CHECK_FILE:
            raise invalid(f"files[{i}].contents", f"at most {MAX_CHECK_FILE // 1024} KiB")
        total += len(f.contents)
    if total > MAX_CHECK_FILES:
        raise invalid("files", f"the files hold {total} bytes together, over "
                               f"{MAX_CHECK_FILES // 1024} KiB")


def run_check(spec, f, timeout):
    """Runs one shell file as a local process, its contents on `sh`'s standard input, in a
    process group of its own killed whole at the timeout; stdout and stderr share one pipe, of
    which only the last CHECK_OUTPUT bytes are kept (PROTOCOL.md [X3])."""
    result = pb.CheckResult(endpoint=f.endpoint, file_name=f.file_name)
    env = dict(os.environ, ANTIDOTE_HOST=f.endpoint, ANTIDOTE_STAGE=str(spec.stage),
               ANTIDOTE_LIVE_LESSON=spec.live_lesson_id)
    started = time.monotonic()
    try:
        child = subprocess.Popen(["sh", "-s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except OSError as e:
        result.exited, result.exit_code, result.error = False, -1, f"could not start sh: {e}"
        result.duration.FromNanoseconds(0)
        return result
    tail, wrote = bytearray(), [0]

    def feed():
        # A file that exits before reading all of itself closes the pipe: not an error.
        try:
            child.stdin.write(f.contents)
            child.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def drain():
        while True:
            chunk = child.stdout.read1(65536)
            if not chunk:
                return
            wrote[0] += len(chunk)
            tail.extend(chunk)
            if len(tail) > CHECK_OUTPUT:
                del tail[:len(tail) - CHECK_OUTPUT]

    threads = [threading.Thread(target=feed, daemon=True),
               threading.Thread(target=drain, daemon=True)]
    for t in threads:
        t.start()
    try:
        code = child.wait(timeout)
        result.exited, result.exit_code = True, code
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
        result.exited, result.exit_code, result.timed_out = False, -1, True
    # What it left running may hold the pipe open: the answer does not wait for it.
    threads[1].join(1.0)
    result.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
    kept = bytes(tail)
    while kept and kept[0] & 0xC0 == 0x80:   # no partial character at the start
        kept = kept[1:]
    result.output = kept.decode("utf-8", errors="replace")
    result.truncated = wrote[0] > len(kept)
    return result


class Backend(pb_grpc.BackendServicer):
    def __init__(self, book):
        self.book = book
        self.instance_id = str(uuid.uuid4())
        self.checking = set()   # live lessons whose files run now (under book.mu)

    def Handshake(self, request, context):
        common = set(request.supported_majors) & set(MAJORS)
        if not common:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "NO_COMMON_MAJOR",
                           f"no common major version: the scheduler speaks "
                           f"{sorted(request.supported_majors)}, this agent speaks {MAJORS}",
                           scheduler_majors=",".join(map(str, request.supported_majors)),
                           agent_majors=",".join(map(str, MAJORS)))
        log.info("handshake from scheduler %s (%s)", request.scheduler_instance_id,
                 request.scheduler_version)
        with self.book.mu:
            live = self.book.held()
        return pb.HandshakeResponse(
            major=max(common), agent_name=AGENT_NAME, build_version=BUILD_VERSION,
            instance_id=self.instance_id, capabilities=CAPABILITIES,
            capacity=pb.Capacity(max_live_lessons=self.book.max, live_lessons=live),
            labels={"backend": "local-processes", "language": "python"})

    def Plan(self, request, context):
        """A broken spec is refused as Provision refuses it; otherwise the objects, and
        diagnostics for what the rules do not cover (PROTOCOL.md [N2], [N3])."""
        spec = require_valid(request)
        out = pb.PlanResponse()
        for severity, field, message in check_spec(spec):
            out.diagnostics.add(severity=severity, field=field, message=message)
        for field, slug in unknown_images(spec):
            out.diagnostics.add(severity=pb.SEVERITY_ERROR, field=field,
                                message=f"image `{slug}` is not one this agent runs "
                                        f"({', '.join(sorted(IMAGES))}): it would go FAILED")
        if self.book.dir:
            out.objects.add(kind="record", name=self.book.path(spec.live_lesson_id),
                            detail="the live lesson's labels and spec (without passwords)")
        for ep in spec.endpoints:
            for p in ep.presentations:
                kind = TYPES.get(p.type, "?")
                out.objects.add(kind="process", name=f"{ep.name}/{p.name}",
                                detail=f"{kind} presenter on a free 127.0.0.1 port standing in "
                                       f"for port {p.port} (image `{ep.image.slug}` is not run)")
        return out

    def Provision(self, request, context):
        spec = require_valid(request)
        book = self.book
        with book.mu:
            l = book.lessons.get(spec.live_lesson_id)
            if l is None or l.dormant:
                # Not held: capacity applies (PROTOCOL.md [C2]).
                if book.max and book.held() >= book.max:
                    raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED",
                                   f"at capacity: {book.held()} of {book.max} live lessons",
                                   max_live_lessons=book.max)
            if l is None:
                handle = json.dumps({"agent": AGENT_NAME,
                                     "live_lesson_id": spec.live_lesson_id}).encode()
                l = book.lessons[spec.live_lesson_id] = Lesson(spec, handle)
                l.reason = "accepted"
                book.save(l)
                log.info("provision %s generation %d (new)", l.id, spec.generation)
                state = book.publish(l)
                self.start(l)
                return pb.ProvisionResponse(state=state)
            return pb.ProvisionResponse(state=self.update(l, spec, "Provision"))

    def update(self, l, spec, rpc):
        """The generation rules for a known live lesson (book.mu held)."""
        book, held = self.book, l.spec.generation
        if l.stopping:
            raise RpcError(grpc.StatusCode.ABORTED, "BEING_REMOVED",
                           f"live lesson {l.id} is being deprovisioned", live_lesson_id=l.id)
        if spec.generation < held:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "GENERATION_OUTDATED",
                           f"generation {spec.generation} is older than generation {held}, "
                           f"which this agent already holds for live lesson {l.id}",
                           live_lesson_id=l.id, generation=spec.generation,
                           held_generation=held)
        if spec.generation == held:
            if digest(spec) != l.digest:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS, "SPEC_CONFLICT",
                               f"live lesson {l.id} generation {held} was provisioned "
                               f"with another spec", live_lesson_id=l.id, generation=held)
            l.spec = spec  # same spec; after a restart this one also has the passwords
            if l.dormant:
                log.info("%s %s: adopting the record of generation %d", rpc, l.id, held)
                self.adopt(l)
            return book.publish(l)
        for (field, was), (_, now) in zip(fixed(l.spec), fixed(spec)):
            if was != now:
                raise invalid(f"spec.{field}", f"differs from generation {held} of this live "
                              "lesson; only the stage, the ready delay, configurations and "
                              "image credentials change between generations")
        log.info("%s %s: generation %d -> %d, stage %d", rpc, l.id, held, spec.generation,
                 spec.stage)
        l.spec, l.digest = spec, digest(spec)
        l.phase, l.reason = pb.PHASE_CONFIGURING, f"moving to stage {spec.stage}"
        l.dormant, l.dirty = False, True
        book.save(l)
        state = book.publish(l)
        self.start(l)
        return state

    def adopt(self, l):
        """Takes over a record from before a restart (book.mu held): its processes died with the
        previous agent, so they are started again, on their old ports when free. A FAILED
        generation stays FAILED."""
        l.dormant = False
        if l.phase != pb.PHASE_FAILED:
            n = sum(len(ep.presentations) for ep in l.spec.endpoints)
            l.phase = pb.PHASE_BOOTING
            l.reason = f"adopted after an agent restart: starting {n} presentation processes again"
            l.dirty = True
            self.start(l)

    def start(self, l):
        if l.worker is None or not l.worker.is_alive():
            l.worker = threading.Thread(target=Worker(self.book, l).run, daemon=True,
                                        name=f"lesson-{l.id[:8]}")
            l.worker.start()
        l.wake.set()

    def Deprovision(self, request, context):
        book = self.book
        with book.mu:
            l = book.lessons.get(request.live_lesson_id)
            if l is None:
                return pb.DeprovisionResponse(gone=True)
            if not l.stopping:
                l.stopping = True
                l.phase, l.reason = pb.PHASE_TERMINATING, "removing the presentation processes"
                book.publish(l)
                l.remover = threading.Thread(target=self.remove, args=(l,), daemon=True)
                l.remover.start()
                log.info("deprovision %s", l.id)
            remover = l.remover
        remover.join(10.0)
        return pb.DeprovisionResponse(gone=not remover.is_alive())

    def remove(self, l):
        l.wake.set()
        if l.worker is not None:
            l.worker.join()
        for child in list(l.children.values()):
            child.stop()
        l.children.clear()
        self.book.unsave(l)
        # No stream ever showed a live lesson found after a restart and never adopted: its
        # removal sends no event either (PROTOCOL.md [D3]).
        self.book.forget(l, quietly=l.dormant)
        log.info("removed %s", l.id)

    def Get(self, request, context):
        """The state of a held live lesson; one found after a restart and not adopted yet is not
        held (PROTOCOL.md [G1])."""
        with self.book.mu:
            l = self.book.lessons.get(request.live_lesson_id)
            if l is None or l.dormant:
                raise not_found(request.live_lesson_id,
                                f"live lesson {request.live_lesson_id} is not held by this agent")
            return pb.GetResponse(state=l.state)

    def List(self, request, context):
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        with self.book.mu:
            items = [s for s in self.book.matching(dict(request.label_selector), found=True)
                     if s.live_lesson_id > request.page_token]
            revision = self.book.revision
        page = items[:size]
        more = len(items) > size
        return pb.ListResponse(items=page, revision=revision,
                               next_page_token=page[-1].live_lesson_id if more else "")

    def Recover(self, request, context):
        """The Provision table for a live lesson with a record, adopting one found after a
        restart; NOT_FOUND without a record (PROTOCOL.md [A1]-[A4])."""
        spec = require_valid(request)
        if spec.live_lesson_id != request.live_lesson_id:
            raise invalid("spec.live_lesson_id", "differs from live_lesson_id")
        with self.book.mu:
            l = self.book.lessons.get(request.live_lesson_id)
            if l is None:
                raise not_found(request.live_lesson_id,
                                f"nothing is left of live lesson {request.live_lesson_id}")
            return pb.RecoverResponse(state=self.update(l, spec, "Recover"))

    def RunChecks(self, request, context):
        """Runs shell check or solution files on a READY live lesson, one after another, as local
        processes: the refusals in the order of PROTOCOL.md [X2], one run per live lesson at a
        time [X4], nothing reported changes [X5]."""
        id = request.live_lesson_id
        with self.book.mu:
            l = self.book.lessons.get(id)
            held = l if l is not None and not l.dormant else None
            check_files(request, held.spec if held else None)
            if held is None:
                raise not_found(id, f"live lesson `{id}` is not held by this agent")
            spec = held.spec
            if (held.phase != pb.PHASE_READY or held.stopping
                    or spec.generation != request.generation):
                phase = pb.PHASE_TERMINATING if held.stopping else held.phase
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "NOT_READY",
                               f"live lesson `{id}` is {pb.Phase.Name(phase)[6:]} at generation "
                               f"{spec.generation}, not READY at generation {request.generation}",
                               live_lesson_id=id, phase=pb.Phase.Name(phase),
                               generation=spec.generation)
            if id in self.checking:
                raise RpcError(grpc.StatusCode.ABORTED, "CHECKS_RUNNING",
                               f"a run of live lesson `{id}` is already going on; one at a time",
                               live_lesson_id=id)
            self.checking.add(id)
        try:
            limit = seconds(request.timeout) if request.HasField("timeout") else 0
            timeout = CHECK_LIMIT if limit <= 0 else min(limit, CHECK_LIMIT)
            results = [run_check(spec, f, timeout) for f in request.files]
            log.info("checks of %s: %s", id, ", ".join(
                f"{r.file_name} {'exit ' + str(r.exit_code) if r.exited else 'timed out'}"
                for r in results))
            return pb.RunChecksResponse(results=results)
        finally:
            with self.book.mu:
                self.checking.discard(id)

    def Watch(self, request, context):
        """A snapshot of the held live lessons, then their changes; heartbeats and resyncs carry
        the revision of the last message sent on this stream (PROTOCOL.md [W1]-[W4])."""
        book = self.book
        # 0 or negative asks for the default (PROTOCOL.md [W4]).
        interval = seconds(request.heartbeat_interval)
        interval = DEFAULT_HEARTBEAT if interval <= 0 else interval
        interval = min(max(interval, 0.1), MAX_HEARTBEAT)
        w = Watcher(dict(request.label_selector))
        with book.mu:
            book.watchers.add(w)
            first = pb.WatchEvent(revision=book.revision,
                                  snapshot=pb.Snapshot(items=book.matching(w.selector)))
        context.add_callback(lambda: w.offer(None))
        told = first.revision
        try:
            yield first
            while context.is_active() and not book.closing:
                if w.overflow:
                    with book.mu:
                        dropped = w.events.qsize()
                        w.events = queue.Queue(maxsize=WATCH_QUEUE)
                        w.overflow = False
                        snap = pb.WatchEvent(revision=book.revision, snapshot=pb.Snapshot(
                            items=book.matching(w.selector)))
                    yield pb.WatchEvent(revision=told, resync=pb.Resync(
                        reason=f"watcher fell behind by more than {dropped} events"))
                    told = max(told, snap.revision)
                    yield snap
                    continue
                try:
                    event = w.events.get(timeout=interval)
                except queue.Empty:
                    sent = timestamp_pb2.Timestamp()
                    sent.GetCurrentTime()
                    yield pb.WatchEvent(revision=told, heartbeat=pb.Heartbeat(sent_at=sent))
                    continue
                if event is not None and event.revision > told:
                    told = event.revision
                    yield event
        finally:
            with book.mu:
                book.watchers.discard(w)


def errors_as_status(servicer):
    """Wraps every RPC: a request over REQUEST_LIMIT is REQUEST_TOO_LARGE, an RpcError becomes
    its status with its ErrorInfo, and any other exception INTERNAL with BACKEND_ERROR, so that
    no refusal goes out untyped (PROTOCOL.md [E1], [E4])."""
    def check_size(request):
        size = request.ByteSize()
        if size > REQUEST_LIMIT:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "REQUEST_TOO_LARGE",
                           f"request too large: {size} bytes, the limit is {REQUEST_LIMIT}",
                           limit=REQUEST_LIMIT)

    def refused(context, e):
        context.abort_with_status(e.status())

    def fault(context, e):
        log.exception("RPC failed")
        refused(context, RpcError(grpc.StatusCode.INTERNAL, "BACKEND_ERROR", f"agent error: {e}"))

    def wrap(fn):
        def unary(request, context):
            try:
                check_size(request)
                return fn(request, context)
            except RpcError as e:
                refused(context, e)
            except Exception as e:  # noqa: BLE001 (every refusal is typed)
                fault(context, e)

        def stream(request, context):
            try:
                check_size(request)
                yield from fn(request, context)
            except RpcError as e:
                refused(context, e)
        return stream if fn.__name__ == "Watch" else unary
    for name in ("Handshake", "Plan", "Provision", "Deprovision", "Get", "List", "Recover",
                 "RunChecks", "Watch"):
        setattr(servicer, name, wrap(getattr(servicer, name)))
    return servicer


def main():
    global IMAGES, SILENT_PORT, READY_TIMEOUT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port; port 0 picks a free one")
    p.add_argument("--state-dir", help="where the live lessons' records are kept across restarts")
    p.add_argument("--max-live-lessons", type=int, default=0, help="0: no limit")
    p.add_argument("--images", default=",".join(sorted(IMAGES)),
                   help="the image slugs this agent runs, comma-separated; others never start")
    p.add_argument("--silent-port", type=int, default=SILENT_PORT,
                   help="presentations on this port accept and never answer (0: none)")
    p.add_argument("--probe-timeout", type=float, default=READY_TIMEOUT,
                   help="seconds a presentation may take to answer before FAILED")
    args = p.parse_args()
    IMAGES = {i for i in args.images.split(",") if i}
    SILENT_PORT, READY_TIMEOUT = args.silent_port, args.probe_timeout
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="python-agent %(asctime)s %(levelname)s %(message)s")

    book = Book(args.state_dir, args.max_live_lessons)
    backend = Backend(book)
    # gRPC's own limit is raised above REQUEST_LIMIT so that the handlers refuse larger
    # requests themselves, typed.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rpc"),
                         options=[("grpc.so_reuseport", 0),
                                  ("grpc.max_receive_message_length", 4 * REQUEST_LIMIT)])
    pb_grpc.add_BackendServicer_to_server(errors_as_status(backend), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host, _, _ = args.listen.rpartition(":")
    port = server.add_insecure_port(args.listen)
    if not port:
        log.error("cannot listen on %s", args.listen)
        sys.exit(1)
    server.start()
    for service in ("", SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("instance %s, %d live lessons found in the state dir, capacity %s",
             backend.instance_id, len(book.lessons), args.max_live_lessons or "unlimited")
    print(f"listening on {host}:{port}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # a signal caught by another thread only runs the handler once
        pass                   # the main thread executes Python code again
    log.info("stopping: the presentation processes go, the records in the state dir stay")
    health_servicer.enter_graceful_shutdown()
    with book.mu:
        book.closing = True
        lessons = list(book.lessons.values())
    server.stop(grace=1.0).wait()
    for l in lessons:
        l.wake.set()
        if l.worker is not None:
            l.worker.join(10.0)
        for child in list(l.children.values()):
            child.stop()
    log.info("stopped")


if __name__ == "__main__":
    main()
