"""The ``tiertrain train`` loop and what only it needs: the run's typed config, metrics and the
CPU and disk watches, the objective, the LR schedule, graceful stop and the run directory. It drives
a tiered model through the public API (``tiertrain.api``) exactly as a user's own loop would."""
