"""A trajectory as one object: its steps, annotations, export, and the resume helper."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from .client import Client
from .errors import UnknownOutcome
from .sandbox import Sandbox
from .types import Command, ExecResult, TrajectoryInfo


@dataclass
class ResumeReport:
    """What :meth:`Trajectory.resume` did with each step."""

    replayed: List[int] = field(default_factory=list)
    """Steps answered from the log (nothing ran)."""
    live: List[int] = field(default_factory=list)
    """Steps that ran (beyond the log, or with a different action)."""
    unknown: List[int] = field(default_factory=list)
    """Steps whose outcome the log does not know (started, never answered)."""
    results: List[ExecResult] = field(default_factory=list)
    """The answers, in step order (up to the first unknown step)."""


Step = Union[Command, Tuple[Command, Mapping[str, Any]]]


class Trajectory:
    """Steps of one trajectory run in one sandbox, numbered for you.

    ``traj.exec(cmd)`` sends the next step; after a preemption a trainer rebuilds the object
    and calls :meth:`resume` with the actions it had sent so far: each logged step is answered
    from the log byte for byte without running, and the first one the log does not have runs
    live. A step that started but was never answered stops the resume (``report.unknown``):
    the caller decides whether to re-send it as a different action.
    """

    def __init__(self, sandbox: Sandbox, trajectory_id: str, *, client: Optional[Client] = None) -> None:
        self.sandbox = sandbox
        self.id = trajectory_id
        self.client = client or sandbox.client
        self.next_step = 1

    def exec(self, cmd: Command, *, step: Optional[int] = None, **kwargs: Any) -> ExecResult:
        """Run ``cmd`` as the next step (or as ``step``)."""
        n = self.next_step if step is None else step
        r = self.sandbox.exec(cmd, trajectory=self.id, step=n, **kwargs)
        self.next_step = n + 1
        return r

    def resume(self, steps: Iterable[Step]) -> ResumeReport:
        """Re-send ``steps`` (commands, or ``(command, exec kwargs)`` pairs) from step 1."""
        report = ResumeReport()
        self.next_step = 1
        for s in steps:
            cmd, kwargs = (s[0], dict(s[1])) if isinstance(s, tuple) else (s, {})
            n = self.next_step
            try:
                r = self.exec(cmd, **kwargs)
            except UnknownOutcome:
                report.unknown.append(n)
                break
            (report.replayed if r.replayed else report.live).append(n)
            report.results.append(r)
        return report

    def info(self) -> TrajectoryInfo:
        """Counters: intents, results (acknowledged), unknown outcomes, annotations."""
        return self.client.get_trajectory(self.id)

    def steps(self, *, from_step: Optional[int] = None) -> Iterator[Dict[str, Any]]:
        """The log records (intent, result, annotation), in log order, page by page."""
        return self.client.trajectory_records(self.id, from_step=from_step)

    def annotate(
        self,
        *,
        step: Optional[int] = None,
        reward: Optional[float] = None,
        labels: Optional[Sequence[str]] = None,
        data: Optional[Mapping[str, Any]] = None,
    ) -> int:
        """Annotate the trajectory (or one step); durable; returns its lsn."""
        return self.client.annotate_trajectory(self.id, step=step, reward=reward, labels=labels, data=data)

    def finish(self) -> None:
        """Mark it finished: it will not be resumed, and its records may be compacted away."""
        self.client.request_json("POST", f"/v1/trajectories/{self.id}/finish")

    def export(self, *, label: Optional[str] = None, min_reward: Optional[float] = None) -> List[Dict[str, Any]]:
        """Training rows (action, observation, status, timings, annotations) per step."""
        return self.client.export_trajectory(self.id, label=label, min_reward=min_reward)
