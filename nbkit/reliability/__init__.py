"""What happens when something goes wrong: input checks before training, out-of-memory and non-finite-loss
handling at the step, atomic checkpoints and resume. None of it changes the numbers of a run that goes right."""
