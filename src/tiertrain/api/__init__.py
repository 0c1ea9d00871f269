"""The public entry: ``tiertrain.setup`` tiers a model in place and returns it with a real
``torch.optim.Optimizer`` (``TieredOptimizer``); ``TieredModule`` is what the model becomes, and the
clip redirect makes ``torch.nn.utils.clip_grad_norm_`` see the gradients tiertrain keeps. Budgets a
user does not give are taken from the machine (``machine_budgets``)."""
