"""A data-parallel run's optimizer: torch's one-dict state_dict is refused where states are sharded
(no rank holds them whole) and names tiertrain's per-rank checkpoints; replicated states give it."""

from dp_harness import run_ranks


def _state_dict_outcome(rank: int, shard: bool) -> str:
    import tiertrain
    from dp_harness import _fresh
    from tiertrain.api.tiered_optimizer import ShardedStates
    from tiertrain.memory import Budgets
    from tiertrain.plan import builtin_plan, data_parallel

    model, opt = _fresh()
    plan = data_parallel(builtin_plan("resident", 4), 2, shard=shard)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=plan, page_size=64 << 10)
    try:
        try:
            state = topt.state_dict()
        except ShardedStates as exc:
            return str(exc)
        return f"{len(state['state'])} states"
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def _sharded(rank: int) -> str:
    return _state_dict_outcome(rank, True)


def _replicated(rank: int) -> str:
    return _state_dict_outcome(rank, False)


def test_a_sharded_runs_optimizer_state_dict_is_refused_naming_the_checkpoints(tmp_path):
    got = run_ranks(2, tmp_path, [("sharded", _sharded), ("replicated", _replicated)])
    for rank in (0, 1):
        assert "holds a shard of the optimizer states" in got[("sharded", rank)]
        assert "save_checkpoint on every rank" in got[("sharded", rank)]
        assert got[("replicated", rank)].endswith(" states")
