"""The results store: nothing is overwritten or lost. Configs live side by side, a finished cell is re-run only
with --force, damaged files are reported in one line, set aside and recomputed, files get the user's umask, and a
run that blows up without a NaN is still marked diverged."""

from __future__ import annotations

import os

import pytest
import torch

from qlbench import cli, engine
from qlbench.experiments import adapted
from qlbench.records import results
from qlbench.records.store import Store

from helpers import one_line_error

SMOKE = ["--function", "matyas", "--arch", "deep-narrow", "--no-progress"]


def run(tmp_path, *args) -> int:
    return cli.main(["run", *SMOKE, "--out", str(tmp_path), *args])


def records(tmp_path, method="lora") -> list:
    return Store(tmp_path).records(method=method)


def test_budgets_live_side_by_side_with_loadable_models(tmp_path, capsys, monkeypatch):
    # the store keys cells by the budget's name: a shortened `quick` (a few epochs) tests the same layout in seconds
    short = engine.Budget("quick", 3, engine.Phase(4, 3e-3), engine.Phase(6, 5e-4), eval_every=2)
    monkeypatch.setitem(engine.BUDGETS["deep-narrow"], "quick", short)
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    assert run(tmp_path, "--budget", "quick", "--methods", "lora", "--seeds", "1") == 0
    found = records(tmp_path)
    assert sorted(Store(tmp_path).cell_of(p)[3] for p in found) == ["quick", "smoke"]
    for record in found:
        model, data, rec = adapted.load_adapted(record)
        expected = torch.tensor([s["test_curve"][-1] for s in rec["train_info"]["per_seed"]])
        torch.testing.assert_close(engine.evaluate(model, data.x_test, data.y_test), expected, rtol=1e-5, atol=0)
    capsys.readouterr()
    assert cli.main(["results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| lora ") == 2 and "deep-narrow/quick: 1 record(s)" in out


def test_same_config_is_skipped_and_force_reruns_it(tmp_path, capsys):
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    (record,) = records(tmp_path)
    stamp = record.stat().st_mtime_ns
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    assert record.stat().st_mtime_ns == stamp and "--force re-runs them" in capsys.readouterr().err
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora", "--hp", "r=4") == 0  # another config: a new file
    assert len(records(tmp_path)) == 2 and record.stat().st_mtime_ns == stamp
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora", "--force") == 0
    assert record.stat().st_mtime_ns != stamp


@pytest.mark.parametrize("content", ["", '{"run_info": {', "[1, 2]", '{"a": 1}'])
def test_a_damaged_record_is_reported_set_aside_and_recomputed(tmp_path, capsys, content):
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    (record,) = records(tmp_path)
    record.write_text(content)
    capsys.readouterr()
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{record} is damaged" in err and "recomputed" in err
    assert results.read_record(record)["train_info"]["status"] == "ok"
    assert record.with_name(record.name + ".damaged-1").read_text() == content  # kept, never deleted


def test_a_damaged_backbone_cache_is_set_aside_and_retrained(tmp_path, capsys):
    assert run(tmp_path, "--budget", "smoke", "--methods", "mean") == 0
    cache = sorted(Store(tmp_path).backbone_dir.glob("*.pt"))
    cache[0].write_bytes(cache[0].read_bytes()[:100])  # truncated
    for record in records(tmp_path, "mean"):
        record.unlink()
    capsys.readouterr()
    assert run(tmp_path, "--budget", "smoke", "--methods", "mean") == 0
    err = capsys.readouterr().err
    assert f"{cache[0]} is damaged" in err and "retraining" in err and "Traceback" not in err
    assert torch.load(cache[0])["state"] and cache[0].with_name(cache[0].name + ".damaged-1").exists()


def test_a_damaged_model_file_is_one_line_in_verify(tmp_path, capsys):
    assert run(tmp_path, "--budget", "smoke", "--methods", "queryable") == 0
    (record,) = records(tmp_path, "queryable")
    Store.model_of(record).write_bytes(b"")
    line = one_line_error(capsys, ["verify", "--results", str(tmp_path)])
    assert "is damaged" in line and str(Store.model_of(record)) in line and "moved to" in line
    assert Store.model_of(record).with_name(Store.model_of(record).name + ".damaged-1").exists()
    # the next run sees the cell has no readable weights and recomputes it; verify then works
    assert run(tmp_path, "--budget", "smoke", "--methods", "queryable") == 0
    assert "is missing; the cell is recomputed" in capsys.readouterr().err
    assert cli.main(["verify", "--results", str(tmp_path), "--out", str(tmp_path / "v.json")]) == 0


def test_a_damaged_model_file_makes_run_recompute_the_cell(tmp_path, capsys):
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    (record,) = records(tmp_path)
    model = Store.model_of(record)
    model.write_bytes(model.read_bytes()[:50])
    capsys.readouterr()
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    err = capsys.readouterr().err
    assert f"{model} is damaged" in err and "recomputed" in err and "Traceback" not in err
    assert torch.load(model)["state"] and model.with_name(model.name + ".damaged-1").exists()


def test_out_that_cannot_hold_results_fails_before_any_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file" in one_line_error(capsys, ["run", *SMOKE, "--budget", "smoke", "--out", str(afile)])
    assert "cannot create" in one_line_error(capsys, ["run", *SMOKE, "--budget", "smoke", "--out", str(afile / "sub")])
    assert "--out: empty path" in one_line_error(capsys, ["run", *SMOKE, "--out", ""])
    assert "--methods is empty" in one_line_error(capsys, ["run", *SMOKE, "--methods", " , "])


def test_files_get_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        assert run(tmp_path, "--budget", "smoke", "--methods", "lora") == 0
    finally:
        os.umask(old)
    (record,) = records(tmp_path)
    for path in (record, Store.model_of(record), *Store(tmp_path).backbone_dir.glob("*.pt")):
        assert path.stat().st_mode & 0o777 == 0o644, path


def test_a_blow_up_without_nan_is_diverged_and_every_seed_is_named(tmp_path, capsys):
    """alpha = 1e4 makes LoRA's first steps explode to huge but finite MSEs (1e14 to 1e25): not "ok", and not
    hidden by a best value taken before the blow-up."""
    assert run(tmp_path, "--budget", "smoke", "--methods", "lora", "--hp", "alpha=1e4") == 0
    err = capsys.readouterr().err
    (record,) = records(tmp_path)
    info = results.read_record(record)["train_info"]
    assert info["status"] == "diverged" and all(s["status"] == "diverged" for s in info["per_seed"])
    assert "every seed diverged" in err and "other seeds completed" not in err


def test_a_killed_writers_lock_file_is_removed_and_a_held_one_kept(tmp_path):
    """kill -9 skips claim's clean-up and leaves `.<record>.lock`; the next run's clean-up removes a lock nobody
    holds, never one a live process holds (here: this process, through another descriptor)."""
    from qlbench.records import store

    stale, live = tmp_path / "a.json", tmp_path / "b.json"
    stale.with_name(".a.json.lock").write_text("")  # what a killed writer leaves
    with store.claim([live]) as held:
        assert held == {live}
        assert store.clean_locks(tmp_path) == [stale]
        assert not stale.with_name(".a.json.lock").exists() and live.with_name(".b.json.lock").exists()
        with store.claim([live]) as again:
            assert again == set()  # still held: cleaning did not steal it


def test_a_folder_or_a_link_loop_where_a_file_should_be_is_damage(tmp_path):
    from qlbench.records import store

    folder, loop = tmp_path / "rec.json", tmp_path / "loop.json"
    folder.mkdir()
    loop.symlink_to(loop)
    for path, words in ((folder, "a folder, not a file"), (loop, "symbolic-link loop")):
        with pytest.raises(store.DamagedFile, match=words):
            store.read_json(path)
        with pytest.raises(store.DamagedFile, match=words):
            store.load_torch(path)
    assert store.set_aside(folder) == "moved to rec.json.damaged-1" and not folder.exists()
    assert (tmp_path / "rec.json.damaged-1").is_dir()


def test_an_out_that_is_a_link_loop_or_holds_a_read_only_folder_is_refused(tmp_path, monkeypatch):
    from qlbench.records import store

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match="symbolic link to nothing"):
        store.check_writable(loop)
    out = tmp_path / "out"
    (out / "records" / "deep-narrow").mkdir(parents=True)
    store.check_writable(out)
    locked = str(out / "records" / "deep-narrow")
    access = os.access  # as root every folder reads as writable: the read-only one is planted through os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == locked else access(p, mode))
    with pytest.raises(ValueError, match=f"{locked} is not writable"):
        store.check_writable(out)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc file system here")
def test_an_out_on_a_file_system_that_takes_no_folders_is_refused_before_any_work():
    """/proc is writable to os.access as root, but takes no new folder: the probe creates (and removes) one."""
    from qlbench.records import store

    with pytest.raises(ValueError, match="cannot create results folder /proc/qlbench-x/y"):
        store.check_writable(store.Path("/proc/qlbench-x/y"))


def test_an_out_on_a_full_device_is_refused(tmp_path, monkeypatch):
    from qlbench.records import store

    store.check_writable(tmp_path / "new")
    usage = store.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(ValueError, match="4,096 bytes free"):
        store.check_writable(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_the_atomic_writer_replaces_only_regular_files(tmp_path):
    """A record, a report or a verify file is written over a regular file or a missing path, never over a device, a
    pipe or a folder (a rename over /dev/full as root replaced the device)."""
    from qlbench.records import store

    fifo, folder, link = tmp_path / "pipe", tmp_path / "folder", tmp_path / "link"
    os.mkfifo(fifo)
    folder.mkdir()
    store.write_json({"a": 1}, tmp_path / "file.json")
    link.symlink_to(tmp_path / "file.json")
    store.write_json({"a": 2}, link)  # a link to a regular file: the link is replaced by the file
    for target in (fifo, folder, *([store.Path("/dev/full")] if os.path.exists("/dev/full") else [])):
        kind = os.stat(target).st_mode
        with pytest.raises(ValueError, match="writes only over regular files"):
            store.write_json({"a": 3}, target)
        assert os.stat(target).st_mode == kind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.json", "folder", "link", "pipe"]  # no temp file left
