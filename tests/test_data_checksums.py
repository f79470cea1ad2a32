"""Tests for jaxpipe.data's checksums: a changed token file is caught, an unchanged one read once."""

import importlib.util
import json
import os
import time

import numpy as np
import pytest

from jaxpipe import data as jd
from jaxpipe.data import _format
from jaxpipe.errors import DataError
from tests import _runs
from tests._data_util import one_line, overwrite, write_arange

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _aged(out):
  """Backdates the split files as if written before any verification.

  train.bin gets an mtime two hours ago, val.bin one hour ago. Verification
  trusts only a file last modified before its record was written; a test that
  writes and opens within one tick of the file system's clock would otherwise
  (rightly) read the file again.
  """
  now = time.time_ns()
  for hours, name in ((2, "train.bin"), (1, "val.bin")):
    os.utime(os.path.join(out, name), ns=(now, now - hours * 3600 * 10**9))


def _count_reads(monkeypatch):
  """Counts, from now on, the passes over split files and the sha256 hashes begun."""
  count = {"split": 0, "sha256": 0}
  split, sha256 = _format.TokenData.split, _format.hashlib.sha256

  def counted_split(self, name):
    count["split"] += 1
    return split(self, name)

  def counted_sha256(*args):
    count["sha256"] += 1
    return sha256(*args)

  monkeypatch.setattr(_format.TokenData, "split", counted_split)
  monkeypatch.setattr(_format.hashlib, "sha256", counted_sha256)
  return count


def test_overwritten_tokens_fail_the_checksum(tmp_path):
  out = write_arange(tmp_path / "ds")
  data = jd.open_tokens(out)
  np.testing.assert_array_equal(data.split("train")[8:16], np.arange(8, 16))
  del data
  overwrite(os.path.join(out, "train.bin"))
  ids = np.fromfile(os.path.join(out, "train.bin"), "<u2")
  assert ids.max() < 5000 and ids.size == 4000  # in range and the same size: only the hash sees it
  with pytest.raises(DataError) as e:
    jd.open_tokens(out)
  message = one_line(e.value, os.path.join(out, "train.bin"))
  for needle in ("sha256 does not match", "meta.json", "corrupt or was changed after it was "
                 "written", "tools/prepare_data.py"):
    assert needle in message, message
  assert jd.open_tokens(out, verify=False).num_tokens("train") == 4000  # the header still reads


def test_train_refuses_a_dataset_whose_checksum_fails(tmp_path):
  out = jd.write_tokens(tmp_path / "ds", {
      "train": np.random.default_rng(0).integers(0, 256, 4000),
      "val": np.random.default_rng(1).integers(0, 256, 1000)},
      vocab_size=257, eos_id=256, tokenizer="byte")
  overwrite(os.path.join(out, "train.bin"), at=1234)
  run_dir = tmp_path / "run"
  p = _runs.run(str(run_dir), f"data.path={out}", "run.steps=1",
                cache_dir=str(tmp_path / "cache"))
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
  assert os.path.join(out, "train.bin") in lines[0] and "sha256" in lines[0], lines[0]
  assert "Traceback" not in p.stderr
  assert not run_dir.exists()


def test_an_unchanged_dataset_is_verified_once(tmp_path, monkeypatch):
  out = write_arange(tmp_path / "ds")
  _aged(out)
  reads = _count_reads(monkeypatch)
  jd.open_tokens(out)
  assert reads == {"split": 2, "sha256": 2}  # train and val, once each
  record = json.loads(open(os.path.join(out, _format.VERIFIED)).read())
  assert sorted(record) == ["train.bin", "val.bin"]
  data = jd.open_tokens(out)
  assert reads == {"split": 2, "sha256": 2}  # nothing read again
  np.testing.assert_array_equal(data.split("val")[:5], np.arange(5))
  assert data.split_names == ("train", "val")

  os.remove(os.path.join(out, _format.VERIFIED))  # the control: without it, both are read
  jd.open_tokens(out)
  assert reads == {"split": 5, "sha256": 4}
  jd.open_tokens(out, verify=False)  # nothing read, and nothing recorded
  assert reads["sha256"] == 4
  # A record written in the tick the file last changed could miss a later write
  # in that tick, so it does not count for that file (val.bin, newer than train.bin).
  st = os.stat(os.path.join(out, "val.bin"))
  os.utime(os.path.join(out, _format.VERIFIED), ns=(st.st_atime_ns, st.st_mtime_ns))
  jd.open_tokens(out)
  assert reads["sha256"] == 5
  with open(os.path.join(out, _format.VERIFIED), "w") as f:
    f.write("{not json")  # a damaged record is no record
  jd.open_tokens(out)
  assert reads["sha256"] == 7
  json.loads(open(os.path.join(out, _format.VERIFIED)).read())
  # The record is no dataset file: the same dataset written again is still the same.
  assert write_arange(out) == out
  assert sorted(os.listdir(out)) == [_format.VERIFIED, "meta.json", "train.bin", "val.bin"]

  def read_only(*args):
    raise PermissionError(13, "Permission denied")

  os.remove(os.path.join(out, _format.VERIFIED))
  monkeypatch.setattr(_format.os, "replace", read_only)
  jd.open_tokens(out)  # a directory it cannot write to: verified, and nothing kept
  assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]


def test_a_change_after_verification_is_seen(tmp_path, monkeypatch):
  out = write_arange(tmp_path / "ds")
  train = os.path.join(out, "train.bin")
  _aged(out)
  reads = _count_reads(monkeypatch)
  jd.open_tokens(out)
  jd.open_tokens(out)
  assert reads["sha256"] == 2  # verified and recorded
  overwrite(train)  # same size, new mtime
  with pytest.raises(DataError) as e:
    jd.open_tokens(out)
  one_line(e.value, train)

  # A write that puts the old mtime back (touch -d, os.utime) still changes ctime.
  out = write_arange(tmp_path / "ds2")
  train = os.path.join(out, "train.bin")
  _aged(out)
  jd.open_tokens(out)
  before = os.stat(train)
  overwrite(train)
  os.utime(train, ns=(before.st_atime_ns, before.st_mtime_ns))
  assert os.stat(train).st_mtime_ns == before.st_mtime_ns
  with pytest.raises(DataError, match="sha256 does not match"):
    jd.open_tokens(out)

  # A header edited after verification is held to its new vocab_size.
  out = write_arange(tmp_path / "ds3")
  _aged(out)
  jd.open_tokens(out)
  meta = json.loads(open(os.path.join(out, "meta.json")).read())
  meta["vocab_size"] = 3000
  with open(os.path.join(out, "meta.json"), "w") as f:
    json.dump(meta, f)
  with pytest.raises(DataError, match="token id 3000 at position 3000"):
    jd.open_tokens(out)


def test_a_split_without_a_checksum_still_opens(tmp_path, monkeypatch):
  out = write_arange(tmp_path / "ds")
  meta = json.loads(open(os.path.join(out, "meta.json")).read())
  del meta["splits"]["train"]["sha256"]
  with open(os.path.join(out, "meta.json"), "w") as f:
    json.dump(meta, f)
  overwrite(os.path.join(out, "train.bin"))  # undetectable without a checksum
  reads = _count_reads(monkeypatch)
  jd.open_tokens(out)
  assert reads == {"split": 2, "sha256": 1}  # ids checked in both, val hashed


def test_split_shorter_than_one_sequence(tmp_path):
  out = write_arange(tmp_path / "ds", n=100, val=16)
  data = jd.open_tokens(out)
  assert data.num_sequences("val", 15) == 1
  with pytest.raises(DataError) as e:
    jd.eval_batches(data, seq_len=16, batch_size=2, num_microbatches=1, num_batches=1)
  one_line(e.value, os.path.join(out, "val.bin"))
  with pytest.raises(DataError) as e:
    jd.train_dataset(out, seq_len=100, batch_size=2, num_microbatches=1, seed=0)
  one_line(e.value, os.path.join(out, "train.bin"))
  with pytest.raises(DataError, match="no split 'test'"):
    data.split("test")


def test_bench_data_verify_runs_and_cleans_up(tmp_path, capsys):
  spec = importlib.util.spec_from_file_location(
      "_tool_bench_data_verify", os.path.join(REPO, "tools", "bench_data_verify.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  assert bench.main(["--gib", "0.001", "--repeat", "1", "--dir", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  for row in ("open_tokens, no record", "... file evicted", "open_tokens, recorded",
              "open_tokens(verify=False)", "id check alone", "id check + sha256"):
    assert f"| {row} " in out, out
  assert "load average" in out and "GiB on disk" in out
  assert os.listdir(tmp_path) == []
