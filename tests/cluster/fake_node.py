"""A stand-in process for launcher tests: answers /health like a node and starts two "rank" children.

Invoked as `fake_node.py [-m module] ... --port P ...` (the launcher's command lines with the interpreter
replaced). One rank child stays in the node's process group, the other starts its own session, as rank
processes of a real node may; both get SIGTERM when the node dies (PR_SET_PDEATHSIG), as a real node's ranks do
(engine/parallel/groups.py), so a rank forked while the launcher is stopping its node cannot outlive it. `FAKE_EXIT_CODE=N` exits at once with N (a node that dies at startup);
`FAKE_IGNORE_TERM=1` ignores SIGTERM (a node that hangs on shutdown). `PREFILL_/DECODE_METRICS_PORT` (from the
launcher) serves the same answers on that port too.
"""

import ctypes
import http.server
import os
import signal
import subprocess
import sys
import threading
import time

RANK = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]


def _die_with_node() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok\n" if self.path == "/health" else b"# fake metrics\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main() -> None:
    if os.environ.get("FAKE_EXIT_CODE"):
        sys.exit(int(os.environ["FAKE_EXIT_CODE"]))
    if os.environ.get("FAKE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    same_group = subprocess.Popen(RANK, preexec_fn=_die_with_node)
    own_session = subprocess.Popen(RANK, start_new_session=True, preexec_fn=_die_with_node)
    print(f"PIDS {os.getpid()} {same_group.pid} {own_session.pid}", flush=True)
    time.sleep(float(os.environ.get("FAKE_HEALTH_DELAY_S", "0")))
    metrics_port = os.environ.get("PREFILL_METRICS_PORT") or os.environ.get("DECODE_METRICS_PORT")
    if metrics_port:
        metrics = http.server.HTTPServer(("127.0.0.1", int(metrics_port)), Handler)
        threading.Thread(target=metrics.serve_forever, daemon=True).start()
    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
