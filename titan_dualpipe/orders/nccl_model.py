"""Does a per-rank sequence of posted communication complete under NCCL's semantics?

gloo buffers a send until its receive is posted, so an order can run on the CPU and still hang
on GPUs. This model has no buffering: each rank posts *kernels* (one ``isend``/``irecv``, one
``batch_isend_irecv`` group, or one collective) on a *communicator*, each (rank, communicator)
runs its kernels one after the other (NCCL's stream), and a rank's ``wait`` holds back
everything it posts afterwards. Communicators are created at their first use, as NCCL does
without eager init (torchtitan's way). :func:`check_completes` runs a trace under these rules
(listed there) and raises :class:`Deadlock` naming what every stuck rank waits for; eager init
(``init_process_group(device_id=...)``) is :func:`check_completes_eager`. The recorded traces
come from :mod:`titan_dualpipe.runtime.comm_record` (docs/numerics.md#nccls-semantics-on-the-cpu).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Iterable, Sequence, Union

SEND, RECV = "send", "recv"


@dataclass(frozen=True)
class P2P:
    """One send to or receive from global rank ``peer`` of a message described by ``signature``
    (shape and dtype; a receive must match its send's)."""

    kind: str
    peer: int
    signature: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {'to' if self.kind == SEND else 'from'} {self.peer} {self.signature}".rstrip()


@dataclass(frozen=True)
class Collective:
    """A collective over global ranks ``members``."""

    name: str
    members: tuple[int, ...]
    signature: str = ""

    def __str__(self) -> str:
        return f"{self.name} over {list(self.members)}"


Op = Union[P2P, Collective]


@dataclass(frozen=True)
class Post:
    """Rank posts kernel ``work`` on communicator ``comm`` with these ops; ``label`` says where
    in the program (e.g. the action) for error messages; ``members`` lists the communicator's
    ranks (needed to create a group's communicator that this trace uses for p2p only)."""

    work: int
    comm: Hashable
    ops: tuple[Op, ...]
    label: str = ""
    members: tuple[int, ...] = ()  # the communicator's global ranks, where not implied (see check_completes)


@dataclass(frozen=True)
class Wait:
    """Rank waits for kernel ``work``: everything it posts later starts after that kernel ended."""

    work: int


Event = Union[Post, Wait]
Trace = dict[int, list[Event]]


class Deadlock(RuntimeError):
    """The posted kernels cannot all complete; the message names every rank's stuck kernel."""


@dataclass
class _Kernel:
    rank: int
    index: int  # position among this rank's kernels (its host posts them in this order)
    post: Post
    after: frozenset[int]  # works this rank waited for before posting it
    done_ops: set[int] = field(default_factory=set)

    @property
    def finished(self) -> bool:
        return len(self.done_ops) == len(self.post.ops)

    def describe(self) -> str:
        pending = [str(op) for i, op in enumerate(self.post.ops) if i not in self.done_ops]
        where = f" ({self.post.label})" if self.post.label else ""
        return f"kernel {self.post.work}{where} on {self.post.comm}: {', '.join(pending)}"


def pair_comm(group: Hashable, a: int, b: int) -> tuple:
    """The two-rank communicator torch uses (lazy init) for a lone isend/irecv between ``a`` and
    ``b`` (torch 2.13+ posts all-send or all-receive batches that way too)."""
    return ("pair", group, min(a, b), max(a, b))


def group_comm(group: Hashable) -> tuple:
    """The process group's own communicator (batched p2p, collectives and functional collectives:
    one FIFO per rank for all its peers)."""
    return ("group", group)


def _kernels(trace: Trace) -> tuple[dict[int, list[_Kernel]], dict[tuple[int, int], _Kernel]]:
    per_rank: dict[int, list[_Kernel]] = {}
    by_work: dict[tuple[int, int], _Kernel] = {}
    for rank, events in trace.items():
        waited: set[int] = set()
        kernels = per_rank[rank] = []
        for event in events:
            if isinstance(event, Wait):
                waited.add(event.work)
            elif event.ops:
                kernel = _Kernel(rank, len(kernels), event, frozenset(waited))
                kernels.append(kernel)
                by_work[(rank, event.work)] = kernel
    return per_rank, by_work


def _match(per_rank: dict[int, list[_Kernel]]) -> dict[tuple[int, int, int], list[tuple[int, int, int]]]:
    """For every op (rank, work, index) the ops it must run together with."""
    sends: dict[tuple, list] = defaultdict(list)
    recvs: dict[tuple, list] = defaultdict(list)
    collectives: dict[tuple, list] = defaultdict(list)
    for rank, kernels in per_rank.items():
        for kernel in kernels:
            for i, op in enumerate(kernel.post.ops):
                ref = (rank, kernel.post.work, i)
                if isinstance(op, Collective):
                    collectives[(kernel.post.comm, rank)].append((ref, op))
                elif op.kind == SEND:
                    sends[(kernel.post.comm, rank, op.peer)].append((ref, op))
                else:
                    recvs[(kernel.post.comm, op.peer, rank)].append((ref, op))
    partners: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    for channel in set(sends) | set(recvs):
        comm, src, dst = channel
        out, inn = sends.get(channel, []), recvs.get(channel, [])
        if len(out) != len(inn):
            raise Deadlock(f"rank {src} posts {len(out)} sends to rank {dst} on {comm}, which posts {len(inn)} receives "
                           "from it: the extra ones never complete")
        for (s_ref, s_op), (r_ref, r_op) in zip(out, inn):
            if s_op.signature != r_op.signature:
                raise Deadlock(f"rank {dst} receives {r_op.signature} from rank {src} on {comm} where the matching "
                               f"send carries {s_op.signature}")
            partners[s_ref], partners[r_ref] = [r_ref], [s_ref]
    _match_collectives(collectives, partners)
    return partners


def _match_collectives(collectives: dict[tuple, list], partners: dict) -> None:
    by_comm: dict[Hashable, dict[int, list]] = defaultdict(dict)
    for (comm, rank), entries in collectives.items():
        by_comm[comm][rank] = entries
    for comm, ranks in by_comm.items():
        for rank, entries in ranks.items():
            for n, (ref, op) in enumerate(entries):
                others = []
                for member in op.members:
                    theirs = ranks.get(member, [])
                    if n >= len(theirs) or theirs[n][1].name != op.name:
                        got = theirs[n][1].name if n < len(theirs) else "nothing"
                        raise Deadlock(f"collective {n} on {comm}: rank {rank} runs {op.name}, rank {member} {got}")
                    others.append(theirs[n][0])
                partners[ref] = [o for o in others if o != ref]


def communicators(trace: Trace) -> set[Hashable]:
    """Every communicator ``trace`` posts on (pass as ``created`` to model them all as existing)."""
    return {e.comm for events in trace.values() for e in events if isinstance(e, Post) and e.ops}


def first_uses(trace: Trace) -> dict[int, dict[Hashable, int]]:
    """Per rank, each communicator -> the index in the rank's events of its first post on it
    (where lazy init creates it)."""
    firsts: dict[int, dict[Hashable, int]] = {}
    for rank, events in trace.items():
        mine = firsts[rank] = {}
        for i, event in enumerate(events):
            if isinstance(event, Post) and event.ops:
                mine.setdefault(event.comm, i)
    return firsts


def eager_init(trace: Trace, groups: Iterable[Hashable] | None = None) -> Trace:
    """``trace`` (recorded with lazy init's communicators) as NCCL runs it when process groups
    ``groups`` (default: every group) were initialised eagerly: every lone p2p op of such a group
    moves from its pair communicator to the group's own, where it runs in issue order with every
    other op of the group ("unbatched P2P ops are treated as independent collective ops, and are
    thus serialized with all other ops on this ProcessGroup, including other P2P ops", torch's
    warning). Groups made after ``init_process_group(device_id=...)`` inherit the bound device."""
    chosen = None if groups is None else set(groups)

    def comm_of(comm: Hashable) -> Hashable:
        if _is_pair(comm) and (chosen is None or comm[1] in chosen):
            return group_comm(comm[1])
        return comm

    return {rank: [replace(e, comm=comm_of(e.comm)) if isinstance(e, Post) else e for e in events]
            for rank, events in trace.items()}


def check_completes_eager(trace: Trace, groups: Iterable[Hashable] | None = None) -> int:
    """:func:`check_completes` of ``trace`` (recorded with lazy init's communicators) under eager
    init of ``groups`` (default: every group; none: lazy init throughout): their communicators
    exist before the trace, any other is created at its first use."""
    chosen = None if groups is None else set(groups)
    remapped = eager_init(trace, chosen)
    made = None if chosen is None else {group_comm(g) for g in chosen}
    return check_completes(remapped, created=[c for c in communicators(remapped)
                                              if not _is_pair(c) and (made is None or c in made)])


def _is_pair(comm: Hashable) -> bool:
    return isinstance(comm, tuple) and comm[:1] == ("pair",)


def _comm_members(comm: Hashable, kernels: list[_Kernel]) -> tuple[int, ...]:
    """The ranks that create ``comm`` together (see :func:`check_completes`)."""
    if _is_pair(comm):
        return tuple(sorted({comm[2], comm[3]}))
    named = {m for k in kernels for m in k.post.members}
    if named:
        return tuple(sorted(named))
    ranks = {k.rank for k in kernels}
    ranks |= {m for k in kernels for op in k.post.ops if isinstance(op, Collective) for m in op.members}
    return tuple(sorted(ranks))


class _Hosts:
    """Where each rank's host is: it has posted its kernels before ``at[rank]``, and waits there
    to create that kernel's communicator (or has posted everything)."""

    def __init__(self, per_rank: dict[int, list[_Kernel]], created: Iterable[Hashable]) -> None:
        self.per_rank = per_rank
        self.created = set(created)
        by_comm: dict[Hashable, list[_Kernel]] = defaultdict(list)
        for kernels in per_rank.values():
            for kernel in kernels:
                by_comm[kernel.post.comm].append(kernel)
        self.members = {comm: _comm_members(comm, ks) for comm, ks in by_comm.items()}
        self.at = {rank: 0 for rank in per_rank}
        for rank in per_rank:
            self._advance(rank)

    def _advance(self, rank: int) -> None:
        kernels, i = self.per_rank[rank], self.at[rank]
        while i < len(kernels) and kernels[i].post.comm in self.created:
            i += 1
        self.at[rank] = i

    def blocked_on(self, rank: int) -> Hashable | None:
        """The communicator this rank's host waits to create, if any (none for a rank not traced)."""
        kernels, i = self.per_rank.get(rank, []), self.at.get(rank, 0)
        return kernels[i].post.comm if i < len(kernels) else None

    def posted(self, kernel: _Kernel) -> bool:
        return kernel.index < self.at[kernel.rank]

    def create_ready(self) -> bool:
        """Create every communicator whose members all wait at its first use; whether any was."""
        waiting = {self.blocked_on(r) for r in self.per_rank} - {None}
        ready = [c for c in waiting if all(self.blocked_on(m) == c for m in self.members[c])]
        for comm in ready:
            self.created.add(comm)
            for rank in self.members[comm]:
                self._advance(rank)
        return bool(ready)

    def describe_block(self, rank: int) -> str:
        comm = self.blocked_on(rank)
        kernel = self.per_rank[rank][self.at[rank]]
        absent = [m for m in self.members[comm] if self.blocked_on(m) != comm]
        where = f" ({kernel.post.label})" if kernel.post.label else ""
        return (f"rank {rank}: host blocked creating {comm} at its first use{where} (lazy init, a rendezvous of "
                f"ranks {list(self.members[comm])}): rank(s) {absent} not there")


def check_completes(trace: Trace, created: Iterable[Hashable] = ()) -> int:
    """Run ``trace`` under the model; return the number of rounds, or raise :class:`Deadlock`.

    - A point-to-point op completes when it and its match are both running: the n-th send from
      ``a`` to ``b`` on a communicator matches the n-th receive at ``b`` from ``a`` on it (FIFO).
    - The ops of one kernel progress together; the kernel ends when all of them completed.
    - A collective completes when every member's matching collective (the n-th on that
      communicator) is running.
    - A rank's ``wait`` on a kernel makes everything it posts afterwards wait for that kernel (the
      compute stream waits on it, and later kernels wait on the compute stream).
    - Posting never blocks, except that a communicator not in ``created`` is created at its first
      use in ``trace`` (lazy init): a rank's first kernel on it blocks that rank's host until every
      member has reached its own first kernel on it (``ncclCommInitRank`` is collective). Members:
      a pair communicator's two ranks; for a group's communicator the ranks named by
      ``Post.members``, else those of its collectives and the ranks posting on it.
      ``created=communicators(trace)`` models every communicator as existing."""
    per_rank, by_work = _kernels(trace)
    partners = _match(per_rank)
    hosts = _Hosts(per_rank, created)
    queues: dict[tuple[int, Hashable], list[_Kernel]] = defaultdict(list)
    for rank, kernels in per_rank.items():
        for kernel in kernels:
            queues[(rank, kernel.post.comm)].append(kernel)
    ended: set[tuple[int, int]] = set()

    def running(kernel: _Kernel) -> bool:
        queue = queues[(kernel.rank, kernel.post.comm)]
        return bool(queue) and queue[0] is kernel and hosts.posted(kernel) and all(
            (kernel.rank, w) in ended for w in kernel.after if (kernel.rank, w) in by_work)

    rounds = 0
    while any(queues.values()):
        rounds += 1
        progress = hosts.create_ready()
        heads = [q[0] for q in queues.values() if q and running(q[0])]
        for kernel in heads:
            for i in range(len(kernel.post.ops)):
                if i in kernel.done_ops:
                    continue
                refs = partners[(kernel.rank, kernel.post.work, i)]
                if all(running(by_work[(r, w)]) for r, w, _ in refs):
                    for r, w, j in [(kernel.rank, kernel.post.work, i), *refs]:
                        by_work[(r, w)].done_ops.add(j)
                    progress = True
        for key, queue in queues.items():
            while queue and queue[0].finished:
                ended.add((key[0], queue.pop(0).post.work))
                progress = True
        if not progress:
            raise Deadlock("posted communication cannot complete without buffering (NCCL):\n  "
                           + "\n  ".join(_stuck(queues, hosts, running)))
    return rounds


def _stuck(queues: dict, hosts: _Hosts, running: Callable[[_Kernel], bool]) -> list[str]:
    """One line per rank whose host waits to create a communicator, and per stuck kernel."""
    lines = [hosts.describe_block(r) for r in sorted(hosts.per_rank) if hosts.blocked_on(r) is not None]
    for q in queues.values():
        if q and hosts.posted(q[0]):
            own = "" if running(q[0]) else " (waits for its own earlier kernels)"
            lines.append(f"rank {q[0].rank}: {q[0].describe()}{own}")
    return lines


def describe(trace: Trace, ranks: Iterable[int] | None = None) -> str:
    """The trace, one line per event, for failure messages."""
    lines = []
    for rank in sorted(trace if ranks is None else ranks):
        lines.append(f"rank {rank}:")
        for event in trace[rank]:
            if isinstance(event, Wait):
                lines.append(f"  wait {event.work}")
            else:
                ops = ", ".join(map(str, event.ops))
                lines.append(f"  post {event.work} {event.label} on {event.comm}: {ops}")
    return "\n".join(lines)


def kernels_of(trace: Trace) -> Sequence[tuple[int, Post]]:
    """Every posted kernel, rank-major (for tests and reports)."""
    return [(rank, e) for rank, events in sorted(trace.items()) for e in events if isinstance(e, Post)]


def planned_trace(lowered: dict[int, list], place, *, lone_ops_on_pairs: bool = True, group: str = "pp",
                  max_outstanding_sends: int | None = None) -> Trace:
    """What the runtime posts for a lowered order (before any early send), as a trace.

    Each SEND/RECV action is one kernel (an all-send or all-receive batch: a lone op on the
    pair's communicator when ``lone_ops_on_pairs``, torch 2.13+; a batch on the group's
    communicator otherwise, torch 2.11-2.12); a compute action waits for the receives feeding
    it; the step ends waiting for every send. Signatures name the message (stage, kind,
    microbatch), so a receive matched to another message is reported. ``max_outstanding_sends``:
    after posting a send, the rank waits for its oldest sends until at most that many are pending
    (the runtime's cap).
    """
    from .._compat.pipelining import RECV_B, RECV_F, SEND_B, SEND_F
    from .dataflow import peer_stage
    from .lowering import leaf_actions

    def peer_of(action) -> int:
        return place.rank_of(peer_stage(action, place))

    def message(action) -> str:
        stage, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
        if kind == SEND_F:
            return f"activation {stage}->{place.next_stage(stage)} mb{mb}"
        if kind == RECV_F:
            return f"activation {place.prev_stage(stage)}->{stage} mb{mb}"
        if kind == SEND_B:
            return f"gradient {stage}->{place.prev_stage(stage)} mb{mb}"
        return f"gradient {place.next_stage(stage)}->{stage} mb{mb}"

    trace: Trace = {}
    for rank, actions in lowered.items():
        events: list[Event] = []
        recv_work: dict[tuple, int] = {}
        sends: list[int] = []
        for action in actions:
            kind = action.computation_type
            if kind in (SEND_F, SEND_B, RECV_F, RECV_B):
                peer = peer_of(action)
                op = P2P(SEND if kind in (SEND_F, SEND_B) else RECV, peer, message(action))
                comm = pair_comm(group, rank, peer) if lone_ops_on_pairs else group_comm(group)
                work = len(events)
                events.append(Post(work, comm, (op,), str(action)))
                if op.kind == SEND:
                    sends.append(work)
                    while max_outstanding_sends is not None and len(sends) > max_outstanding_sends:
                        events.append(Wait(sends.pop(0)))
                else:
                    consumer = "F" if kind == RECV_F else "B"
                    recv_work[(action.stage_index, consumer, action.microbatch_index)] = work
                continue
            for leaf in leaf_actions(action):
                wanted = "F" if leaf.computation_type.name == "FORWARD" else "B"
                work = recv_work.pop((leaf.stage_index, wanted, leaf.microbatch_index), None)
                if work is not None and leaf.computation_type.name != "BACKWARD_WEIGHT":
                    events.append(Wait(work))
        events.extend(Wait(w) for w in sends)
        trace[rank] = events
    return trace
