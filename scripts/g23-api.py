#!/usr/bin/env python3
"""G-23 through the sandbox API: `exec /bin/true` in a quiet sandbox, every 20 ms, while N
other sandboxes each run a Python fork bomb. Prints the victim's p50/p99/max (ms), its errors,
and how many forks the pids controller refused (after copying an address space) per second.

    DSEC_URL=http://127.0.0.1:7700 DSEC_DATA_DIR=/var/lib/dsec USERNS=0|1 N=20 \
        PIDS=256 WEIGHT=100 python3 scripts/g23-api.py

`USERNS=1` creates the bombs' sandboxes with `"userns": true` (RLIMIT_NPROC refuses their
forks before the copy). `STALL_DUMP=1` prints the victim's kernel stacks while an exec is
out for over a second. `dsec bench api` measures the same (`exec_true_beside_20_fork_bombs*`).
"""
import json
import os
import threading
import time
import urllib.error
import urllib.request

URL = os.environ.get("DSEC_URL", "http://127.0.0.1:7700")
DATA = os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec")
KEY = os.environ.get("DSEC_API_KEY") or open(os.path.join(DATA, "admin.key")).read().strip()
USERNS = os.environ.get("USERNS", "0") == "1"
N = int(os.environ.get("N", "20"))
PIDS = int(os.environ.get("PIDS", "256"))
WEIGHT = int(os.environ.get("WEIGHT", "100"))
VICTIMS = int(os.environ.get("VICTIMS", "200"))
BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"


def req(method, path, body=None, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(URL + path, data=data, method=method,
                               headers={"X-API-Key": KEY, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def refused(ids):
    """Sum of `max` in the bombs' pids.events (cgroup v1 or v2)."""
    total = 0
    for id in ids:
        for base in ("/sys/fs/cgroup/pids/dsec", "/sys/fs/cgroup/dsec"):
            try:
                with open(os.path.join(base, id, "pids.events")) as f:
                    total += int(f.read().split("max")[1].split()[0])
                break
            except (OSError, IndexError, ValueError):
                pass
    return total


s, v = req("POST", "/v1/sandboxes", {})
victim = v["id"]
s, v = req("POST", "/v1/sandboxes/batch", {"count": N, "spec": {
    "labels": {"g23": "bomb"}, "userns": USERNS,
    "limits": {"memory_max": 256 << 20, "pids_max": PIDS, "cpu_weight": WEIGHT}}})
bombs = [i["sandbox"]["id"] for i in v["items"] if i.get("ok")]
for id in bombs:
    req("POST", f"/v1/sandboxes/{id}/processes", {"argv": ["/usr/bin/python3", "-c", BOMB]})
time.sleep(0.5)
init = req("GET", f"/v1/sandboxes/{victim}")[1].get("init_pid")
inflight = [None]


def stacks(pid):
    """Kernel stacks of a process's threads and its children (a stalled exec's whereabouts)."""
    out = {}
    try:
        kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        kids = []
    for p in [str(pid)] + kids:
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                out[f"{p}/{t}"] = open(f"/proc/{p}/task/{t}/stack").read().split("\n")[:6]
        except OSError:
            pass
    return out


def watch():
    """With STALL_DUMP=1: once an exec has been out for 1 s, print where the victim waits."""
    while inflight is not None:
        t = inflight[0]
        if t is not None and time.monotonic() - t > 1 and init:
            extra = {}
            for pid in os.environ.get("STALL_PIDS", "").split():
                for tid in os.listdir(f"/proc/{pid}/task"):
                    st = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
                    wchan = open(f"/proc/{pid}/task/{tid}/wchan").read()
                    extra[f"{pid}/{tid}"] = f"{st} {wchan}"
            print(json.dumps({"stalled_s": round(time.monotonic() - t, 1), "stacks": stacks(init),
                              "others": extra}))
            time.sleep(2)
        time.sleep(0.1)


if os.environ.get("STALL_DUMP") == "1":
    threading.Thread(target=watch, daemon=True).start()
r0, t0 = refused(bombs), time.monotonic()
lat, errors = [], []
for _ in range(VICTIMS):
    t = time.monotonic()
    inflight[0] = t
    s, v = req("POST", f"/v1/sandboxes/{victim}/exec", {"argv": ["/bin/true"]})
    inflight[0] = None
    lat.append((time.monotonic() - t) * 1000)
    if s != 200 or v.get("status") != "ok":
        errors.append((s, v))
    time.sleep(0.02)
per_s = (refused(bombs) - r0) / (time.monotonic() - t0)
req("POST", "/v1/sandboxes/batch-delete", {"labels": {"g23": "bomb"}})
req("DELETE", f"/v1/sandboxes/{victim}")
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
print(json.dumps({"userns": USERNS, "bombs": len(bombs), "pids_max": PIDS, "cpu_weight": WEIGHT,
                  "p50_ms": round(q(0.5), 2), "p99_ms": round(q(0.99), 2),
                  "max_ms": round(lat[-1], 1), "errors": len(errors),
                  "first_error": errors[0] if errors else None,
                  "forks_refused_after_copy_per_s": round(per_s)}))
