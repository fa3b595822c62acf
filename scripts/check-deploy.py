#!/usr/bin/env python3
"""Checks deploy/ for syntax: every Kubernetes manifest parses as YAML documents that each name
an apiVersion, a kind and a metadata.name; every systemd unit parses as an INI file with [Unit],
[Service] (with an ExecStart) and [Install]."""
import configparser
import pathlib
import sys

import yaml

root = pathlib.Path(__file__).resolve().parent.parent / "deploy"
errors = []
manifests = sorted((root / "k8s").glob("*.yaml"))
units = sorted((root / "systemd").glob("*.service"))
if not manifests or not units:
    errors.append("deploy/: no manifests or no units")
for p in manifests:
    try:
        docs = [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
    except yaml.YAMLError as e:
        errors.append(f"{p}: {e}")
        continue
    for d in docs:
        for field in ("apiVersion", "kind"):
            if not d.get(field):
                errors.append(f"{p}: a document without {field}")
        if not (d.get("metadata") or {}).get("name"):
            errors.append(f"{p}: a {d.get('kind')} without metadata.name")
for p in units:
    c = configparser.ConfigParser(strict=False, interpolation=None)
    try:
        c.read_string(p.read_text())
    except configparser.Error as e:
        errors.append(f"{p}: {e}")
        continue
    for section in ("Unit", "Service", "Install"):
        if section not in c:
            errors.append(f"{p}: no [{section}]")
    if "Service" in c and "ExecStart" not in c["Service"]:
        errors.append(f"{p}: no ExecStart")
for e in errors:
    print(f"check-deploy: {e}", file=sys.stderr)
print(f"check-deploy: {len(manifests)} manifests, {len(units)} units" + (", errors" if errors else ", ok"))
sys.exit(1 if errors else 0)
