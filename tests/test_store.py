import json
import os

import pytest

import hetsplit.store as store
from hetsplit import Profile, ProfileFileError
from hetsplit.planning import latest_profile


def _profile(**kw):
    return Profile.from_measurements(
        {"cpu": [(1, 0.1), (8, 0.4)], "cpu@0.25": [(1, 0.4), (8, 1.6)]}, memory_caps={"cpu": 1000}, **kw
    )


def test_save_load_round_trip_with_schema_header(tmp_path):
    p = _profile(model={"name": "lenet", "fingerprint": "abc", "input_shape": [[1, 28, 28]]})
    path = p.save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == store.SCHEMA_VERSION and doc["kind"] == "profile"
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
    with pytest.raises(ProfileFileError, match=r"p\.json: schema version 99"):
        Profile.load(path)
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
