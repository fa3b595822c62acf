#!/usr/bin/env python3
"""The fake internet of dsec's egress tests: a DNS server, HTTP and HTTPS web servers, and a
tiny PEP 503 package index, all served inside the network namespace of one
`dsec_testkit::fakenet::FakeNet` (which starts this script there with `ip netns exec`).

Python 3 standard library only (Debian 12's python3); the certificates are made with the
`openssl` command line. Everything it writes goes to --dir:

  zone.json      the DNS zone, {"name": ["a.b.c.d", ...]}, re-read on every query
  ca.pem         the certificate of the CA that signed the HTTPS server's certificate
  pki/           the CA's and the server's keys and certificates
  dsecprobe-1.0-py3-none-any.whl   the one wheel of the package index
  ready          written once every listener is bound

It exits when its parent exits (it is then adopted by another process), so that a test killed
with SIGKILL leaves no server behind.
"""

import argparse
import base64
import datetime
import hashlib
import html
import http.server
import json
import os
import re
import secrets
import socket
import socketserver
import ssl
import struct
import subprocess
import sys
import threading
import time
import zipfile

# The names of the HTTPS server's certificate.
CERT_NAMES = ["pypi.test", "*.pythonhosted.test", "github.test", "evil.test", "other.test"]

TTL = 5
CHUNK = 64 * 1024

WHEEL_NAME = "dsecprobe-1.0-py3-none-any.whl"
PROJECT = "dsecprobe"


def log(msg):
    print(f"fakenet: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# DNS


class Zone:
    """The zone file, read anew for every query (a test may rewrite it at any time)."""

    def __init__(self, path):
        self.path = path

    def lookup(self, name):
        """The addresses of `name` (a list, maybe empty), or None for a name not in the zone.
        A key "*.example.test" answers for every name below example.test."""
        with open(self.path, encoding="utf-8") as f:
            zone = json.load(f)
        zone = {k.lower().rstrip("."): v for k, v in zone.items()}
        name = name.lower().rstrip(".")
        if name in zone:
            return zone[name]
        labels = name.split(".")
        for i in range(1, len(labels)):
            wild = "*." + ".".join(labels[i:])
            if wild in zone:
                return zone[wild]
        return None


RCODE_OK, RCODE_FORMERR, RCODE_SERVFAIL, RCODE_NXDOMAIN, RCODE_NOTIMP = 0, 1, 2, 3, 4
QTYPE_A = 1


def parse_question(msg):
    """(id, flags, qname, qtype, qclass, end of the question) of a query; raises ValueError."""
    if len(msg) < 12:
        raise ValueError("short header")
    qid, flags, qdcount = struct.unpack("!HHH", msg[:6])
    if qdcount != 1:
        raise ValueError(f"{qdcount} questions")
    pos = 12
    labels = []
    while True:
        if pos >= len(msg):
            raise ValueError("name runs past the end")
        n = msg[pos]
        pos += 1
        if n == 0:
            break
        if n & 0xC0:
            raise ValueError("compressed name in a question")
        label = msg[pos:pos + n]
        if len(label) != n:
            raise ValueError("label runs past the end")
        labels.append(label.decode("ascii", "replace"))
        pos += n
    if pos + 4 > len(msg):
        raise ValueError("question runs past the end")
    qtype, qclass = struct.unpack("!HH", msg[pos:pos + 4])
    return qid, flags, ".".join(labels), qtype, qclass, pos + 4


def answer(zone, msg):
    """The reply to one query message, or None when it is not even worth a FORMERR."""
    if len(msg) < 12:
        return None
    qid, qflags = struct.unpack("!HH", msg[:4])
    if qflags & 0x8000:
        return None  # a response, not a query
    opcode = (qflags >> 11) & 0xF
    # QR, the opcode, AA, RD as asked, RA.
    flags = 0x8000 | (opcode << 11) | 0x0400 | (qflags & 0x0100) | 0x0080
    if opcode != 0:
        return struct.pack("!HHHHHH", qid, flags | RCODE_NOTIMP, 0, 0, 0, 0)
    try:
        _, _, qname, qtype, _qclass, end = parse_question(msg)
    except ValueError:
        return struct.pack("!HHHHHH", qid, flags | RCODE_FORMERR, 0, 0, 0, 0)
    question = msg[12:end]
    try:
        addrs = zone.lookup(qname)
    except (OSError, ValueError) as e:
        log(f"zone: {e}")
        return struct.pack("!HHHHHH", qid, flags | RCODE_SERVFAIL, 1, 0, 0, 0) + question
    if addrs is None:
        return struct.pack("!HHHHHH", qid, flags | RCODE_NXDOMAIN, 1, 0, 0, 0) + question
    records = b""
    count = 0
    if qtype == QTYPE_A:
        for a in addrs:
            try:
                rdata = socket.inet_aton(a)
            except OSError:
                log(f"zone: {qname}: not an IPv4 address: {a!r}")
                continue
            # The name is a pointer to the question's (offset 12).
            records += struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, TTL, 4) + rdata
            count += 1
    # Any other type (AAAA among them) of a known name: NOERROR without records.
    return struct.pack("!HHHHHH", qid, flags | RCODE_OK, 1, count, 0, 0) + question + records


def serve_dns_udp(sock, zone):
    while True:
        try:
            msg, peer = sock.recvfrom(4096)
        except OSError as e:
            log(f"dns/udp: {e}")
            continue
        reply = answer(zone, msg)
        if reply is None:
            continue
        if len(reply) > 512:
            # Truncated: the header and question only, with TC set.
            _, _, _, _, _, end = parse_question(msg)
            qid, flags = struct.unpack("!HH", reply[:4])
            reply = struct.pack("!HHHHHH", qid, flags | 0x0200, 1, 0, 0, 0) + msg[12:end]
        try:
            sock.sendto(reply, peer)
        except OSError as e:
            log(f"dns/udp: reply to {peer}: {e}")


def recv_exact(conn, n):
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def serve_dns_tcp_conn(conn, zone):
    with conn:
        conn.settimeout(30)
        try:
            while True:
                head = recv_exact(conn, 2)
                if head is None:
                    return
                (length,) = struct.unpack("!H", head)
                msg = recv_exact(conn, length)
                if msg is None:
                    return
                reply = answer(zone, msg)
                if reply is None:
                    return
                conn.sendall(struct.pack("!H", len(reply)) + reply)
        except OSError:
            return


def serve_dns_tcp(sock, zone):
    while True:
        try:
            conn, _ = sock.accept()
        except OSError as e:
            log(f"dns/tcp: {e}")
            time.sleep(0.1)
            continue
        threading.Thread(target=serve_dns_tcp_conn, args=(conn, zone), daemon=True).start()


# ---------------------------------------------------------------------------------------------
# The wheel and the index


def record_hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def build_wheel(path):
    """Writes the one wheel of the index, a pure-Python `dsecprobe` with `VALUE = 42`."""
    dist_info = "dsecprobe-1.0.dist-info"
    files = [
        ("dsecprobe/__init__.py", b'"""A probe of dsec\'s egress tests."""\nVALUE = 42\n'),
        (
            f"{dist_info}/METADATA",
            b"Metadata-Version: 2.1\nName: dsecprobe\nVersion: 1.0\n"
            b"Summary: A probe package of dsec's egress tests\n",
        ),
        (
            f"{dist_info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: dsec-fakenet\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n",
        ),
    ]
    record = "".join(f"{name},{record_hash(data)},{len(data)}\n" for name, data in files)
    record += f"{dist_info}/RECORD,,\n"
    files.append((f"{dist_info}/RECORD", record.encode("ascii")))
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in files:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, data)
    os.rename(tmp, path)
    with open(path, "rb") as f:
        return f.read()


def normalize(name):
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------
# HTTP and HTTPS


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dsec-fakenet/1"
    timeout = 120  # an idle keep-alive connection

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        if self.server.verbose:
            super().log_message(format, *args)

    def send_body(self, status, content_type, body):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def not_found(self):
        self.send_body(404, "text/plain", b"not found\n")

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/whoami":
            return self.whoami()
        if path.startswith("/bytes/"):
            return self.send_bytes(path[len("/bytes/"):])
        if path == "/simple" or path.startswith("/simple/"):
            return self.simple(path)
        if path.startswith("/packages/"):
            return self.package(path[len("/packages/"):])
        self.not_found()

    def whoami(self):
        body = json.dumps(
            {
                "server": self.connection.getsockname()[0],
                "host": self.headers.get("Host", ""),
                "client": self.client_address[0],
                "scheme": self.server.scheme,
            }
        ).encode("utf-8")
        self.send_body(200, "application/json", body)

    def send_bytes(self, arg):
        if not arg.isdigit():
            return self.send_body(400, "text/plain", b"/bytes/<n>: n is a count of bytes\n")
        n = int(arg)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        if self.command == "HEAD":
            return
        chunk = memoryview(self.server.chunk)
        while n > 0:
            part = chunk[: min(n, CHUNK)]
            self.wfile.write(part)
            n -= len(part)

    def simple(self, path):
        parts = [p for p in path.split("/") if p]
        if len(parts) == 1:
            if not path.endswith("/"):
                return self.redirect("/simple/")
            body = (
                "<!DOCTYPE html>\n<html><head><title>Simple index</title></head><body>\n"
                f'<a href="/simple/{PROJECT}/">{PROJECT}</a>\n</body></html>\n'
            )
            return self.send_body(200, "text/html; charset=utf-8", body.encode("utf-8"))
        if len(parts) != 2 or normalize(parts[1]) != PROJECT:
            return self.not_found()
        if parts[1] != PROJECT or not path.endswith("/"):
            return self.redirect(f"/simple/{PROJECT}/")
        href = f"/packages/{WHEEL_NAME}#sha256={self.server.wheel_sha256}"
        body = (
            "<!DOCTYPE html>\n<html><head><title>Links for "
            f"{PROJECT}</title></head><body>\n<h1>Links for {PROJECT}</h1>\n"
            f'<a href="{html.escape(href)}">{WHEEL_NAME}</a>\n</body></html>\n'
        )
        self.send_body(200, "text/html; charset=utf-8", body.encode("utf-8"))

    def package(self, name):
        if name != WHEEL_NAME:
            return self.not_found()
        self.send_body(200, "application/octet-stream", self.server.wheel)

    def redirect(self, location):
        self.send_response(301)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


class WebServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, scheme, wheel, verbose, tls=None):
        super().__init__(addr, Handler)
        self.scheme = scheme
        self.wheel = wheel
        self.wheel_sha256 = hashlib.sha256(wheel).hexdigest()
        self.verbose = verbose
        self.chunk = bytes(CHUNK)
        self.tls = tls

    def finish_request(self, request, client_address):
        # The TLS handshake happens here, in the connection's own thread, not in accept().
        if self.tls is None:
            return super().finish_request(request, client_address)
        try:
            request.settimeout(30)
            conn = self.tls.wrap_socket(request, server_side=True)
            conn.settimeout(None)
        except (ssl.SSLError, OSError) as e:
            if self.verbose:
                log(f"tls from {client_address}: {e}")
            return
        try:
            self.RequestHandlerClass(conn, client_address, self)
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def handle_error(self, request, client_address):
        # A client that went away mid-answer is no news.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, ssl.SSLError, TimeoutError)):
            return
        super().handle_error(request, client_address)


# ---------------------------------------------------------------------------------------------
# Certificates


OPENSSL_CNF = """\
[ca]
default_ca = fake_ca
[fake_ca]
dir = {pki}
database = {pki}/index.txt
new_certs_dir = {pki}
serial = {pki}/serial
default_md = sha256
policy = policy_any
unique_subject = no
copy_extensions = none
email_in_dn = no
[policy_any]
commonName = supplied
[req]
distinguished_name = dn
prompt = no
[dn]
CN = dsec fake internet
[v3_ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[v3_leaf]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = {san}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def openssl(*args):
    p = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {p.returncode}: {p.stderr.strip()}")


def make_certs(d):
    """A CA (`<d>/ca.pem`) and a server certificate of CERT_NAMES signed by it, both valid from
    an hour ago (a VM's clock may lag the host's) to a day from now, EC P-256 keys.
    Returns (server certificate, server key)."""
    pki = os.path.join(d, "pki")
    os.makedirs(pki, exist_ok=True)
    cnf = os.path.join(pki, "openssl.cnf")
    san = ",".join(f"DNS:{n}" for n in CERT_NAMES)
    with open(cnf, "w", encoding="ascii") as f:
        f.write(OPENSSL_CNF.format(pki=pki, san=san))
    open(os.path.join(pki, "index.txt"), "w").close()
    with open(os.path.join(pki, "serial"), "w", encoding="ascii") as f:
        f.write("10" + secrets.token_hex(15) + "\n")
    now = datetime.datetime.now(datetime.timezone.utc)
    start = (now - datetime.timedelta(hours=1)).strftime("%Y%m%d%H%M%SZ")
    end = (now + datetime.timedelta(days=1)).strftime("%Y%m%d%H%M%SZ")
    p = lambda name: os.path.join(pki, name)  # noqa: E731
    newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    dates = ["-startdate", start, "-enddate", end]
    openssl("req", "-new", *newkey, "-keyout", p("ca.key"), "-out", p("ca.csr"),
            "-config", cnf, "-subj", "/CN=dsec fake internet CA")
    openssl("ca", "-batch", "-notext", "-config", cnf, "-selfsign", "-keyfile", p("ca.key"),
            "-in", p("ca.csr"), "-out", p("ca.pem"), "-extensions", "v3_ca", *dates)
    openssl("req", "-new", *newkey, "-keyout", p("server.key"), "-out", p("server.csr"),
            "-config", cnf, "-subj", f"/CN={CERT_NAMES[0]}")
    openssl("ca", "-batch", "-notext", "-config", cnf, "-cert", p("ca.pem"),
            "-keyfile", p("ca.key"), "-in", p("server.csr"), "-out", p("server.pem"),
            "-extensions", "v3_leaf", *dates)
    with open(p("ca.pem"), "rb") as f:
        ca = f.read()
    tmp = os.path.join(d, "ca.pem.tmp")
    with open(tmp, "wb") as f:
        f.write(ca)
    os.chmod(tmp, 0o644)
    os.rename(tmp, os.path.join(d, "ca.pem"))
    return p("server.pem"), p("server.key")


# ---------------------------------------------------------------------------------------------


def watch_parent(parent):
    """Exits once the process that started this one is gone (this one was adopted)."""
    while True:
        if os.getppid() != parent:
            log("parent gone, exiting")
            os._exit(0)
        time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the zone is and what is made goes")
    ap.add_argument("--dns", required=True, help="the address the DNS server binds")
    ap.add_argument("--verbose", action="store_true", help="log every HTTP request")
    args = ap.parse_args()
    d = args.dir

    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()

    zone = Zone(os.path.join(d, "zone.json"))
    zone.lookup("probe.invalid")  # the zone is there and reads

    wheel = build_wheel(os.path.join(d, WHEEL_NAME))
    cert, key = make_certs(d)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    tls.set_alpn_protocols(["http/1.1"])

    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((args.dns, 53))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((args.dns, 53))
    tcp.listen(64)
    http_server = WebServer(("0.0.0.0", 80), "http", wheel, args.verbose)
    https_server = WebServer(("0.0.0.0", 443), "https", wheel, args.verbose, tls)

    threading.Thread(target=serve_dns_udp, args=(udp, zone), daemon=True).start()
    threading.Thread(target=serve_dns_tcp, args=(tcp, zone), daemon=True).start()
    threading.Thread(target=https_server.serve_forever, daemon=True).start()
    threading.Thread(target=http_server.serve_forever, daemon=True).start()

    ready = os.path.join(d, "ready")
    with open(ready + ".tmp", "w", encoding="ascii") as f:
        f.write(f"{os.getpid()}\n")
    os.rename(ready + ".tmp", ready)
    log(f"ready: dns {args.dns}:53, http :80, https :443")
    # SIGTERM's default action ends the process; the main thread only waits for it.
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
