"""Token files (octoplan.tokenfile, octorun.data): which windows each sample reads, that a step
reads one global batch whatever pp and dp are, resumption, the model-file hooks, every bad input,
and ``octoplan tokenize``."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import octorun.data as data_module
from octoplan.errors import InputError
from octoplan.modelfile import load_model_file
from octoplan.tokenfile import MEGATRON_INDEX_MAGIC, tokenize_text
from octorun.data import TokenData, epoch_seed

REPO = Path(__file__).resolve().parents[1]

_MODEL = """
import torch
CONFIG = {config!r}
def num_layers(**config): return 1
def build_layer(index, **config): return torch.nn.Identity()
def sample_batch(microbatch_size, generator, **config): return torch.zeros(microbatch_size, 1), torch.zeros(microbatch_size, 1)
def loss_fn(outputs, targets): return (outputs - targets).pow(2).mean()
"""


def _model(tmp_path, config=None, hooks="", name="model.py"):
    path = tmp_path / name
    path.write_text(_MODEL.format(config=config if config is not None else {"seq": 3}) + textwrap.dedent(hooks))
    return load_model_file(path)


def _tokens(path, values, dtype="<u2"):
    np.asarray(values, dtype=dtype).tofile(path)
    return str(path)


def _starts(rows: torch.Tensor) -> list[int]:
    """A file of ids 0, 1, 2, ... holds its own positions: a window's first id is where it starts."""
    return rows[:, 0].tolist()


@pytest.mark.parametrize("num_tokens,expected", [(9, 2), (10, 3), (11, 3), (12, 3), (13, 4)])
def test_windows_start_every_L_minus_1_tokens(tmp_path, num_tokens, expected):
    # L = seq + 1 = 4: window k holds tokens 3k .. 3k+3, sharing token 3k+3 with window k+1
    data = TokenData.open(_tokens(tmp_path / "t.bin", range(num_tokens)), _model(tmp_path), seed=0)
    assert (data.tokens_per_sample, data.num_windows, data.dtype) == (4, expected, "uint16")
    rows = data.windows(0, expected)
    by_start = rows[rows[:, 0].argsort()]
    assert torch.equal(by_start, torch.tensor([[3 * k, 3 * k + 1, 3 * k + 2, 3 * k + 3] for k in range(expected)]))
    assert rows.dtype == torch.int64


def test_order_is_the_seeded_permutation_of_each_epoch(tmp_path):
    data = TokenData.open(_tokens(tmp_path / "t.bin", range(301)), _model(tmp_path), seed=7)  # 100 windows
    assert data.num_windows == 100
    for epoch in range(3):
        order = torch.randperm(100, generator=torch.Generator().manual_seed(epoch_seed(7, epoch)))
        assert _starts(data.windows(epoch * 100, 100)) == (order * 3).tolist()
    first, second = _starts(data.windows(0, 100)), _starts(data.windows(100, 100))
    assert sorted(first) == sorted(second) == list(range(0, 300, 3))  # every window once per epoch
    assert first != second  # and a new order each epoch
    # a read across the boundary is the end of one epoch and the start of the next
    assert torch.equal(data.windows(97, 6), torch.cat([data.windows(97, 3), data.windows(100, 3)]))
    other = TokenData.open(data.path, _model(tmp_path, name="again.py"), seed=8)
    assert _starts(other.windows(0, 100)) != first


def _global_batch(data, *, dp, microbatches, microbatch_size, consumed):
    """Every replica's microbatches of one step, replica by replica: (inputs, targets, per-replica inputs)."""
    parts = [[data.microbatch(consumed=consumed, replica=r, mb=m, microbatches=microbatches,
                              microbatch_size=microbatch_size) for m in range(microbatches)] for r in range(dp)]
    inputs = torch.cat([x for replica in parts for x, _ in replica])
    targets = torch.cat([y for replica in parts for _, y in replica])
    return inputs, targets, [torch.cat([x for x, _ in replica]) for replica in parts]


def test_a_step_reads_one_global_batch_whatever_dp(tmp_path):
    data = TokenData.open(_tokens(tmp_path / "t.bin", range(601)), _model(tmp_path), seed=3)  # 200 windows
    batches = {}
    for dp, microbatches in ((1, 8), (2, 4), (4, 2)):
        for consumed in (0, 48, 192):  # 192: this step's 16 samples straddle the epoch's end
            batches[dp, consumed] = _global_batch(data, dp=dp, microbatches=microbatches, microbatch_size=2,
                                                  consumed=consumed)
    for consumed in (0, 48, 192):
        whole = data.windows(consumed, 16)
        for dp in (1, 2, 4):
            inputs, targets, _ = batches[dp, consumed]
            assert torch.equal(inputs, whole[:, :-1]) and torch.equal(targets, whole[:, 1:])
    # replicas read disjoint windows within a step
    _, _, per_replica = batches[4, 48]
    starts = [set(_starts(part)) for part in per_replica]
    assert sum(map(len, starts)) == len(set().union(*starts)) == 16


def test_a_resumed_run_reads_what_the_uninterrupted_run_reads(tmp_path):
    path = _tokens(tmp_path / "t.bin", range(100))  # 33 windows: steps of 12 samples cross epochs unevenly
    steps, resume_at, global_batch = 7, 3, 12
    first = TokenData.open(path, _model(tmp_path), seed=5)
    through = [_global_batch(first, dp=2, microbatches=3, microbatch_size=2, consumed=s * global_batch)
               for s in range(steps)]
    # the resumed run is a fresh process (nothing cached) under another plan
    resumed = TokenData.open(path, _model(tmp_path, name="resumed.py"), seed=5)
    for step in range(resume_at, steps):
        inputs, targets, _ = _global_batch(resumed, dp=3, microbatches=2, microbatch_size=2, consumed=step * global_batch)
        assert torch.equal(inputs, through[step][0]) and torch.equal(targets, through[step][1])


def test_a_file_changed_inside_keeps_its_fingerprint_but_not_its_sampled_digest(tmp_path):
    """The fingerprint reads 65,536 tokens at each end; blocks sampled evenly through the file
    see an edit of its middle (a shard re-tokenized in place), which a resume then refuses."""
    values = np.arange(300_000) % 1000
    before = TokenData.open(_tokens(tmp_path / "a.bin", values), _model(tmp_path, {"seq": 7, "vocab": 1000}), seed=0)
    values[100_000:200_000] = (values[100_000:200_000] + 1) % 1000
    after = TokenData.open(_tokens(tmp_path / "b.bin", values), _model(tmp_path, {"seq": 7, "vocab": 1000}), seed=0)
    assert before.fingerprint() == after.fingerprint()
    assert before.sampled_digest() != after.sampled_digest()
    again = TokenData.open(_tokens(tmp_path / "c.bin", np.arange(300_000) % 1000),
                           _model(tmp_path, {"seq": 7, "vocab": 1000}), seed=0)
    assert again.sampled_digest() == before.sampled_digest()
    tiny = TokenData.open(_tokens(tmp_path / "t.bin", range(10)), _model(tmp_path, {"seq": 3}), seed=0)
    assert len(tiny.sampled_digest()) == 12  # a file shorter than a block: the whole file


def test_default_hooks_are_next_token_prediction(tmp_path):
    model = _model(tmp_path, {"seq": 5})
    assert model.tokens_per_sample() == 6
    tokens = torch.arange(12).view(2, 6)
    inputs, targets = model.batch_from_tokens(tokens)
    assert torch.equal(inputs, tokens[:, :-1]) and torch.equal(targets, tokens[:, 1:])
    assert torch.equal(inputs, torch.tensor([[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]))


def test_a_model_files_own_hooks(tmp_path):
    hooks = """
    def tokens_per_sample(**config): return config["width"] + 2
    def batch_from_tokens(tokens, **config): return tokens[:, :2] * config["width"], tokens[:, 2:].sum(1)
    """
    model = _model(tmp_path, {"width": 3}, hooks)
    data = TokenData.open(_tokens(tmp_path / "t.bin", range(9)), model, seed=0)  # L = 5: windows at 0 and 4
    assert (data.tokens_per_sample, data.num_windows) == (5, 2)
    inputs, targets = data.microbatch(consumed=0, replica=0, mb=0, microbatches=1, microbatch_size=2)
    order = _starts(data.windows(0, 2))
    expected = {0: ([0, 3], 2 + 3 + 4), 4: ([12, 15], 6 + 7 + 8)}
    assert inputs.tolist() == [expected[s][0] for s in order]
    assert targets.tolist() == [expected[s][1] for s in order]


@pytest.mark.parametrize("config,hooks,field,problem", [
    ({"hidden": 4}, "", "tokens_per_sample", "is not defined, and the config has no positive int seq"),
    ({"seq": True}, "", "tokens_per_sample", "is not defined"),
    ({}, "def tokens_per_sample(**config): return 1\n", "tokens_per_sample", "returned 1"),
    ({}, "def tokens_per_sample(**config): return 4.0\n", "tokens_per_sample", "returned 4.0"),
])
def test_bad_tokens_per_sample(tmp_path, config, hooks, field, problem):
    with pytest.raises(InputError) as error:
        _model(tmp_path, config, hooks).tokens_per_sample()
    assert (error.value.field, error.value.file) == (field, str(tmp_path / "model.py"))
    assert problem in error.value.problem


def test_bad_batch_from_tokens(tmp_path):
    model = _model(tmp_path, None, "def batch_from_tokens(tokens, **config): return tokens\n")
    with pytest.raises(InputError) as error:
        model.batch_from_tokens(torch.zeros(2, 4, dtype=torch.int64))
    assert error.value.field == "batch_from_tokens" and "not (inputs, targets)" in error.value.problem
    # and as the file opens, before any rank starts: not at the first step
    with pytest.raises(InputError, match="not \\(inputs, targets\\)"):
        TokenData.open(_tokens(tmp_path / "t.bin", range(20)), model, seed=0)


def _open_error(tmp_path, path, *, config=None, dtype=None) -> InputError:
    with pytest.raises(InputError) as error:
        TokenData.open(str(path), _model(tmp_path, config), seed=0, dtype=dtype)
    return error.value


def test_bad_token_files(tmp_path):
    missing = _open_error(tmp_path, tmp_path / "none.bin")
    assert (missing.file, missing.field, missing.problem) == (str(tmp_path / "none.bin"), None, "no such file")
    assert "octoplan tokenize" in missing.fix
    assert _open_error(tmp_path, tmp_path).problem == "is a folder"
    (tmp_path / "empty.bin").write_bytes(b"")
    empty = _open_error(tmp_path, tmp_path / "empty.bin")
    assert (empty.field, empty.problem) == ("size", "is empty")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    odd = _open_error(tmp_path, tmp_path / "odd.bin")
    assert (odd.field, odd.problem) == ("size", "is 3 bytes, not a whole number of uint16 ids (2 bytes each)")
    (tmp_path / "six.bin").write_bytes(bytes(6))
    six = _open_error(tmp_path, tmp_path / "six.bin", dtype="uint32")
    assert six.field == "size" and six.fix == "if it holds uint16 ids, give --data-dtype uint16"
    short = _open_error(tmp_path, _tokens(tmp_path / "short.bin", [1, 2, 3]))
    assert short.field == "size" and short.problem.startswith("holds 3 tokens, fewer than one sample's 4")
    unknown = _open_error(tmp_path, _tokens(tmp_path / "t.bin", range(10)), dtype="int8")
    assert (unknown.file, unknown.field, unknown.problem) == (None, "--data-dtype", "is 'int8'")


def test_ids_beyond_the_vocab(tmp_path):
    path = _tokens(tmp_path / "t.bin", [1, 2, 99, 3, 100, 4, 150, 5, 6, 7])
    error = _open_error(tmp_path, path, config={"seq": 3, "vocab": 100})
    assert (error.file, error.field) == (path, "token 6")
    assert error.problem.startswith("is 150, beyond the model's vocab 100") and "read as uint16" in error.problem
    assert error.fix == "if the file holds uint32 ids, give --data-dtype uint32; else train a model with a vocab above 150"
    TokenData.open(path, _model(tmp_path, {"seq": 3, "vocab": 151}), seed=0)  # fits a larger vocab


def test_ids_beyond_the_checked_prefix_are_caught_when_read(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "VOCAB_CHECK_TOKENS", 4)
    data = TokenData.open(_tokens(tmp_path / "t.bin", [1, 2, 3, 4, 5, 6, 500]), _model(tmp_path, {"seq": 3, "vocab": 100}),
                          seed=0)  # windows at 0 and 3; the second holds token 6 = 500
    with pytest.raises(InputError) as error:
        data.windows(0, 2)
    assert error.value.field == "token 6" and error.value.problem.startswith("is 500, beyond the model's vocab 100")


def test_uint32_read_as_uint16_is_named(tmp_path):
    path = _tokens(tmp_path / "t.bin", range(1, 41), dtype="<u4")
    error = _open_error(tmp_path, path)
    assert (error.field, error.fix) == ("dtype", "give --data-dtype uint32, or --data-dtype uint16 if it is one")
    data = TokenData.open(path, _model(tmp_path, {"seq": 3}), seed=0, dtype="uint32")
    assert (data.dtype, data.num_windows) == ("uint32", 13)
    assert sorted(_starts(data.windows(0, 13))) == list(range(1, 40, 3))


def test_uint32_of_a_large_vocab_read_as_uint16_is_named(tmp_path):
    # a 70,000-token vocabulary: 7% of the ids are above 65,535, so not every high half is 0;
    # read as uint16 every id fits the vocab, and only the high halves' pattern gives it away
    ids = np.random.default_rng(0).integers(0, 70_000, size=400)
    assert (ids >= 65_536).any()
    path = _tokens(tmp_path / "t.bin", ids.tolist(), dtype="<u4")
    error = _open_error(tmp_path, path, config={"seq": 3, "vocab": 70_000})
    assert (error.field, error.fix) == ("dtype", "give --data-dtype uint32, or --data-dtype uint16 if it is one")
    assert TokenData.open(path, _model(tmp_path, {"seq": 3, "vocab": 70_000}), seed=0, dtype="uint32").num_tokens == 400
    # uint16 text, byte-level (every id under 256, few of them 0) or of a 50k vocabulary, is read
    for name, text in (("bytes.bin", list(b"hello, world\n" * 20)),
                       ("bpe.bin", np.random.default_rng(1).integers(0, 50_257, size=400).tolist())):
        assert TokenData.open(_tokens(tmp_path / name, text), _model(tmp_path, {"seq": 3}), seed=0).dtype == "uint16"
    # a file of 4 symbols, 0 the commonest, looks like uint32 only to a model whose vocabulary
    # may be that large: a model of a small vocab reads it, and --data-dtype uint16 always does
    dna = _tokens(tmp_path / "dna.bin", np.random.default_rng(2).choice(4, size=400, p=[0.4, 0.2, 0.2, 0.2]).tolist())
    assert _open_error(tmp_path, dna).field == "dtype"  # no vocab known
    assert TokenData.open(dna, _model(tmp_path, {"seq": 3, "vocab": 4}), seed=0).dtype == "uint16"
    assert TokenData.open(dna, _model(tmp_path, {"seq": 3}), seed=0, dtype="uint16").dtype == "uint16"


def test_the_vocab_size_hook_bounds_the_ids(tmp_path):
    path = _tokens(tmp_path / "t.bin", [1, 2, 3, 4, 5, 60, 7])
    model = _model(tmp_path, {"seq": 3}, "def vocab_size(**config): return 50\n")
    with pytest.raises(InputError) as error:
        TokenData.open(path, model, seed=0)
    assert error.value.field == "token 5" and error.value.problem.startswith("is 60, beyond the model's vocab 50")
    bad = _model(tmp_path, {"seq": 3}, "def vocab_size(**config): return 0\n")
    with pytest.raises(InputError) as error:
        TokenData.open(path, bad, seed=0)
    assert (error.value.field, error.value.problem) == ("vocab_size", "returned 0")


def _megatron_index(path, code, magic=MEGATRON_INDEX_MAGIC, version=1):
    # the header, then sequence and document counts, as Megatron-LM's index writer lays them out
    path.write_bytes(magic + struct.pack("<QB", version, code) + struct.pack("<QQ", 1, 2))


def test_megatron_index_names_the_dtype(tmp_path):
    _tokens(tmp_path / "corpus.bin", range(1, 41), dtype="<u4")
    _megatron_index(tmp_path / "corpus.idx", 4)  # int32
    data = TokenData.open(str(tmp_path / "corpus.bin"), _model(tmp_path), seed=0)
    assert (data.dtype, data.num_windows) == ("int32", 13)
    conflict = _open_error(tmp_path, tmp_path / "corpus.bin", dtype="uint16")
    assert (conflict.file, conflict.field) == (str(tmp_path / "corpus.idx"), "dtype")
    assert TokenData.open(str(tmp_path / "corpus.bin"), _model(tmp_path), seed=0, dtype="uint32").dtype == "uint32"
    _megatron_index(tmp_path / "corpus.idx", 8)  # uint16: 80 bytes as 40 uint16 ids, half of them 0
    stale = _open_error(tmp_path, tmp_path / "corpus.bin")  # the uint32 file named as uint16 by an index not its own
    index = tmp_path / "corpus.idx"
    assert (stale.field, stale.problem) == ("dtype", f"read as uint16 (as {index} says), every second id is 0 or small: "
                                                     "it looks like a file of uint32 ids")
    assert stale.fix == (f"give --data-dtype uint32, or --data-dtype uint16 if it is one; if {index} is another "
                         "file's index, remove it")
    # the first fix is refused by the index, whose line says the way out (it went round in circles)
    conflict = _open_error(tmp_path, tmp_path / "corpus.bin", dtype="uint32")
    assert conflict.fix == "drop --data-dtype, or give --data-dtype uint16; if this index is another file's, remove it"
    assert TokenData.open(str(tmp_path / "corpus.bin"), _model(tmp_path), seed=0, dtype="uint16").dtype == "uint16"
    for code, magic, version, field in ((7, MEGATRON_INDEX_MAGIC, 1, "dtype"), (8, b"NOTANIDX\x00", 1, "header"),
                                        (8, MEGATRON_INDEX_MAGIC, 2, "version")):
        _megatron_index(tmp_path / "corpus.idx", code, magic, version)
        error = _open_error(tmp_path, tmp_path / "corpus.bin")
        assert (error.file, error.field) == (str(tmp_path / "corpus.idx"), field)
        # the fix those lines give, --data-dtype, reads the file past a file that is no index
        # (or another version of one); an index naming a dtype we cannot read is still refused
        if field == "dtype":
            assert _open_error(tmp_path, tmp_path / "corpus.bin", dtype="uint32").field == "dtype"
        else:
            assert TokenData.open(str(tmp_path / "corpus.bin"), _model(tmp_path), seed=0, dtype="uint32").dtype == "uint32"


def test_a_uint16_file_the_user_names_is_read_though_it_looks_like_uint32(tmp_path):
    """Ids whose every second one is 0 (or UTF-16 text tokenized byte by byte) look like uint32
    halves; --data-dtype uint16, which the refusal offers, reads them."""
    ids = [0 if i % 2 else i % 60 + 1 for i in range(2000)]
    path = _tokens(tmp_path / "zeros.bin", ids)
    assert _open_error(tmp_path, path).field == "dtype"
    data = TokenData.open(path, _model(tmp_path, {"seq": 3, "vocab": 64}), seed=0, dtype="uint16")
    assert (data.dtype, data.num_tokens) == ("uint16", 2000)


def test_a_path_without_a_file_name_is_refused_as_a_folder(tmp_path, monkeypatch):
    """``--data .`` ended in a traceback: the index beside it was looked for by its suffix."""
    from octoplan.tokenfile import index_path

    monkeypatch.chdir(tmp_path)
    for given in (".", "/", ""):
        assert index_path(given) == Path(given)
    assert _open_error(tmp_path, ".").problem == "is a folder"


def test_negative_int32_ids_are_refused(tmp_path):
    _tokens(tmp_path / "n.bin", [1, 2, 3, -5, 4, 5, 6], dtype="<i4")
    _megatron_index(tmp_path / "n.idx", 4)
    error = _open_error(tmp_path, tmp_path / "n.bin")
    assert (error.field, error.problem) == ("token 3", "is -5, a negative id")


def test_tokenize_library_refuses_non_utf8_and_keeps_the_old_output(tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"ok\xff\xfe")
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(InputError) as error:
        tokenize_text(tmp_path / "bin.txt", out)
    assert error.value.problem == "is not UTF-8 text (near byte 2)"
    assert out.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["bin.txt", "out.bin"]  # no temporary left
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(InputError, match="is empty"):
        tokenize_text(tmp_path / "empty.txt", out)
    # the folders a refused text would have been written into are not left behind
    with pytest.raises(InputError, match="is not UTF-8"):
        tokenize_text(tmp_path / "bin.txt", tmp_path / "new" / "deeper" / "out.bin")
    assert not (tmp_path / "new").exists()
    (tmp_path / "ok.txt").write_text("ok")
    assert tokenize_text(tmp_path / "ok.txt", tmp_path / "new" / "deeper" / "ok.bin") == 2


def _octoplan(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "octoplan.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env)


@pytest.mark.parametrize("dtype,np_dtype", [("uint16", "<u2"), ("uint32", "<u4")])
def test_tokenize_round_trips_bytes(tmp_path, dtype, np_dtype):
    text = "Pipelines: café, naïve — 東京 ✓\n" * 3
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    done = _octoplan("tokenize", tmp_path / "in.txt", "-o", tmp_path / "out" / "t.bin", "--dtype", dtype)
    assert done.returncode == 0, done.stderr
    ids = np.fromfile(tmp_path / "out" / "t.bin", dtype=np_dtype).tolist()
    assert ids == list(text.encode("utf-8"))
    assert f"{len(ids)} tokens ({dtype}, one per byte)" in done.stdout


def test_tokenize_holds_out_the_texts_end_at_a_character_boundary(tmp_path):
    """--holdout 0.25 of 20 bytes cuts at byte 15, inside the 3-byte "東" (bytes 14-16): the cut
    moves to 17, so each file decodes as whole characters, and together they are the text."""
    text = "abcdefghijklmn東opq"  # 14 ASCII bytes, 東 (3 bytes), 3 more: 20 bytes
    data = text.encode("utf-8")
    assert len(data) == 20
    (tmp_path / "in.txt").write_bytes(data)
    done = _octoplan("tokenize", tmp_path / "in.txt", "-o", tmp_path / "train.bin", "--holdout", "0.25",
                     "--holdout-output", tmp_path / "held" / "val.bin")
    assert done.returncode == 0, done.stderr
    train = np.fromfile(tmp_path / "train.bin", dtype="<u2").tolist()
    held = np.fromfile(tmp_path / "held" / "val.bin", dtype="<u2").tolist()
    assert (train, held) == (list(data[:17]), list(data[17:]))
    assert bytes(train).decode("utf-8") == "abcdefghijklmn東" and bytes(held).decode("utf-8") == "opq"
    assert done.stdout.splitlines() == [f"17 tokens (uint16, one per byte) -> {tmp_path / 'train.bin'}",
                                        f"3 tokens held out -> {tmp_path / 'held' / 'val.bin'}"]


@pytest.mark.parametrize("args,line", [
    (["--holdout", "0.1"], "error: --holdout: needs --holdout-output FILE (give both, or neither)"),
    (["--holdout-output", "VAL"], "error: --holdout-output: needs --holdout FRACTION (give both, or neither)"),
    (["--holdout", "1", "--holdout-output", "VAL"],
     "error: --holdout: is 1.0 (give the held-out fraction of the text, above 0 and below 1)"),
    (["--holdout", "0.01", "--holdout-output", "VAL"],
     "error: IN: is 20 bytes: a --holdout of 0.01 leaves the held-out part empty (give a longer text, or another --holdout)"),
    (["--holdout", "0.1", "--holdout-output", "OUT"], "error: OUT: --holdout-output: is the -o file too (give another file)"),
])
def test_tokenize_bad_holdouts_exit_2_and_write_nothing(tmp_path, args, line):
    """One line each, and no file or temporary left behind."""
    (tmp_path / "in.txt").write_bytes(b"abcdefghijklmnopqrst")
    names = {"IN": str(tmp_path / "in.txt"), "OUT": str(tmp_path / "t.bin"), "VAL": str(tmp_path / "v.bin")}
    done = _octoplan("tokenize", names["IN"], "-o", names["OUT"], *[names.get(a, a) for a in args])
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    for name, path in names.items():
        line = line.replace(f" {name}:", f" {path}:")
    assert lines == [line]
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def test_tokenize_missing_input_exits_2_with_one_line(tmp_path):
    done = _octoplan("tokenize", tmp_path / "none.txt", "-o", tmp_path / "t.bin")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"error: {tmp_path / 'none.txt'}: no such file (give a UTF-8 text file)"]
    assert not (tmp_path / "t.bin").exists()



def test_the_demo_corpus_trains_the_hybrid_example():
    corpus = REPO / "examples" / "data" / "corpus.txt"
    text = corpus.read_text(encoding="utf-8")
    assert 60_000 <= len(text.encode("utf-8")) <= 120_000
    model = load_model_file(REPO / "examples" / "models" / "hybrid.py")
    assert model.tokens_per_sample() == model.config["seq"] + 1
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<u2")
    assert int(ids.max()) < model.config["vocab"]


def test_copies_of_a_token_file_agree_and_a_stale_or_cut_copy_does_not(tmp_path):
    """What the nodes of a job compare before training (octorun.agreement): each may read its
    own copy of the token file, and a copy that differs at either end is another file."""
    model = _model(tmp_path)
    values = list(range(1000))

    def fingerprint(name, tokens):
        return TokenData.open(_tokens(tmp_path / name, tokens), model, seed=0).fingerprint()

    first = fingerprint("a.bin", values)
    assert first.startswith("a file of 1000 uint16 tokens (digest ") and first == fingerprint("copy.bin", values)
    assert fingerprint("cut.bin", values[:-1]).startswith("a file of 999 uint16 tokens")
    assert fingerprint("last.bin", values[:-1] + [7]) != first
    assert fingerprint("first.bin", [7] + values[1:]) != first


def test_octorun_warns_of_a_file_under_one_global_batch_and_of_a_resume_without_data(tmp_path):
    """Two runs that train, but not as the user may think: a token file of fewer windows than a
    step reads (so the step reads some twice), and a resume of a checkpoint trained on --data
    by a run without it (a restart script that lost the flag trains on sample_batch)."""
    import runtime_helpers as h
    from octoplan.plan import save_plan
    from training_helpers import MODEL, write_tokens

    config = {"vocab": 11, "hidden": 8, "depth": 2, "seq": 5, "tie": False, "poison": -1}
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    plan = tmp_path / "plan.yaml"
    save_plan(h.baseline_plan("1f1b", model, config, tmp_path, gpus=1, pp=1, microbatches=4), plan)  # 4 x 2 samples
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"

    def octorun(*args):
        done = subprocess.run([sys.executable, "-m", "octorun", str(plan), *map(str, args)], capture_output=True,
                              text=True, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stderr

    small = write_tokens(tmp_path / "small.bin", count=25)  # (25 - 1) // 5 = 4 windows, under a batch of 8
    assert f"octorun: {small} holds 4 windows of 6 tokens, fewer than one global batch of 8 samples" in octorun(
        "--steps", 1, "--data", small)
    large = write_tokens(tmp_path / "large.bin")
    said = octorun("--steps", 1, "--data", large, "--save", tmp_path / "saved")
    assert "global batch" not in said
    resumed = octorun("--steps", 2, "--resume", "auto", "--save", tmp_path / "saved", "--lr", 0.5)
    assert f"the checkpoint was trained on --data {large}; this run has no --data" in resumed, resumed
    # and a setting changed on the way is named (the run goes on with its own)
    assert "this run's settings differ from the checkpoint's: lr_schedule.lr 0.001 -> 0.5;" in resumed, resumed


def test_a_file_cut_short_while_it_is_read_is_named(tmp_path):
    """Prepared again in place (nanoGPT's np.memmap(mode='w+')) while a run reads it: a mapped
    page past the new end killed the process with SIGBUS and no word."""
    path = _tokens(tmp_path / "t.bin", [i % 50 + 1 for i in range(4000)])
    data = TokenData.open(path, _model(tmp_path, {"seq": 3, "vocab": 64}), seed=0)
    opened = data.fingerprint()
    assert data.windows(0, 8).shape == (8, 4)
    os.truncate(path, 2000)  # 1000 tokens of the 4000 left
    with pytest.raises(InputError) as error:
        data.windows(0, 1333)  # one epoch: every window, most of them gone
    assert (error.value.file, error.value.field) == (path, "size")
    assert error.value.problem == "is 2000 bytes, cut short since the run opened it with 4000 tokens"
    assert data.fingerprint() == opened  # what checkpoints record: the file as the run opened it
