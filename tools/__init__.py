"""What rlpipe does around runs, never inside a training step, above core and plugins.

- `report`: a run's plots and summary (``rlpipe report``); `compare`: runs overlaid;
- `doctor`: the health rules replayed over a run directory (``rlpipe doctor``, the report's
  "health" section);
- `export`: a checkpoint's policy as a ``from_pretrained`` folder (``rlpipe export``);
- `explain`: the config reference (``rlpipe config --explain/--defaults``, docs/config.md);
- `train_rm`: the Bradley–Terry reward-model trainer (``rlpipe train-rm``).

Core and plugins never import this package (pyproject ``[tool.importlinter]``).
"""
