# The function-substrate zygote: loaded once into a persistent Python session inside a
# container sandbox. It never runs user code itself: each call forks a child that gets its own
# limits, scratch directory, stdin and output files, runs the code in a clean globals dict and
# exits; the zygote waits for it, removes what it left and prints one JSON line.
import os, sys, json, time, signal, resource, base64, shutil, traceback, builtins, select

_DSEC_WRITABLE = ("/tmp", "/var/tmp", "/root", "/home", "/workspace", "/dev/shm")


def _dsec_init(preload, sweep):
    for m in preload:
        try:
            __import__(m)
        except Exception:
            pass
    st = _DSEC_STATE
    st["sweep"] = sweep
    st["base"] = _dsec_snap()


def _dsec_snap():
    s = {}
    for d in _DSEC_WRITABLE:
        try:
            s[d] = {e.name: e.stat(follow_symlinks=False).st_mtime_ns for e in os.scandir(d)}
        except OSError:
            s[d] = None
    return s


def _dsec_clean():
    """Kills every process but the zygote and the agent, removes new files in the writable
    directories; True when something it cannot undo changed (the zygote is then replaced)."""
    tainted = False
    st = _DSEC_STATE
    if st["sweep"]:
        # Repeat until no live process but the agent and the zygote is left: a fork bomb can
        # fork between the listing and the kill (pids.max bounds how long that can go on).
        me = os.getpid()
        for _ in range(200):
            live = 0
            for p in os.listdir("/proc"):
                if not p.isdigit() or int(p) in (1, me):
                    continue
                try:
                    with open("/proc/%s/stat" % p, "rb") as f:
                        if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                            continue
                except (OSError, IndexError):
                    continue
                live += 1
                try:
                    os.kill(int(p), signal.SIGKILL)
                except OSError:
                    pass
            if live == 0:
                break
            time.sleep(0.001)
    for d, base in st["base"].items():
        if base is None:
            continue
        try:
            now = list(os.scandir(d))
        except OSError:
            tainted = True
            continue
        seen = 0
        for e in now:
            m = base.get(e.name)
            try:
                if m is None:
                    if e.is_dir(follow_symlinks=False):
                        shutil.rmtree(e.path)
                    else:
                        os.unlink(e.path)
                else:
                    seen += 1
                    if e.stat(follow_symlinks=False).st_mtime_ns != m:
                        tainted = True
            except OSError:
                tainted = True
        if seen != len(base):
            tainted = True
    return tainted


def _dsec_tmpfd(path, data=b""):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _dsec_child(req, d, fi, fo, fe, fs):
    rc = 0
    try:
        os.setsid()
        os.dup2(fi, 0)
        os.dup2(fo, 1)
        os.dup2(fe, 2)
        os.closerange(3, fs)
        os.closerange(fs + 1, 65536)
        for name, b64 in req["files"].items():
            p = os.path.join(d, name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(base64.b64decode(b64))
        path = os.path.join(d, "main.py")
        with open(path, "w") as f:
            f.write(req["code"])
        os.chdir(d)
        os.environ["HOME"] = d
        os.environ["TMPDIR"] = d
        mem = req["mem"]
        if mem > 0:
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        cpu = req["cpu"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (req["cap"] + 1, req["cap"] + 1))
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        sys.argv = [path]
        code = compile(req["code"], path, "exec")
        g = {"__name__": "__main__", "__builtins__": builtins, "__file__": path}
        req = None
        exec(code, g)
    except SystemExit as e:
        c = e.code
        if c is None:
            rc = 0
        elif isinstance(c, int):
            rc = c & 0xFF
        else:
            try:
                print(c, file=sys.stderr)
            except BaseException:
                pass
            rc = 1
    except MemoryError as e:
        try:
            os.write(fs, b"M")
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:
            pass
        rc = 1
    except BaseException as e:
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:
            pass
        rc = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                pass
        os._exit(rc)


def _dsec_read(fd, cap):
    size = os.fstat(fd).st_size
    data = os.pread(fd, cap, 0)
    os.close(fd)
    return base64.b64encode(data).decode(), size > cap


def _dsec_call(raw):
    req = json.loads(raw)
    st = _DSEC_STATE
    st["n"] += 1
    n = st["n"]
    d = "/tmp/dsec-run-%d-%d" % (os.getpid(), n)
    os.mkdir(d, 0o700)
    pre = "/tmp/.dsec-%d-%d-" % (os.getpid(), n)
    fi = _dsec_tmpfd(pre + "i", base64.b64decode(req["stdin"]))
    fo = _dsec_tmpfd(pre + "o")
    fe = _dsec_tmpfd(pre + "e")
    fs = _dsec_tmpfd(pre + "s")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _dsec_child(req, d, fi, fo, fe, fs)
    os.close(fi)
    pfd = os.pidfd_open(pid)
    p = select.poll()
    p.register(pfd, select.POLLIN)
    tle = not p.poll(int(req["timeout"] * 1000))
    if tle:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            os.kill(pid, signal.SIGKILL)
    _, status, ru = os.wait4(pid, 0)
    el = time.monotonic() - t0
    os.close(pfd)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    cap = req["cap"]
    out, out_over = _dsec_read(fo, cap)
    err, err_over = _dsec_read(fe, cap)
    mle = os.pread(fs, 1, 0) == b"M"
    os.close(fs)
    rc = os.waitstatus_to_exitcode(status)
    if tle or rc == -signal.SIGXCPU:
        verdict = "TimeLimitExceeded"
    elif mle:
        verdict = "MemoryLimitExceeded"
    elif out_over or err_over:
        verdict = "OutputLimitExceeded"
    elif rc == 0:
        verdict = "Finished"
    else:
        verdict = "RuntimeError"
    files = {}
    for f in req["fetch"]:
        try:
            with open(os.path.join(d, f), "rb") as fh:
                files[f] = base64.b64encode(fh.read(cap + 1)[:cap]).decode()
        except OSError:
            pass
    taint = _dsec_clean()
    res = {"verdict": verdict, "rc": rc, "out": out, "err": err, "t": el,
           "kb": ru.ru_maxrss, "files": files, "taint": taint}
    sys.__stdout__.write(json.dumps(res) + "\n")


_DSEC_STATE = {"n": 0, "sweep": False, "base": {}}
