"""Best-first search over sandbox states with snapshots and forks.

Each node of the search is a sandbox state; expanding a node forks its sandbox once per action
(every child starts from the parent's files) and runs the action in the child. The score of a
state is computed inside its sandbox. The search stops at the first state that reaches the
goal and prints the path that led there.

The toy problem: reach a total of ``GOAL`` in ``/workspace/total`` by adding 3, 5 or 7 in as
few steps as possible (a real agent would run model-written code instead).

    DSEC_URL=http://127.0.0.1:8080 DSEC_API_KEY=... python3 examples/tree_search.py
"""

from __future__ import annotations

import heapq
import itertools
import sys

import dsec

GOAL = 29
ACTIONS = (3, 5, 7)


def score(sb: dsec.Sandbox) -> int:
    """The state's distance to the goal, read inside the sandbox."""
    return abs(GOAL - int(sb.exec("cat /workspace/total").text.strip()))


def search(client: dsec.Client, max_expansions: int = 40) -> list[int] | None:
    """Best-first search; returns the actions that reach the goal, or None."""
    root = client.create_sandbox(labels={"example": "tree_search"})
    root.exec("echo 0 > /workspace/total")
    tie = itertools.count()
    # (priority: distance + steps so far, tie-break, distance, actions, sandbox)
    first = score(root)
    frontier: list[tuple[int, int, int, list[int], dsec.Sandbox]] = [(first, next(tie), first, [], root)]
    live: list[dsec.Sandbox] = [root]
    snapshots: list[str] = []
    try:
        for _ in range(max_expansions):
            if not frontier:
                return None
            _, _, dist, path, sb = heapq.heappop(frontier)
            if dist == 0:
                return path
            forks = sb.fork(len(ACTIONS), labels={"example": "tree_search"})
            snapshots.append(forks.snapshot.id)
            live.extend(forks)
            for action, child in zip(ACTIONS, forks):
                child.exec(f"echo $(( $(cat /workspace/total) + {action} )) > /workspace/total")
                d = score(child)
                if int(child.exec("cat /workspace/total").text) <= GOAL:
                    heapq.heappush(frontier, (d + len(path) + 1, next(tie), d, [*path, action], child))
        return None
    finally:
        for sb in live:
            sb.destroy()
        for s in snapshots:
            if _exists(client, s):
                client.delete_snapshot(s, recursive=True)


def _exists(client: dsec.Client, snapshot_id: str) -> bool:
    try:
        client.get_snapshot(snapshot_id)
        return True
    except dsec.SnapshotNotFound:
        return False


def main() -> int:
    with dsec.Client() as client:
        path = search(client)
    if path is None:
        print("no path found")
        return 1
    print(f"reached {GOAL} with {path} ({len(path)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
