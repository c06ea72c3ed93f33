import json
import os

import pytest

import hetsplit.files as files
import hetsplit.store as store
from hetsplit import Profile
from hetsplit.files import ProfileFileError
from hetsplit.planning.profile import latest_profile


def _profile(**kw):
    return Profile.from_measurements(
        {"cpu": [(1, 0.1), (8, 0.4)], "cpu@0.25": [(1, 0.4), (8, 1.6)]}, memory_caps={"cpu": 1000}, **kw
    )


def test_save_load_round_trip_with_schema_header(tmp_path):
    p = _profile(model={"name": "lenet", "fingerprint": "abc", "input_shape": [[1, 28, 28]]})
    path = p.save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == files.SCHEMA_VERSION and doc["kind"] == "profile"
    assert doc["versions"]["torch"] and doc["versions"]["hetsplit"]
    assert doc["devices"][0]["measurements"][0]["times"] == [0.1]
    q = Profile.load(path)
    assert q.to_dict() == p.to_dict()
    assert q.step_time("cpu@0.25", 5) == p.step_time("cpu@0.25", 5)


def test_default_location_and_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HETSPLIT_PROFILE_DIR", str(tmp_path / "env"))
    assert store.profile_dir() == tmp_path / "env"
    assert store.profile_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("HETSPLIT_PROFILE_DIR")
    monkeypatch.chdir(tmp_path)
    assert store.profile_dir() == tmp_path / "profiles"
    path = _profile().save()
    assert path.parent == tmp_path / "profiles" and path.suffix == ".json"


def test_other_schema_version_and_damage_name_the_file(tmp_path):
    path = _profile().save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    doc["schema_version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileFileError, match=r"p\.json: schema version 99 .*newer.*; upgrade hetsplit") as e:
        Profile.load(path)
    assert "re-create" not in str(e.value) and "\n" not in str(e.value)
    doc["schema_version"] = 0  # an older file is re-created, not a reason to upgrade
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileFileError, match=r"p\.json: schema version 0, .*re-create it") as e:
        Profile.load(path)
    assert "upgrade" not in str(e.value)
    path.write_text(path.read_text()[:40])
    with pytest.raises(ProfileFileError, match=r"p\.json: damaged file"):
        Profile.load(path)
    path.write_text(json.dumps({"schema": "hetsplit", "kind": "profile", "schema_version": 1, "devices": [{}]}))
    with pytest.raises(ProfileFileError, match=r"p\.json: damaged profile"):
        Profile.load(path)
    with pytest.raises(ProfileFileError, match="no such file"):
        Profile.load(tmp_path / "missing.json")


def test_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = _profile(model={"name": "old"}).save(tmp_path / "p.json")
    before = path.read_text()

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _profile(model={"name": "new"}).save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_find_profiles_newest_first_and_filtered(tmp_path):
    a = _profile(host="h1")
    a.created = "2026-01-01T00:00:00+00:00"
    b = _profile(host="h1")
    b.created = "2026-02-01T00:00:00+00:00"
    only_cpu = Profile.from_measurements({"cpu": [(1, 0.1)]}, host="h1")
    pa, pb = a.save(tmp_path / "a.json"), b.save(tmp_path / "b.json")
    only_cpu.save(tmp_path / "c.json")
    (tmp_path / "junk.json").write_text("{")
    assert store.find_profiles(["cpu", "cpu@0.25"], tmp_path, host="h1") == [pb, pa]
    assert len(store.find_profiles(["cpu"], tmp_path, host="h1")) == 3
    assert store.find_profiles(["cpu"], tmp_path) == []  # measured on another host
    assert latest_profile(["cuda:0"], tmp_path) is None


def test_gpus_are_matched_by_uuid_when_their_index_changes():
    from hetsplit.devices import DeviceInfo
    from hetsplit.planning.curve import Curve
    from hetsplit.planning.profile import DeviceProfile

    def entry(name, uuid, emulated=False):
        info = DeviceInfo(
            name=name, kind="cuda", description="GPU", uuid=uuid, emulated=emulated, speed=0.5 if emulated else 1.0
        )
        return DeviceProfile(info, [], Curve([1.0], [0.01], 0.0, 0.01))

    prof = Profile([entry("cuda:0", "GPU-a"), entry("cuda:1", "GPU-b"), entry("cuda:1@0.5", "GPU-b", True)])
    moved = prof.matched_to_local({"GPU-a": "cuda:1", "GPU-b": "cuda:0"})  # CUDA_VISIBLE_DEVICES=1,0
    assert moved.devices == ["cuda:1", "cuda:0", "cuda:0@0.5"]
    assert moved.entry("cuda:1").info.uuid == "GPU-a" and prof.devices == ["cuda:0", "cuda:1", "cuda:1@0.5"]
    assert prof.matched_to_local({}).devices == prof.devices  # no GPU here: unchanged


def _stored_here(directory, **kw):
    import platform

    p = _profile(**kw)
    p.host = platform.node()
    return p.save(directory / "good.json")


def test_a_fifo_or_an_endless_device_in_the_store_is_skipped_not_read(tmp_path):
    import warnings

    good = _stored_here(tmp_path)
    os.mkfifo(tmp_path / "stuck.json")  # reading it waited for a writer forever
    (tmp_path / "zero.json").symlink_to("/dev/zero")  # reading it grew memory without bound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.find_profiles(["cpu"], tmp_path) == [good]
    assert len(caught) == 1  # one warning for the lookup, naming both
    message = str(caught[0].message)
    assert "stuck.json: a named pipe (FIFO)" in message and "zero.json: a link to /dev/zero" in message
    with pytest.raises(ProfileFileError, match=r"stuck\.json: a named pipe \(FIFO\), not a hetsplit file"):
        Profile.load(tmp_path / "stuck.json")  # named explicitly: refused at once, not hung
    with pytest.raises(ProfileFileError, match="zero.json: a device"):
        Profile.load(tmp_path / "zero.json")


def test_an_oversized_file_is_refused_by_its_size_without_reading_it(tmp_path, monkeypatch):
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(files.MAX_FILE_BYTES + 1)  # sparse: no disk used
    reads = []
    monkeypatch.setattr(store.os, "fdopen", lambda *a, **k: reads.append(a))
    with pytest.raises(ProfileFileError, match=r"big\.json: 33,554,433 bytes, larger than any hetsplit file"):
        Profile.load(big)
    assert reads == []


def test_a_link_is_followed_only_inside_the_profile_directory(tmp_path):
    import warnings

    inside = tmp_path / "store"
    inside.mkdir()
    good = _stored_here(inside)
    (inside / "alias.json").symlink_to(good.name)  # inside: followed
    outside = _profile(model={"name": "elsewhere"})
    outside.host = __import__("platform").node()
    outside.created = "9999-01-01T00:00:00+00:00"
    (inside / "escape.json").symlink_to(outside.save(tmp_path / "outside.json"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = store.find_profiles(["cpu"], inside)
    assert sorted(p.name for p in found) == ["alias.json", "good.json"]
    assert "escape.json: a link to" in str(caught[0].message) and "outside the profile directory" in str(
        caught[0].message
    )


def test_a_lookup_reads_only_files_changed_since_the_last_and_warns_once(tmp_path, monkeypatch):
    import warnings

    for k in range(20):
        _profile().save(tmp_path / f"p{k}.json")
    (tmp_path / "junk.json").write_text("{")
    opened = []
    real = files._read_text
    monkeypatch.setattr(files, "_read_text", lambda path: opened.append(path.name) or real(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest_profile(["cpu"], tmp_path)
        assert len(opened) == 21  # each file once (was twice for the one loaded)
        opened.clear()
        for _ in range(5):
            latest_profile(["cpu"], tmp_path)
        assert opened == []  # nothing changed: nothing read again
        (tmp_path / "p3.json").write_text((tmp_path / "p3.json").read_text() + " ")
        latest_profile(["cpu"], tmp_path)
        assert opened == ["p3.json"]
    assert len([w for w in caught if "junk.json" in str(w.message)]) == 1


def test_a_stored_profile_applies_only_to_the_model_it_measured(tmp_path):
    from torch import nn

    from hetsplit.profiler import fingerprint

    lenet, mlp = nn.Sequential(nn.Conv2d(1, 6, 5)), nn.Sequential(nn.Linear(3, 2))
    _stored_here(tmp_path, model={"name": "lenet", "fingerprint": fingerprint(lenet)})
    assert latest_profile(["cpu"], tmp_path, model=fingerprint(lenet)).model["name"] == "lenet"
    assert latest_profile(["cpu"], tmp_path, model=fingerprint(mlp)) is None  # LeNet's curves: not for an MLP
    assert latest_profile(["cpu"], tmp_path) is not None  # no model named: any model's profile, as before
    with pytest.raises(TypeError, match=r"model must be a fingerprint string .*hetsplit.profiler.fingerprint"):
        latest_profile(["cpu"], tmp_path, model=mlp)


def test_saving_reads_the_umask_without_changing_it(tmp_path, monkeypatch):
    old = os.umask(0o027)
    try:
        calls = []
        monkeypatch.setattr(store.os, "umask", lambda *a: calls.append(a) or 0o027)
        path = _profile().save(tmp_path / "p.json")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert calls == []  # /proc/self/status says it: no moment with another umask for other threads
    assert path.stat().st_mode & 0o777 == 0o640


def test_a_full_disk_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store.os, "fsync", full)
    with pytest.raises(ProfileFileError, match=r"cannot write .*p\.json: No space left on device; free some space"):
        _profile().save(tmp_path / "p.json")
    with pytest.raises(ProfileFileError, match=f"cannot write {tmp_path}/"):
        _profile().save(directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_stored_profile_from_another_torch_or_other_hardware_is_used_with_one_warning(tmp_path):
    import dataclasses
    import platform
    import warnings

    import torch

    from hetsplit.devices import describe

    prof = _profile(host=platform.node())
    prof.versions = {"hetsplit": "0.1", "torch": "1.0.0"}
    path = prof.save(tmp_path / "p.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_profile(["cpu", "cpu@0.25"], tmp_path) is not None  # still used
        latest_profile(["cpu", "cpu@0.25"], tmp_path)  # said once
    assert [str(w.message) for w in caught] == [
        f"hetsplit: using the stored profile {path}, measured under torch 1.0.0 (now {torch.__version__}); "
        "its split may be off — re-profile ('hetsplit profile') to refresh it"
    ]
    assert caught[0].filename == __file__  # at the caller's line
    # The same torch, but the CPU was another one when measured.
    cpu = prof.entry("cpu")
    prof.entries[0] = dataclasses.replace(cpu, info=dataclasses.replace(describe("cpu"), description="Imaginary CPU"))
    prof.versions = {"hetsplit": "0.1", "torch": torch.__version__}
    prof.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest_profile(["cpu"], tmp_path)
    now = describe("cpu").description
    assert [str(w.message) for w in caught] == [
        f"hetsplit: using the stored profile {path}, measured on other hardware (cpu was 'Imaginary CPU', now "
        f"{now!r}); its split may be off — re-profile ('hetsplit profile') to refresh it"
    ]
    # Nothing changed: nothing said.
    prof.entries[0] = dataclasses.replace(cpu, info=describe("cpu"))
    prof.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest_profile(["cpu"], tmp_path)
    assert caught == []
