"""The engine's parts, built once, in dependency order (`EngineParts.build`).

Each part gets the collaborators it uses as constructor arguments, built before it; none is
patched in afterwards and none reaches through another for a third:

1. the KV control's holder (`ControlRef`), which every part that talks to the service asks;
2. the metrics, and the loop's events: `wake` (anything that happens wakes the loop) and
   `device_quiet` (set while no step is in flight: the recovery waits on it before letting go of
   lost memory);
3. the `Finisher`, which every part that ends a request calls, and the finished requests kept
   for a late resume (`FinishedRequests`);
4. the scheduler (its admissions raise ServiceUnavailable when the service is lost: the loop
   then fails everything, so the scheduler needs no way to reach the failure handling);
5. the recovery, then the failure handling that starts it (`Failures`);
6. the StepEnd reports, the releaser, the post-processing;
7. the request API the server calls (`RequestAPI`, held as `Engine.api`);
8. the step runner, which launches steps on the compute's model runner.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine_client.client.control import KVControl
from engine_client.client.prefill_router import PrefillRouter
from engine_client.loop.acceptance_rates import AcceptanceRates
from engine_client.loop.admission_limit import AdmissionLimit
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.failure import Failures
from engine_client.loop.finished import FinishedRequests
from engine_client.loop.metrics import EngineMetrics
from engine_client.loop.page_names import PrefixReuse
from engine_client.loop.postprocess import Postprocessor, ReportSender
from engine_client.loop.queue_policy import QueueLimits
from engine_client.loop.recovery import ServiceRecovery
from engine_client.loop.release import Finisher, Releaser
from engine_client.loop.remote_prefill import RemotePrefill
from engine_client.loop.request_api import RequestAPI
from engine_client.loop.scheduler import Scheduler
from engine_client.loop.state_file import StateFile
from engine_client.loop.step_runner import StepRunner
from engine_client.loop.synthetic import SyntheticContext
from engine_client.model.compute import Compute


@dataclass(frozen=True)
class EngineOptions:
    """How the engine schedules and steps (the server's settings for it)."""

    policy: QueueLimits
    overlap: bool = True
    prefix: PrefixReuse = PrefixReuse()
    acceptance: AcceptanceRates | None = None  # BENCHMARK-ONLY synthetic acceptance
    prefill_peers: PrefillRouter | None = None  # disaggregation: the decode role's prefill engines


@dataclass(frozen=True)
class EngineParts:
    control: ControlRef
    metrics: EngineMetrics
    wake: asyncio.Event
    device_quiet: asyncio.Event
    finisher: Finisher
    finished: FinishedRequests
    scheduler: Scheduler
    recovery: ServiceRecovery
    failures: Failures
    reports: ReportSender
    releaser: Releaser
    postprocess: Postprocessor
    api: RequestAPI
    step_runner: StepRunner

    @classmethod
    def build(
        cls,
        compute: Compute,
        control: KVControl,
        admission: AdmissionLimit,
        state: StateFile | None,
        metrics: EngineMetrics | None,
        options: EngineOptions,
    ) -> EngineParts:
        ref, wake, quiet = ControlRef(control), asyncio.Event(), asyncio.Event()
        quiet.set()  # no step in flight yet
        metrics = metrics or EngineMetrics()
        metrics.watch_admission(admission)
        finisher, finished = Finisher(state, wake), FinishedRequests(state)
        peers = options.prefill_peers
        remote = RemotePrefill(peers, ref, finisher.finish, wake) if peers is not None else None
        scheduler = _scheduler(compute, ref, admission, finisher, state, options, remote)
        recovery = ServiceRecovery(ref, compute, device_quiet=quiet)
        failures = Failures(scheduler, ref, recovery, state, finisher.finish, wake, finished)
        reports = ReportSender(ref)
        releaser = Releaser(scheduler, ref, reports, state, failures, finished)
        postprocess = Postprocessor(compute.row_bytes, state, reports, metrics, finisher.finish)
        api = RequestAPI(scheduler, failures, finished, finisher, state, wake)
        step_runner = _step_runner(compute, options)
        return cls(
            ref,
            metrics,
            wake,
            quiet,
            finisher,
            finished,
            scheduler,
            recovery,
            failures,
            reports,
            releaser,
            postprocess,
            api,
            step_runner,
        )


def _scheduler(
    compute: Compute,
    control: ControlRef,
    admission: AdmissionLimit,
    finisher: Finisher,
    state: StateFile | None,
    options: EngineOptions,
    remote: RemotePrefill | None,
) -> Scheduler:
    return Scheduler(
        control,
        options.policy,
        admission=admission,
        max_batch=compute.max_batch,
        prefill_chunk=compute.prefill_chunk,
        synthetic=SyntheticContext(compute.synthetic_context, compute.synthetic_shared),
        finish=finisher.finish,
        state=state,
        prefix=options.prefix,
        draft_tokens=compute.draft_tokens,
        remote=remote,
    )


def _step_runner(compute: Compute, options: EngineOptions) -> StepRunner:
    rule = options.acceptance
    if rule is not None and rule.draft_tokens != compute.draft_tokens:
        raise ValueError(
            f"synthetic acceptance for {rule.draft_tokens} drafts, the compute drafts "
            f"{compute.draft_tokens}"
        )
    return StepRunner(compute, overlap=options.overlap, acceptance=rule)
