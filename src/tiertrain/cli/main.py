"""The ``tiertrain`` command. User errors print one line and exit 2; bugs keep their traceback."""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable

import click
from rich.console import Console

from tiertrain.errors import ConfigError, UserError
from tiertrain.plan import BUILTIN_PLANS, DEFAULT_MAX_STALENESS
from tiertrain.precisions import PRECISIONS

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class AtLeast(click.ParamType):
    """A whole-number flag with a lower bound, refused as "--x must be at least N"."""

    name = "integer"

    def __init__(self, low: int) -> None:
        self.low = low

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            self.fail(f"{value!r} is not a whole number", param, ctx)
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a whole number", param, ctx)
        if number < self.low:
            self.fail(f"must be at least {self.low}, got {number}", param, ctx)
        return number


POSITIVE = AtLeast(1)
BENCH_PRECISIONS = PRECISIONS[:2]  # the benches compare fp32 and bf16 (fp16 needs loss scaling)


class Finite(click.FloatRange):
    """A float flag that refuses NaN and infinities (``click.FloatRange`` lets NaN through: every
    comparison with it is false)."""

    name = "finite float"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def _console() -> Console:
    """Lines are never broken at the console's width: in a log (not a terminal, where rich takes 80
    columns) a broken checkpoint path or resume command could not be copied back."""
    return Console(soft_wrap=True)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="tiertrain")
def cli() -> None:
    """Train Transformer models whose training state does not fit in accelerator memory.

    Start with `tiertrain train` (no arguments: a small GPT on a built-in corpus) and
    `tiertrain info --model gpt3-13b` (what a model needs, before you build it).
    """


@cli.command(context_settings=CONTEXT)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML or JSON file of options; flags override it.")
@click.option("--model", help="Model name (see `tiertrain info --list`), or a config JSON (ours or a transformers config.json).")
@click.option("--data", help='"builtin" (default), a token file (.bin uint16, .u32.bin, .npy), a text file or a directory of text.')
@click.option("--tokenizer", help="Local transformers tokenizer directory for text data (default: bytes).")
@click.option("--steps", type=int, help="Optimizer steps to train to (default 200).")
@click.option("--batch-size", type=int, help="Sequences per micro-batch (default 16).")
@click.option("--seq-len", type=int, help="Tokens per sequence (default 128, or the model's maximum where shorter).")
@click.option("--grad-accum", type=int, help="Micro-batches per optimizer step (default 1).")
@click.option("--lr", type=float, help="Peak learning rate, after warm-up (default 2e-3).")
@click.option("--min-lr", type=float, help="The cosine schedule's floor, reached at --steps (default lr / 10).")
@click.option("--warmup-steps", type=int, help="Linear warm-up steps (default 10% of --steps, at most 100).")
@click.option("--precision", type=click.Choice(PRECISIONS), help="Compute precision (default: bf16 on GPU, fp32 on CPU).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Where to compute (default auto).")
@click.option("--seed", type=int, help="Seed for weights, data order and masking (default 0).")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory: metrics.jsonl and checkpoints/ (default runs/tiertrain).")
@click.option("--resume", type=click.Path(), help="Continue from a run directory or a checkpoint directory.")
@click.option("--overwrite", is_flag=True, default=None,
              help="Start a new run in an --out that holds another run's checkpoints and metrics, removing them.")
@click.option("--save-every", type=int, help="Save a checkpoint every N steps (default: only at the end).")
@click.option("--no-save", "save", flag_value=False, default=None,
              help="Write no checkpoint, not even at the end (trials, benchmarks): a stopped run is lost.")
@click.option("--log-every", type=int, help="Print a line every N steps when not on a terminal (default 10).")
@click.option("--plan", help="Put training state in tiers: resident, stream, max-offload, auto (profile and solve for the budgets), or a plan JSON file (default: plain PyTorch).")
@click.option("--update", type=click.Choice(["sync", "overlap", "lockfree"]),
              help="With --plan: update after backward (sync), during it (overlap), or never waiting for it (lockfree); "
                   "default: a plan file's, else sync.")
@click.option("--max-staleness", type=int,
              help="With --update lockfree: steps a block's params may lag (default: a plan file's, else 1).")
@click.option("--grad-clip", type=float, help="Clip gradients to this global norm (default 1.0; 0 turns it off).")
@click.option("--device-memory", help='With --plan: device budget, e.g. "2GiB" (default 90% of the GPU; 4GiB on CPU).')
@click.option("--host-memory", help='With --plan: host budget, e.g. "16GiB" (default half the RAM).')
@click.option("--disk", help='With --plan: disk tier "DIR:SIZE", e.g. /nvme/tt:200GiB.')
@click.option("--page-size", help='With --plan: memory page size, e.g. "4MiB" (default: measured and cached per machine).')
@click.option("--reduce-dtype", type=click.Choice(["fp32", "bf16"]),
              help="With --plan under --nproc N: the dtype gradients are summed over the ranks in (default fp32; bf16 "
                   "halves the bytes each rank sends, at bf16's rounding of the sum).")
@click.option("--ep", type=int, help="With --plan under --nproc N: divide each mixture-of-experts layer's experts "
                                    "over groups of this many ranks (expert parallel; default 1).")
@click.option("--shard-group", type=int, help="With --plan under --nproc N: hybrid sharding: split each block over "
                                             "groups of this many consecutive ranks (one node's GPUs) and replicate it "
                                             "across the groups, so only gradient all-reduces cross between nodes "
                                             "(default: every block sharded over all N ranks).")
@click.option("--pp", type=int, help="With --plan under --nproc N: pipeline parallel: cut the model into stages over "
                                    "runs of this many ranks, N / pp replicas of the pipeline (default 1).")
@click.option("--schedule", type=click.Choice(["aiao", "1f1b", "interleaved", "gpipe"]),
              help="With --pp: the pipeline schedule (default aiao, FOLD3D's).")
@click.option("--micro-batches", type=int, help="With --pp: micro-batches per step through the pipeline (the same "
                                               "as --grad-accum; default 1).")
@click.option("--segments", type=int, help="With --pp and aiao or interleaved: virtual stages per rank (default 1).")
@click.option("--tp", type=int, help="With --plan under --nproc N: tensor parallel: cut every block (attention "
                                    "heads, MLP features) over groups of this many consecutive ranks, N / tp replicas "
                                    "of the group; with --pp, each stage's blocks (N / (pp x tp) replicas). Default 1; "
                                    "tiertrain's GPT and transformers GPT-2, GPT-NeoX, Llama, Qwen2, Mistral.")
@click.option("--sequence-parallel/--no-sequence-parallel", default=None,
              help="With --tp: each rank holds its slice of the sequence between the cut regions (Megatron's "
                   "sequence parallel: norms and residuals 1/tp each; not with experts). A resume keeps the "
                   "checkpoint's unless told.")
@click.option("--quiet", is_flag=True, help="Print only the summary.")
@click.option("--nproc", type=POSITIVE, default=None,
              help="Data-parallel processes on this machine (runs torchrun --nproc-per-node N for you; several "
                   "machines: launch torchrun yourself, see docs/distributed.md). Default 1; a resume keeps the "
                   "checkpoint's.")
def train(config_file: str | None, quiet: bool, nproc: int | None, **flags: Any) -> None:
    """Train a model. With no arguments: a small GPT on the built-in corpus, about a minute on CPU.

    Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint and stops;
    `--resume OUT` continues exactly where it stopped.
    """
    from pathlib import Path

    from tiertrain.cli.summary import print_summary
    from tiertrain.checkpoint.run import saved_run_options, saved_world
    from tiertrain.train.config import make_config, read_config_file
    from tiertrain.train.metrics import Reporter
    from tiertrain.train.pipeline_loop import trainer_for
    from tiertrain.train.run_dir import RunDir
    from tiertrain.parallel.group import end_process_group

    file_values = read_config_file(config_file) if config_file else {}
    _micro_batches_as_accum(file_values, "micro_batches")  # the user's file, before a checkpoint's options join it
    sliced = flags.get("sequence_parallel") or file_values.get("sequence_parallel")  # asked now, not saved before
    no_save = flags.get("save") is False or file_values.get("save") is False
    if no_save and flags.get("save_every") is None and "save_every" not in file_values:
        flags["save_every"] = 0  # no checkpoints over a resumed run's --save-every: the user's word wins
    if flags.get("resume"):
        if not flags.get("out") and "out" not in file_values:
            flags["out"] = _run_dir_of(flags["resume"])
        if os.environ.get("RANK", "0") == "0":  # rank 0 tests before it locks; another would find rank 0's lock
            RunDir(Path(_run_dir_of(flags["resume"]))).refuse_if_busy()
        saved = saved_run_options(Path(flags["resume"]))
        if saved.get("plan") and not (flags.get("disk") or file_values.get("disk")):
            _refuse_resume_without_disk(Path(flags["resume"]))
        file_values = {**saved, **file_values}
        if nproc is None and "LOCAL_RANK" not in os.environ:
            nproc = _resumed_world(saved_world(Path(flags["resume"])))
    nproc = nproc or 1
    piped = [f for f in ("schedule", "segments", "micro_batches") if flags.get(f) is not None]
    if piped and not (flags.get("pp") or file_values.get("pp") or 1) > 1:
        raise ConfigError("--schedule, --segments and --micro-batches apply to a pipelined run; add --pp P (and "
                          "--nproc N)")
    _micro_batches_as_accum(flags, "--micro-batches")
    cfg = make_config(file_values, flags)  # checked here first: a bad value is one message, not one per rank
    if sliced and cfg.tp == 1:
        raise ConfigError("--sequence-parallel slices the sequence over a tensor-parallel group: give --tp T (above "
                          "1) with it")
    if cfg.plan and cfg.plan not in (*BUILTIN_PLANS, "auto") and os.path.isfile(cfg.plan):  # on every rank too
        from tiertrain.plan.plan import plan_file

        plan_file(cfg.plan).parallel.check_run(cfg.tp, cfg.sequence_parallel, f"the plan {cfg.plan}")
    if cfg.pp > 1 and nproc == 1 and "LOCAL_RANK" not in os.environ:
        raise ConfigError(f"--pp {cfg.pp} cuts the model over ranks: add --nproc {cfg.pp} (or a multiple of it)"
                          + ("; or resume in one process with --pp 1" if flags.get("resume") else ""))
    if cfg.tp > 1 and nproc == 1 and "LOCAL_RANK" not in os.environ:
        raise ConfigError(f"--tp {cfg.tp} cuts the model over ranks: add --nproc {cfg.tp} (or a multiple of it)"
                          + ("; or resume in one process with --tp 1" if flags.get("resume") else ""))
    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        _check_layout(cfg, nproc)
        staged = None
        if cfg.pp > 1 and cfg.plan == "auto":
            from tiertrain.cli.stage_plan import plan_stages

            staged = plan_stages(cfg, nproc)
        raise SystemExit(_torchrun(nproc, staged))
    console = _console()
    reporter = Reporter(cfg.steps, cfg.log_every, quiet=quiet)
    trainer = trainer_for(cfg, reporter)
    if trainer.rank == 0:  # one header for the run, not one per rank
        reporter.message(trainer.describe())
    summary = trainer.run()
    if trainer.rank == 0:
        print_summary(summary, console)
    end_process_group()  # only after a run that ended well: after a lost rank a group's teardown may hang


def _resumed_world(world: int) -> int:
    """A resume without --nproc trains on as many ranks as its checkpoint's run did (one process would
    halve the global batch, and the losses would part from the uninterrupted run's without a word)."""
    if world > 1:
        click.echo(f"tiertrain: resuming on the checkpoint's {world} ranks (--nproc {world}); give --nproc to "
                   "train on another number (the tokens a step takes change with it)", err=True)
    return world


def _micro_batches_as_accum(values: dict[str, Any], name: str) -> None:
    """``--micro-batches M`` (``micro_batches`` in a config file) is the pipeline's name for ``--grad-accum M``:
    one value, however it is given."""
    micro = values.pop("micro_batches", None)
    if micro is None:
        return
    if values.get("grad_accum") not in (None, micro):
        raise ConfigError(f"{name} {micro} and grad_accum {values['grad_accum']} name the same count; give one "
                          "of them")
    values["grad_accum"] = micro


def _check_layout(cfg: Any, nproc: int) -> None:
    """What the ranks would each refuse, said once before torchrun starts them: an ``--ep`` or
    ``--shard-group`` that does not divide the data-parallel ranks (a tensor-parallel group's or a
    pipeline's replicas), an update mode the loop's clipping or accumulation contradicts, a plan file laid
    out for another number of ranks."""
    from pathlib import Path

    from tiertrain.plan import ParallelLayout, Plan, check_update_mode

    if cfg.tp > 1:
        _check_tensor_layout(cfg, nproc)
    if cfg.pp > 1:
        _check_pipeline_layout(cfg, nproc)
    if cfg.ep > 1 or cfg.shard_group:  # one message where they do not divide the replicas
        ParallelLayout(dp=nproc // (cfg.tp * cfg.pp), ep=cfg.ep, shard_group=cfg.shard_group)
    planned = None
    if cfg.plan and cfg.plan.endswith(".json") and os.path.isfile(cfg.plan):
        planned = Plan.from_json(Path(cfg.plan).read_text(), f"plan {cfg.plan}")
    # a pipeline's stages update as --update says (sync by default), the others as the plan file does
    update = cfg.update or (planned.update if planned is not None and cfg.pp == 1 else None)
    if update is not None:  # the loop's clipping and accumulation against it (fp16 is the one dtype refused)
        check_update_mode(update, cfg.precision or "fp32", cfg.grad_accum, cfg.grad_clip > 0)
    if planned is not None:
        dp = planned.parallel.dp
        per = cfg.tp * cfg.pp  # a replica's ranks (a group, a pipeline of them): the plan's dp counts replicas
        ranks = nproc // per
        if dp not in (1, ranks):
            if per == 1:
                raise ConfigError(f"the plan {cfg.plan} is laid out for {dp} ranks but --nproc is {nproc}: use "
                                  f"--nproc {dp}, or make the plan for {nproc} (tiertrain plan --nproc {nproc} ...)")
            layout = (f" --pp {cfg.pp}" if cfg.pp > 1 else "") + (f" --tp {cfg.tp}" if cfg.tp > 1 else "")
            raise ConfigError(f"the plan {cfg.plan} is laid out for {dp} ranks but --nproc {nproc}{layout} makes "
                              f"{ranks}: use --nproc {dp * per}, or make the plan for them (tiertrain plan "
                              f"--nproc {nproc}{layout} ...)")


def _check_pipeline_layout(cfg: Any, nproc: int) -> None:
    """--pp's layout, and a tied head with updates during backward (each rank would refuse it), before
    torchrun starts."""
    from tiertrain.models import build, config_blocks, resolve_config
    from tiertrain.models.stages import tied_head
    from tiertrain.plan.pipeline import PipelineLayout
    from tiertrain.plan.update_modes import rules

    model_cfg = resolve_config(cfg.model)
    PipelineLayout(cfg.pp, cfg.schedule, cfg.grad_accum, cfg.segments).check(
        nproc // cfg.tp, config_blocks(model_cfg) or cfg.pp * cfg.segments, cfg.grad_accum)
    if cfg.update and rules(cfg.update).updates_as_final and tied_head(build(model_cfg, device="meta")):
        raise ConfigError(f"--update {cfg.update} updates each block during backward, and a head tied to the "
                          "embedding sums its two stages' gradients first: use --update sync, or untie the head "
                          "(tie_embeddings: false)")


def _check_tensor_layout(cfg: Any, nproc: int) -> None:
    """--tp's layout and the model's cut, refused before torchrun starts (the model built on the meta device)."""
    from tiertrain.models import build, config_vocab_and_len, resolve_config
    from tiertrain.parallel.tensor_plans import check_pipeline_tensor, check_sequence_parallel
    from tiertrain.train.config import SEQ_LEN

    if nproc % (cfg.tp * cfg.pp):
        both = f"--pp {cfg.pp} x --tp {cfg.tp}" if cfg.pp > 1 else f"--tp {cfg.tp}"
        raise ConfigError(f"{both} must divide --nproc {nproc}: give --nproc a multiple of {cfg.tp * cfg.pp}")
    model = build(resolve_config(cfg.model), device="meta")
    cut = check_pipeline_tensor(model, cfg.tp, cfg.pp)
    if cfg.sequence_parallel:
        check_sequence_parallel(model, cut)
        seq = cfg.seq_len or min(SEQ_LEN, config_vocab_and_len(resolve_config(cfg.model))[1] or SEQ_LEN)
        if seq % cfg.tp:
            raise ConfigError(f"--sequence-parallel slices each sequence over the {cfg.tp} ranks of a group: give a "
                              f"--seq-len that {cfg.tp} divides (not {seq})")
    if cfg.plan.endswith(".json") and os.path.isfile(cfg.plan):  # a plan file's update mode and dtype too
        from tiertrain.api.tensor_parallel import check_tensor_plan
        from tiertrain.plan import RunOptions
        from tiertrain.plan.plan import plan_file

        # the run computes in --precision's dtype (fp16 refused with it), not the file's: its update mode is checked
        check_tensor_plan(plan_file(cfg.plan), RunOptions(update=cfg.update, max_staleness=cfg.max_staleness,
                                                           compute_dtype="fp32"))


def _torchrun(nproc: int, plan: "Path | None" = None) -> int:
    """``tiertrain train ... --nproc N``: the same command under torchrun, N processes on this machine
    (``plan``: the plan file they take in place of ``--plan auto``)."""
    import shutil
    import subprocess
    import tempfile

    args = _without(sys.argv[1:], "--nproc")
    if plan is not None:
        args = [*_without(args, "--plan"), "--plan", str(plan)]
    # torchrun keeps its agent's logs in a temporary directory it never removes (one per launch, left in
    # TMPDIR): given one of ours, it is removed when the ranks are done
    logs = tempfile.mkdtemp(prefix="tiertrain-torchrun-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--log-dir={logs}", "-m", "tiertrain", *args]
    threads = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    try:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": threads, **os.environ})
        return _relay_ranks(proc)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _without(args: list[str], flag: str) -> list[str]:
    """``args`` less ``flag`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(f"{flag}="):
            out.append(a)
    return out


_LAUNCHER = re.compile(r"^[WEI]\d{4} .*torch/distributed/elastic/.*")
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _relay_ranks(proc: "subprocess.Popen[str]") -> int:
    """The ranks' output as they print it; torchrun's own report of a failed rank (its log lines and
    the launcher's traceback) is cut to one line, and only where no rank said what went wrong."""
    said, failed, errors = False, None, set()
    while True:
        try:
            line = proc.stderr.readline() if proc.stderr else ""
        except KeyboardInterrupt:  # the ranks got it too: they save and stop; keep relaying until they have
            continue
        if not line:
            break
        found = _FAILED.search(line)
        if found and failed is None:
            failed = found
        if line in errors:  # every rank refuses the same bad value: one message
            continue
        if line.startswith("error:") or (failed is None and not _LAUNCHER.match(line)):
            if line.startswith("error:"):  # after a failure, only the ranks' own error lines pass
                said = True
                errors.add(line)
            sys.stderr.write(line)
    rc = proc.wait()
    if rc and failed is not None and not said:
        code, rank = int(failed.group(1)), failed.group(2)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        sys.stderr.write(f"error: rank {rank} {how}\n")
    return rc


def _refuse_resume_without_disk(resume: "Path") -> None:
    """A run whose states lived on disk resumes only with --disk given again: a checkpoint never
    chooses where tiertrain writes (or, at the end, deletes)."""
    from tiertrain.checkpoint.run import find_checkpoint, read_trainer

    disk = read_trainer(find_checkpoint(resume)).run_config.get("disk")
    if disk:
        raise ConfigError(f"the run in {resume} kept states on disk (--disk {disk}); give --disk again to resume "
                          "it: paths are never taken from a checkpoint")


def _run_dir_of(resume: str) -> str:
    """Resuming writes on into the run the checkpoint came from."""
    from pathlib import Path

    path = Path(resume)
    if (path / "trainer.json").is_file() and path.parent.name == "checkpoints":
        return str(path.parent.parent)
    return str(path)


@cli.command(context_settings=CONTEXT)
@click.option("--model", default=None, help="Model name or config file.")
@click.option("--batch-size", type=POSITIVE, default=1, show_default=True, help="Sequences per micro-batch (with --pp: a step's, split into its micro-batches).")
@click.option("--seq-len", type=POSITIVE, default=None, help="Tokens per sequence (default: the model's maximum).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="bf16", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--list", "list_models", is_flag=True, help="List the named models.")
def info(model: str | None, batch_size: int, seq_len: int | None, precision: str, as_json: bool, list_models: bool) -> None:
    """Parameters, FLOPs per token, and memory per state kind and per tier (ANGEL-PTM Table 1)."""
    from tiertrain.cli.info import info_json, model_info, print_info
    from tiertrain.models import CONFIGS, param_count
    from tiertrain.units import format_count

    if list_models:
        for name, cfg in CONFIGS.items():
            click.echo(f"{name:12s} {format_count(param_count(cfg)):>8s}  {cfg.n_layer} x {cfg.d_model}")
        return
    if model is None:
        raise click.UsageError("give --model NAME (or --list to see the names)")
    data = model_info(model, batch_size, seq_len, precision)
    if as_json:
        click.echo(info_json(data))
    else:
        print_info(data, _console())


@cli.group(context_settings=CONTEXT)
def bench() -> None:
    """Benchmarks that print each figure next to the limit measured in the same run."""


@bench.command("memory", context_settings=CONTEXT)
@click.option("--disk", "disk_dir", type=click.Path(file_okay=False), help="Directory on the disk to measure (default: a temporary one here).")
@click.option("--size", default="1GiB", show_default=True, help="Bytes moved per direction and repeat.")
@click.option("--page-sizes", default="1MiB,4MiB,16MiB", show_default=True, help="Page sizes to compare; the picked size is added.")
@click.option("--chunk", default="64MiB", show_default=True, help="Chunk size moved through the tier.")
@click.option("--repeats", type=POSITIVE, default=3, show_default=True)
@click.option("--io-workers", type=POSITIVE, default=8, show_default=True, help="Disk requests in flight.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the figures to this JSON file.")
def bench_memory(disk_dir: str | None, size: str, page_sizes: str, chunk: str, repeats: int, io_workers: int,
                 json_out: str | None) -> None:
    """Raw disk (and pinned PCIe) bandwidth next to what the memory tiers achieve moving chunks."""
    import json as _json

    from tiertrain.bench.memory import run_memory_bench
    from tiertrain.units import parse_size

    results = run_memory_bench(disk_dir, parse_size(size), [parse_size(p) for p in page_sizes.split(",")],
                               parse_size(chunk), repeats, io_workers, click.echo)
    if json_out:
        with open(json_out, "w") as f:
            _json.dump(results, f, indent=1)


@bench.command("optimizer", context_settings=CONTEXT)
@click.option("--d-model", type=POSITIVE, default=768, show_default=True)
@click.option("--layers", type=POSITIVE, default=8, show_default=True)
@click.option("--repeats", type=POSITIVE, default=5, show_default=True)
def bench_optimizer_cmd(d_model: int, layers: int, repeats: int) -> None:
    """tiertrain's per-block AdamW against the memory-bandwidth bound and torch's fused AdamW."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.runtime import bench_optimizer

    click.echo(f"machine: {describe()}")
    bench_optimizer(d_model, layers, repeats, click.echo)


def _disk_bound_shape(command: Callable) -> Callable:
    """The model and batch options of the disk-bound benches (offload, convergence)."""
    options = [click.option("--d-model", type=POSITIVE, default=512, show_default=True),
               click.option("--layers", type=POSITIVE, default=8, show_default=True),
               click.option("--batch-size", type=POSITIVE, default=1, show_default=True,
                            help="Sequences per step; the default makes the step disk-bound on a 2-core CPU machine."),
               click.option("--seq-len", type=POSITIVE, default=128, show_default=True)]
    for option in reversed(options):
        command = option(command)
    return command


@bench.command("offload", context_settings=CONTEXT)
@_disk_bound_shape
@click.option("--disk", "disk_dir", type=click.Path(file_okay=False), help="Directory on the disk (default: a temporary one here).")
@click.option("--repeats", type=POSITIVE, default=8, show_default=True,
              help="Timed steps per plan (a multiple of each staleness, so lockfree's passes are all counted).")
@click.option("--page-size", help='Memory page size, e.g. "1MiB" (default: measured, as train uses).')
@click.option("--max-staleness", "stalenesses", default="1,4", show_default=True,
              help="Lockfree runs, one per max staleness (comma-separated); the first is train's default.")
def bench_offload_cmd(d_model: int, layers: int, batch_size: int, seq_len: int, disk_dir: str | None, repeats: int,
                      page_size: str | None, stalenesses: str) -> None:
    """Step time with states on disk against max(compute, disk I/O, optimizer) measured in the same run."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.runtime import bench_offload
    from tiertrain.measure.page_size import page_size_for
    from tiertrain.memory.system import compute_device
    from tiertrain.units import parse_size

    staleness = _stalenesses(stalenesses)
    click.echo(f"machine: {describe(disk_dir)}")
    page = page_size_for(parse_size(page_size) if page_size else None, disk_dir, compute_device())
    bench_offload(d_model, layers, batch_size, seq_len, disk_dir, repeats, click.echo, page, staleness)


@bench.command("convergence", context_settings=CONTEXT)
@_disk_bound_shape
@click.option("--steps", type=POSITIVE, default=200, show_default=True)
@click.option("--lr", type=Finite(min=0, min_open=True), default=2e-3, show_default=True)
@click.option("--disk", "disk_dir", type=click.Path(file_okay=False), help="Directory on the disk (default: a temporary one here).")
@click.option("--max-staleness", "stalenesses", default="1,4", show_default=True,
              help="Lockfree runs, one per max staleness (comma-separated).")
@click.option("--page-size", help='Memory page size, e.g. "1MiB" (default: measured, as train uses).')
def bench_convergence_cmd(d_model: int, layers: int, batch_size: int, seq_len: int, steps: int, lr: float,
                          disk_dir: str | None, stalenesses: str, page_size: str | None) -> None:
    """Loss against wall time, sync and lockfree, with states on disk: what lockfree's faster steps learn."""
    from tiertrain.bench.convergence import bench_convergence
    from tiertrain.bench.machine import describe
    from tiertrain.measure.page_size import page_size_for
    from tiertrain.memory.system import compute_device
    from tiertrain.units import parse_size

    staleness = _stalenesses(stalenesses)
    if seq_len > 256:
        raise ConfigError("--seq-len must be at most 256 (the bench model's maximum)")
    click.echo(f"machine: {describe(disk_dir)}")
    page = page_size_for(parse_size(page_size) if page_size else None, disk_dir, compute_device())
    bench_convergence(d_model, layers, batch_size, seq_len, steps, lr, disk_dir, staleness, click.echo, page)


def _stalenesses(text: str) -> tuple[int, ...]:
    """``--max-staleness 1,4`` as numbers, or one clear error."""
    try:
        staleness = tuple(int(v) for v in text.split(","))
    except ValueError:
        staleness = ()
    if not staleness or min(staleness) < 0:
        raise ConfigError(f"--max-staleness {text!r}: give whole numbers >= 0, comma-separated, e.g. 1,4")
    return staleness


@bench.command("overhead", context_settings=CONTEXT)
@click.option("--model", default=None, help="A named model (tiertrain info); default: a 25M GPT of --d-model, --layers.")
@click.option("--d-model", type=POSITIVE, default=512, show_default=True)
@click.option("--layers", type=POSITIVE, default=8, show_default=True)
@click.option("--batch-size", type=POSITIVE, default=4, show_default=True)
@click.option("--seq-len", type=POSITIVE, default=128, show_default=True)
@click.option("--precision", type=click.Choice(BENCH_PRECISIONS), default="fp32", show_default=True)
@click.option("--update", "updates", default="sync,overlap", show_default=True,
              help="Update modes of the resident plan to compare with plain PyTorch (comma-separated).")
@click.option("--rounds", type=POSITIVE, default=5, show_default=True, help="Interleaved rounds (the median is taken).")
@click.option("--steps", type=POSITIVE, default=4, show_default=True, help="Timed steps per variant per round.")
def bench_overhead_cmd(model: str | None, d_model: int, layers: int, batch_size: int, seq_len: int, precision: str,
                       updates: str, rounds: int, steps: int) -> None:
    """Plain PyTorch against the resident plan on a model that fits: overhead, tokens/s, MFU."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.overhead import bench_overhead
    from tiertrain.bench.runtime import model_cfg
    from tiertrain.models import resolve_config
    from tiertrain.plan.update_modes import UPDATE_MODES, rules

    modes = tuple(u for u in updates.split(",") if u)
    if not modes or any(u not in UPDATE_MODES or rules(u).loops for u in modes):
        raise ConfigError(f"--update {updates!r}: give sync and/or overlap, comma-separated (lockfree changes the "
                          "numerics, so it has no plain peer)")
    cfg = resolve_config(model) if model else model_cfg(d_model, layers)
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's maximum {cfg.max_seq_len}")
    click.echo(f"machine: {describe()}")
    bench_overhead(cfg, batch_size, seq_len, precision, modes, rounds, steps, click.echo)


@bench.command("parallel", context_settings=CONTEXT)
@click.option("--nproc", type=click.IntRange(2), default=2, show_default=True, help="Ranks of the data-parallel runs.")
@click.option("--layouts", default="ddp,zero2,zero3", show_default=True,
              help="Comma-separated: ddp (resident, replicated), zero2 (resident, sharded), zero3 (stream, sharded).")
@click.option("--d-model", type=POSITIVE, default=512, show_default=True)
@click.option("--layers", type=POSITIVE, default=6, show_default=True)
@click.option("--batch-size", type=POSITIVE, default=4, show_default=True, help="Per rank.")
@click.option("--seq-len", type=click.IntRange(1, 256), default=128, show_default=True)
@click.option("--steps", type=POSITIVE, default=5, show_default=True, help="Timed steps per run, after 2 warm-up.")
@click.option("--rounds", type=POSITIVE, default=3, show_default=True, help="dp=1 and dp=N alternated, per layout.")
def bench_parallel_cmd(nproc: int, layouts: str, d_model: int, layers: int, batch_size: int, seq_len: int,
                       steps: int, rounds: int) -> None:
    """dp=N against dp=1 with the same per-rank batch: step time, exposed communication, bytes sent."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.parallel import LAYOUTS, ParallelBench, bench_parallel

    chosen = tuple(x for x in layouts.split(",") if x)
    if not chosen or any(x not in LAYOUTS for x in chosen):
        raise ConfigError(f"--layouts {layouts!r}: give some of {', '.join(LAYOUTS)}, comma-separated")
    threads = max(1, len(os.sched_getaffinity(0)) // nproc)
    click.echo(f"machine: {describe()}")
    bench_parallel(ParallelBench(d_model, layers, batch_size, seq_len, steps, threads), nproc, chosen, rounds,
                   click.echo)


@bench.command("pipeline", context_settings=CONTEXT)
@click.option("--rate", default=None, help="Rate-limit the link between the two emulated hosts (root, iproute2: two "
              "network namespaces and a veth pair with tc tbf), e.g. 1gbit; left out: the loopback.")
@click.option("--schedules", default="1f1b,interleaved,aiao", show_default=True, help="Comma-separated.")
@click.option("--plan", "plan_name", type=click.Choice(["resident", "stream", "max-offload"]), default="resident",
              show_default=True, help="Where each stage's states live (max-offload: on disk).")
@click.option("--d-model", type=POSITIVE, default=512, show_default=True)
@click.option("--layers", type=POSITIVE, default=8, show_default=True)
@click.option("--rows", type=POSITIVE, default=8, show_default=True, help="Sequences per replica and step.")
@click.option("--seq-len", type=click.IntRange(1, 256), default=32, show_default=True)
@click.option("--micro-batches", type=POSITIVE, default=4, show_default=True)
@click.option("--segments", type=POSITIVE, default=2, show_default=True, help="AIAO's segments, interleaved's "
              "virtual stages per rank.")
@click.option("--steps", type=POSITIVE, default=4, show_default=True, help="Timed steps, after one warm-up.")
def bench_pipeline_cmd(rate: str | None, schedules: str, plan_name: str, d_model: int, layers: int, rows: int,
                       seq_len: int, micro_batches: int, segments: int, steps: int) -> None:
    """pp=2 x dp=2 (four ranks on two emulated hosts): 1F1B, interleaved and AIAO side by side, step time and
    exposed DP.sync."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.pipeline import SCHEDULES, PipelineBench, bench_pipeline, link_bytes_per_s
    from tiertrain.plan.pipeline import PipelineLayout

    chosen = tuple(x for x in schedules.split(",") if x)
    if not chosen or any(x not in SCHEDULES for x in chosen):
        raise ConfigError(f"--schedules {schedules!r}: give some of {', '.join(SCHEDULES)}, comma-separated")
    if rate is not None:
        try:
            link_bytes_per_s(rate)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if rate is not None and os.geteuid() != 0:
        raise ConfigError("--rate makes two network namespaces and a veth pair, which needs root: run it as root, "
                          "or leave --rate out to use the loopback")
    for s in chosen:  # what a rank would refuse, before any starts
        PipelineLayout(2, s, micro_batches, 1 if s == "1f1b" else segments).check(4, layers, rows)
    click.echo(f"machine: {describe()}")
    bench_pipeline(PipelineBench(d_model, layers, rows, seq_len, micro_batches, segments, steps, threads=1,
                                 plan=plan_name, schedules=chosen), rate, click.echo)


def _bench_model(plan: str, rows_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of a bench over the bench GPT: where its states live, its shape, the batch and the steps."""
    options = [click.option("--plan", "plan_name", type=click.Choice(["resident", "stream", "max-offload"]),
                            default=plan, show_default=True, help="Where the states live (max-offload: on disk)."),
               click.option("--d-model", type=POSITIVE, default=512, show_default=True, callback=_eight_heads),
               click.option("--layers", type=POSITIVE, default=8, show_default=True),
               click.option("--rows", type=POSITIVE, default=8, show_default=True, help=rows_help),
               click.option("--seq-len", type=click.IntRange(1, 1024), default=128, show_default=True),
               click.option("--steps", type=POSITIVE, default=4, show_default=True,
                            help="Timed steps, after one warm-up step.")]

    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            f = option(f)
        return f
    return apply


def _eight_heads(ctx: click.Context, param: click.Parameter, d_model: int) -> int:
    if d_model % 8:
        raise ConfigError(f"--d-model {d_model}: the bench model has 8 heads; give a multiple of 8")
    return d_model


@bench.command("tensor", context_settings=CONTEXT)
@_bench_model("stream", "Sequences per step.")
@click.option("--sequence-parallel", is_flag=True, help="tp=2 with the sequence sliced (sequence parallel) too.")
def bench_tensor_cmd(plan_name: str, d_model: int, layers: int, rows: int, seq_len: int, steps: int,
                     sequence_parallel: bool) -> None:
    """tp=2 (two ranks) beside tp=1 (one process) on the same cores: step time, and the bytes each rank sent
    per step beside the formula."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.tensor import TensorBench, bench_tensor

    click.echo(f"machine: {describe()}")
    if sequence_parallel and seq_len % 2:
        raise ConfigError(f"--sequence-parallel slices each sequence over 2 ranks: give an even --seq-len, not {seq_len}")
    bench_tensor(TensorBench(d_model, layers, rows, seq_len, steps, plan_name), click.echo, sequence_parallel)


@bench.command("streams", context_settings=CONTEXT)
@_bench_model("resident", "Sequences per step (at least 4).")
def bench_streams_cmd(plan_name: str, d_model: int, layers: int, rows: int, seq_len: int, steps: int) -> None:
    """Every block over 1, 2 and 4 device streams (STRONGHOLD's multi-stream execution): step time beside one
    stream's, and the losses against the same chunks on one stream (bit for bit) and the whole batch."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.streams import STREAMS, StreamsBench, bench_streams

    if rows < max(STREAMS):
        raise ConfigError(f"--rows {rows}: each of up to {max(STREAMS)} streams takes a chunk of the rows; give at least "
                          f"{max(STREAMS)}")
    click.echo(f"machine: {describe()}")
    bench_streams(StreamsBench(d_model, layers, rows, seq_len, steps, plan_name), click.echo)


@bench.command("peers", context_settings=CONTEXT)
@click.option("--model", default="gpt-small", show_default=True,
              help="A named model (tiertrain info --list) or one of our model config JSONs.")
@click.option("--batch-size", type=POSITIVE, default=2, show_default=True)
@click.option("--seq-len", type=POSITIVE, default=128, show_default=True)
@click.option("--precision", type=click.Choice(BENCH_PRECISIONS), default="fp32", show_default=True)
@click.option("--device-memory", default="1GiB", show_default=True,
              help="tiertrain's device budget (its device pool and, on a GPU, its activations).")
@click.option("--device-cap", help="On CUDA, the device memory every system may allocate, tiertrain included "
                                   "[default: the device budget + 1GiB, room for what the planner's count of "
                                   "activations misses].")
@click.option("--host-memory", default="16GiB", show_default=True, help="tiertrain's host budget.")
@click.option("--update", type=click.Choice(["sync", "overlap", "lockfree"]), default="overlap", show_default=True,
              help="tiertrain's update mode (sync and overlap are exact, as the peers are).")
@click.option("--peers", "peer_list", default="deepspeed,fsdp2", show_default=True,
              help="Comma-separated: deepspeed (ZeRO-3, params and optimizer on host), fsdp2 (CPUOffloadPolicy).")
@click.option("--steps", type=POSITIVE, default=4, show_default=True, help="Timed steps per system (the median is taken).")
@click.option("--warmup", type=AtLeast(0), default=2, show_default=True, help="Untimed steps first.")
@click.option("--disk", help='States on disk, "DIR:SIZE": tiertrain\'s disk budget, and DeepSpeed ZeRO-Infinity (NVMe) there.')
@click.option("--probe-each-step", is_flag=True,
              help="With --disk: let each timed step's write-backs land and measure the disk's raw rates between "
                   "steps, so each step is set against the rates on either side of it (for a disk whose rate moves).")
def bench_peers_cmd(model: str, batch_size: int, seq_len: int, precision: str, device_memory: str,
                    device_cap: str | None, host_memory: str, update: str, peer_list: str, steps: int,
                    warmup: int, disk: str | None, probe_each_step: bool) -> None:
    """tiertrain (plan auto) beside DeepSpeed ZeRO-Offload and FSDP2 CPU offload: tokens/s, MFU, device peak."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.peers import PEERS, PeerBench, bench_peers
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig, resolve_config
    from tiertrain.plan.fit import check_device_cap
    from tiertrain.units import parse_size

    peers = tuple(p for p in peer_list.split(",") if p)
    if any(p not in PEERS for p in peers):
        raise ConfigError(f"--peers {peer_list!r}: choose from {', '.join(PEERS)}, comma-separated")
    if probe_each_step and not disk:
        raise ConfigError("--probe-each-step measures the disk: give --disk DIR:SIZE too")
    cfg = resolve_config(model)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"--model {model!r}: bench peers runs our GPT configs (tiertrain info --list), "
                          "so every system builds the same model")
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's maximum {cfg.max_seq_len}")
    click.echo(f"machine: {describe()}")
    budgets = Budgets.parse(device_memory, host_memory, disk)
    if disk and "fsdp2" in peers:
        raise ConfigError("--disk: FSDP2 offloads to host memory only; leave it out (--peers deepspeed)")
    cap = parse_size(device_cap) if device_cap else None
    if cap is not None:
        check_device_cap(cap, budgets)
    work = PeerBench(cfg, batch_size, seq_len, precision, budgets, steps, warmup, update, probe_each_step,
                     cap=cap)
    rows = bench_peers(work, peers, click.echo)
    if not rows[0].ran:
        raise SystemExit(1)


def _bench_model_shape(command: Callable) -> Callable:
    """The GPT shape the planner benches build (``--d-model``, ``--layers``, ``--batch-size``, ``--seq-len``)."""
    for option in reversed((click.option("--d-model", type=POSITIVE, default=512, show_default=True),
                            click.option("--layers", type=POSITIVE, default=6, show_default=True),
                            click.option("--batch-size", type=POSITIVE, default=8, show_default=True),
                            click.option("--seq-len", type=POSITIVE, default=256, show_default=True))):
        command = option(command)
    return command


@bench.command("largest", context_settings=CONTEXT)
@click.option("--device-memory", required=True, help='Device budget of every trial, e.g. "8GiB".')
@click.option("--host-memory", required=True, help='Host budget of every trial, e.g. "32GiB".')
@click.option("--disk", help='Disk tier "DIR:SIZE" of every trial, e.g. /nvme/tt:200GiB (default: none).')
@click.option("--batch-size", type=POSITIVE, default=1, show_default=True)
@click.option("--seq-len", type=POSITIVE, default=512, show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), help="Default: bf16 on a GPU, fp32 on CPU.")
@click.option("--steps", type=click.IntRange(3), default=3, show_default=True, help="Steps each trial must train.")
@click.option("--max-trials", type=POSITIVE, default=6, show_default=True, help="Real runs at most.")
@click.option("--trial-timeout", type=POSITIVE, default=600, show_default=True,
              help="Seconds a trial may run; one past it did not train.")
@click.option("--update", type=click.Choice(["sync", "overlap", "lockfree"]), default="sync", show_default=True,
              help="Every trial's update mode.")
@click.option("--grad-clip", type=click.FloatRange(0), default=1.0, show_default=True,
              help="Every trial's clipping (0: none; clipping keeps every block's gradient until the norm is known).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the figures to this JSON file.")
def bench_largest_cmd(device_memory: str, host_memory: str, disk: str | None, batch_size: int, seq_len: int,
                      precision: str | None, steps: int, max_trials: int, trial_timeout: int, update: str,
                      grad_clip: float, json_out: str | None) -> None:
    """The largest GPT-3-shaped model that really trains within the budgets: plan --max-model's answer
    as the seed, then real runs (--plan auto, each in its own process) galloped and bisected over depth."""
    from pathlib import Path

    from tiertrain.bench.largest import bench_largest
    from tiertrain.bench.machine import describe
    from tiertrain.bench.train_trial import TrainArgs
    from tiertrain.memory.system import compute_device

    if disk is not None and (":" not in disk or not disk.rpartition(":")[0]):
        raise ConfigError(f"--disk {disk!r}: give DIR:SIZE, e.g. /nvme/tt:100GiB (the capacity bound needs the size)")
    from tiertrain.plan import check_update_mode

    precision = precision or ("bf16" if compute_device().type == "cuda" else "fp32")
    check_update_mode(update, precision, 1, grad_clip > 0)
    click.echo(f"machine: {describe()}")
    args = TrainArgs(device_memory, host_memory, disk, batch_size, seq_len, precision, steps, trial_timeout,
                     update=update, grad_clip=grad_clip)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped, it removes its trials' pages as on Ctrl-C
    bench_largest(args, max_trials, click.echo, Path(json_out) if json_out else None)


@bench.command("planner", context_settings=CONTEXT)
@_bench_model_shape
@click.option("--steps", type=POSITIVE, default=6, show_default=True, help="Measured steps per plan, after 2 of warm-up.")
@click.option("--disk-dir", type=click.Path(file_okay=False), help="Disk tier directory (default: a temporary one here).")
@click.option("--part", type=click.Choice(["solver", "fidelity", "auto", "estimate", "all"]), default="all",
              show_default=True)
def bench_planner_cmd(d_model: int, layers: int, batch_size: int, seq_len: int, steps: int, disk_dir: str | None,
                      part: str) -> None:
    """DP speed against 2 s; the simulator's predictions against measured runs of 6 plans; auto against built-ins;
    the profile of a model too big to run against the measured one."""
    from tiertrain.bench.machine import describe
    from tiertrain.bench.planner import bench_auto, bench_estimate, bench_fidelity, bench_solver

    click.echo(f"machine: {describe(disk_dir)}")
    # The DP's large temporary arrays go last: once, after them, the profile measured 18% faster
    # than the runs it predicted (allocator state, it seems), where alone it was within 3%.
    if part in ("fidelity", "all"):
        bench_fidelity(d_model, layers, batch_size, seq_len, steps, disk_dir, click.echo)
    if part in ("auto", "all"):
        bench_auto(d_model, layers, batch_size, seq_len, steps, click.echo)
    if part in ("estimate", "all"):
        bench_estimate(d_model, layers, batch_size, seq_len, click.echo)
    if part in ("solver", "all"):
        bench_solver(100, 128, click.echo)


@bench.command("description", context_settings=CONTEXT)
@_bench_model_shape
@click.option("--steps", type=POSITIVE, default=4, show_default=True, help="Measured steps per plan and round, after 2 of warm-up.")
@click.option("--rounds", type=POSITIVE, default=3, show_default=True)
@click.option("--disk-dir", type=click.Path(file_okay=False), help="Disk tier directory (default: a temporary one here).")
@click.option("--machine", "machine_file", type=click.Path(dir_okay=False),
              help="Predict from this description file (default: this machine, probed fresh each round).")
def bench_description_cmd(d_model: int, layers: int, batch_size: int, seq_len: int, steps: int, rounds: int,
                          disk_dir: str | None, machine_file: str | None) -> None:
    """Three plans' step times predicted from this machine's description alone (no block run) against
    their measured step times, in the same rounds."""
    from tiertrain.bench.description import bench_description
    from tiertrain.bench.machine import describe

    click.echo(f"machine: {describe(disk_dir)}")
    bench_description(d_model, layers, batch_size, seq_len, steps, disk_dir, click.echo, machine_file, rounds)


@cli.command("plan", context_settings=CONTEXT)
@click.option("--model", help="Model name or config file (one block measured here within the measurement bounds).")
@click.option("--batch", "batch", type=POSITIVE, default=1, show_default=True, help="Sequences per micro-batch (with --pp: a step's, split into its micro-batches).")
@click.option("--seq", "seq", type=POSITIVE, default=None, help="Tokens per sequence (default: the model's maximum).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--device-memory", help='Device budget, e.g. "8GiB" (default with --machine: 90% of its device memory).')
@click.option("--host-memory", help='Host budget, e.g. "64GiB" (default with --machine: 90% of its RAM).')
@click.option("--disk", help='Disk tier "DIR:SIZE" (its speed is measured in DIR; with --machine the size is its disk).')
@click.option("--machine", help="Plan for this machine: a built-in name (tiertrain probe --list) or a description "
                                "file (tiertrain probe --out FILE); default: this machine, probed.")
@click.option("--max-model", is_flag=True, help="Find the largest GPT-3-shaped model the machine trains with any plan.")
@click.option("--nproc", type=POSITIVE, default=1, show_default=True,
              help="Data-parallel ranks the plan is for, each with the budgets given (per rank); it chooses every "
                   "block sharded (ZeRO) or replicated (DDP) from the collectives' rates, measured between local "
                   "ranks here or taken from --machine's network link.")
@click.option("--ep", type=POSITIVE, default=1, show_default=True,
              help="With --nproc N and a mixture-of-experts --model: divide each layer's experts over groups of this "
                   "many ranks (expert parallel); each rank is planned with the experts it holds, whole.")
@click.option("--nproc-per-node", type=POSITIVE, default=None,
              help="With --nproc N over several nodes: ranks per node. --machine's first network link is then "
                   "the one inside a node, its second the one between nodes, and hybrid sharding (each block "
                   "sharded inside a node, replicated across; train --shard-group) is planned beside the others.")
@click.option("--pp", type=POSITIVE, default=1, show_default=True,
              help="With --nproc N: pipeline stages (the ranks as N / pp replicas of a pipeline). Each rank's stages "
                   "are planned, and FOLD3D's model chooses the schedule, segments and micro-batches (of --batch-size).")
@click.option("--schedule", type=click.Choice(["aiao", "1f1b", "interleaved", "gpipe"]), default=None,
              help="With --pp: plan the stages for this schedule (with --segments, and --grad-accum micro-batches "
                   "splitting --batch) instead of choosing one.")
@click.option("--segments", type=POSITIVE, default=1, show_default=True,
              help="With --pp and --schedule: the segments (AIAO) or virtual stages per rank (interleaved).")
@click.option("--tp", type=POSITIVE, default=1, show_default=True,
              help="With --nproc N and --model: tensor parallel, each block cut over groups of this many ranks (inside "
                   "a node, on --machine's first link); each rank is planned with its share of every block and the "
                   "group's sums in its times. With --max-model: the largest over every tp a node's ranks allow.")
@click.option("--sequence-parallel", is_flag=True,
              help="With --tp: plan each rank with its slice of the sequence between the cut regions (what "
                   "train --sequence-parallel runs).")
@click.option("--layouts", is_flag=True,
              help="With --nproc N and --model: plan every dp x pp x tp layout of the N ranks (tp inside a node), "
                   "print their predicted steps and throughput side by side, and write the fastest's plan.")
@click.option("--profile", "profile_file", type=click.Path(dir_okay=False), help="Plan from this profile JSON instead.")
@click.option("--solver", "solvers", multiple=True, type=click.Choice(["dp", "greedy", "random", "stronghold"]),
              help="Solvers to run (default: all); the best predicted plan is chosen.")
@click.option("--levels", type=click.IntRange(min=2, max=1 << 16), default=None,
              help="Device memory discretisation of the DP (default: 4 per block, at least 128; host: 2 per block).")
@click.option("--page-size", help='Memory page size the plan will run with, e.g. "4MiB" (default: measured, as train).')
@click.option("--update", type=click.Choice(["sync", "overlap", "lockfree"]), default="sync", show_default=True,
              help="The update mode the run will use (as train's --update): it sets how many gradients the host holds.")
@click.option("--max-staleness", type=AtLeast(0), default=DEFAULT_MAX_STALENESS, show_default=True,
              help="With --update lockfree: steps a block's params may lag.")
@click.option("--grad-clip", type=Finite(min=0), default=1.0, show_default=True,
              help="The run's clipping norm (0: off). Clipping waits for every gradient, so the host holds them all.")
@click.option("--grad-accum", type=POSITIVE, default=1, show_default=True,
              help="The run's micro-batches per step (train --pp's --micro-batches).")
@click.option("--measure-memory", help='Memory measuring one block may take (default: half of what is free now).')
@click.option("--measure-seconds", type=Finite(min=0), default=None,
              help="Seconds measuring one block may take (default 5); beyond them a reduced shape, or the FLOP estimate.")
@click.option("--out", type=click.Path(dir_okay=False), default="plan.json", show_default=True, help="Write the plan JSON here.")
@click.option("--png", type=click.Path(dir_okay=False), help="Write the resource timelines and tier memory here.")
def plan_cmd(out: str, png: str | None, **flags: Any) -> None:
    """Choose a plan for a model under budgets, on this machine or a described one (--machine), print
    it with its predicted step, and save it for `tiertrain train --plan FILE` with the same --update,
    --grad-clip and --grad-accum; or, with --max-model, the largest GPT-3-shaped model that fits."""
    from pathlib import Path

    from tiertrain.cli.plan import (
        PlanRequest,
        run_layouts,
        run_max_model,
        run_plan,
        write_png,
    )

    search = flags.pop("layouts")
    req = PlanRequest(**{**flags, "solvers": tuple(flags["solvers"]), "nproc_per_node": flags["nproc_per_node"] or 0})
    console = _console()
    if req.max_model:
        chosen = run_max_model(req, console).chosen
    else:
        chosen = (run_layouts(req, console) if search else run_plan(req, console)).chosen
    _write_output(Path(out), chosen.plan.to_json().encode())
    click.echo(f"plan written to {out}")
    if png:
        write_png(chosen.sim, Path(png))
        click.echo(f"timelines written to {png}")


@cli.command("export", context_settings=CONTEXT)
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=True), help="A new directory for the exported model.")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]),
              help="The dtype the weights are written in (a checkpoint holds fp32 masters).")
def export_cmd(checkpoint: str, out: str, dtype: str) -> None:
    """Write a checkpoint (a run's --out: its newest; or a checkpoints/step-* directory), sharded or not,
    as one safetensors state dict with its config: for a transformers model a directory from_pretrained
    loads. Streamed: a bounded part of the weights in memory, whatever the model's size."""
    from pathlib import Path

    from tiertrain.checkpoint.export import export_checkpoint

    export_checkpoint(Path(checkpoint), Path(out), dtype, say=click.echo)


@cli.command("probe", context_settings=CONTEXT)
@click.option("--disk", "disk_dir", type=click.Path(file_okay=False), help="Directory on the disk the disk tier will use.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the description JSON here (for plan --machine).")
@click.option("--list", "list_machines", is_flag=True, help="List the built-in machine descriptions instead.")
def probe_cmd(disk_dir: str | None, out: str | None, list_machines: bool) -> None:
    """Measure this machine (links, disk, AdamW, memory and matmul rates, memory sizes) into a
    description `tiertrain plan --machine FILE` plans for; kept in the cache when the machine was quiet."""
    from pathlib import Path

    from tiertrain.cli.probe import print_builtins, print_machine, take_probe

    if list_machines:
        print_builtins(_console())
        return
    machine = take_probe(disk_dir)
    print_machine(machine, _console())
    if out:
        _write_output(Path(out), machine.to_json().encode())
        click.echo(f"description written to {out}")


def _write_output(path: "Path", data: bytes) -> None:
    """An output file written whole (atomically) or one clear error: an unwritable place is the user's to fix."""
    from tiertrain.checkpoint.atomic import write_atomic
    from tiertrain.errors import OutputError

    try:
        write_atomic(path, data)
    except OSError as exc:
        raise OutputError(f"cannot write {path} ({exc.strerror}); give a writable place with --out") from None


def _says_it(exc: UserError) -> bool:
    """Under torchrun every rank reads the same flags, files and checkpoint: their errors are said once,
    by rank 0; what befell one rank alone (its disk, a lost peer) that rank says."""
    from tiertrain.errors import CheckpointError, DataError

    if os.environ.get("RANK", "0") == "0":
        return True
    return not isinstance(exc, (ConfigError, CheckpointError, DataError))


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="tiertrain", standalone_mode=False)
    except UserError as exc:
        if _says_it(exc):
            click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:  # a bad flag: one line, as every other user error
        ctx = getattr(exc, "ctx", None)
        hint = f"; see {ctx.command_path} --help" if ctx is not None else ""
        click.echo(f"error: {' '.join(exc.format_message().split())}{hint}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
