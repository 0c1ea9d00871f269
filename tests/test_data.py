import numpy as np
import pytest
import torch

from tiertrain.data import BatchSampler, load_tokens
from tiertrain.data.corpus import default_corpus
from tiertrain.errors import DataError


def test_builtin_corpus_is_nonempty_text_and_deterministic():
    a, b = default_corpus(), default_corpus()
    assert a == b and len(a) > 1_000_000
    tokens = load_tokens("builtin", 256)
    assert tokens.max() < 256 and len(tokens) == len(a)


@pytest.mark.parametrize("suffix,dtype", [(".bin", np.uint16), (".u32.bin", np.uint32)])
def test_token_files_are_memory_mapped(tmp_path, suffix, dtype):
    data = (np.arange(5000) % 300).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    data.tofile(path)
    tokens = load_tokens(str(path), 300)
    assert isinstance(tokens, np.memmap) and tokens.dtype == dtype
    assert np.array_equal(tokens, data)


def test_npy_tokens_and_vocab_check(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(1000, dtype=np.int32))
    assert len(load_tokens(str(path), 1000)) == 1000
    with pytest.raises(DataError, match="token id 999 .* 500 entries"):
        load_tokens(str(path), 500)


def test_text_directory_is_read_byte_level(tmp_path):
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("world")
    (tmp_path / "skip.bin.bak").write_text("zzz")
    tokens = load_tokens(str(tmp_path), 256)
    assert bytes(tokens.astype(np.uint8)) == b"hello \nworld"


def test_sampler_is_a_pure_function_of_seed_and_position():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = BatchSampler(tokens, 4, 16, seed=1)
    first = [a.next() for _ in range(5)]
    b = BatchSampler(tokens, 4, 16, seed=1, position=3)
    assert torch.equal(b.next(), first[3]) and torch.equal(b.next(), first[4])
    c = BatchSampler(tokens, 4, 16, seed=2)
    assert not torch.equal(c.next(), first[0])
    # Each row is a contiguous window of seq_len + 1 tokens.
    assert first[0].shape == (4, 17) and torch.all(first[0][:, 1:] - first[0][:, :-1] == 1)


@pytest.mark.parametrize("case", ["missing", "empty_text", "empty_bin", "empty_dir", "odd_bytes"])
def test_bad_data_is_refused_with_its_name(tmp_path, case):
    path = tmp_path / "data"
    if case == "empty_text":
        path = tmp_path / "e.txt"
        path.write_text("")
    elif case == "empty_bin":
        path = tmp_path / "e.bin"
        path.write_bytes(b"")
    elif case == "empty_dir":
        path.mkdir()
    elif case == "odd_bytes":
        path = tmp_path / "odd.bin"
        path.write_bytes(b"abc")
    with pytest.raises(DataError) as err:
        load_tokens(str(path), 256)
    assert str(path) in str(err.value)


def test_data_shorter_than_one_batch_is_refused():
    with pytest.raises(DataError, match="shorter than one batch of 4 x 17 = 68"):
        BatchSampler(np.arange(50, dtype=np.uint16), 4, 16, seed=0)
