#!/usr/bin/env python3
"""R-13 through the code runner: a short call every 20 ms while N clients keep an abusive
snippet at its 2 s time limit. Prints the short calls' p50/p90/p99 (ms) and any slow ones.

    DSEC_URL=http://127.0.0.1:7700 DSEC_API_KEY=... ABUSE=spin|fork|mem N=20 python3 scripts/r13-runner.py

`dsec bench run` measures the same (its `function_beside_20_*` figures); this script runs
against any daemon, e.g. one started with other `--run-*` flags for an A/B.
"""
import json
import os
import threading
import time
import urllib.error
import urllib.request

URL = os.environ.get("DSEC_URL", "http://127.0.0.1:7700")
KEY = os.environ.get("DSEC_API_KEY") or open(
    os.path.join(os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"), "admin.key")).read().strip()
ABUSE = {
    "spin": "while True: pass",
    "fork": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "mem": "a = []\nwhile True: a.append(bytearray(1 << 20))",
}[os.environ.get("ABUSE", "fork")]
N = int(os.environ.get("N", "20"))
VICTIMS = int(os.environ.get("VICTIMS", "100"))


def call(code, timeout=2):
    body = json.dumps({"code": code, "language": "python", "run_timeout": timeout}).encode()
    req = urllib.request.Request(URL + "/v1/run", data=body,
                                 headers={"X-API-Key": KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


stop = False
errors = []


def abuser():
    while not stop:
        try:
            call(ABUSE)
        except urllib.error.HTTPError as e:
            errors.append((e.code, e.read()[:200]))
        except OSError as e:
            errors.append(str(e))


for _ in range(N):
    threading.Thread(target=abuser, daemon=True).start()
time.sleep(0.5)
lat = []
for i in range(VICTIMS):
    t = time.monotonic()
    try:
        v = call("print(1+1)")
        ok = v["run_result"]["stdout"] == "2\n"
    except (OSError, KeyError, ValueError) as e:
        v, ok = str(e), False
    ms = (time.monotonic() - t) * 1000
    lat.append(ms)
    if ms > 300 or not ok:
        print("slow" if ok else "failed", i, round(ms), v if not ok else v.get("server_us"))
    time.sleep(0.02)
stop = True
lat.sort()
q = lambda p: round(lat[min(len(lat) - 1, int(len(lat) * p))], 1)
print(json.dumps({"abuse": os.environ.get("ABUSE", "fork"), "abusers": N, "victims": len(lat),
                  "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99), "max_ms": round(lat[-1], 1),
                  "abuser_errors": len(errors)}))
