"""Checkpoint cadence, crash-safe save order and resume point: a run without a critic still
saves, and a resume never restarts at rollout 0 when there is a checkpoint."""

import asyncio
import json
import os

import pytest

from furlong.core.run import checkpoints as ck
from furlong.core.config.launch_args import launch_args
from furlong.hooks import PluginError


def _args(**kw):
    """The launch flags of a 10-rollout run (every other flag at the parser's default), ``kw`` replacing any."""
    return launch_args(**{"num_rollout": 10, **kw})


def _writer(content: str):
    """A save_model that writes one file, as a train backend would."""

    async def save_model(path):
        with open(os.path.join(path, "model.txt"), "w") as f:
            f.write(content)

    return save_model


def _save(args, rollout_id, state=None, content="w"):
    return asyncio.run(ck.save_checkpoint(args, rollout_id, _writer(content), state or {"r": rollout_id}))


def _marker(save):
    with open(os.path.join(save, ck.MARKER_NAME)) as f:
        return f.read()


@pytest.mark.parametrize(
    ("r", "k", "last", "expected"),
    [
        (0, None, 5, False),  # no interval: never, not even the last rollout
        (4, None, 5, False),
        (1, 2, 5, True),  # (1+1) % 2 == 0
        (2, 2, 5, False),
        (4, 2, 5, True),  # r == last - 1
        (98, 100, None, False),
        (99, 100, None, True),
        (249, 100, None, False),  # no forced last point without `last`
    ],
)
def test_periodic(r, k, last, expected):
    assert ck.periodic(r, k, last) is expected


def test_periodic_rejects_non_positive_interval():
    with pytest.raises(ValueError) as excinfo:
        ck.periodic(3, 0, 10)
    assert str(excinfo.value) == "interval must be a positive number of rollouts, got 0"


def test_default_cadence_100_of_250(tmp_path):
    args = _args(save=str(tmp_path), save_interval=100, num_rollout=250)
    assert [r for r in range(250) if ck.should_save(args, r)] == [99, 199, 249]


def test_no_save_dir_means_no_save_even_with_interval():
    # --save-interval without --save is rejected by the config; here it just never saves.
    args = _args(save=None, save_interval=1, num_rollout=3)
    assert [r for r in range(3) if ck.should_save(args, r)] == []


def test_iter_dir_and_state_path():
    assert ck.iter_dir("/ck", 4) == os.path.join("/ck", "iter_0000004")
    assert ck.iter_dir("/ck", 1234567) == os.path.join("/ck", "iter_1234567")
    assert ck.state_path("/ck", 7) == os.path.join("/ck", "rollout", "state_7.json")


def test_c011_critic_free_run_saves_at_interval_and_final(tmp_path):
    save = str(tmp_path / "ckpt")
    args = _args(save=save, save_interval=2, num_rollout=5)
    saved = []
    for r in range(5):
        if ck.should_save(args, r):
            path = _save(args, r, state={"data_source": {"sample_offset": 4 * (r + 1)}, "rollout": r})
            saved.append(r)
            assert path == ck.iter_dir(save, r)
    assert saved == [1, 3, 4]
    assert sorted(os.listdir(save)) == [
        "iter_0000001",
        "iter_0000003",
        "iter_0000004",
        ck.MARKER_NAME,
        "rollout",
    ]
    assert sorted(os.listdir(os.path.join(save, "rollout"))) == ["state_1.json", "state_3.json", "state_4.json"]
    assert _marker(save) == "4"
    with open(os.path.join(ck.iter_dir(save, 4), "model.txt")) as f:
        assert f.read() == "w"

    resume = ck.resolve_start(_args(load=save, num_rollout=5))
    assert resume.start_rollout_id == 5  # nothing left to run: range(5, 5) is empty
    assert resume.load_dir == ck.iter_dir(save, 4)
    assert resume.loaded_rollout_id == 4
    assert resume.state == {"data_source": {"sample_offset": 20}, "rollout": 4}


def test_c012_resume_from_marker_7(tmp_path):
    load = str(tmp_path)
    args = _args(save=load, num_rollout=10)
    _save(args, 7, state={"data_source": {"sample_offset": 32, "epoch_id": 1}, "sample_index": 256})
    resume = ck.resolve_start(_args(load=load, num_rollout=10))
    assert resume.start_rollout_id == 8
    assert resume.load_dir == os.path.join(load, "iter_0000007")
    assert resume.state == {"data_source": {"sample_offset": 32, "epoch_id": 1}, "sample_index": 256}
    # Rollouts 8 and 9 run; the next checkpoint is the final one, numbered 9.
    assert [r for r in range(resume.start_rollout_id, 10) if ck.should_save(args, r)] == [9]


def test_c012_empty_load_keeps_explicit_start_id(tmp_path):
    resume = ck.resolve_start(_args(load=str(tmp_path), start_rollout_id=3))
    assert (resume.start_rollout_id, resume.load_dir, resume.state) == (3, None, None)


def test_c012_empty_load_starts_at_zero(tmp_path):
    resume = ck.resolve_start(_args(load=str(tmp_path)))
    assert (resume.start_rollout_id, resume.load_dir, resume.state) == (0, None, None)


def test_missing_load_dir_and_no_load_warm_start(tmp_path):
    assert ck.resolve_start(_args(load=str(tmp_path / "nope"))).start_rollout_id == 0
    assert ck.resolve_start(_args(load=None, start_rollout_id=2)).start_rollout_id == 2


def test_explicit_start_id_beats_marker_and_picks_its_state(tmp_path):
    load = str(tmp_path)
    args = _args(save=load)
    _save(args, 3, state={"at": 3})
    _save(args, 5, state={"at": 5})
    resume = ck.resolve_start(_args(load=load, start_rollout_id=4))
    assert resume.start_rollout_id == 4
    assert resume.load_dir == ck.iter_dir(load, 5)  # weights still from the marker
    assert resume.state == {"at": 3}  # state_{start-1}


def test_ckpt_step_loads_that_iteration(tmp_path):
    load = str(tmp_path)
    args = _args(save=load)
    _save(args, 3, state={"at": 3})
    _save(args, 5, state={"at": 5})
    resume = ck.resolve_start(_args(load=load, ckpt_step=3))
    assert (resume.start_rollout_id, resume.load_dir, resume.state) == (4, ck.iter_dir(load, 3), {"at": 3})


def test_missing_state_file_gives_none(tmp_path):
    load = str(tmp_path)
    _save(_args(save=load), 2)
    os.remove(ck.state_path(load, 2))
    resume = ck.resolve_start(_args(load=load))
    assert (resume.start_rollout_id, resume.load_dir, resume.state) == (3, ck.iter_dir(load, 2), None)


def test_marker_naming_missing_iter_dir_is_an_error(tmp_path):
    load = str(tmp_path)
    (tmp_path / ck.MARKER_NAME).write_text("6")
    with pytest.raises(PluginError) as excinfo:
        ck.resolve_start(_args(load=load))
    missing = os.path.join(load, "iter_0000006")
    assert str(excinfo.value) == (
        f"--load {load!r}: latest_checkpointed_iteration.txt (6) names checkpoint {missing}, which does "
        "not exist. Point --load at the directory holding iter_* and latest_checkpointed_iteration.txt, "
        "fix the marker, or pass --ckpt-step with an existing iteration."
    )


def test_ckpt_step_naming_missing_iter_dir_is_an_error(tmp_path):
    load = str(tmp_path)
    _save(_args(save=load), 2)
    with pytest.raises(PluginError) as excinfo:
        ck.resolve_start(_args(load=load, ckpt_step=9))
    assert str(excinfo.value).startswith(
        f"--load {load!r}: --ckpt-step 9 names checkpoint {os.path.join(load, 'iter_0000009')}, which does not exist."
    )


def test_garbage_marker_is_an_error(tmp_path):
    (tmp_path / ck.MARKER_NAME).write_text("seven\n")
    with pytest.raises(PluginError) as excinfo:
        ck.resolve_start(_args(load=str(tmp_path)))
    marker = os.path.join(str(tmp_path), ck.MARKER_NAME)
    assert str(excinfo.value) == (
        f"--load {str(tmp_path)!r}: {marker} holds 'seven', not a rollout id; write the id of the newest "
        "complete iter_* directory into it, or delete it to warm-start."
    )


def test_sentinel_forces_save_and_is_removed_after_marker(tmp_path):
    save = str(tmp_path / "ckpt")
    sentinel = tmp_path / "SAVE_NOW"
    args = _args(save=save, save_interval=100, num_rollout=250, save_trigger_sentinel=str(sentinel))
    assert ck.should_save(args, 10) is False
    sentinel.write_text("")
    assert ck.should_save(args, 10) is True

    seen = {}

    async def save_model(path):
        seen["sentinel_during_save"] = sentinel.exists()
        seen["marker_during_save"] = os.path.exists(os.path.join(save, ck.MARKER_NAME))

    asyncio.run(ck.save_checkpoint(args, 10, save_model, {"x": 1}))
    assert seen == {"sentinel_during_save": True, "marker_during_save": False}
    assert not sentinel.exists()
    assert _marker(save) == "10"
    assert ck.should_save(args, 11) is False


def test_sentinel_without_save_dir_does_nothing(tmp_path):
    sentinel = tmp_path / "SAVE_NOW"
    sentinel.write_text("")
    assert ck.should_save(_args(save=None, save_trigger_sentinel=str(sentinel)), 0) is False


def test_crash_in_save_model_keeps_previous_marker_and_checkpoint(tmp_path):
    save = str(tmp_path)
    sentinel = tmp_path / "SAVE_NOW"
    args = _args(save=save, save_trigger_sentinel=str(sentinel))
    _save(args, 3, state={"at": 3}, content="three")
    sentinel.write_text("")

    async def crashing(path):
        with open(os.path.join(path, "half.bin"), "w") as f:
            f.write("partial")
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        asyncio.run(ck.save_checkpoint(args, 5, crashing, {"at": 5}))
    assert _marker(save) == "3"
    assert not os.path.exists(ck.iter_dir(save, 5))  # the .tmp was never renamed
    assert not os.path.exists(ck.state_path(save, 5))
    assert sentinel.exists()  # not durable, so the request stays pending
    with open(os.path.join(ck.iter_dir(save, 3), "model.txt")) as f:
        assert f.read() == "three"
    resume = ck.resolve_start(_args(load=save))
    assert (resume.start_rollout_id, resume.load_dir, resume.state) == (4, ck.iter_dir(save, 3), {"at": 3})

    # The next save removes the stale .tmp before writing.
    _save(args, 5, state={"at": 5}, content="five")
    assert sorted(os.listdir(ck.iter_dir(save, 5))) == ["model.txt", ck.WRITER_NAME]
    assert not os.path.exists(ck.iter_dir(save, 5) + ".tmp")
    assert _marker(save) == "5"


def test_unserializable_state_fails_before_anything_is_written(tmp_path):
    save = str(tmp_path)
    args = _args(save=save)
    _save(args, 1)
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(ck.save_checkpoint(args, 2, _writer("x"), {"obj": object()}))
    assert str(excinfo.value).startswith("checkpoint of rollout 2: the data state is not JSON-serializable (")
    assert not os.path.exists(ck.iter_dir(save, 2) + ".tmp")
    assert _marker(save) == "1"


def test_marker_replacement_is_atomic(tmp_path, monkeypatch):
    save = str(tmp_path)
    args = _args(save=save)
    _save(args, 1)
    marker = os.path.join(save, ck.MARKER_NAME)
    inode_before = os.stat(marker).st_ino
    replaced = []
    real_replace = os.replace

    def spy_replace(src, dst):
        # When the marker is swapped in, the temp file already holds the full new id.
        with open(src) as f:
            replaced.append((os.path.basename(src), os.path.basename(dst), f.read()))
        with open(marker) as f:
            assert f.read() == "1"  # readers still see the old, complete marker
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", spy_replace)
    _save(args, 2, state={"at": 2})
    assert replaced == [
        ("state_2.json.tmp", "state_2.json", json.dumps({"at": 2}, indent=1)),
        (ck.MARKER_NAME + ".tmp", ck.MARKER_NAME, "2"),
    ]
    assert _marker(save) == "2"
    assert os.stat(marker).st_ino != inode_before  # a new file took the name, no in-place rewrite
    assert not os.path.exists(marker + ".tmp")


def test_resave_same_rollout_replaces_iter_dir(tmp_path):
    save = str(tmp_path)
    args = _args(save=save)
    _save(args, 4, content="first")
    _save(args, 4, content="second")
    with open(os.path.join(ck.iter_dir(save, 4), "model.txt")) as f:
        assert f.read() == "second"
    assert sorted(os.listdir(save)) == ["iter_0000004", ck.MARKER_NAME, "rollout"]


def test_interrupted_resave_is_recovered_from_old(tmp_path):
    # A crash between moving iter_N aside and renaming the new one in leaves only iter_N.old.
    save = str(tmp_path)
    _save(_args(save=save), 4, state={"at": 4}, content="first")
    os.rename(ck.iter_dir(save, 4), ck.iter_dir(save, 4) + ".old")
    resume = ck.resolve_start(_args(load=save))
    assert (resume.start_rollout_id, resume.load_dir, resume.state) == (5, ck.iter_dir(save, 4) + ".old", {"at": 4})


def test_a_checkpoint_names_its_train_backend_and_another_backend_is_told_which_to_resume_with(tmp_path):
    save = str(tmp_path / "ckpt")
    _save(_args(save=save, train_backend="megatron"), 3)
    with open(os.path.join(ck.iter_dir(save, 3), ck.WRITER_NAME)) as f:
        assert json.load(f) == {"train_backend": "megatron"}
    assert ck.resolve_start(_args(load=save, train_backend="megatron")).loaded_rollout_id == 3
    with pytest.raises(PluginError) as err:
        ck.resolve_start(_args(load=save, train_backend="fsdp"))
    assert str(err.value) == (f"--load {save}: iter_0000003 was written by --train-backend megatron, which this run's "
                              "--train-backend fsdp cannot read; resume with --train-backend megatron (or start "
                              "another run without --load).")
    os.remove(os.path.join(ck.iter_dir(save, 3), ck.WRITER_NAME))  # written before backends were recorded
    assert ck.resolve_start(_args(load=save, train_backend="fsdp")).loaded_rollout_id == 3


# --- --finetune: the checkpoint's weights only, rollout 0, the data from its start ----------------------


def test_finetune_loads_the_marked_checkpoint_from_rollout_0_without_data_state(tmp_path):
    save = str(tmp_path)
    for r in range(3):
        _save(_args(save=save), r)
    point = ck.resolve_start(_args(load=save, finetune=True))
    assert (point.start_rollout_id, point.load_dir, point.state, point.loaded_rollout_id) == (
        0, ck.iter_dir(save, 2), None, 2)
    stepped = ck.resolve_start(_args(load=save, finetune=True, ckpt_step=1, start_rollout_id=4))
    assert (stepped.start_rollout_id, stepped.load_dir, stepped.state) == (4, ck.iter_dir(save, 1), None)


# --- --save-retain-interval: Megatron-LM's rule, on real folders -------------------------------------------


@pytest.mark.parametrize(("previous", "rollout_id", "retain", "expected"), [
    (None, 0, 2, False),  # no checkpoint before
    (0, 1, 2, False),  # rollout 0 always stays (Megatron: iteration > 0 only)
    (1, 2, 2, True),
    (2, 3, 2, False),  # a multiple of the interval
    (3, 3, 2, False),  # the checkpoint just written (a re-save of the same rollout)
    (19, 39, 20, True),  # Miles' cadence (saves at 19, 39, ...): only multiples of 20 stay
    (5, 6, None, False),  # no --save-retain-interval: everything stays
])
def test_retired_follows_megatron(previous, rollout_id, retain, expected):
    assert ck.retired(previous, rollout_id, retain) is expected


def _listing(save):
    return sorted(os.listdir(save)), sorted(os.listdir(os.path.join(save, "rollout")))


def test_retain_interval_keeps_multiples_the_newest_and_rollout_0(tmp_path):
    args = _args(save=str(tmp_path), save_interval=1, save_retain_interval=2)
    for r in range(6):
        _save(args, r)
    assert _listing(tmp_path) == (["iter_0000000", "iter_0000002", "iter_0000004", "iter_0000005", ck.MARKER_NAME,
                                   "rollout"], ["state_0.json", "state_2.json", "state_4.json", "state_5.json"])
    assert _marker(tmp_path) == "5"


def test_retain_interval_never_deletes_a_link_a_foreign_folder_or_the_resumed_checkpoint(tmp_path):
    save, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    args = _args(save=str(save), save_interval=1, save_retain_interval=10)
    _save(args, 0)
    _save(args, 1)
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("x")
    os.rename(save / "iter_0000001", save / "moved")
    os.symlink(elsewhere, save / "iter_0000001")  # the marker names 1: a link now
    _save(args, 2)
    assert (elsewhere / "precious.txt").read_text() == "x" and os.path.islink(save / "iter_0000001")
    (save / "iter_0000002" / ck.WRITER_NAME).unlink()  # a folder furlong did not write
    _save(args, 3)
    assert (save / "iter_0000002" / "model.txt").exists()
    assert (save / "rollout" / "state_1.json").exists() and (save / "rollout" / "state_2.json").exists()
    asyncio.run(ck.save_checkpoint(args, 4, _writer("w"), {}, keep=str(save / "iter_0000003")))
    assert (save / "iter_0000003").is_dir()  # the run resumed from it
    _save(args, 5)
    assert not (save / "iter_0000004").exists() and not (save / "rollout" / "state_4.json").exists()
    assert not any(name.endswith(".tmp") for name in os.listdir(save))


def test_retain_interval_deletes_the_critic_of_a_retired_checkpoint(tmp_path):
    save, critic = tmp_path / "run", tmp_path / "run_critic"
    args = _args(save=str(save), save_interval=1, save_retain_interval=3, critic_save=str(critic))
    args.use_critic = True  # as a ppo run's configuration says
    for r in range(3):
        asyncio.run(ck.save_checkpoint(args, r, _writer("a"), {}, save_critic=_writer("c")))
    assert sorted(os.listdir(critic)) == ["iter_0000000", "iter_0000002", ck.MARKER_NAME]
    assert sorted(os.listdir(save))[:2] == ["iter_0000000", "iter_0000002"]


def test_exit_on_missing_checkpoint_refuses_a_load_folder_without_one(tmp_path):
    with pytest.raises(PluginError) as err:
        ck.resolve_start(_args(load=str(tmp_path), exit_on_missing_checkpoint=True))
    assert str(err.value) == (f"--load {tmp_path}: no checkpoint there (no {ck.MARKER_NAME}) and "
                              "--exit-on-missing-checkpoint is given; point --load at a folder a run saved to, or "
                              "drop --exit-on-missing-checkpoint to start from the initial weights.")
    _save(_args(save=str(tmp_path)), 0)
    assert ck.resolve_start(_args(load=str(tmp_path), exit_on_missing_checkpoint=True)).start_rollout_id == 1
