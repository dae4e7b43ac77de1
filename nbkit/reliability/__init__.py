"""What happens when something goes wrong. None of it changes the numbers of a run that goes right.

- ``guards``: checks of datasets and settings before training (``InputError`` naming the row or the setting);
  ``sharegpt``: ``from_sharegpt``, which turns ShareGPT chats into TRL's messages form (re-exported here).
- ``jsonl``: ``load_jsonl`` (exported as ``nbkit.load_jsonl``), a JSON Lines file checked line by line before
  ``datasets`` reads it.
- ``oom``: out-of-memory errors that name the step, the memory and what to change.
- ``nonfinite``: non-finite losses and batches with nothing to train on, named by their dataset rows;
  ``deferred_check``: their flags kept on the device and read after the optimizer step (no host read in the step).
- ``checkpoints``: atomic saves, recovery after a kill, the newest complete checkpoint.
- ``trainer_mixin``: ``ReliableTraining``, which wires all of it into ``FastSFT``.
"""

from .sharegpt import from_sharegpt

__all__ = ["from_sharegpt"]
