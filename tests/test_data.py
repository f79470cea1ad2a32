"""Tests for jaxpipe.data: the token format, tokenizers, corpus, pipeline and CLI.

The checksums of a dataset are tested in test_data_checksums.py."""

import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest

from jaxpipe import data as jd
from jaxpipe.errors import DataError
from tests._data_util import one_line, overwrite, write_arange

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "prepare_data.py")




# --- format ------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [257, 70_000])
def test_round_trip(tmp_path, vocab):
  rng = np.random.default_rng(0)
  train, val = rng.integers(0, vocab, 1000), rng.integers(0, vocab, 77)
  out = jd.write_tokens(tmp_path / "ds", {"train": train, "val": val}, vocab_size=vocab,
                        eos_id=vocab - 1, tokenizer="byte", meta_extra={"source": "test"})
  data = jd.open_tokens(out)
  assert (data.vocab_size, data.eos_id, data.tokenizer) == (vocab, vocab - 1, "byte")
  assert data.dtype == (np.uint16 if vocab <= 65536 else np.uint32)
  assert isinstance(data.split("train"), np.memmap)
  np.testing.assert_array_equal(data.split("train"), train)
  np.testing.assert_array_equal(data.split("val"), val)
  meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
  assert meta["format"] == "jaxpipe-tokens" and meta["version"] == 1
  assert meta["splits"]["val"] == {"file": "val.bin", "num_tokens": 77,
                                   "sha256": meta["splits"]["val"]["sha256"]}
  assert meta["source"] == "test"
  assert os.path.getsize(tmp_path / "ds" / "train.bin") == 1000 * data.dtype.itemsize
  assert sorted(os.listdir(tmp_path)) == ["ds"]  # no temporary directories left


def test_write_never_replaces_a_different_dataset(tmp_path):
  out = tmp_path / "ds"
  write_arange(out, n=100)
  write_arange(out, n=100)  # the same dataset again: kept, no error
  with pytest.raises(DataError) as e:
    write_arange(out, n=101)
  one_line(e.value, str(out))
  assert jd.open_tokens(out).num_tokens("train") == 100
  jd.write_tokens(out, {"train": np.arange(5)}, vocab_size=10, eos_id=0, tokenizer="byte",
                  overwrite=True)
  assert jd.open_tokens(out).split_names == ("train",)
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "keep.txt").write_text("mine")
  with pytest.raises(DataError, match="not a jaxpipe token directory"):
    jd.write_tokens(tmp_path / "notes", {"train": np.arange(5)}, vocab_size=10, eos_id=0,
                    tokenizer="byte", overwrite=True)
  assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
  assert sorted(os.listdir(tmp_path)) == ["ds", "notes"]


def test_failed_write_leaves_nothing(tmp_path):
  with pytest.raises(RuntimeError):
    with jd.TokenWriter(tmp_path / "ds", vocab_size=257, eos_id=256, tokenizer="byte") as w:
      w.append("train", np.arange(10))
      raise RuntimeError("killed")
  with pytest.raises(DataError, match="outside"):
    jd.write_tokens(tmp_path / "ds", {"train": np.array([300])}, vocab_size=257, eos_id=256,
                    tokenizer="byte")
  assert os.listdir(tmp_path) == []


def _corrupt(tmp_path, how):
  """Writes a small dataset, damages it as `how` says, and returns (dir, culprit)."""
  out = tmp_path / "ds"
  write_arange(out, n=100, vocab=200, val=30)
  meta_path = out / "meta.json"
  meta = json.loads(meta_path.read_text())
  if how == "missing dir":
    return tmp_path / "nowhere", tmp_path / "nowhere"
  if how == "missing meta":
    meta_path.unlink()
    return out, meta_path
  if how == "bad json":
    meta_path.write_text("{not json")
    return out, meta_path
  if how == "missing split file":
    (out / "val.bin").unlink()
    return out, out / "val.bin"
  if how == "truncated":
    with open(out / "train.bin", "r+b") as f:
      f.truncate(150)
    return out, out / "train.bin"
  if how == "ids beyond vocab":
    ids = np.arange(100, dtype="<u2")
    ids[57] = 250
    ids.tofile(out / "train.bin")
    return out, out / "train.bin"
  if how == "bytes changed":
    overwrite(out / "val.bin")
    return out, out / "val.bin"
  if how == "bad sha256":
    meta["splits"]["val"]["sha256"] = "abc"
    meta_path.write_text(json.dumps(meta))
    return out, meta_path
  edits = {
      "wrong format": {"format": "npy"},
      "wrong version": {"version": 2},
      "bad dtype": {"dtype": "float32"},
      "eos beyond vocab": {"eos_id": 200},
      "split path": {"splits": {"train": {"file": "../train.bin", "num_tokens": 100}}},
  }
  if how == "missing key":
    del meta["vocab_size"]
  else:
    meta.update(edits[how])
  meta_path.write_text(json.dumps(meta))
  return out, meta_path


@pytest.mark.parametrize("how", [
    "missing dir", "missing meta", "bad json", "wrong format", "wrong version", "missing key",
    "bad dtype", "eos beyond vocab", "split path", "missing split file", "truncated",
    "ids beyond vocab", "bytes changed", "bad sha256"])
def test_bad_data_is_a_one_line_error_naming_the_file(tmp_path, how):
  path, culprit = _corrupt(tmp_path, how)
  with pytest.raises(DataError) as e:
    jd.open_tokens(path)
  message = one_line(e.value, str(culprit))
  if how == "ids beyond vocab":
    assert "250" in message and "position 57" in message
  if how == "truncated":
    assert "truncated" in message
  if how == "bytes changed":
    assert "sha256" in message and "meta.json" in message


def test_ids_are_checked_in_chunks(tmp_path, monkeypatch):
  from jaxpipe.data import _format
  monkeypatch.setattr(_format, "_CHUNK", 7)
  ids = np.arange(100) % 50
  ids[93] = 60
  jd.write_tokens(tmp_path / "ds", {"train": ids % 50}, vocab_size=100, eos_id=0,
                  tokenizer="byte")
  ids.astype("<u2").tofile(tmp_path / "ds" / "train.bin")
  jd.open_tokens(tmp_path / "ds", verify=False)
  meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
  meta["vocab_size"] = 55
  (tmp_path / "ds" / "meta.json").write_text(json.dumps(meta))
  with pytest.raises(DataError, match="position 93"):
    jd.open_tokens(tmp_path / "ds")


# --- tokenizers --------------------------------------------------------------


def test_byte_tokenizer():
  tok = jd.get_tokenizer("byte")
  text = "Grüße, 世界! naïve café ✓"
  ids = tok.encode(text)
  assert ids == list(text.encode("utf-8")) and max(ids) < 256
  assert tok.decode(ids) == text
  assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")
  docs = tok.encode_documents(["ab", "", "ü"])
  assert docs.tolist() == [97, 98, 256, 256, 195, 188, 256]
  assert tok.decode(docs) == "ab<|endoftext|><|endoftext|>ü<|endoftext|>"


def test_gpt2_tokenizer_offline(monkeypatch):
  from jaxpipe.data import _tokenizers

  def no_network(*args, **kwargs):
    raise AssertionError("the gpt2 tokenizer tried to use the network")

  monkeypatch.setattr(socket.socket, "connect", no_network)
  monkeypatch.setattr(socket, "create_connection", no_network)
  tok = _tokenizers._Gpt2Tokenizer()  # pylint: disable=protected-access
  assert tok.encode("Hello world") == [15496, 995]
  assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
  text = "It's 2024: naïve BPE — tokens, ids & bytes!\n\n  Indented."
  assert tok.decode(tok.encode(text)) == text
  # The end-of-text string in a document is text, not the special id.
  assert 50256 not in tok.encode("a <|endoftext|> b")
  assert jd.get_tokenizer("gpt2").encode_documents(["Hello", "world"]).tolist() == [
      15496, 50256, 6894, 50256]


def test_tokenizer_json(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = ["the quick brown fox jumps over the lazy dog", "über naïve café"] * 50
  tok.train_from_iterator(corpus, trainer)
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  ours = jd.get_tokenizer(str(path))
  assert ours.eos_id == 0 and ours.vocab_size == tok.get_vocab_size()
  text = "The lazy fox, über alles: 42!"
  assert ours.decode(ours.encode(text)) == text
  assert ours.encode_documents(["fox", "dog"])[-1] == 0
  assert jd.get_tokenizer(str(tmp_path)).fingerprint == ours.fingerprint
  # A dataset keeps its tokenizer.json, so it decodes wherever it is moved.
  out = jd.write_tokens(tmp_path / "ds", {"train": ours.encode_documents(["the dog"])},
                        vocab_size=ours.vocab_size, eos_id=ours.eos_id, tokenizer=str(path))
  data = jd.open_tokens(out)
  assert data.tokenizer == "tokenizer.json"
  assert data.load_tokenizer().decode(data.split("train")) == "the dog<|endoftext|>"


def test_bad_tokenizer_specs(tmp_path):
  with pytest.raises(DataError, match="unknown tokenizer 'gpt5'"):
    jd.get_tokenizer("gpt5")
  with pytest.raises(DataError, match="not found"):
    jd.get_tokenizer(str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text('{"not": "a tokenizer"}')
  with pytest.raises(DataError) as e:
    jd.get_tokenizer(str(bad))
  one_line(e.value, str(bad))


# --- embedded corpus ---------------------------------------------------------


@pytest.fixture(scope="session")
def kjv(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("cache"))
  return cache, jd.prepare_embedded("kjv", "byte", cache)


def test_embedded_corpus(kjv):
  cache, path = kjv
  assert os.path.dirname(path) == cache and os.path.basename(path) == "kjv-byte-v1"
  data = jd.open_tokens(path)
  assert (data.vocab_size, data.eos_id, data.tokenizer) == (257, 256, "byte")
  train, val = data.num_tokens("train"), data.num_tokens("val")
  assert 4_000_000 < train < 4_200_000
  assert 0.01 < val / (train + val) < 0.025
  text = data.load_tokenizer().decode(data.split("train")[:400])
  assert text.startswith("In the beginning God created the heaven and the earth.")
  assert "darkness was upon the face" in text  # italics brackets dropped, words kept
  raw = bytes(np.asarray(data.split("train")[:400_000], np.uint8))
  assert b"[" not in raw and "\u2019".encode() not in raw
  assert data.meta["num_documents"]["val"] == 92


def test_embedded_corpus_is_cached(kjv, monkeypatch):
  cache, path = kjv
  from jaxpipe.data import _corpus

  def rebuild():
    raise AssertionError("rebuilt a cached corpus")

  stamp = os.stat(os.path.join(path, "meta.json")).st_mtime_ns
  monkeypatch.setitem(_corpus.CORPORA, "kjv", rebuild)
  assert jd.prepare_embedded("kjv", "byte", cache) == path
  assert os.stat(os.path.join(path, "meta.json")).st_mtime_ns == stamp
  assert [n for n in os.listdir(cache) if n.startswith(".")] == []


def test_embedded_corpus_cache_dir_and_repair(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXPIPE_CACHE", str(tmp_path))
  stale, live = tmp_path / ".kjv-byte-v1.tmp-killed", tmp_path / ".kjv-byte-v1.tmp-running"
  stale.mkdir()
  live.mkdir()
  os.utime(stale, (0, 0))  # left by a build killed long ago
  path = jd.prepare_embedded("kjv", "byte")
  assert os.path.dirname(path) == str(tmp_path)
  assert not stale.exists() and live.exists()
  with open(os.path.join(path, "val.bin"), "r+b") as f:
    f.truncate(10)  # damage from outside is repaired by a rebuild
  assert jd.prepare_embedded("kjv", "byte") == path
  assert jd.open_tokens(path).num_tokens("val") > 10
  with pytest.raises(DataError, match="known corpora: kjv"):
    jd.prepare_embedded("wikitext")


# --- pipeline ----------------------------------------------------------------


@pytest.fixture
def arange_data(tmp_path):
  return jd.open_tokens(write_arange(tmp_path / "ds", n=4001, vocab=5000, val=700))


def _windows(batch, seq_len):
  return (batch["tokens"][..., 0] // seq_len).reshape(-1)


def test_batches_shapes_and_targets(arange_data):
  ds = jd.train_dataset(arange_data, seq_len=16, batch_size=12, num_microbatches=3, seed=0)
  for k in (0, 1, 500):
    batch = ds[k]
    assert set(batch) == {"tokens", "targets"}
    for x in batch.values():
      assert x.shape == (3, 4, 16) and x.dtype == np.int32
    tokens, targets = batch["tokens"], batch["targets"]
    np.testing.assert_array_equal(targets[..., :-1], tokens[..., 1:])
    np.testing.assert_array_equal(targets[..., -1], tokens[..., -1] + 1)
    assert np.all(tokens[..., 0] % 16 == 0)  # windows start at multiples of seq_len
    np.testing.assert_array_equal(tokens, tokens[..., :1] + np.arange(16))


def test_epochs_cover_every_window_and_reshuffle(arange_data):
  # 4001 tokens hold 250 windows of 17 at stride 16: 25 batches of 10 per epoch.
  ds = jd.train_dataset(arange_data, seq_len=16, batch_size=10, num_microbatches=2, seed=3)
  epoch0 = np.concatenate([_windows(ds[k], 16) for k in range(25)])
  epoch1 = np.concatenate([_windows(ds[k], 16) for k in range(25, 50)])
  assert sorted(epoch0) == sorted(epoch1) == list(range(250))
  assert not np.array_equal(epoch0, epoch1)
  assert not np.array_equal(epoch0, np.arange(250))
  other = jd.train_dataset(arange_data, seq_len=16, batch_size=10, num_microbatches=2, seed=4)
  assert not np.array_equal(_windows(ds[0], 16), _windows(other[0], 16))
  again = jd.train_dataset(arange_data.path, seq_len=16, batch_size=10, num_microbatches=2,
                           seed=3)
  np.testing.assert_array_equal(_windows(again[7], 16), _windows(ds[7], 16))


@pytest.mark.parametrize("shards", [2, 4])
def test_shards_are_disjoint_and_form_the_global_batch(arange_data, shards):
  kw = dict(seq_len=8, batch_size=16, num_microbatches=2, seed=1)
  whole = jd.train_dataset(arange_data, **kw)
  parts = [jd.train_dataset(arange_data, shard_index=s, shard_count=shards, **kw)
           for s in range(shards)]
  for k in (0, 3, 1000):
    local = [p[k] for p in parts]
    assert local[0]["tokens"].shape == (2, 8 // shards, 8)
    for key in ("tokens", "targets"):
      np.testing.assert_array_equal(np.concatenate([x[key] for x in local], axis=1),
                                    whole[k][key])
    seen = np.concatenate([_windows(x, 8) for x in local])
    assert len(set(seen.tolist())) == 16
  evals = [jd.eval_batches(arange_data, seq_len=8, batch_size=16, num_microbatches=2,
                           num_batches=2, shard_index=s, shard_count=shards)
           for s in range(shards)]
  full = jd.eval_batches(arange_data, seq_len=8, batch_size=16, num_microbatches=2,
                         num_batches=2)
  for j in range(2):
    np.testing.assert_array_equal(
        np.concatenate([e[j]["tokens"] for e in evals], axis=1), full[j]["tokens"])


def test_only_local_rows_are_read(arange_data, monkeypatch):
  tokens = arange_data.split("train")
  starts = []

  class Recorder:

    def __getitem__(self, sl):
      starts.append(sl.start)
      return tokens[sl]

  monkeypatch.setattr(arange_data, "split", lambda name: Recorder())
  ds = jd.train_dataset(arange_data, seq_len=16, batch_size=32, num_microbatches=4, seed=0,
                        shard_index=1, shard_count=4)
  ds[0]
  assert len(starts) == 4 * 2  # 4 microbatches x 2 rows of this shard, not 32


def test_batch_arithmetic_is_checked(arange_data):
  for kw in (dict(batch_size=10, num_microbatches=3), dict(batch_size=12, num_microbatches=2,
                                                           shard_count=4),
             dict(batch_size=8, num_microbatches=2, shard_index=2, shard_count=2)):
    with pytest.raises(ValueError):
      jd.train_dataset(arange_data, seq_len=8, seed=0, **kw)


_RESUME = """
import json, sys
sys.path.insert(0, {repo!r})
import numpy as np
from jaxpipe import data as jd
it = jd.train_iterator({path!r}, seq_len=16, batch_size=8, num_microbatches=2, seed=5,
                       shard_index=1, shard_count=2)
it.set_state(json.loads(sys.argv[1]))
print(json.dumps([next(it)["tokens"].tolist() for _ in range(3)]))
"""


@pytest.mark.parametrize("prefetch", [0, 2])
def test_iterator_resumes_exactly(arange_data, prefetch):
  kw = dict(seq_len=16, batch_size=8, num_microbatches=2, seed=5, shard_index=1,
            shard_count=2)
  it = jd.train_iterator(arange_data.path, prefetch=prefetch, **kw)
  for _ in range(40):  # past the first epoch (250 windows = 31 batches of 8)
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(3)]
  fresh = jd.train_iterator(arange_data.path, prefetch=prefetch, **kw)
  next(fresh)
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    for key in ("tokens", "targets"):
      np.testing.assert_array_equal(got[key], want[key])
  if prefetch:  # and in another process, from nothing but the saved state
    script = _RESUME.format(repo=REPO, path=arange_data.path)
    out = subprocess.run([sys.executable, "-c", script, json.dumps(state)],
                         capture_output=True, text=True, check=True, timeout=120)
    np.testing.assert_array_equal(np.array(json.loads(out.stdout)),
                                  np.stack([b["tokens"] for b in expected]))


def test_eval_batches_in_order_and_wrapping(arange_data):
  # val: 700 tokens = 43 windows of 17 at stride 16.
  kw = dict(seq_len=16, batch_size=8, num_microbatches=2, num_batches=7)
  first, second = jd.eval_batches(arange_data, **kw), jd.eval_batches(arange_data.path, **kw)
  assert len(first) == 7
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  np.testing.assert_array_equal(_windows(first[0], 16), np.arange(8))
  np.testing.assert_array_equal(_windows(first[6], 16), np.arange(48, 56) % 43)
  assert first[0]["tokens"].shape == (2, 4, 16)
  assert jd.eval_batches(arange_data, seq_len=16, batch_size=8, num_microbatches=2,
                         num_batches=0) == []


# --- prepare_data ------------------------------------------------------------


def _inputs(tmp_path):
  src = tmp_path / "src"
  (src / "sub").mkdir(parents=True)
  paragraphs = [f"Paragraph {i} of the book, with some words." for i in range(20)]
  (src / "book.txt").write_text("\n\n".join(paragraphs) + "\n")
  (src / "sub" / "notes.md").write_text("# Notes\n\nA short note.\n")
  with open(src / "sub" / "docs.jsonl", "w") as f:
    for i in range(10):
      f.write(json.dumps({"id": i, "text": f"Document number {i}."}) + "\n")
    f.write("\n")
  (src / "array.json").write_text(json.dumps([{"text": "From an array."}]))
  (src / "ignored.csv").write_text("a,b\n")
  (src / "sub" / "figure.png").write_bytes(b"\x89PNG")
  (src / ".DS_Store").write_bytes(b"\0")  # hidden: passed over without a word
  (src / ".git").mkdir()
  (src / ".git" / "description.txt").write_text("not part of the corpus")
  return src


def test_prepare_data_cli(tmp_path):
  src = _inputs(tmp_path)
  out = tmp_path / "out"
  run = subprocess.run(
      [sys.executable, TOOL, "--tokenizer", "byte", "--out", str(out), "--val-fraction", "0.2",
       "--seq-len", "32", "src"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert run.returncode == 0, run.stderr
  summary = run.stdout.strip().splitlines()
  assert len(summary) == 1 and str(out) in summary[0] and "train" in summary[0]
  assert summary[0].endswith(
      "; skipped 1 file, not a text extension (name it to include it): src/ignored.csv"
      "; skipped 1 file, not UTF-8 text: src/sub/figure.png"), summary[0]
  data = jd.open_tokens(out)
  tok = jd.get_tokenizer("byte")
  train = tok.decode(data.split("train"))
  val = tok.decode(data.split("val"))
  # Units in sorted path order: array.json (0), book.txt's paragraphs (1-20),
  # sub/docs.jsonl (21-30), sub/notes.md (31-32); every 5th (i % 5 == 4) is val.
  assert data.meta["num_documents"] == {"train": 11, "val": 3}
  assert "Paragraph 3 of" in val and "Paragraph 3 of" not in train
  assert "Paragraph 2 of the book, with some words.\n\nParagraph 4 of" in train
  assert "Document number 3." in val and "Document number 4." in train
  assert "From an array.<|endoftext|>" in train and "a,b" not in train + val
  assert len(data.meta["sources"]) == 4 and "corpus" not in train + val
  assert data.meta["skipped_files"] == [str(src / "ignored.csv"), str(src / "sub" / "figure.png")]
  assert data.meta["skipped_reasons"] == {
      str(src / "ignored.csv"): "not a text extension (name it to include it)",
      str(src / "sub" / "figure.png"): "not UTF-8 text"}

  too_long = ["--val-fraction", "0.2", "--seq-len", "4096", str(src)]
  for culprit, args in (("missing.txt", [str(src / "missing.txt")]),
                        ("seq_len+1 = 4097", too_long)):
    # Refused before and after tokenising (with a progress bar, were stderr a terminal).
    bad = subprocess.run(
        [sys.executable, TOOL, "--tokenizer", "byte", "--out", str(tmp_path / "out2"), *args],
        capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0] and "Traceback" not in bad.stderr, lines
    assert not (tmp_path / "out2").exists()
  assert sorted(os.listdir(tmp_path)) == ["out", "src"]


# The start of a PNG file: invalid UTF-8 in its second byte, as binaries are.
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def test_prepare_data_reads_a_text_file_named_whatever_its_name(tmp_path, capsys):
  """LICENSE, README, notes.log: a text file named itself is read as a .txt."""
  (tmp_path / "LICENSE").write_text("Permission is granted.\n\nTo everyone.\n\nFree of charge.\n")
  (tmp_path / "run.log").write_text("step 1\n\nstep 2\n")
  code = _tool().main(["--tokenizer", "byte", "--out", str(tmp_path / "out"), "--quiet",
                       "--val-fraction", "0.5", "--seq-len", "3",
                       str(tmp_path / "LICENSE"), str(tmp_path / "run.log")])
  assert code == 0, capsys.readouterr().err
  data = jd.open_tokens(tmp_path / "out")
  tok = jd.get_tokenizer("byte")
  # Units: LICENSE's three paragraphs (0-2), then run.log's two (3-4); odd ones are val.
  assert tok.decode(data.split("train")) == (
      "Permission is granted.\n\nFree of charge.<|endoftext|>step 2<|endoftext|>")
  assert tok.decode(data.split("val")) == "To everyone.<|endoftext|>step 1<|endoftext|>"
  assert data.meta["sources"] == [str(tmp_path / "LICENSE"), str(tmp_path / "run.log")]
  assert data.meta["skipped_files"] == []


def test_prepare_data_says_which_files_of_a_folder_it_skipped_and_why(tmp_path, capsys):
  src = tmp_path / "data"
  src.mkdir()
  (src / "a.txt").write_text("one\n\ntwo\n\nthree\n")
  (src / "x.bin").write_bytes(PNG)
  (src / "LICENSE").write_text("Text, but not by its name.\n")
  code = _tool().main(["--tokenizer", "byte", "--out", str(tmp_path / "out"), "--quiet",
                       "--val-fraction", "0.5", "--seq-len", "3", str(src)])
  out, err = capsys.readouterr()
  assert code == 0 and err == "", err
  lines = out.strip().splitlines()
  assert len(lines) == 1, lines
  # The folder rule is unchanged: by extension. LICENSE sorts before x.bin.
  assert lines[0].endswith(
      f"; skipped 1 file, not a text extension (name it to include it): {src / 'LICENSE'}"
      f"; skipped 1 file, not UTF-8 text: {src / 'x.bin'}"), lines[0]
  data = jd.open_tokens(tmp_path / "out")
  assert data.meta["sources"] == [str(src / "a.txt")]
  assert data.meta["skipped_reasons"] == {
      str(src / "LICENSE"): "not a text extension (name it to include it)",
      str(src / "x.bin"): "not UTF-8 text"}
  assert "Text, but" not in jd.get_tokenizer("byte").decode(data.split("train"))


@pytest.mark.parametrize("content", [PNG, "UTF-16 text".encode("utf-16"),
                                     b"NUL\x00in valid UTF-8"])
def test_prepare_data_refuses_a_named_file_that_is_not_text(tmp_path, capsys, content):
  (tmp_path / "a.txt").write_text("one\n\ntwo\n\nthree\n")
  (tmp_path / "blob").write_bytes(content)
  code = _tool().main(["--tokenizer", "byte", "--out", str(tmp_path / "out"), "--quiet",
                       str(tmp_path / "a.txt"), str(tmp_path / "blob")])
  captured = capsys.readouterr()
  assert code == 2 and captured.out == ""
  assert captured.err == (f"prepare_data: {tmp_path / 'blob'}: not UTF-8 text; give UTF-8 "
                          "text files (any name), or .jsonl, .json or .parquet files\n")
  assert sorted(os.listdir(tmp_path)) == ["a.txt", "blob"]  # nothing written


def test_a_dataset_takes_the_modes_the_umask_gives(tmp_path):
  """A dataset is readable by whoever may read its neighbours: 0777/0666 & ~umask, not 0700."""
  # 0o077 as well: the modes follow the umask, they are not set to fixed values.
  for umask, folder, files in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
    out = tmp_path / f"data-{umask:03o}"
    old = os.umask(umask)
    try:
      write_arange(out, n=50)
    finally:
      os.umask(old)
    modes = {p: stat.S_IMODE(os.stat(out / p).st_mode) for p in ["", *os.listdir(out)]}
    assert {"", "meta.json", "train.bin", "val.bin"} <= set(modes), modes
    assert {k: oct(v) for k, v in modes.items()} == {
        k: oct(folder if k == "" else files) for k in modes}


def _tool():
  from jaxpipe.cli import prepare_data  # pylint: disable=g-import-not-at-top
  return prepare_data


def test_prepare_data_names_a_few_skipped_files(tmp_path, capsys):
  src = tmp_path / "src"
  src.mkdir()
  (src / "a.txt").write_text("one\n\ntwo\n\nthree\n")
  for i in range(7):
    (src / f"img{i}.png").write_bytes(b"")
  code = _tool().main(["--tokenizer", "byte", "--out", str(tmp_path / "out"), "--quiet",
                       "--val-fraction", "0.5", "--seq-len", "3", str(src)])
  assert code == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert len(out) == 1
  names = ", ".join(str(src / f"img{i}.png") for i in range(5))
  assert out[0].endswith("; skipped 7 files, not a text extension (name it to include it): "
                         f"{names} and 2 more"), out[0]
  assert len(jd.open_tokens(tmp_path / "out").meta["skipped_files"]) == 7


def test_prepare_data_minimum_is_the_trainers(tmp_path):
  """A val split of exactly seq_len+1 tokens passes, and holds the trainer's one sequence."""
  good = tmp_path / "a.txt"
  good.write_text("one\n\ntwo\n\nthree\n")  # val: "two" + end of text = 4 tokens
  data = jd.prepare_files([str(good)], str(tmp_path / "out"), tokenizer="byte",
                          val_fraction=0.5, seq_len=3, progress=False)
  assert data.num_tokens("val") == 4 and data.num_sequences("val", 3) == 1
  assert data.meta["skipped_files"] == []
  with pytest.raises(DataError) as e:
    jd.prepare_files([str(good)], str(tmp_path / "out2"), tokenizer="byte", val_fraction=0.5,
                     seq_len=4, progress=False)
  one_line(e.value, "4 tokens, fewer than one sequence of seq_len+1 = 5")
  with pytest.raises(DataError):  # what the trainer would have said
    data.num_sequences("val", 4)
  assert sorted(os.listdir(tmp_path)) == ["a.txt", "out"]


@pytest.mark.parametrize("case", ["unknown tokenizer", "empty dir", "bad jsonl", "missing key",
                                  "exists", "bad fraction", "not utf8", "parquet",
                                  "no val", "usage", "zero fraction", "short val",
                                  "short train", "bad seq len", "binary named",
                                  "only other types"])
def test_prepare_data_bad_input(tmp_path, capsys, case):
  prepare_data = _tool()
  src = tmp_path / "src"
  src.mkdir()
  good = src / "a.txt"
  good.write_text("one\n\ntwo\n\nthree\n")
  out = tmp_path / "out"
  args = ["--tokenizer", "byte", "--out", str(out), "--quiet", str(good)]
  if case == "unknown tokenizer":
    args[1] = "sentencepiece"
  elif case == "empty dir":
    (tmp_path / "empty").mkdir()
    args[-1] = str(tmp_path / "empty")
  elif case in ("bad jsonl", "missing key"):
    bad = src / "b.jsonl"
    bad.write_text('{"text": "fine"}\n' + ('{"text": ' if case == "bad jsonl" else '{"body": "x"}')
                   + "\n")
    args.append(str(bad))
  elif case == "exists":
    write_arange(out, n=50)
  elif case == "bad fraction":
    args += ["--val-fraction", "0.9"]
  elif case == "not utf8":
    (src / "c.txt").write_bytes(b"\xff\xfe\x00binary")
    args.append(str(src / "c.txt"))
  elif case == "parquet":
    (src / "d.parquet").write_bytes(b"PAR1")
    args.append(str(src / "d.parquet"))
  elif case == "no val":
    args += ["--val-fraction", "0.1"]
  elif case == "usage":
    args = ["--out"]
  elif case == "zero fraction":
    args += ["--val-fraction", "0"]
  elif case == "short val":  # val: "two" + end of text = 4 tokens
    args += ["--val-fraction", "0.5", "--seq-len", "8"]
  elif case == "short train":  # train: "a" + end of text; val: 11 tokens
    good.write_text("a\n\nbbbbbbbbbb\n")
    args += ["--val-fraction", "0.5", "--seq-len", "4"]
  elif case == "bad seq len":
    args += ["--seq-len", "0"]
  elif case == "binary named":  # named itself, so read whatever its name: if it is text
    (src / "figure.png").write_bytes(PNG)
    args.append(str(src / "figure.png"))
  elif case == "only other types":
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "table.csv").write_text("a,b\n")
    args[-1] = str(tmp_path / "empty")
  if case == "parquet" and _has_pyarrow():
    pytest.skip("pyarrow is installed")
  try:
    code = prepare_data.main(args)
  except SystemExit as e:  # argparse's usage errors
    code = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2, err
  assert len(err) == 1 and err[0].startswith("prepare_data: "), err
  said = {
      "zero fraction": "val fraction 0.0 is not in (0, 0.5]; training needs a val split",
      "short val": "the val split would hold 4 tokens, fewer than one sequence of "
                   "seq_len+1 = 9; raise --val-fraction",
      "short train": "the train split would hold 2 tokens, fewer than one sequence of "
                     "seq_len+1 = 5; add text or lower --seq-len",
      "bad seq len": "seq_len 0 is not an integer >= 1",
      "binary named": "figure.png: not UTF-8 text; give UTF-8 text files (any name), or ",
      "only other types": "no .txt, .md, .jsonl, .json or .parquet files in this directory "
                          "(only 1 of other types: ",
  }
  assert said.get(case, "") in err[0], err
  if case == "exists":
    assert jd.open_tokens(out).num_tokens("train") == 50
  else:
    assert not out.exists()
  assert sorted(os.listdir(tmp_path)) in (["src"], ["empty", "src"], ["out", "src"])


def _has_pyarrow():
  return importlib.util.find_spec("pyarrow") is not None

