"""``rollout_backend="vllm"``: generation on vLLM servers behind the same pool, admission control and queue.

Each server is one *lane* of the pool (what a worker process is for the transformers backend): the pool's dispatcher
hands it admitted groups, and the lane issues one ``/inference/v1/generate`` request per group (``n =
num_generations``) from its own threads, many at once, so the server's continuous batching stays full. Finished
groups reach the pool's collector through a pipe exactly like a worker's, so scoring, the queue and every metric are
shared. Each token comes back with its log-prob under the distribution vLLM sampled from (the server runs with
``--logprobs-mode processed_logprobs``: temperature, top-k/top-p applied), i.e. mu, and with the label of the
weights that sampled it (vLLM's ``weight_versions`` spans; a weight push labels the weights with the policy version).

A lane health-checks its server every 0.5 s; a server silent for ``rollout_heartbeat_timeout_s`` is lost: what it
held is generated again on the other servers, and its lane is replaced by one that waits for it (weight_push/recovery.py). A
server that fails a weight sync, whatever its phase, is lost the same way, with every member of a push that broke off
(``_lose_or_raise``). When
it answers again as the same server, the next publish re-opens the weight transport with it, pushes the current
weights (with adapters: the base, then the current adapter), compares a greedy probe with a peer's, and only then
does it take work. Training stops, naming the server, once it has been down ``rollout_vllm_down_limit_s``, every
server for ``rollout_vllm_retry_s``, or it comes back as another model (never a hang).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from transformers.utils import logging

from ...weights.buckets import Buckets
from ...weights.lora_merge import served_adapter
from .adapters import AdapterPlan  # noqa: F401 - setup/pool.py builds it from here
from .client import VLLMServer
from .server_checks import ServerSurvey, survey_servers
from .server_lane import VLLMLane, VLLMLaneSpec, cut_after_eos  # noqa: F401 - importable from here
from .weight_push.pusher import VLLMWeightPusher
from .weight_push.recovery import Return

logger = logging.get_logger(__name__)
PROBE = (1, 2, 3, 4, 5, 6, 7, 8)  # the prompt a returning server and a peer both complete greedily


class VLLMBackend:
    """The pool's backend for vLLM servers: one lane per server and the weight pusher. With an ``AdapterPlan`` the
    base is pushed once (``publish_base``) and each version is loaded as a named adapter (``publish``), unless a
    server cannot serve the adapters: then ``adapter_blocker`` says why and every version is pushed merged."""

    restartable = True  # a lost server's lane waits for it to come back (weight_push/recovery.py)
    owned: Sequence = ()  # colocated servers (colocate.py), stopped with the backend
    restart_note = "waiting for it to come back (re-attached at a weight sync once it answers)"

    def __init__(
        self,
        specs: Sequence[VLLMLaneSpec],
        survey: ServerSurvey,
        max_outstanding: int,
        weight_specs: dict,
        bucket_bytes: int,
        pause_mode: str,
        startup_timeout_s: float,
        adapters: AdapterPlan | None = None,
        down_limit_s: float | None = None,
        owned: Sequence = (),
    ) -> None:
        """No I/O: ``survey`` holds what the servers said (``connect`` asks them first), and the weight transport
        opens at ``open_transport``."""
        self.owned = list(owned)
        self.specs = list(specs)
        self.max_outstanding = max_outstanding
        self.pause_mode = pause_mode
        self.servers = survey.servers
        # the weight sync and the probe never retry: a server restarted meanwhile is a new process, which must not
        # get half a sync meant for the old one (the failure lets it go; it is re-attached from the start)
        self._sync_clients = [VLLMServer(s.url, s.request_timeout_s, 0.0) for s in self.specs]
        self.identities = survey.identities  # what a server must be to be taken back
        self.down_limit_s = down_limit_s
        self.reattached: list[dict] = []  # each re-attach: url, seconds down, seconds from back to taking work
        self.adapter_blocker = survey.adapter_blocker
        self.served = survey.served
        self.plan = adapters if self.served is not None else None
        self._pushed_specs = self.plan.base_specs if self.plan else weight_specs
        self._transport = (survey.transport, bucket_bytes, startup_timeout_s)
        self.pusher: VLLMWeightPusher | None = None  # open_transport
        self._members: list[int] = []  # the servers the pusher's collective group spans
        self._based: list[int] = []  # servers back after a loss that got the frozen base at this publish
        self.lanes: list[VLLMLane] = []  # every lane started, replaced ones included
        self.current: list[VLLMLane | None] = [None] * len(self.servers)  # by server

    @classmethod
    def connect(
        cls,
        specs: Sequence[VLLMLaneSpec],
        transport: str,
        trainer_device: str,
        startup_timeout_s: float,
        adapters: AdapterPlan | None = None,
        **settings,
    ) -> VLLMBackend:
        """Check the servers (server_checks.py), build the backend and open the weight transport with every server.
        ``settings``: the rest of the constructor's arguments."""
        survey = survey_servers(specs, startup_timeout_s, transport, trainer_device, adapters)
        backend = cls(specs, survey, startup_timeout_s=startup_timeout_s, adapters=adapters, **settings)
        backend.open_transport()
        return backend

    def open_transport(self) -> None:
        """The weight transport's group over every server (each rendezvous is network I/O)."""
        self._regroup(list(range(len(self.servers))))

    @property
    def adapter_sync(self) -> bool:
        return self.plan is not None

    def start_lane(self, index: int, restarts: int = 0) -> VLLMLane:
        """A server's lane; a replacement (``restarts`` > 0) waits for its server to come back (weight_push/recovery.py)."""
        returning = None
        if restarts:
            returning = Return(
                self.specs[index].url,
                self.identities[index],
                self.down_limit_s,
                self.specs[index].retry_s,
                lambda: any(ln.attached for ln in self.current if ln not in (None, lane)),
            )
        lane = VLLMLane(self.specs[index], self.max_outstanding, restarts, adapters=self.served, returning=returning)
        self.lanes.append(lane)
        self.current[index] = lane
        return lane

    def _back(self) -> list[int]:
        return [
            i for i, ln in enumerate(self.current) if ln is not None and ln.returning and ln.returning.state == "back"
        ]

    def _live(self, back: list[int]) -> list[int]:
        """The servers to sync now: ``back`` (being re-attached) and the attached ones; with merged pushes only those
        that answer (a dead one in the push group would fail the push; it is skipped and its lane is replaced)."""
        return [
            i
            for i, ln in enumerate(self.current)
            if i in back
            or (ln is not None and ln.attached and (self.plan is not None or self.servers[i].healthy(timeout_s=2.0)))
        ]

    @property
    def needs_base(self) -> bool:
        """Adapter-only sync: a server came back and must get the frozen base before its first adapter."""
        return self.plan is not None and bool(self._back())

    @property
    def resync_wanted(self) -> bool:
        """A server is back while no lane takes work: training waits for groups that only a weight sync can bring
        (the trainer then publishes its current weights again; RolloutPool.take)."""
        return bool(self._back()) and not any(ln is not None and ln.attached for ln in self.current)

    @property
    def publish_target(self) -> None:
        return None  # weights stream to the servers; nothing to write in place

    base_target = publish_target

    def publish_base(self, buckets: Buckets, version: int, digest=None) -> None:
        """The frozen base before the first adapter (the servers may have started from other weights): to every
        server first, later to the servers that came back."""
        if self.pusher.pushes:  # returning servers: a group of their own (the others keep their base and adapters)
            self._based = self._back()  # (one seen back after this waits for the next publish)
            if not self._based:  # it went down again meanwhile
                _drain(buckets)
                return
        members = self._based if self.pusher.pushes else list(range(len(self.servers)))
        try:
            if self.pusher.pushes:
                self._regroup(self._based)
            self.pusher.push(buckets, version, self.pause_mode)
        except Exception as exc:
            _drain(buckets)
            self._based = []
            self._lose_or_raise(members, "the push of the frozen base", exc, settle=self.pusher.settle)

    def publish(self, buckets: Buckets, version: int, digest=None, ready=None) -> None:
        # no digest here (rollout_verify_weights is refused with vLLM: its kernels do not reproduce the trainer's)
        if ready is not None:
            ready()
        # the servers re-attached now: every one back (merged weights go to all), or those that got the base
        back = self._back() if self.plan is None else [i for i in self._back() if i in self._based]
        self._based = []
        live = self._live(back)
        if (
            not live
        ):  # every server is down: nothing to sync; the lanes wait for one to come back (weight_push/recovery.py)
            _drain(buckets)  # (every rank streams to the end: under ZeRO-3 each bucket is a gather)
            return
        if self.plan is not None:
            tensors = {name: t.detach().clone() for bucket in buckets for name, t in bucket}
            loaded = self.served.publish(
                *served_adapter(self.plan.merges, tensors), version, [self.servers[i] for i in live]
            )
            self._lose([i for i, ok in zip(live, loaded, strict=True) if not ok], "loading the adapter")
            live = [i for i, ok in zip(live, loaded, strict=True) if ok]
        else:
            try:
                if live != self._members or back:  # a server was lost or came back: a new group over those up now
                    self._regroup(live)  # (one back is a new process: its transport is opened before any push, even
                    # when the group's members are the same as at the last push: the only server, or one lost and
                    # back between two pushes)
                self.pusher.push(buckets, version, self.pause_mode)
            except Exception as exc:
                _drain(buckets)  # the rest of the stream: under ZeRO-3 every rank's gathers go on in lock-step
                self._lose_or_raise(live, f"the weight push of version {version}", exc, settle=self.pusher.settle)
                return
        peers = [i for i in live if i not in back]
        for i in back:
            if i in live:
                self._reattach(i, version, peers)
        for i in live:
            if self.current[i].attached:
                self.current[i].adopted(version)

    def _lose_or_raise(
        self, members: list[int], during: str, exc: Exception, only_down: bool = False, settle=None
    ) -> None:
        """A sync step over ``members`` raised ``exc``. If a server no longer answers, it died or hung there: the
        members are let go (``_lose``; with ``only_down`` only those down). If every one still answers, the error is
        not a lost server, and retrying would only repeat it: it is raised. Health is read at once (a server
        restarted meanwhile answers again), then ``settle`` waits for the survivors to leave the broken push."""
        down = [i for i in members if not self.servers[i].healthy(timeout_s=2.0)]
        if settle is not None:
            settle()
        if not down:
            raise exc
        self._lose(down if only_down else members, f"{during} ({type(exc).__name__}: {exc})")

    def _lose(self, members: list[int], during: str) -> None:
        """``members`` failed ``during`` a weight sync: none is known to hold a whole version (a push that broke off
        leaves the survivors paused with mixed weights), so each is let go as lost. What its lane held is generated
        again, and a lane that waits for it takes it back, with a new transport group, the current weights and a
        probe, once it answers (weight_push/recovery.py); training goes on meanwhile, or waits for it within the limits."""
        if not members:
            return
        logger.warning(
            "vLLM server(s) %s failed during %s; each is re-attached once it answers",
            ", ".join(self.specs[i].url for i in members),
            during,
        )
        for i in members:
            if self.current[i] is not None:
                self.current[i].lose()
        self._members = []  # the next push opens a new group, whoever is in it

    def _regroup(self, members: list[int]) -> None:
        self.pusher = VLLMWeightPusher([self._sync_clients[i] for i in members], *self._transport, self._pushed_specs)
        self._members = members

    def _reattach(self, index: int, version: int, peers: list[int]) -> None:
        """A server that came back now holds ``version``: check that it samples as a peer does, then give it work. A
        server whose greedy output differs is left out (warned; training goes on with the others)."""
        lane, adapter = self.current[index], (self.served.name(version), version) if self.served else None
        back_at = lane.returning.back_at
        if lane.returning.state != "back" or back_at is None:  # gone again during the sync: the next publish retries
            return
        if peers:
            params = {"n": 1, "max_tokens": 8, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
            try:
                mine, theirs = (
                    self._sync_clients[i].generate(PROBE, params, adapter=adapter)[0].token_ids
                    for i in (index, peers[0])
                )
            except Exception as exc:  # one of them died or stopped answering: no verdict
                self._lose_or_raise(
                    [index, peers[0]], f"the probe of {lane.spec.url} after its re-attach", exc, only_down=True
                )
                return
            if mine != theirs:
                lane.returning.state = "refused"
                logger.warning(
                    f"vLLM server {lane.describe()} came back, but after the weight sync its greedy output {mine} "
                    f"differs from {self.servers[peers[0]].url}'s {theirs} on the same version {version}: it gets "
                    "no more work in this run"
                )
                return
        seconds = lane.returning.attach(time.time())
        self.reattached.append(
            {"url": lane.spec.url, "down_to_working_s": seconds, "back_to_working_s": time.time() - back_at}
        )
        logger.warning(
            "vLLM server %s re-attached at version %d, %.1fs after it was lost%s",
            lane.spec.url,
            version,
            seconds,
            "" if peers else " (no other server to compare its output with)",
        )

    def close(self) -> None:
        for lane in self.lanes:
            lane.kill()
        if self.served is not None:
            self.served.close()
        for server in self.owned:
            server.stop()


def _drain(buckets: Buckets) -> None:
    for _ in buckets:
        pass
