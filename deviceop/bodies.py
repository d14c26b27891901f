"""What the body of a loop or a branch may not do (``BodyGuard``), checked as it runs,
eagerly as captured, and the ops built before a body or branch function was called
that it may not hold.  The guard rides on the ExecutionContext (``ctx.guard``) of the
body or branch: kernel launches, copies, nested loops and ``then`` callbacks ask it."""
from __future__ import annotations

from .errors import GraphSafetyError, LaunchError, OwnershipError
from .execution import _SharedCore, walk


class BodyGuard:
    """What the body of a loop (or a branch) may not do, checked as it runs, eagerly as
    captured: hold an op that is not graph-safe (the body is one conditional graph node)
    or one built before its function was called that it may not hold (``check_built_before``),
    or write a buffer a loop borrows read-only: its index and count (the loop sets the
    index at each iteration, and a body that wrote either would run another number of
    iterations eagerly than captured).  Nested loops and branches chain theirs to the
    enclosing one's (``outer``).  Ops a ``then`` returns in the body are checked by ``check_op``,
    and each write as it happens by ``check`` (kernel launches, copies, nested loops)."""

    __slots__ = ("label", "entries", "mark", "mark_label", "branch_mark", "branch_label")

    def __init__(self, label: str, borrowed=(), outer: "BodyGuard | None" = None):
        self.label = label
        # births_mark() when the innermost loop's body function was last called (graph/loops.py sets
        # it) and that loop's label; in a branch, when the branch function was called (graph/branches.py):
        # the ops built before them that a ``then`` in the body or branch may not return either
        self.mark, self.mark_label = (outer.mark, outer.mark_label) if outer is not None else (None, None)
        self.branch_mark = self.branch_label = None
        mine = tuple((t, label, whose) for t, whose in borrowed if t is not None)
        self.entries = mine + (outer.entries if outer is not None else ())

    def check(self, tensor, what) -> None:
        """Refuse (OwnershipError) a write into ``tensor`` by ``what`` (a string, or a callable making one)."""
        for borrowed, label, whose in self.entries:
            if tensor.overlaps(borrowed):
                what = what if isinstance(what, str) else what()
                raise OwnershipError(
                    f"{label}'s body writes {whose} ({what} writes into it): a loop borrows its count and index "
                    "read-only while it runs (the loop sets the index at each iteration, and a body that wrote "
                    "either would run another number of iterations eagerly than captured). Have the body read "
                    "them, and write into buffers of its own")

    def check_op(self, op, fresh=None, where: str = "run") -> None:
        """Refuse ``op`` in the body before it runs: an op built before the body or branch
        function was called that it may not hold (LaunchError, ``check_built_before``), an op
        in its tree that is not graph-safe (GraphSafetyError), or a write its ops know of into
        what a loop borrows (``writes()``: kernel launches, copies, loops).  ``fresh``: as for
        ``unsafe_for_graphs``."""
        self.check_built_before(op)
        bad = op.unsafe_for_graphs(fresh)
        if bad is not None:
            reason = bad.unsafe_reason
            if reason.startswith("it allocates"):
                reason = "it allocates; allocate before the loop and pass the buffers in"
            raise GraphSafetyError(f"the body of {self.label} contains {bad.describe()}, which a loop body or branch "
                                   f"cannot hold (it is {where} as one conditional graph node, so it may only launch "
                                   f"kernels and copy): {reason}")
        if not self.entries:
            return
        for o in walk(op):
            writes = getattr(o, "writes", None)
            if writes is not None:
                for t in writes():
                    self.check(t, o.describe)


    def check_built_before(self, op) -> None:
        """Refuse in ``op`` (what a ``then`` returned in the body or branch) the ops built before
        the body or branch function was called that the function itself could not return."""
        if self.mark is not None:
            refuse_prebuilt(op, self.mark, self.mark_label)
        if self.branch_mark is not None:
            refuse_shared_made_before(op, self.branch_mark, self.branch_label)


def _pending_shared(op) -> bool | None:
    """For a shared op: has it not run yet (True) or has it (False, a value)?  None for other ops."""
    core = getattr(op, "core", None)
    return None if type(core) is not _SharedCore else not core.done


def refuse_prebuilt(op, mark: int, label: str) -> None:
    """Refuse a body holding an op built before its function was called (a closure's op,
    or a shared op's source; a shared op that has run is a value, welcome): captured, that op
    would run at every iteration, but eagerly an op runs once, so the modes would part."""
    for o in walk(op):  # (a shared op comes before its source: its error names the fix that fits it)
        if _pending_shared(o) and o.core.op._born < mark:
            raise LaunchError(f"the body of {label} holds {o.describe()}, which has not run and was built "
                              "before the body function was called: captured it would run at every iteration, "
                              "eagerly once. Run it before the loop (e.g. shared.clone().sync_on(stream)): a shared "
                              "op that has run is a value the body may hold; or build it in the body function")
        if o._born < mark and _pending_shared(o) is not False:  # a done one is a value
            raise LaunchError(f"the body of {label} holds {o.describe()}, built before the body function was "
                              "called: an op runs once, and the body runs at every iteration, so the function "
                              "must build its ops each time it is called (e.g. lambda i: kernel(...), not "
                              "lambda i: op_built_earlier)")


def refuse_shared_made_before(op, mark: int, what: str) -> None:
    """Refuse a branch holding a shared op made before its function was called and not run
    yet: captured, it would run only at the replays that take this branch, while its other
    clones (after the branch, in another branch) take its result as computed; eagerly they
    compute it whenever the branch is not taken, so the two modes would part."""
    for o in walk(op):
        if _pending_shared(o) and o.core.born < mark:
            raise LaunchError(f"{what} holds {o.describe()}, a shared op made before the branch function was called "
                              "and not run yet: captured, it would run only at the replays that take this branch, "
                              "while its clones elsewhere take its result as computed. Run it before the branch (its "
                              "clones are then values), or build the op inside the branch function")
