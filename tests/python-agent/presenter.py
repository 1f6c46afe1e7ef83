"""One presentation of one endpoint, as a local process on loopback.

    presenter.py --type http|ssh --port PORT --live-lesson ID --lesson SLUG --endpoint NAME
                 --presentation NAME --stage N --generation G --parent PID

The agent starts one of these per presentation, in its own process group. It binds 127.0.0.1 on
PORT (or, when PORT is 0 or taken, on a free port) and prints "port N" on stdout once it listens;
it prints nothing else there. It exits when the agent (PID) is gone, so that no presentation
outlives its agent even when the agent is killed with SIGKILL.

  http    answers every GET with 200 and a page naming the lesson, the endpoint and the stage.
  ssh     writes the banner "SSH-2.0-antidote-python\\r\\n" on connect (it speaks no more SSH).
  silent  accepts connections and never answers: a server that hangs (for probes that time out).

The --live-lesson/--lesson/--generation arguments are this process's labels: they make it
findable in `ps` like a labelled container.
"""

import argparse
import html
import http.server
import os
import socket
import socketserver
import sys
import threading
import time

SSH_BANNER = b"SSH-2.0-antidote-python\r\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--type", choices=["http", "ssh", "silent"], required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--live-lesson", required=True)
    p.add_argument("--lesson", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--presentation", required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args()

    server = make_server(args)
    threading.Thread(target=watch_parent, args=(args.parent,), daemon=True).start()
    sys.stdout.write(f"port {server.server_address[1]}\n")
    sys.stdout.flush()
    server.serve_forever()


def make_server(args):
    if args.type == "http":
        handler = http_handler(args)
    elif args.type == "silent":
        handler = Silent
    else:
        handler = SshBanner
    server_class = type("Server", (socketserver.ThreadingTCPServer,), {
        "daemon_threads": True, "allow_reuse_address": True})
    for port in ([args.port, 0] if args.port else [0]):
        try:
            return server_class(("127.0.0.1", port), handler)
        except OSError as err:
            print(f"presenter: cannot bind 127.0.0.1:{port}: {err}", file=sys.stderr)
    sys.exit(1)


def http_handler(args):
    title = f"{args.lesson}: {args.endpoint}"
    page = (
        "<!doctype html>\n<html><head><title>{t}</title></head><body>\n"
        "<h1>{t}</h1>\n"
        "<p>lesson <b id=lesson>{lesson}</b>, endpoint <b id=endpoint>{endpoint}</b>, "
        "presentation <b id=presentation>{pres}</b>, stage <b id=stage>{stage}</b> "
        "(generation {gen}, live lesson {ll})</p>\n</body></html>\n"
    ).format(t=html.escape(title), lesson=html.escape(args.lesson),
             endpoint=html.escape(args.endpoint), pres=html.escape(args.presentation),
             stage=args.stage, gen=args.generation, ll=html.escape(args.live_lesson))
    body = page.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        server_version = "antidote-python-presenter"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Antidote-Stage", str(args.stage))
            self.end_headers()
            self.wfile.write(body)

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()

        def log_message(self, *_):
            pass

    return Page


class SshBanner(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            self.request.sendall(SSH_BANNER)
            # Hold the connection briefly like a server waiting for the client's banner.
            self.request.settimeout(10)
            self.request.recv(256)
        except OSError:
            pass


class Silent(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            # Read and say nothing until the client gives up.
            while self.request.recv(256):
                pass
        except OSError:
            pass


def watch_parent(parent):
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


if __name__ == "__main__":
    main()
