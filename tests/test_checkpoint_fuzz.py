"""Randomly corrupted checkpoints (issue 16, must hold): every one is refused with one ``UserError``
whose message is one line, nothing outside the checkpoint is changed (or, where the filesystem
records reads, read), and memory stays bounded.

The corruptions: random byte flips, truncations and appended bytes in every file; files replaced by
symlinks pointing out of the checkpoint, by directories or FIFOs; safetensors headers edited (huge
header lengths and shapes, moved offsets, swapped dtypes, renamed, dropped and added tensors) with
the manifest's checksum fixed so that only the header checks can refuse them; trainer.json broken
as JSON or wrong inside (every field, the RNG states, the parameter groups, the scaler), manifest
entries with random names including traversals to real files (``../../x``), absolute paths and
symlinks out of the checkpoint, each recorded with the target's true checksum; ``latest`` naming
places outside the run. ``TIERTRAIN_FUZZ_SEED`` replays a run; the seed is printed.

All library cases run in this one process against ``saved_run_options``, ``find_checkpoint`` and
``load_checkpoint``; a handful go through the real CLI in process (exit 2, one ``error:`` line).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_config
from tiertrain.cli.main import main
from tiertrain.checkpoint.run import NEEDED, file_digest, find_checkpoint, load_checkpoint, saved_run_options
from tiertrain.train.loop import Trainer, train
from tiertrain.errors import UserError

SEED = int(os.environ.get("TIERTRAIN_FUZZ_SEED", "16016"))
CASES = 500
MEMORY_BOUND = 512 << 20  # peak RSS growth allowed in one case; a checkpoint here is ~0.5 MiB
STEP = "step-00000002"
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")


# ---------------------------------------------------------------- the world a case runs in


@dataclass
class World:
    base: Path
    run: Path
    ckpt: Path
    sentinel: Path
    pristine: dict[str, bytes]
    latest: bytes
    state: object
    reads_seen: bool  # whether this filesystem updates atime on a read (relatime with an old atime)
    targets: list[Path] = field(default_factory=list)  # sentinel files that traversal names point at
    digests: dict[Path, str] = field(default_factory=dict)  # their checksums, taken without touching atimes

    @property
    def root(self) -> Path:
        return self.run / "checkpoints"

    def restore(self) -> None:
        """The checkpoint and ``latest`` as saved, and nothing a case planted beside them."""
        if self.ckpt.is_symlink() or self.ckpt.is_file():
            self.ckpt.unlink()
        elif self.ckpt.exists():
            shutil.rmtree(self.ckpt)
        self.ckpt.mkdir()
        for name, data in self.pristine.items():
            (self.ckpt / name).write_bytes(data)
        for p in self.root.iterdir():
            if p.name not in (STEP,):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        (self.root / "latest").write_bytes(self.latest)


def _tree(root: Path, skip: set[Path], atimes: bool) -> dict[str, tuple]:
    """Names and types of a tree, and of its files and links their sizes, mtimes, ctimes, contents
    (and atimes, where reads show). Directories' own times are left out: the run directory's change
    when a run probes it or the checkpoint is restored. Files are hashed with O_NOATIME, so that
    taking the digest is not itself a read that shows."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        for name in sorted(dirnames + filenames):
            p = here / name
            if p in skip:
                continue
            st = os.lstat(p)
            entry: tuple = (stat.S_IFMT(st.st_mode),)
            if stat.S_ISREG(st.st_mode):
                fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
                with open(fd, "rb") as f:
                    entry += (st.st_size, st.st_mtime_ns, st.st_ctime_ns, hashlib.sha256(f.read()).hexdigest())
                if atimes:
                    entry += (st.st_atime_ns,)
            elif stat.S_ISLNK(st.st_mode):
                entry += (os.readlink(p), st.st_mtime_ns)
            out[str(p.relative_to(root))] = entry
    return out


def _quiet_digest(path: Path) -> str:
    """A manifest digest of ``path`` read with O_NOATIME: the test's own reads must not show."""
    import crc32c

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
    with open(fd, "rb") as f:
        return f"crc32c:{crc32c.crc32c(f.read()):08x}"


def _make_sentinel(base: Path, run: Path) -> tuple[Path, list[Path]]:
    """Files beside the checkpoint and elsewhere that crafted names point at: a secret, a disk
    tier's directory with user data, another run's complete checkpoint, a copy of trainer.json."""
    sentinel = base / "sentinel"
    files = {"secret.txt": b"the user's secret\n", "passwd": b"root:x:0:0::/root:/bin/sh\n",
             "tiertrain-run-1234/data.bin": os.urandom(64 << 10), "deep/er/x": b"x" * 100,
             "trainer.json": (run / "checkpoints" / STEP / "trainer.json").read_bytes()}
    for rel, data in files.items():
        (sentinel / rel).parent.mkdir(parents=True, exist_ok=True)
        (sentinel / rel).write_bytes(data)
    shutil.copytree(run / "checkpoints", sentinel / "other_run" / "checkpoints")  # valid, outside the run
    beside = run / "x"  # the target of ../../x from the checkpoint
    beside.write_bytes(b"beside the checkpoints\n")
    targets = [sentinel / rel for rel in files]
    targets += [beside, sentinel / "other_run" / "checkpoints" / STEP / "model.safetensors"]
    old = time.time() - 10 * 86400
    for p in targets:  # atime older than mtime: under relatime any read moves it
        os.utime(p, (old, p.stat().st_mtime))
    return sentinel, targets


def _reads_show(base: Path) -> bool:
    probe = base / "atime-probe"
    probe.write_bytes(b"probe")
    old = time.time() - 10 * 86400
    os.utime(probe, (old, probe.stat().st_mtime))
    probe.read_bytes()
    seen = probe.stat().st_atime > old + 1
    probe.unlink()
    return seen


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    base = tmp_path_factory.mktemp("fuzz")
    run = base / "run"
    train(tiny_config(run, steps=2))
    ckpt = find_checkpoint(run)
    assert ckpt.name == STEP
    sentinel, targets = _make_sentinel(base, run)
    state = Trainer(tiny_config(tmp_path_factory.mktemp("fuzz-loader") / "out", steps=4)).state
    return World(base, run, ckpt, sentinel, {p.name: p.read_bytes() for p in ckpt.iterdir()},
                 (run / "checkpoints" / "latest").read_bytes(), state, _reads_show(base), targets,
                 {t: _quiet_digest(t) for t in targets})


# ---------------------------------------------------------------- memory


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    raise AssertionError(key)


# ---------------------------------------------------------------- safetensors editing


def _split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _tensor_names(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


SAME_SIZE = {"F32": "I32", "I32": "F32", "U8": "I8", "I8": "U8", "F16": "BF16", "BF16": "F16"}


# ---------------------------------------------------------------- mutations


class Skip(Exception):
    """This mutation does not apply to what was drawn; draw another."""


def _manifest(w: World, edit: Callable[[dict], object]) -> None:
    path = w.ckpt / "trainer.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _fix_digest(w: World, name: str) -> None:
    _manifest(w, lambda d: d["files"].__setitem__(name, file_digest(w.ckpt / name)))


def flip_bytes(w: World, r: random.Random) -> str:
    name = r.choice(NEEDED)
    data = bytearray((w.ckpt / name).read_bytes())
    spots = [r.randrange(len(data)) for _ in range(r.randint(1, 8))]
    for i in spots:
        data[i] ^= r.randint(1, 255)
    (w.ckpt / name).write_bytes(bytes(data))
    return f"flip {len(spots)} bytes of {name}"


def truncate(w: World, r: random.Random) -> str:
    name = r.choice([*NEEDED, "trainer.json"])
    data = (w.ckpt / name).read_bytes()
    keep = r.choice([0, 1, 7, 8, 9, r.randrange(len(data)), len(data) - 1])
    (w.ckpt / name).write_bytes(data[:keep])
    return f"truncate {name} to {keep}"


def append(w: World, r: random.Random) -> str:
    name = r.choice(NEEDED)
    with open(w.ckpt / name, "ab") as f:
        f.write(r.randbytes(r.randint(1, 4096)))
    return f"append to {name}"


def replace_file(w: World, r: random.Random) -> str:
    """A file gone, or something else under its name: a directory, a FIFO, a symlink pointing out
    (to a copy with the same bytes, or to a sentinel file whose checksum is put in the manifest)."""
    name = r.choice([*NEEDED, "trainer.json"])
    path = w.ckpt / name
    kind = r.choice(["delete", "directory", "fifo", "symlink same bytes", "symlink sentinel"])
    if kind == "symlink same bytes":
        copy = w.sentinel / "other_run" / "checkpoints" / STEP / name
        path.unlink()
        path.symlink_to(copy)
        return f"{name} -> symlink to an identical copy outside"
    if kind == "symlink sentinel":
        target = r.choice(w.targets)
        if name != "trainer.json":
            _manifest(w, lambda d: d["files"].__setitem__(name, w.digests[target]))
        path.unlink()
        path.symlink_to(target if r.random() < 0.5 else os.path.relpath(target, w.ckpt))
        return f"{name} -> symlink to {target}"
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    return f"{name}: {kind}"


def header_edit(w: World, r: random.Random) -> str:
    """An edited safetensors header whose checksum the manifest then records: only the loader's
    header checks (and safetensors' own) stand between it and the model."""
    name = r.choice(TENSOR_FILES)
    path = w.ckpt / name
    data = path.read_bytes()
    header, body = _split(data)
    tensor = r.choice(_tensor_names(header))
    entry = header[tensor]
    kind = r.choice(["length", "garbage", "huge shape", "offsets", "dtype", "reshape", "rename", "drop", "add",
                     "convert"])
    if kind == "length":
        n = r.choice([2**64 - 1, 2**62, 100 << 20, len(data), len(data) - 7, 0, 1, 3])
        new = struct.pack("<Q", n) + data[8:]
    elif kind == "garbage":
        n = struct.unpack("<Q", data[:8])[0]
        new = data[:8] + r.randbytes(n) + data[8 + n :]
    elif kind == "huge shape":
        entry["shape"] = r.choice([[2**31, 2**31], [2**62], [2**40, 3], [-1], [0, 2**63]])
        new = _join(header, body)
    elif kind == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = r.choice([[start, end + 4], [start + 4, end], [start, 2**62], [end, start],
                                          [start, end + (1 << 30)]])
        new = _join(header, body)
    elif kind == "dtype":
        entry["dtype"] = SAME_SIZE[entry["dtype"]]
        new = _join(header, body)
    elif kind == "reshape":  # the same bytes, another shape
        shape = entry["shape"]
        if len(shape) == 2 and shape[0] != shape[1]:
            entry["shape"] = [shape[1], shape[0]]
        elif len(shape) == 2:
            entry["shape"] = [shape[0] * shape[1]]
        else:
            entry["shape"] = [1, *shape]
        new = _join(header, body)
    elif kind == "rename":
        header[r.choice([f"{tensor}x", tensor.replace("::", "::momentum_") if "::" in tensor else f"{tensor}::",
                         f"zz.{tensor}", "torch_cuda_x"])] = header.pop(tensor)
        new = _join(header, body)
    else:  # whole-file rewrites through safetensors itself: a valid file of the wrong contents
        tensors = load_file(path)
        if kind == "drop":
            del tensors[tensor]
        elif kind == "add":
            extra = r.choice(["zz.extra", "blocks.0.attn.qkv.weight::max_exp_avg_sq", "torch_cuda_99x",
                              "lm_head.weight", "tok_emb.weight::step2"])
            if extra in tensors:
                raise Skip
            tensors[extra] = torch.zeros(3)
        else:  # convert: right names and shapes, wrong dtype (an rng state as float32, weights as fp16...)
            t = tensors[tensor]
            tensors[tensor] = t.float() if t.dtype != torch.float32 else t.to(r.choice([torch.float16, torch.bfloat16,
                                                                                        torch.float64, torch.int32]))
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, path)
        _fix_digest(w, name)
        return f"{name}: {kind} {tensor}"
    path.write_bytes(new)
    _fix_digest(w, name)
    return f"{name}: header {kind} ({tensor})"


def _bad_values(d: dict) -> dict[str, list]:
    """Per field of trainer.json, values that are certainly wrong."""
    py, np_ = d["rng"]["python"], d["rng"]["numpy"]
    group = d["param_groups"][0]
    scaler = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
              "_growth_tracker": 0}
    return {
        "format_version": [2, 0, "1", None, [], 1.5],
        "step": ["abc", -1, 1.5, None, True, [], {}, 2**70, "2"],
        "data_position": ["abc", -3, 0.5, None, False, [1], 2**64],
        "scaler": [[], "x", 3, {"scale": "x"}, {**scaler, "scale": -1.0}, {**scaler, "growth_interval": 0},
                   {**scaler, "backoff_factor": 2.0}, {**scaler, "bogus": 1}, {"scale": 1.0}],
        "run_config": [[], "x", 3, None, True],
        "rng": [[], {}, "x", {"numpy": np_}, {"python": py},
                {"numpy": np_, "python": [3, py[1][:10], None]}, {"numpy": np_, "python": [2, py[1], None]},
                {"numpy": np_, "python": [3, py[1][:-1] + [700], None]},
                {"numpy": np_, "python": [3, [-1] + py[1][1:], None]},
                {"numpy": np_, "python": [3, py[1], "x"]},
                {"numpy": ["PCG64", *np_[1:]], "python": py},
                {"numpy": [np_[0], np_[1][:10], *np_[2:]], "python": py},
                {"numpy": [*np_[:2], 700, *np_[3:]], "python": py},
                {"numpy": [*np_[:3], 5, np_[4]], "python": py},
                {"numpy": [np_[0], [2**33] + np_[1][1:], *np_[2:]], "python": py},
                {"numpy": np_, "python": py, "extra": 1}],
        "param_groups": [{}, [], [group], [group] * 3, [1, 2], [[group], group],
                         [{**group, "lr": "x"}, group], [{**group, "betas": [0.9]}, group],
                         [{**group, "betas": [0.9, 1.5]}, group], [{**group, "eps": -1}, group],
                         [{**group, "weight_decay": None}, group],
                         [{k: v for k, v in group.items() if k != "lr"}, group]],
        "files": [[], "x", {}, None, {**d["files"], "model.safetensors": 5},
                  {**d["files"], "model.safetensors": "md5:0"}, {**d["files"], "rng.safetensors": "crc32c:zzzzzzzz"},
                  {**d["files"], "config.json": "crc32c:00000000"}],
        "saved_at_ns": ["x", -5, 1.5, [], True],
        "bogus": [1, None, "x"],
    }


def trainer_wrong_inside(w: World, r: random.Random) -> str:
    path = w.ckpt / "trainer.json"
    d = json.loads(path.read_text())
    kind = r.choice(["not a mapping", "drop", "value"])
    if kind == "not a mapping":
        new = r.choice([[], [d], "x", 3, None, True, 1.5])
        path.write_text(json.dumps(new))
        return f"trainer.json is {new!r:.20}"
    if kind == "drop":
        key = r.choice(["format_version", "step", "data_position", "scaler", "run_config", "rng", "param_groups",
                        "files"])
        del d[key]
        path.write_text(json.dumps(d))
        return f"trainer.json without {key}"
    key, values = r.choice(sorted(_bad_values(d).items()))
    d[key] = r.choice(values)
    path.write_text(json.dumps(d))
    return f"trainer.json {key} = {d[key]!r:.60}"


def trainer_broken(w: World, r: random.Random) -> str:
    """trainer.json that is not JSON, too deep, too big (valid JSON padded past the size cap), or
    holding a number too long to convert."""
    path = w.ckpt / "trainer.json"
    text = path.read_bytes()
    kind = r.choice(["flip", "deep", "huge", "long number", "not utf-8"])
    if kind == "flip":
        for _ in range(100):
            data = bytearray(text)
            for _ in range(r.randint(1, 4)):
                data[r.randrange(len(data))] ^= r.randint(1, 255)
            try:
                json.loads(bytes(data))
            except ValueError:
                break
        else:
            raise Skip
        path.write_bytes(bytes(data))
    elif kind == "deep":
        path.write_text("[" * r.choice([1000, 100000]) + "]" * 10)
    elif kind == "huge":
        path.write_bytes(b" " * (5 << 20) + text)
    elif kind == "long number":
        path.write_text(text.decode().replace('"step": 2', '"step": ' + "9" * 5000, 1))
    else:
        path.write_bytes(b"\xff\xfe\x00" + text)
    return f"trainer.json {kind}"


def _random_bad_name(w: World, r: random.Random) -> tuple[str, Path | None]:
    """A manifest name that must never be opened, and the file it would reach (to record its
    true checksum, so that only the name check can refuse it)."""
    target = r.choice(w.targets)
    kind = r.choice(["traversal", "traversal", "absolute", "separator", "special", "random"])
    if kind == "traversal":
        rel = os.path.relpath(target, w.ckpt)
        return rel, target
    if kind == "absolute":
        return str(target), target
    if kind == "separator":
        return r.choice(["sub/model.safetensors", "./config.json", "model.safetensors/", "a\\b", "config.json/."]), None
    if kind == "special":
        return r.choice(["", ".", "..", "...", ".hidden", "-rf", "a\nb", "a\x00b", "name ", "ümlaut", "x" * 300,
                         "~/x", "$HOME"]), None
    alphabet = "abc./\\-_~ \n\x00é"
    return "".join(r.choice(alphabet) for _ in range(r.randint(1, 24))), None


def manifest_names(w: World, r: random.Random) -> str:
    name, target = _random_bad_name(w, r)
    if name and all(c.isalnum() or c in "_.-" for c in name) and name[0].isalnum() and name.isascii():
        raise Skip  # a plain name after all (the random alphabet can make one)
    digest = w.digests[target] if target is not None else f"crc32c:{r.getrandbits(32):08x}"
    kind = r.choice(["add", "rename needed"])
    if kind == "add":
        _manifest(w, lambda d: d["files"].__setitem__(name, digest))
    else:
        needed = r.choice(NEEDED)
        _manifest(w, lambda d: (d["files"].pop(needed), d["files"].__setitem__(name, digest)))
    return f"manifest {kind}: {name!r:.80}"


def manifest_unlisted(w: World, r: random.Random) -> str:
    """A file the loader reads left out of the manifest (and changed, so reading it unverified shows)."""
    name = r.choice(NEEDED)
    _manifest(w, lambda d: d["files"].pop(name))
    if name == "config.json":
        (w.ckpt / name).write_text(json.dumps({"tiertrain_model": {"n_layer": 3}}))
    return f"manifest lacks {name}"


def config_wrong_inside(w: World, r: random.Random) -> str:
    new = r.choice([[], "tiny", 3, None, {"tiertrain_model": []}, {"tiertrain_model": "tiny"},
                    {"tiertrain_model": {"n_layer": "x"}}, {}, {"model_type": "gpt2", "n_layer": 2}])
    (w.ckpt / "config.json").write_text(json.dumps(new))
    _fix_digest(w, "config.json")
    return f"config.json = {new!r:.40}"


def latest_outside(w: World, r: random.Random) -> str:
    """``latest`` naming a place that is not a checkpoint beside it, though some of them are
    complete, valid checkpoints elsewhere."""
    latest = w.root / "latest"
    outside = w.sentinel / "other_run" / "checkpoints" / STEP
    kind = r.choice(["relative", "absolute", "symlinked sibling", "latest a symlink", "latest a directory",
                     "checkpoint a symlink", "text"])
    if kind == "relative":
        latest.write_text(os.path.relpath(outside, w.root))
    elif kind == "absolute":
        latest.write_text(str(outside))
    elif kind == "symlinked sibling":
        (w.root / "step-00000099").symlink_to(outside)
        latest.write_text("step-00000099")
    elif kind == "latest a symlink":
        latest.unlink()
        latest.symlink_to(w.sentinel / "other_run" / "checkpoints" / "latest")
    elif kind == "latest a directory":
        latest.unlink()
        latest.mkdir()
    elif kind == "checkpoint a symlink":
        shutil.rmtree(w.ckpt)
        w.ckpt.symlink_to(outside)
    else:
        text = r.choice(["", "step-x", "step-00000099", "../step-00000002", f"{STEP}/..", f"{STEP}/../{STEP}",
                         "." * 300, "step-" + "9" * 40, "\x00", "a" * (1 << 20)])
        latest.write_bytes(text.encode() if r.random() < 0.9 else r.randbytes(r.randint(1, 64)))
        if latest.read_bytes().decode("ascii", "replace").strip() == STEP:
            raise Skip
    return f"latest: {kind}"


MUTATIONS: list[tuple[Callable[[World, random.Random], str], int]] = [
    (flip_bytes, 3), (truncate, 2), (append, 1), (replace_file, 3), (header_edit, 6), (trainer_wrong_inside, 5),
    (trainer_broken, 2), (manifest_names, 4), (manifest_unlisted, 1), (config_wrong_inside, 1), (latest_outside, 3),
]


def _draw(w: World, r: random.Random) -> tuple[str, str]:
    """A fresh copy of the checkpoint with one random corruption: (its kind, what it did)."""
    fns, weights = zip(*MUTATIONS)
    while True:
        w.restore()
        fn = r.choices(fns, weights)[0]
        try:
            return fn.__name__, fn(w, r)
        except Skip:
            continue


def _resume(w: World) -> None:
    """What ``tiertrain train --resume RUN`` asks of the checkpoint code."""
    saved_run_options(w.run)
    load_checkpoint(find_checkpoint(w.run), w.state)


# ---------------------------------------------------------------- the tests


def test_randomly_corrupted_checkpoints_are_each_one_clear_error(world: World, capsys):
    r = random.Random(SEED)
    with capsys.disabled():
        print(f"\ncheckpoint fuzz: seed {SEED} (TIERTRAIN_FUZZ_SEED replays it), {CASES} cases; "
              f"reads {'are' if world.reads_seen else 'are not'} visible in atimes here")
    skip = {world.ckpt, world.root / "latest", world.root / "step-00000099"}
    baseline = _tree(world.base, skip, world.reads_seen)
    measured = _reset_peak()
    kinds: dict[str, int] = {}
    peak = 0
    began = time.perf_counter()
    for case in range(CASES):
        kind, what = _draw(world, r)
        kinds[kind] = kinds.get(kind, 0) + 1
        if measured:
            _reset_peak()
            rss = _status("VmRSS")
        with pytest.raises(UserError) as info:
            _resume(world)
        message = str(info.value)
        assert message and "\n" not in message and "\r" not in message, (case, what, message)
        if measured:
            peak = max(peak, _status("VmHWM") - rss)
            assert peak < MEMORY_BOUND, (case, what, peak)
        world.restore()
        after = _tree(world.base, skip, world.reads_seen)
        changed = {k for k in set(after) | set(baseline) if after.get(k) != baseline.get(k)}
        assert not changed, (case, what, changed)
    with capsys.disabled():
        grew = f"peak RSS growth in a case {peak / 2**20:.1f} MiB" if measured else "peak RSS not measurable here"
        print(f"checkpoint fuzz: {CASES} cases in {time.perf_counter() - began:.1f} s, {grew}; {sorted(kinds.items())}")
    _resume(world)  # restored, the checkpoint still loads


def _cli_traversal(w: World) -> None:
    secret = w.sentinel / "secret.txt"
    _manifest(w, lambda d: d["files"].__setitem__(os.path.relpath(secret, w.ckpt), w.digests[secret]))


def _cli_latest_outside(w: World) -> None:
    (w.root / "latest").write_text(os.path.relpath(w.sentinel / "other_run" / "checkpoints" / STEP, w.root))


def _cli_float32_rng(w: World) -> None:
    cpu = load_file(w.ckpt / "rng.safetensors")["torch_cpu"]
    save_file({"torch_cpu": cpu.float()}, w.ckpt / "rng.safetensors")
    _fix_digest(w, "rng.safetensors")


def _cli_step_abc(w: World) -> None:
    _manifest(w, lambda d: d.__setitem__("step", "abc"))


def _cli_huge_shape(w: World) -> None:
    header, body = _split((w.ckpt / "model.safetensors").read_bytes())
    header["tok_emb.weight"]["shape"] = [2**31, 2**31]
    (w.ckpt / "model.safetensors").write_bytes(_join(header, body))
    _fix_digest(w, "model.safetensors")


CLI_CASES = {f.__name__.removeprefix("_cli_"): f for f in (_cli_traversal, _cli_latest_outside, _cli_float32_rng,
                                                         _cli_step_abc, _cli_huge_shape)}


@pytest.mark.parametrize("case", CLI_CASES)
def test_corrupted_checkpoints_through_the_cli_exit_2_with_one_error_line(world: World, capsys, case):
    world.restore()
    skip = {world.ckpt, world.root / "latest", world.run / ".lock"}  # the lock a refused run takes and gives back
    baseline = _tree(world.base, skip, world.reads_seen)
    CLI_CASES[case](world)
    measured = _reset_peak()
    rss = _status("VmRSS")
    capsys.readouterr()
    code = main(["train", "--resume", str(world.run), "--steps", "4", "--out", str(world.run)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err
    if measured:
        assert _status("VmHWM") - rss < MEMORY_BOUND
    world.restore()
    assert _tree(world.base, skip, world.reads_seen) == baseline
