"""Automatic planning: ``plan="auto"`` profiles the model (through ``tiertrain.measure``) and asks the
planner for the best plan (``auto_plan``), or takes the run's own first step as the profile
(``first_step``); ``largest_model`` answers ``tiertrain plan --max-model``."""
