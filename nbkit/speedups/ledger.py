"""The contract every nbkit speedup follows, and the one ledger through which it changes anything.

A speedup is an object the trainer owns. ``attach(target)`` installs it on one model (stages "model" and "train")
or one trainer (stage "trainer": its step's loss, clip or FLOPs count) and returns whether it is active (``False``:
the plain path is kept and the reason was said once, by name). ``detach()`` leaves the target (a trainer's model
too), its modules and every module-level function exactly as found, and is safe to call twice or without an attach.

What a speedup may touch is written here once: every change to an object it does not own goes through its
``PatchLedger`` (an attribute set, a hook added, a setting switched), and ``detach`` undoes the ledger in reverse
order. The one global act is registering a function with transformers under the name ``"nbkit"``: the experts'
(``ExpertsInterface``) outside the ledger, idempotent, changing nothing that exists; the attention's
(``AttentionInterface``), over the attached ``PackedAttention``'s runs, through its ledger, so that ``detach`` puts
back what the registry held before.
``tests/test_speedup_contract.py`` holds every speedup in ``nbkit.speedups.SPEEDUPS`` to this.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, runtime_checkable

logger = logging.getLogger("nbkit")

_MISSING = object()


@runtime_checkable
class Speedup(Protocol):
    name: str

    def attach(self, target: Any) -> bool:
        """Install on ``target`` (a model, or a trainer for stage "trainer"); return whether it is active (False:
        plain path kept, reason already logged)."""

    def detach(self) -> None:
        """Undo ``attach``; safe to call twice or without a prior attach."""


class PatchLedger:
    """Reversible record of the changes one speedup made, undone last-in first-out by ``undo()``.

    ``set(obj, name, value)`` works on instances, classes and modules alike: an attribute the object held in its own
    ``__dict__`` is put back, one it only inherited (a class's ``forward`` seen from an instance) is deleted again,
    so the object ends exactly as it was. ``undo`` leaves a value alone when something else replaced ours meanwhile
    (it is not ours to remove) and says so once.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, recorded."""
        own = vars(obj) if hasattr(obj, "__dict__") else {}
        previous = own.get(name, _MISSING)

        def restore() -> None:
            if getattr(obj, name, _MISSING) is not value:
                logger.warning("nbkit %s: %s.%s was replaced by someone else; left as it is", self.owner,
                               type(obj).__name__, name)
                return
            if previous is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)

        setattr(obj, name, value)
        self._undo.append((f"set {type(obj).__name__}.{name}", restore))

    def hook(self, handle: Any) -> Any:
        """Keep a ``RemovableHandle`` (forward hooks, pre-hooks, tensor hooks) to remove on undo."""
        self._undo.append(("hook", handle.remove))
        return handle

    def call(self, what: str, undo: Callable[[], None]) -> None:
        """A change made through an object's own API (e.g. ``set_attn_implementation``), with its undo."""
        self._undo.append((what, undo))

    def entries(self) -> list[str]:
        """What is recorded, oldest first (for messages and tests)."""
        return [what for what, _ in self._undo]

    def undo(self) -> None:
        while self._undo:
            _, restore = self._undo.pop()
            restore()
