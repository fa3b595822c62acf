"""A trajectory as one object: its steps, annotations, export, and the resume helper.

:class:`Trajectory` runs in a :class:`~dsec.Sandbox`, :class:`AsyncTrajectory` in an
:class:`~dsec.AsyncSandbox`; what they send is planned once, in :class:`_TrajectoryPlans`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Union, cast

from typing_extensions import Unpack

from . import _api as api
from .client import AsyncClient, Client
from .errors import UnknownOutcome
from .sandbox import AsyncSandbox, Sandbox
from .types import Annotation, Command, ExecOptions, ExecResult, TrajectoryInfo


@dataclass
class ResumeReport:
    """What :meth:`Trajectory.resume` did with each step."""

    replayed: list[int] = field(default_factory=list)
    """Steps answered from the log (nothing ran)."""
    live: list[int] = field(default_factory=list)
    """Steps that ran (beyond the log, or with a different action)."""
    unknown: list[int] = field(default_factory=list)
    """Steps whose outcome the log does not know (started, never answered)."""
    results: list[ExecResult] = field(default_factory=list)
    """The answers, in step order (up to the first unknown step)."""


Step = Union[Command, tuple[Command, Mapping[str, Any]]]


class _TrajectoryPlans:
    """The requests of a trajectory's steps, numbered, as plans either client can run."""

    sandbox: Sandbox | AsyncSandbox
    client: Client | AsyncClient

    def __init__(self, sandbox: Sandbox | AsyncSandbox, trajectory_id: str, client: Client | AsyncClient) -> None:
        self.sandbox = sandbox
        self.id = trajectory_id
        self.client = client
        self.next_step = 1

    def _exec(self, cmd: Command, step: int | None, options: ExecOptions) -> api.Plan[ExecResult]:
        n = self.next_step if step is None else step
        timeout = self.sandbox.client.exec_timeout
        call = api.exec(self.sandbox.id, cmd, timeout, trajectory=self.id, step=n, **options)
        r: ExecResult = yield call
        self.next_step = n + 1
        return r

    def _resume(self, steps: Iterable[Step]) -> api.Plan[ResumeReport]:
        report = ResumeReport()
        self.next_step = 1
        for s in steps:
            cmd, options = (s[0], cast(ExecOptions, dict(s[1]))) if isinstance(s, tuple) else (s, ExecOptions())
            n = self.next_step
            try:
                r = yield from self._exec(cmd, None, options)
            except UnknownOutcome:
                report.unknown.append(n)
                break
            (report.replayed if r.replayed else report.live).append(n)
            report.results.append(r)
        return report


class Trajectory(_TrajectoryPlans):
    """Steps of one trajectory run in one sandbox, numbered for you.

    ``traj.exec(cmd)`` sends the next step; after a preemption a trainer rebuilds the object
    and calls :meth:`resume` with the actions it had sent so far: each logged step is answered
    from the log byte for byte without running, and the first one the log does not have runs
    live. A step that started but was never answered stops the resume (``report.unknown``):
    the caller decides whether to re-send it as a different action.
    """

    sandbox: Sandbox
    client: Client

    def __init__(self, sandbox: Sandbox, trajectory_id: str, *, client: Client | None = None) -> None:
        super().__init__(sandbox, trajectory_id, client or sandbox.client)

    def exec(self, cmd: Command, *, step: int | None = None, **options: Unpack[ExecOptions]) -> ExecResult:
        """Run ``cmd`` as the next step (or as ``step``)."""
        return self.sandbox.client._run(self._exec(cmd, step, options))

    def resume(self, steps: Iterable[Step]) -> ResumeReport:
        """Re-send ``steps`` (commands, or ``(command, exec options)`` pairs) from step 1."""
        return self.sandbox.client._run(self._resume(steps))

    def info(self) -> TrajectoryInfo:
        """Counters: intents, results (acknowledged), unknown outcomes, annotations."""
        return self.client.get_trajectory(self.id)

    def steps(self, *, from_step: int | None = None) -> Iterator[dict[str, Any]]:
        """The log records (intent, result, annotation), in log order, page by page."""
        return self.client.trajectory_records(self.id, from_step=from_step)

    def annotate(self, **annotation: Unpack[Annotation]) -> int:
        """Annotate the trajectory (or one ``step``) with ``reward``, ``labels`` and ``data``;
        durable; returns its lsn."""
        return self.client.annotate_trajectory(self.id, **annotation)

    def finish(self) -> None:
        """Mark it finished: it will not be resumed, and its records may be compacted away."""
        self.client._send(api.finish_trajectory(self.id))

    def export(self, *, label: str | None = None, min_reward: float | None = None) -> list[dict[str, Any]]:
        """Training rows (action, observation, status, timings, annotations) per step."""
        return self.client.export_trajectory(self.id, label=label, min_reward=min_reward)


class AsyncTrajectory(_TrajectoryPlans):
    """:class:`Trajectory` for an :class:`~dsec.AsyncSandbox`; the same methods, awaited::

    traj = dsec.AsyncTrajectory(sb, "ep-17")
    r = await traj.exec("python3 step.py")            # step 1
    report = await dsec.AsyncTrajectory(sb, "ep-17").resume(actions)
    """

    sandbox: AsyncSandbox
    client: AsyncClient

    def __init__(self, sandbox: AsyncSandbox, trajectory_id: str, *, client: AsyncClient | None = None) -> None:
        super().__init__(sandbox, trajectory_id, client or sandbox.client)

    async def exec(self, cmd: Command, *, step: int | None = None, **options: Unpack[ExecOptions]) -> ExecResult:
        return await self.sandbox.client._run(self._exec(cmd, step, options))

    async def resume(self, steps: Iterable[Step]) -> ResumeReport:
        return await self.sandbox.client._run(self._resume(steps))

    async def info(self) -> TrajectoryInfo:
        return await self.client.get_trajectory(self.id)

    def steps(self, *, from_step: int | None = None) -> AsyncIterator[dict[str, Any]]:
        return self.client.trajectory_records(self.id, from_step=from_step)

    async def annotate(self, **annotation: Unpack[Annotation]) -> int:
        return await self.client.annotate_trajectory(self.id, **annotation)

    async def finish(self) -> None:
        await self.client._send(api.finish_trajectory(self.id))

    async def export(self, *, label: str | None = None, min_reward: float | None = None) -> list[dict[str, Any]]:
        return await self.client.export_trajectory(self.id, label=label, min_reward=min_reward)
