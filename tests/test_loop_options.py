"""What ``train``'s tensor-parallel and pipelined loops hand their Python entries from the command line's
options: the layouts inside the replicas (``--ep``, ``--shard-group``) reach ``tiertrain.tensor_parallel`` and
``tiertrain.pipeline``. Each entry is stood in for (it would need ranks): the loop's call is what is checked."""

from types import SimpleNamespace

import pytest
import torch

from tiertrain.train.config import make_config


class _Called(Exception):
    """The stand-in entry was called: its keywords, and nothing run."""


def _stand_in(*args, **kwargs):
    raise _Called(kwargs)


@pytest.mark.parametrize("loop, entry, layout", [
    ("tiertrain.train.tensor_loop.TensorTrainer", "tiertrain.api.tensor_parallel.tensor_parallel", {"tp": 2}),
    ("tiertrain.train.pipeline_loop.PipelineTrainer", "tiertrain.api.pipeline.pipeline", {"pp": 2}),
])
@pytest.mark.parametrize("given, passed", [({"ep": 2}, {"ep": 2, "shard_group": None}),
                                           ({"shard_group": 2}, {"ep": None, "shard_group": 2}),
                                           ({}, {"ep": None, "shard_group": None})])
def test_the_loops_hand_the_layouts_inside_the_replicas_to_their_entries(monkeypatch, loop, entry, layout, given,
                                                                         passed):
    import importlib

    module, _, name = loop.rpartition(".")
    trainer_type = getattr(importlib.import_module(module), name)
    where, _, fn = entry.rpartition(".")
    monkeypatch.setattr(importlib.import_module(where), fn, _stand_in)
    trainer = object.__new__(trainer_type)  # its fields as _setup_tiered reads them: no ranks, no run directory
    trainer.cfg = make_config({}, {"model": "tiny", "plan": "stream", **layout, **given})
    trainer.model = torch.nn.Linear(2, 2)
    trainer.opt = torch.optim.AdamW(trainer.model.parameters())
    trainer.budgets = SimpleNamespace(budgets=None)
    trainer.precision = SimpleNamespace(name="fp32")
    with pytest.raises(_Called) as called:
        trainer._setup_tiered()
    kwargs = called.value.args[0]
    assert {k: kwargs.get(k) for k in passed} == passed, kwargs


@pytest.mark.parametrize("ep", [1, 2])
def test_train_pp_plan_auto_plans_the_stages_with_the_experts_each_rank_holds(ep):
    """``train --pp --ep --plan auto`` plans the stages before torchrun starts with ``tiertrain plan``'s flags:
    with expert parallel, ``--ep`` among them (each rank holds 1/ep of a stage's experts)."""
    from tiertrain.cli.stage_plan import _plan_args
    from tiertrain.memory import Budgets

    cfg = make_config({}, {"model": "tiny-moe", "plan": "auto", "pp": 2, "ep": ep})
    args = _plan_args(cfg, 4, Budgets(64 << 20, 64 << 20))
    assert (args[args.index("--ep") + 1] == "2") if ep > 1 else "--ep" not in args, args
